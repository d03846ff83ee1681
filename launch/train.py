"""Trains one config; auto-resumes from --workdir.

python launch/train.py --config=configs/minihack_room.py:tiny --workdir=runs/room_tiny [--config.actor.lr=1e-3]

Every config key, its value after overrides and what it means: add --print_config (no --workdir needed).
Resuming with a different config (other than train.steps / eval_tasks / eval_every / log_every) is refused with
the list of changed keys; --allow_config_change resumes anyway, keeps the old config as config.<step>.json and
marks the first new metrics row with config_changed=1.
Errors print two lines (what is wrong, what to do); --verbosity=1 adds the traceback and every library's logs.

Multi-host (JAX multi-controller; run the same command on every host, with a shared --workdir):
  --distributed                      jax.distributed.initialize() with auto-detection (TPU pods, SLURM, ...)
  --coordinator=host:port --num_processes=N --process_id=i   explicit start-up (e.g. N processes on one box)
Meshes: --config.mesh.data/fsdp/tensor, --config.mesh.placement=colocated|disjoint, --config.mesh.actor_fraction.
"""

import json
import os
import shutil
import sys

from absl import flags
from ml_collections import config_flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comprl_jax import config as config_lib
from launch import common as lu

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/<experiment>.py[:variant]", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "run directory (metrics, checkpoints, plots); resumes if present"
)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "print the final config (after overrides), one key per line with its comment; exit"
)
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "resume a run whose config.json differs from this config (the old one is kept as config.<step>.json)",
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


def _fmt(v) -> str:
    return json.dumps(v) if not isinstance(v, float) else f"{v:g}"


def resume_check(config, workdir: str, allow: bool, leader: bool) -> dict | None:
    """Compares this config with the run's ``config.json`` when the run has a checkpoint to resume from.

    Returns the ``row_extra`` for loop.run.run (None when nothing changed). Raises LaunchError listing the
    changed keys unless ``allow``; with ``allow`` the old config is kept as ``config.<step>.json``.
    """
    step = lu.latest_checkpoint_step(workdir)
    path = os.path.join(workdir, "config.json")
    if step is None or not os.path.exists(path):
        return None  # nothing to resume: the run starts from step 0 with this config
    try:
        with open(path) as f:
            old = config_lib.upgrade_saved(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        print(f"warning: {path} is unreadable ({e}); resuming with the new config")
        return None
    diff = lu.config_diff(old, lu.config_tree(config), ignore=lu.RESUME_FREE_KEYS)
    if not diff:
        return None
    shown = ", ".join(f"{k} {_fmt(a)} -> {_fmt(b)}" for k, a, b in diff[:8])
    more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
    if not allow:
        raise lu.LaunchError(
            f"--workdir={workdir} holds a run at step {step} with another config: {shown}{more}",
            "run with that run's flags, pass --allow_config_change to resume with these values, "
            "or choose a new --workdir",
        )
    saved = os.path.join(workdir, f"config.{step}.json")
    if leader:
        shutil.copyfile(path, saved)
    print(f"config changed at step {step}: {shown}{more} (the old config is kept in {saved})")
    return {"config_changed": 1.0}


def summary(out: dict, start_step: int | None, steps: int) -> str:
    """The end-of-run lines: the last recorded metrics (and 'nothing to do' for a finished run), then the
    held-out evaluation table."""
    from launch.tables import eval_table

    last = out.get("last_metrics") or {}
    nan = float("nan")
    lines = []
    if start_step is not None and out["step"] == start_step and start_step >= steps:
        lines.append(f"already at step {out['step']} (train.steps={steps}); nothing to do")
    lines.append(
        f"step {out['step']}: success {last.get('success', nan):.3f} "
        f"(guided {last.get('success/guided', nan):.3f}, free {last.get('success/free', nan):.3f}), "
        f"actions/episode {last.get('actions_per_episode', nan):.2f}, "
        f"bank size {int(last['bank/size']) if 'bank/size' in last else '-'}"
        + (f" (last recorded at step {int(last['step'])})" if "step" in last else "")
    )
    if out.get("eval"):
        lines.append(eval_table(out["eval"]))
    return "\n".join(lines)


def main(argv):
    del argv
    lu.configure_logging(lu.flag_verbosity())
    config = _CONFIG.value
    if config is None:
        raise lu.LaunchError("--config is required", "e.g. --config=configs/minihack_room.py:tiny")
    if type(config).__name__ == "_ErrorConfig":  # config_flags defers a config file's IOError
        raise lu.LaunchError(
            f"--config: {str(object.__getattribute__(config, '_error')).splitlines()[0]}",
            "check the config file",
        )
    from comprl_jax.config import validate

    validate(config)  # the final config, after the command line's overrides
    if _PRINT_CONFIG.value:
        print(lu.format_config(config))
        return
    if not _WORKDIR.value:
        raise lu.LaunchError("--workdir is required", "e.g. --workdir=runs/x (resumes when it holds a run)")
    workdir = os.path.abspath(_WORKDIR.value)
    undo = lu.prepare_workdir(workdir)
    try:
        from comprl_jax.loop import run as run_lib
        from comprl_jax.runtime import distributed

        distributed.initialize(
            auto=_DISTRIBUTED.value,
            coordinator=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
        leader = distributed.is_leader()
        row_extra = resume_check(config, workdir, _ALLOW_CHANGE.value, leader)
        start = lu.latest_checkpoint_step(workdir)
        out = run_lib.run(config, workdir, stop_after=_STOP_AFTER.value, row_extra=row_extra)
    except BaseException:
        if leader_or_single():
            lu.undo_workdir(workdir, undo)
        raise
    print(summary(out, start, config.train.steps))


def leader_or_single() -> bool:
    """Process 0 (or the only process) cleans up: other processes of a multi-host run share its workdir."""
    try:
        import jax

        return jax.process_index() == 0
    except Exception:  # noqa: BLE001 -- JAX not started: a single process
        return True


if __name__ == "__main__":
    lu.run(main, lambda: _WORKDIR.value)
