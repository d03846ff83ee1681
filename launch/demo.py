"""`make demo`: Complementary RL on HiddenRule with the shipped warm models; does experience help?

  python launch/demo.py --workdir=runs/demo [--steps=12] [--baseline] [--room] [--verbosity=0]

Trains `configs/hidden_rule.py:warm` (issue 49: a small actor that reads lessons and a small extractor that writes
them, warm-started by supervised learning on a synthetic corpus, `launch/warm_start.py`; 8 tasks x 8 episodes a
step, half guided by a retrieved lesson, half free) for `--steps` steps into WORKDIR/complementary, then evaluates
the actor on held-out instances (place names never seen in training) with and without experience, 64 episodes per
mode, and prints what the numbers show, computed from them with their standard errors. HiddenRule: 16 families of
locked objects, each opened by one secret action of 8 drawn from the run's seed; a lesson from one solved instance
holds for its whole family, so an actor that reads lessons can beat one that must learn 16 rules into its weights
(uniform random: 0.125). `--baseline` adds the outcome-only baseline for as many steps (WORKDIR/baseline);
`--room` runs the former demo instead (tiny random-init models on MiniHack Room-5x5, `configs/minihack_room.py:cpu`).
Re-running resumes from WORKDIR (delete it, or `make clean`, to start over).
"""

import math
import os
import sys
import time

from absl import flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comprl_jax import config as config_lib
from launch import common as lu


def define_flags() -> None:
    """The command line (defined only when run as a script: tests load this module beside other launch
    scripts, and absl allows one ``--steps`` per process)."""
    flags.DEFINE_string("workdir", "runs/demo", "run directory (one sub-directory per arm)")
    flags.DEFINE_integer("steps", 12, "training steps per arm")
    flags.DEFINE_boolean("baseline", False, "also train the outcome-only baseline")
    flags.DEFINE_boolean("room", False, "the Room-5x5 demo with tiny random-init models instead")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOM = "comprl/MiniHack-Room-5x5-v0"


def demo_config(steps: int, method: str = "complementary", room: bool = False):
    if room:
        config = config_lib.load_file(os.path.join(REPO, "configs", "minihack_room.py") + f":cpu,{method}")
        config.env.tasks = (ROOM,)
        config.train.eval_tasks = 2  # one fixed level: 2 x 8 episodes of it, with and without experience
    else:
        config = config_lib.load_file(os.path.join(REPO, "configs", "hidden_rule.py") + f":warm,{method}")
        config.train.eval_tasks = 16  # 16 held-out tasks x 4 episodes = 64 per mode
    config.train.steps = steps
    config.checkpoint.every = steps
    return config


def verdict(p_with: float, n_with: int, p_without: float, n_without: int) -> str:
    """One sentence of what a with / without experience evaluation shows, from its numbers: the difference, its
    standard error (two independent binomial proportions) and z; "helped" / "hurt" at |z| >= 2, else no clear
    difference."""
    se1 = math.sqrt(p_with * (1 - p_with) / n_with) if n_with else float("nan")
    se0 = math.sqrt(p_without * (1 - p_without) / n_without) if n_without else float("nan")
    d, se = p_with - p_without, math.sqrt(se1**2 + se0**2)
    z = d / se if se > 0 else (math.inf if d > 0 else -math.inf if d < 0 else 0.0)
    head = (
        f"With experience the actor won {p_with:.3f} +- {se1:.3f} of {n_with} held-out episodes, without "
        f"{p_without:.3f} +- {se0:.3f} of {n_without}: a difference of {d:+.3f} +- {se:.3f} (z = {z:.1f}), so "
    )
    if z >= 2:
        return head + "experience helped."
    if z <= -2:
        return head + "experience hurt."
    return head + "these episodes show no clear difference either way."


def _curves(workdir: str, keys=("success", "success/guided", "success/free")) -> dict[str, list]:
    from comprl_jax.runtime import metrics as mlib

    rows = mlib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    by_step = {int(r["step"]): r for r in rows if "success" in r}
    return {k: [by_step[s].get(k) for s in sorted(by_step)] for k in keys}


def _eval_of(result: dict, mode: str):
    section = (result.get("eval") or {}).get(mode) or {}
    for e in section.values():
        return e["success"], e["episodes"]
    return None, 0


def main(argv):
    del argv
    lu.configure_logging(lu.flag_verbosity())
    t0 = time.time()
    from comprl_jax.config import validate

    room = flags.FLAGS.room
    arms = ["complementary"] + (["baseline"] if flags.FLAGS.baseline else [])
    configs = {m: demo_config(flags.FLAGS.steps, m, room) for m in arms}
    for c in configs.values():
        validate(c)
    root = os.path.abspath(flags.FLAGS.workdir)
    undo = lu.prepare_workdir(root)
    env = configs["complementary"].env.tasks[0]
    models = "tiny random-init models" if room else "the shipped warm-start models"
    print(f"[demo] {' vs '.join(arms)} on {env}, {models}, {flags.FLAGS.steps} steps each -> {root}")
    outs = {}
    try:
        from comprl_jax.loop import run as run_lib
        from launch.tables import eval_table

        for m in arms:
            c = configs[m]
            print(f"[demo] {m}: {c.rollout.tasks_per_step * c.rollout.group_size} episodes a step")
            outs[m] = run_lib.run(c, os.path.join(root, m))
    except BaseException:
        lu.undo_workdir(root, undo)
        raise
    from comprl_jax.runtime.metrics import plot_curves

    plot = plot_curves(
        {m: os.path.join(root, m, "metrics.jsonl") for m in arms}, os.path.join(root, "curves.png")
    )
    print(f"\n[demo] done in {(time.time() - t0) / 60:.1f} min")
    curves = _curves(os.path.join(root, "complementary"))
    base = _curves(os.path.join(root, "baseline"))["success"] if "baseline" in arms else None
    print(
        "[demo] training success per step, Complementary RL's guided half (a lesson in the prompt) and free half:"
    )
    print("  step    guided      free" + ("  baseline" if base else ""))
    for k, (g, f) in enumerate(zip(curves["success/guided"], curves["success/free"], strict=True)):
        cells = f"  {k:4d} {_cell(g)} {_cell(f)}" + (
            f" {_cell(base[k] if k < len(base) else None)}" if base else ""
        )
        print(cells)
    for m in arms:
        if outs[m].get("eval"):
            print(f"[demo] {m}, held-out evaluation:\n" + eval_table(outs[m]["eval"]))
    p1, n1 = _eval_of(outs["complementary"], "with_exp")
    p0, n0 = _eval_of(outs["complementary"], "without_exp")
    if p1 is not None and p0 is not None:
        print("[demo] what it shows: " + verdict(p1, n1, p0, n0))
    print(f"[demo] metrics:     {os.path.join(root, '<arm>', 'metrics.jsonl')}")
    print(f"[demo] tensorboard: {lu.tensorboard_command(os.path.join(root, arms[0], 'tb'))}")
    print(f"[demo] checkpoints: {os.path.join(root, '<arm>', 'checkpoints')}")
    print(f"[demo] plot:        {plot}")


def _cell(x) -> str:
    return f"{x:9.3f}" if x is not None else "        -"


if __name__ == "__main__":
    define_flags()
    lu.run(main, lambda: flags.FLAGS.workdir)
