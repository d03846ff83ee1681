"""Config sections ``env`` and ``rollout`` as dataclasses (``runtime.fields.from_section`` builds them): a key of
the section is a field here, and its value is checked here, once. The comments beside the keys in
``comprl_jax/config/schema.py`` document them."""

from __future__ import annotations

import dataclasses

from comprl_jax.runtime.fields import check

BACKENDS = ("thread", "process")
ENGINES = ("continuous", "lockstep")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Config section ``env``: the env ids of the mixture, the run-wide caps on each env's own limits
    (``envs.registry.capped``), the env pool and the held-out split."""

    tasks: tuple[str, ...] = ("comprl/MiniHack-Room-Ultimate-5x5-v0",)
    max_turns: int = 30
    backend: str = "thread"
    workers: int = 8
    step_timeout_s: float = 60.0
    eval_split: str = "eval"

    def __post_init__(self):
        check(len(self.tasks) >= 1, "tasks", "needs at least one env id", self.tasks)
        check(self.max_turns > 0, "max_turns", "must be positive", self.max_turns)
        check(self.backend in BACKENDS, "backend", f"must be one of {BACKENDS}", self.backend)
        check(self.workers >= 1, "workers", "must be >= 1", self.workers)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Config section ``rollout``: the step's batch (tasks x K episodes, K/2 guided), the actor's context, waves
    and the engine (``rollout.engines.make_engine``)."""

    tasks_per_step: int = 16
    group_size: int = 8
    max_context: int = 32768
    rows_per_wave: int = 0
    engine: str = "continuous"
    slots: int = 0
    chunk_steps: int = 16
    exit_frac: float = 0.125
    env_lag: int = 32

    def __post_init__(self):
        check(self.tasks_per_step >= 1, "tasks_per_step", "must be >= 1", self.tasks_per_step)
        check(
            self.group_size >= 2 and self.group_size % 2 == 0,
            "group_size",
            "must be even and >= 2 (half guided, half free)",
            self.group_size,
        )
        check(self.engine in ENGINES, "engine", f"must be one of {ENGINES}", self.engine)
        check(self.slots >= 0, "slots", "must be >= 0 (0 = one per episode)", self.slots)
        check(self.chunk_steps >= 1, "chunk_steps", "must be >= 1", self.chunk_steps)
        check(0.0 < self.exit_frac <= 1.0, "exit_frac", "must be in (0, 1]", self.exit_frac)
        check(self.env_lag >= 1, "env_lag", "must be >= 1 (decode chunks)", self.env_lag)
        check(
            self.rows_per_wave >= 0,
            "rows_per_wave",
            "must be >= 0 (0 = all episodes at once)",
            self.rows_per_wave,
        )
