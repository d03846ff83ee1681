"""The rollout engine a run uses, from its config's ``rollout`` section (``rollout.engine``)."""

from __future__ import annotations

from typing import Any

from comprl_jax.rollout.continuous import Continuous
from comprl_jax.rollout.engine import Engine
from comprl_jax.rollout.lockstep import Lockstep


def make_engine(rollout_cfg: Any, gather: Any = None) -> Engine:
    """``rollout.engine``'s engine; multi-process runs (``gather`` given) always play lock-step (the continuous
    schedule has no cross-process exchange: :mod:`comprl_jax.rollout.continuous`). ``config.validate`` has
    checked ``rollout.engine``."""
    if rollout_cfg.engine == "lockstep" or gather is not None:
        return Lockstep(gather)
    return Continuous(
        slots=rollout_cfg.slots,
        chunk_steps=rollout_cfg.chunk_steps,
        exit_frac=rollout_cfg.exit_frac,
        env_lag=rollout_cfg.env_lag,
    )
