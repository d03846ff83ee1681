"""Evaluates a run's latest checkpoint on held-out tasks, with and without test-time experience.

  python launch/evaluate.py --workdir=runs/room_tiny [--tasks=16]

Reads the run's config from <workdir>/config.json, restores the newest readable checkpoint, prints the held-out
success table and writes <workdir>/eval.json, the input of launch/make_tables.py:
  {"without_exp": {LABEL: {"env_id", "split", "tasks", "success", "episodes", "infra_failed", "mean_reward",
                           "score", "actions"}},
   "with_exp": {...}}   (with_exp only for runs with experience; LABEL = env id, or "<env_id>@<split>")
ALFWorld and WebShop play their whole held-out splits (train.eval_full_splits); --tasks bounds them instead.
"""

import json
import os
import sys

from absl import flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comprl_jax import config as config_lib
from launch import common as lu

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory written by launch/train.py")
_TASKS = flags.DEFINE_integer(
    "tasks", 0, "held-out tasks per env (0 = the config's train.eval_tasks and whole held-out splits)"
)


def main(argv):
    del argv
    lu.configure_logging(lu.flag_verbosity())
    if not _WORKDIR.value:
        raise lu.LaunchError(
            "--workdir is required", "e.g. --workdir=runs/x (a run written by launch/train.py)"
        )
    workdir = _WORKDIR.value
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise lu.LaunchError(
            f"{path} not found", "--workdir must be a run directory written by launch/train.py"
        )
    if lu.latest_checkpoint_step(workdir) is None:
        raise lu.LaunchError(
            f"no checkpoint under {os.path.join(workdir, 'checkpoints')}",
            "train first: launch/train.py --config=... --workdir=" + workdir,
            lu.RUN_EXIT,
        )
    import ml_collections

    from comprl_jax.loop.trainer import Trainer
    from launch.tables import eval_table

    with open(path) as f:
        config = ml_collections.ConfigDict(config_lib.upgrade_saved(json.load(f)))
    if _TASKS.value:  # an explicit count bounds the split envs too
        with config.unlocked():
            config.train.eval_full_splits = False
    tr = Trainer(config, workdir)
    try:
        if not tr.restore():
            raise lu.LaunchError(
                f"no readable checkpoint under {os.path.join(workdir, 'checkpoints')}",
                "the log lines above say why each step was skipped",
                lu.RUN_EXIT,
            )
        n = _TASKS.value or config.train.eval_tasks
        ev = {"without_exp": tr.evaluate(n, with_experience=False)}
        if tr.track is not None:
            ev["with_exp"] = tr.evaluate(n, with_experience=True)
    finally:
        tr.close()
    tmp = os.path.join(workdir, "eval.json.tmp")
    with open(tmp, "w") as f:  # atomic: make_tables never reads a torn file
        json.dump(ev, f, indent=2)
    os.replace(tmp, os.path.join(workdir, "eval.json"))
    print(f"step {tr.step}, held-out tasks per env and split in the tasks column:")
    print(eval_table(ev))
    print(f"written: {os.path.join(workdir, 'eval.json')}")


if __name__ == "__main__":
    lu.run(main, lambda: _WORKDIR.value)
