"""Trains one config; auto-resumes from --workdir.

python launch/train.py --config=configs/minihack_room.py:tiny --workdir=runs/room_tiny [--config.actor.lr=1e-3]
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from comprl_jax import trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/<experiment>.py[:variant]", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "run directory (metrics, checkpoints, plots); resumes if present"
)
_STOP_AFTER = flags.DEFINE_integer("stop_after", None, "stop after this many steps of this invocation")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.getLogger().setLevel(logging.INFO)
    out = trainer.run(_CONFIG.value, _WORKDIR.value, stop_after=_STOP_AFTER.value)
    last = out["last_metrics"]
    print(
        f"step {out['step']}: success {last.get('success', float('nan')):.3f}, "
        f"bank {int(last.get('bank/size', 0))}, eval {out.get('eval')}"
    )


if __name__ == "__main__":
    app.run(main)
