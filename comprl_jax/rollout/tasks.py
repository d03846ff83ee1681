"""Deterministic, checkpointable task sampling for rollout steps (single- and multi-task mixtures).

A step draws ``tasks_per_task`` tasks for every env id in the mixture (the paper's multi-task runs use 128 per
task). A task is ``(env_id, seed)``; the K rollouts of its group share the seed, hence the initial state.
The sampler's whole state is a step counter and a base seed, so resume is exact without storing RNG internals.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Task:
    env_id: str
    seed: int
    task_index: int  # position of env_id in the mixture == bank partition id


class TaskSampler:
    """Draws training tasks per step; eval tasks come from a disjoint seed range.

    Args:
      env_ids: the mixture (one bank partition per id).
      tasks_per_step: tasks per env id per step.
      seed: base seed of the run.
    """

    TRAIN_SEED_SPACE = 1 << 30  # train seeds in [0, 2^30); eval seeds in [2^30, 2^31)

    def __init__(self, env_ids, tasks_per_step: int, seed: int):
        if not env_ids:
            raise ValueError("TaskSampler needs at least one env id (config key env.tasks)")
        self.env_ids = tuple(env_ids)
        self.tasks_per_step = int(tasks_per_step)
        self.seed = int(seed)
        self.step = 0

    def _rng(self, step: int, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step, salt])

    def next(self) -> list[Task]:
        """Tasks of the next step: ``tasks_per_step`` per env id, in mixture order."""
        rng = self._rng(self.step, 0)
        out = []
        for i, env_id in enumerate(self.env_ids):
            for s in rng.integers(0, self.TRAIN_SEED_SPACE, size=self.tasks_per_step):
                out.append(Task(env_id, int(s), i))
        self.step += 1
        return out

    def eval_tasks(self, n_per_task: int) -> list[Task]:
        """A fixed held-out set (same for every run with this base seed)."""
        rng = self._rng(-1 & 0xFFFF, 1)
        out = []
        for i, env_id in enumerate(self.env_ids):
            for s in rng.integers(self.TRAIN_SEED_SPACE, 2 * self.TRAIN_SEED_SPACE, size=n_per_task):
                out.append(Task(env_id, int(s), i))
        return out

    def state_dict(self) -> dict:
        return {
            "env_ids": list(self.env_ids),
            "tasks_per_step": self.tasks_per_step,
            "seed": self.seed,
            "step": self.step,
        }

    def load_state_dict(self, d: dict) -> None:
        if list(d["env_ids"]) != list(self.env_ids):
            raise ValueError(
                f"checkpoint task mixture {d['env_ids']} differs from config env.tasks {self.env_ids}"
            )
        self.step = int(d["step"])
