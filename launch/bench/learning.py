"""Does the loop learn? One JSON line per run: a config trained for a wall-clock budget, with its curve.

  python launch/bench/learning.py --config=configs/minihack_room.py:cpu,baseline --env=comprl/MiniHack-Room-5x5-v0 \\
      --seeds=0,1,2 --budget_s=900

Each run trains through the real :class:`~comprl_jax.loop.trainer.Trainer` (``train_step`` in a loop) until the budget is
spent or the greedy success on the eval tasks has been >= ``--target`` at ``--patience`` evaluations in a row.
Every ``--eval_every`` steps it evaluates the actor alone, greedy and sampled (held-out tasks; for a fixed level such
as Room-5x5 the level itself, so this is a sanity check of the loop, not generalisation). The line carries ``bench``,
``env``, ``method``, ``seed``, ``final_success`` (greedy), ``final_sampled_success``, ``wall_s``, ``steps``,
``reached_target_s`` (seconds until the first greedy success >= target, or null) and ``curve``: per step the training
success (sampled, guided and free halves) and, at eval steps, the greedy / sampled eval success.

The wall clock includes compilation; it is the figure a user waiting at a 2-core CPU sees.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from absl import app, flags

from comprl_jax import config as config_lib


def define_flags() -> None:
    """The command line's flags, defined only when this file runs as a script: tests import its functions, and
    absl allows one definition of a name (``--config``) per process (launch/plan_memory.py has one too)."""
    global _CONFIG, _ENV, _SEEDS, _BUDGET, _EVAL_EVERY, _EVAL_TASKS, _TARGET, _PATIENCE, _OVERRIDES
    _CONFIG = flags.DEFINE_string("config", "configs/minihack_room.py:cpu,baseline", "config file[:variant]")
    _ENV = flags.DEFINE_string("env", "comprl/MiniHack-Room-5x5-v0", "env id (replaces config env.tasks)")
    _SEEDS = flags.DEFINE_string("seeds", "0", "comma-separated seeds, one run each")
    _BUDGET = flags.DEFINE_float("budget_s", 900.0, "wall-clock budget per run (seconds)")
    _EVAL_EVERY = flags.DEFINE_integer("eval_every", 5, "evaluate every N steps")
    _EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 4, "eval tasks per evaluation (x group_size/2 episodes)")
    _TARGET = flags.DEFINE_float("target", 0.9, "greedy success that ends a run early")
    _PATIENCE = flags.DEFINE_integer("patience", 2, "evaluations in a row at >= target that end a run")
    _OVERRIDES = flags.DEFINE_multi_string(
        "set", [], "config overrides key=value (json values), e.g. actor.lr=3e-3"
    )


def load(config_arg: str, env_id: str, seed: int, overrides: list[str]):
    c = config_lib.load_file(config_arg)
    with c.unlocked():
        c.env.tasks = (env_id,)
        c.seed = seed
        c.train.steps = 10**6
        c.checkpoint.every = 10**6
        for item in overrides:
            key, _, value = item.partition("=")
            config_lib.set_key(c, key, json.loads(value))
    return c


def greedy_and_sampled(tr, n_tasks: int) -> tuple[float, float]:
    """Eval success of the actor alone, greedy and with its training sampling settings."""
    sampled = tr.evaluate(n_tasks, with_experience=False)
    sp = tr.actor_sampling
    tr.actor_sampling = dataclasses.replace(sp, greedy=True)
    try:
        greedy = tr.evaluate(n_tasks, with_experience=False)
    finally:
        tr.actor_sampling = sp

    def mean(ev):
        vals = [r["success"] for r in ev.values()]
        return float(sum(vals) / len(vals))

    return mean(greedy), mean(sampled)


def run_one(c, budget_s: float, eval_every: int, eval_tasks: int, target: float, patience: int) -> dict:
    from comprl_jax.loop.trainer import Trainer

    t0 = time.perf_counter()
    tr = Trainer(c, tempfile.mkdtemp(prefix="learning-"))
    curve, streak, reached, greedy, sampled = [], 0, None, float("nan"), float("nan")
    try:
        while time.perf_counter() - t0 < budget_s:
            m = tr.train_step()
            row = {
                "step": tr.step - 1,
                "success": round(m["success"], 4),
                "t": round(time.perf_counter() - t0, 1),
            }
            for k in ("success/guided", "success/free", "actions_per_episode"):
                if k in m:
                    row[k] = round(m[k], 4)
            for k in ("time/rollout_s", "time/update_s", "time/extraction_s"):
                if k in m:
                    row[k.split("/")[1]] = round(m[k], 2)
            if tr.step % eval_every == 0:
                greedy, sampled = greedy_and_sampled(tr, eval_tasks)
                row["eval_greedy"], row["eval_sampled"] = round(greedy, 4), round(sampled, 4)
                streak = streak + 1 if greedy >= target else 0
                if greedy >= target and reached is None:
                    reached = row["t"]
            curve.append(row)
            if streak >= patience:
                break
        if not curve or "eval_greedy" not in curve[-1]:
            greedy, sampled = greedy_and_sampled(tr, eval_tasks)
            if curve:
                curve[-1]["eval_greedy"], curve[-1]["eval_sampled"] = round(greedy, 4), round(sampled, 4)
    finally:
        tr.close()
    return {
        "bench": "learning",
        "env": c.env.tasks[0],
        "method": c.method,
        "seed": c.seed,
        "final_success": round(greedy, 4),
        "final_sampled_success": round(sampled, 4),
        "wall_s": round(time.perf_counter() - t0, 1),
        "steps": len(curve),
        "reached_target_s": reached,
        "config": {
            "tasks_per_step": c.rollout.tasks_per_step,
            "group_size": c.rollout.group_size,
            "max_turns": c.env.max_turns,
            "actor_lr": c.actor.lr,
            "temperature": c.actor.sampling.temperature,
        },
        "curve": curve,
    }


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for seed in [int(s) for s in _SEEDS.value.split(",")]:
        c = load(_CONFIG.value, _ENV.value, seed, _OVERRIDES.value)
        out = run_one(c, _BUDGET.value, _EVAL_EVERY.value, _EVAL_TASKS.value, _TARGET.value, _PATIENCE.value)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
