"""The rollout engine a run uses, from its config's ``rollout`` section (``rollout.engine``)."""

from __future__ import annotations

from typing import Any

from comprl_jax.rollout.continuous import Continuous
from comprl_jax.rollout.engine import Engine
from comprl_jax.rollout.lockstep import Lockstep

ENGINES = ("continuous", "lockstep")  # rollout.engine


def make_engine(rollout_cfg: Any, gather: Any = None) -> Engine:
    """``rollout.engine``'s engine; multi-process runs (``gather`` given) always play lock-step (the continuous
    schedule has no cross-process exchange: :mod:`comprl_jax.rollout.continuous`)."""
    if rollout_cfg.engine not in ENGINES:
        raise ValueError(f"config key rollout.engine: {rollout_cfg.engine!r} not in {ENGINES}")
    if rollout_cfg.engine == "lockstep" or gather is not None:
        return Lockstep(gather)
    return Continuous(
        slots=rollout_cfg.slots,
        chunk_steps=rollout_cfg.chunk_steps,
        exit_frac=rollout_cfg.exit_frac,
        env_lag=rollout_cfg.env_lag,
    )
