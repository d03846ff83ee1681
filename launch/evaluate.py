"""Evaluates a run's latest checkpoint on held-out tasks, with and without test-time experience.

  python launch/evaluate.py --workdir=runs/room_tiny [--tasks=16]

Reads the run's config from <workdir>/config.json, restores the newest readable checkpoint, and writes
<workdir>/eval.json ({"with_exp": {env_id: score}, "without_exp": {...}}), the input of launch/make_tables.py.
"""

import json
import os

import ml_collections
from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory written by launch/train.py")
_TASKS = flags.DEFINE_integer("tasks", 0, "held-out tasks per env (0 = the config's train.eval_tasks)")
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    from comprl_jax.trainer import Trainer

    path = os.path.join(_WORKDIR.value, "config.json")
    if not os.path.exists(path):
        raise app.UsageError(
            f"{path} not found: --workdir must be a run directory written by launch/train.py"
        )
    with open(path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tr = Trainer(config, _WORKDIR.value)
    try:
        if not tr.restore():
            raise app.UsageError(f"no checkpoint under {_WORKDIR.value}/checkpoints")
        n = _TASKS.value or config.train.eval_tasks
        ev = {"without_exp": tr.evaluate(n, with_experience=False)}
        if tr.track is not None:
            ev["with_exp"] = tr.evaluate(n, with_experience=True)
    finally:
        tr.close()
    with open(os.path.join(_WORKDIR.value, "eval.json"), "w") as f:
        json.dump(ev, f, indent=2)
    print(json.dumps(ev))


if __name__ == "__main__":
    app.run(main)
