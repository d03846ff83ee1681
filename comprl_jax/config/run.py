"""The run config as typed sections: :class:`RunConfig` is built once from the ``ConfigDict`` (or a saved JSON
tree), each section by its own dataclass (``runtime.fields.from_section``: a key is a field, checked where the
class is defined); the checks that span sections are here. The trainer opens the config here and nowhere else; the
components it builds take their sections, never the whole config."""

from __future__ import annotations

import dataclasses

from comprl_jax.config import keys, schema
from comprl_jax.config.methods import METHOD_FLAGS, METHODS
from comprl_jax.experience.bank import BankConfig
from comprl_jax.experience.manager import ManagerConfig
from comprl_jax.experience.retrieval import ExperienceConfig, RetrievalConfig
from comprl_jax.roles.role_config import ActorConfig, ExtractorConfig
from comprl_jax.rollout.rollout_config import EnvConfig, RolloutConfig
from comprl_jax.runtime.checkpoint import CheckpointConfig
from comprl_jax.runtime.distributed import MeshConfig
from comprl_jax.runtime.fields import check, from_section


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Config section ``train``: steps, held-out evaluation and metrics rows."""

    steps: int = 145
    eval_every: int = 0
    eval_tasks: int = 128
    eval_full_splits: bool = True
    log_every: int = 1

    def __post_init__(self):
        check(self.steps >= 1, "steps", "must be >= 1", self.steps)
        check(self.eval_every >= 0, "eval_every", "must be >= 0 (0 = only at the end)", self.eval_every)
        check(self.eval_tasks >= 1, "eval_tasks", "must be >= 1", self.eval_tasks)
        check(self.log_every >= 1, "log_every", "must be >= 1", self.log_every)


SECTIONS = {
    "env": EnvConfig,
    "rollout": RolloutConfig,
    "experience": ExperienceConfig,
    "actor": ActorConfig,
    "extractor": ExtractorConfig,
    "bank": BankConfig,
    "retrieval": RetrievalConfig,
    "manager": ManagerConfig,
    "train": TrainConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
}
TOP_LEVEL = ("experiment", "seed", "method")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key {key}: {msg}")


def _attr(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A validated run config, one typed section per ``ConfigDict`` section (same names, same keys)."""

    experiment: str
    seed: int
    method: str
    env: EnvConfig
    rollout: RolloutConfig
    experience: ExperienceConfig
    actor: ActorConfig
    extractor: ExtractorConfig
    bank: BankConfig
    retrieval: RetrievalConfig
    manager: ManagerConfig
    train: TrainConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig

    @classmethod
    def of(cls, c) -> RunConfig:
        """From a ``ConfigDict`` or a JSON tree (a RunConfig passes through). Raises ValueError naming the first
        bad key: an unknown or missing key, a bad value (checked by its section's dataclass), or a combination of
        sections that does not fit (:meth:`__post_init__`)."""
        if isinstance(c, RunConfig):
            return c
        names = list(c.keys())
        unknown = sorted(set(names) - set(SECTIONS) - set(TOP_LEVEL))
        missing = sorted((set(SECTIONS) | set(TOP_LEVEL)) - set(names))
        _check(
            not unknown,
            str(unknown),
            f"unknown section(s); a run config has {sorted(SECTIONS)} and {TOP_LEVEL}",
        )
        _check(not missing, str(missing), "missing from the config (build it with comprl_jax.config.build)")
        # a key the schema has but the config lacks would silently take its dataclass's default
        have = set(keys.flatten(c))
        lost = [
            k for k in keys.flatten(schema.base_config()) if k.split(".")[0] in SECTIONS and k not in have
        ]
        _check(
            not lost,
            ", ".join(lost),
            "missing from the config; an older run's config.json? (comprl_jax.config.upgrade_saved fills the keys "
            "added since: add the key to config/upgrade.py ADDED_KEYS with the value that reproduces older runs)",
        )
        return cls(
            **{k: c[k] for k in TOP_LEVEL}, **{k: from_section(t, c[k], k) for k, t in SECTIONS.items()}
        )

    def __post_init__(self):
        _check(self.method in METHODS, "method", f"{self.method!r} not in {METHODS}")
        flags = METHOD_FLAGS.get(self.method, {})
        off = [
            f"{k}={_attr(self, k)} (method {self.method!r} means {v})"
            for k, v in flags.items()
            if _attr(self, k) != v
        ]
        _check(
            not off,
            "method",
            f"the method's flags were changed: {', '.join(off)}; pick the method with the config's variant word "
            f"(e.g. configs/x.py:tiny,baseline) or set --config.method=custom to combine flags freely",
        )
        _check(
            self.experience.enabled or not (self.extractor.train or self.bank.offline),
            "experience.enabled",
            "is False, so extractor.train and bank.offline must be False too (no bank, no extractor)",
        )
        r = self.rollout
        episodes = r.tasks_per_step * r.group_size * len(self.env.tasks)
        _check(
            r.rows_per_wave == 0 or episodes % min(r.rows_per_wave, episodes) == 0,
            "rollout.rows_per_wave",
            f"={r.rows_per_wave} must divide the {episodes} episodes of a step "
            "(rollout.tasks_per_step x rollout.group_size x len(env.tasks)), or be 0 (all at once)",
        )
