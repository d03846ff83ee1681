"""`make demo`: Complementary RL on MiniHack Room (Ultimate 5x5) with tiny models on this CPU.

  python launch/demo.py --workdir=runs/demo [--steps=20] [--verbosity=0]

Trains the `configs/minihack_room.py:tiny` config (tiny random-init actor and extractor, constrained actions and
ops, a MiniLM retriever over the experience bank) for a fixed number of steps, evaluates on held-out levels with
and without test-time experience, and prints where the metrics, TensorBoard logs, checkpoints and the plot are.
Re-running resumes from runs/demo (delete it, or `make clean`, to start over). Library logs are quiet: the
progress bar, the end-of-run summary and errors are what it prints (--verbosity=0 shows every INFO log).

What to expect: tiny random-init models do not learn Room-Ultimate in minutes (its random-policy success is about
0.45 at 30 turns, lower at the tiny config's 10 turns); the demo shows the whole pipeline running end to end --
rollouts, retrieval, distillation into the bank, merges, actor and extractor updates, checkpoints -- not the
paper's effect, which needs a pretrained model (`:smollm`, ideally on a GPU).
"""

import os
import sys
import time

from absl import flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comprl_jax import config as config_lib
from launch import common as lu

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "run directory")
_STEPS = flags.DEFINE_integer("steps", 20, "training steps")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_config(steps: int):
    config = config_lib.load_file(os.path.join(REPO, "configs", "minihack_room.py") + ":tiny")
    config.train.steps = steps
    config.train.eval_tasks = 4
    return config


def main(argv):
    del argv
    lu.configure_logging(lu.flag_verbosity())
    t0 = time.time()
    from comprl_jax.config import validate

    config = demo_config(_STEPS.value)
    validate(config)
    workdir = os.path.abspath(_WORKDIR.value)
    undo = lu.prepare_workdir(workdir)
    print(
        f"[demo] Complementary RL, {config.env.tasks[0]}, tiny models, {config.train.steps} steps -> {workdir}"
    )
    try:
        from comprl_jax.loop import run as run_lib
        from launch.tables import eval_table

        out = run_lib.run(config, workdir)
    except BaseException:
        lu.undo_workdir(workdir, undo)
        raise
    last = out["last_metrics"]
    nan = float("nan")
    print(f"\n[demo] done in {(time.time() - t0) / 60:.1f} min")
    print(
        f"[demo] step {out['step']}: success {last.get('success', nan):.3f} "
        f"(guided {last.get('success/guided', nan):.3f}, free {last.get('success/free', nan):.3f}), "
        f"actions/episode {last.get('actions_per_episode', nan):.2f}, "
        f"bank size {int(last['bank/size']) if 'bank/size' in last else '-'}"
    )
    if out.get("eval"):
        print("[demo] held-out levels:\n" + eval_table(out["eval"]))
    print(f"[demo] metrics:     {os.path.join(workdir, 'metrics.jsonl')}")
    print(f"[demo] tensorboard: {lu.tensorboard_command(os.path.join(workdir, 'tb'))}")
    print(f"[demo] checkpoints: {os.path.join(workdir, 'checkpoints')}")
    print(f"[demo] plot:        {os.path.join(workdir, 'curves.png')}")


if __name__ == "__main__":
    lu.run(main, lambda: _WORKDIR.value)
