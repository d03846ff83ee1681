"""Trains one config; auto-resumes from --workdir.

python launch/train.py --config=configs/minihack_room.py:tiny --workdir=runs/room_tiny [--config.actor.lr=1e-3]

Multi-host (JAX multi-controller; run the same command on every host, with a shared --workdir):
  --distributed                      jax.distributed.initialize() with auto-detection (TPU pods, SLURM, ...)
  --coordinator=host:port --num_processes=N --process_id=i   explicit start-up (e.g. N processes on one box)
Meshes: --config.mesh.data/fsdp/tensor, --config.mesh.placement=colocated|disjoint, --config.mesh.actor_fraction.
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from comprl_jax import distributed, trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/<experiment>.py[:variant]", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "run directory (metrics, checkpoints, plots); resumes if present"
)
_STOP_AFTER = flags.DEFINE_integer("stop_after", None, "stop after this many steps of this invocation")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "jax.distributed.initialize() with auto-detection (TPU pods, SLURM)"
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 (explicit multi-process start)"
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "number of processes (with --coordinator)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (with --coordinator)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.getLogger().setLevel(logging.INFO)
    distributed.initialize(
        auto=_DISTRIBUTED.value,
        coordinator=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
    )
    out = trainer.run(_CONFIG.value, _WORKDIR.value, stop_after=_STOP_AFTER.value)
    last = out["last_metrics"]
    print(
        f"step {out['step']}: success {last.get('success', float('nan')):.3f}, "
        f"bank {int(last.get('bank/size', 0))}, eval {out.get('eval')}"
    )


if __name__ == "__main__":
    app.run(main)
