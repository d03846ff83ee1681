"""Our environment ids -> implementing class, with lazy imports.

The table is static text (``"module:Class"`` plus keyword arguments), so importing ``comprl_jax.envs`` does not
import NLE, TextWorld or the WebShop catalogue; the class module is imported on the first ``make``. The same ids
are registered with gymnasium (``gymnasium.make("comprl/MiniHack-Room-5x5-v0")`` works once ``comprl_jax.envs``
is imported). Worker processes of the env pool resolve an id to ``(entry_point, kwargs)`` in the parent and
rebuild it in the child from that JSON-able pair.

Each spec also says how the env's tasks split into training and held-out evaluation (SPEC §8: success rate on
held-out tasks), and what a failed episode scores:

* ``levels="split"``: a finite task list per named split (ALFWorld games, WebShop goals); training plays
  ``train_split``, evaluation ``eval_splits`` (the first is the primary figure; ``env.eval_split="eval"`` takes
  them all, another name just that split). Splits are passed to the constructor as ``split=``.
* ``levels="seeded"``: each seed generates its own level (MiniHack Room-Ultimate, mazes, Sokoban); training
  draws seeds from ``[0, 2^30)`` and evaluation from ``[2^30, 2^31)`` (:class:`comprl_jax.rollout.tasks.TaskSampler`).
* ``levels="fixed"``: one level whatever the seed (MiniHack Room-5x5): there is no held-out task, and its
  evaluation says so (split ``"train (one fixed level)"``).

And its episode limits (:class:`Limits`, SPEC §9): 30 turns of up to 4,096 tokens in a 32,768-token context, except
ALFWorld (40 turns of 2,048 tokens, 16,384 context) and WebShop (16,384 context). A mixture plays each env at its own
limits under run-wide caps (:func:`widest`, :func:`capped`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from comprl_jax.envs.base import TextEnv

LEVELS = ("seeded", "fixed", "split")
FIXED_SPLIT = "train (one fixed level)"


@dataclasses.dataclass(frozen=True)
class Limits:
    """An env's episode limits (SPEC §9, the paper's and the released code's): env actions per episode, tokens per
    actor turn, the actor's context. A run caps them with ``env.max_turns``, ``actor.sampling.max_new_tokens``
    and ``rollout.max_context`` (:func:`capped`)."""

    max_turns: int = 30
    turn_tokens: int = 4096
    context: int = 32768


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """How to build one registered environment, how its tasks split, and its failure reward."""

    env_id: str
    entry_point: str  # "package.module:ClassName"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    levels: str = "seeded"
    train_split: str | None = None
    eval_splits: tuple[str, ...] = ()
    failure_reward: float = 0.0  # reward of an unsuccessful episode (success is 1); ALFWorld: -1
    # tasks in each held-out split (seeds wrap around past it: evaluation never plays more); checked against the
    # data by tests/test_envs_alfworld.py and tests/test_envs_webshop.py
    eval_sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    limits: Limits = Limits()
    # the constructor argument that takes the run's seed (``Pools(run_seed=)``; the trainer passes ``seed``): an
    # env whose hidden rules are drawn once per run (HiddenRule); None for the others
    run_seed_kwarg: str | None = None
    # held-out evaluation counts an infra-failed episode as a failure (its number is reported beside the rate):
    # where the agent can make the env fail (SWE: a working copy that hangs the grader), dropping those episodes
    # would let a policy skip the tasks it cannot solve (issue 50 point 3)
    infra_counts_as_failure: bool = False

    def __post_init__(self):
        if self.levels not in LEVELS:
            raise ValueError(f"env {self.env_id!r}: levels must be one of {LEVELS}, got {self.levels!r}")
        if (self.levels == "split") != bool(self.eval_splits and self.train_split):
            raise ValueError(
                f"env {self.env_id!r}: levels='split' needs train_split and eval_splits (only it)"
            )
        if set(self.eval_sizes) != set(self.eval_splits):
            raise ValueError(
                f"env {self.env_id!r}: eval_sizes must give the size of each of {self.eval_splits}"
            )


_MH = "comprl_jax.envs.minihack_env:MiniHackTextEnv"
_REGISTRY: dict[str, EnvSpec] = {}


def register(
    env_id: str,
    entry_point: str,
    *,
    levels: str = "seeded",
    train_split: str | None = None,
    eval_splits: tuple[str, ...] = (),
    failure_reward: float = 0.0,
    eval_sizes: dict[str, int] | None = None,
    limits: Limits = Limits(),
    run_seed_kwarg: str | None = None,
    infra_counts_as_failure: bool = False,
    **kwargs: Any,
) -> EnvSpec:
    """Adds (or replaces) ``env_id``; ``entry_point`` is ``"module:Class"``; ``kwargs`` go to the constructor.
    Returns the spec."""
    if ":" not in entry_point:
        raise ValueError(f"entry_point for {env_id!r} must look like 'module:Class', got {entry_point!r}")
    spec = EnvSpec(
        env_id,
        entry_point,
        dict(kwargs),
        levels,
        train_split,
        tuple(eval_splits),
        failure_reward,
        dict(eval_sizes or {}),
        limits,
        run_seed_kwarg,
        infra_counts_as_failure,
    )
    _REGISTRY[env_id] = spec
    return spec


for _name in (
    "MiniHack-Room-Ultimate-5x5-v0",
    "MiniHack-MazeWalk-9x9-v0",
    "MiniHack-KeyRoom-Dark-S5-v0",
    "MiniHack-River-Narrow-v0",
):
    register(f"comprl/{_name}", _MH, env_name=_name)
# Room-5x5: the agent always starts in the top-left corner and the stairs are in the bottom-right one.
register("comprl/MiniHack-Room-5x5-v0", _MH, levels="fixed", env_name="MiniHack-Room-5x5-v0")
register("comprl/Sokoban-6x6-2-v0", "comprl_jax.envs.sokoban_env:SokobanTextEnv", dim=6, num_boxes=2)
# ALFWorld: trains on the released code's 1,466 games (of the 3,553 train games; SPEC §10's count); held out:
# valid_unseen (134, the paper's figure, the release's test set), then valid_seen (140).
register(
    "comprl/ALFWorld-v0",
    "comprl_jax.envs.alfworld:ALFWorldEnv",
    levels="split",
    train_split="rl_train",
    eval_splits=("valid_unseen", "valid_seen"),
    eval_sizes={"valid_unseen": 134, "valid_seen": 140},
    failure_reward=-1.0,
    limits=Limits(max_turns=40, turn_tokens=2048, context=16384),
)
# WebShop: 6,410 training goals, 500 held-out ones (disjoint goal keys, as WebShop's own split).
register(
    "comprl/WebShop-v0",
    "comprl_jax.envs.webshop.env:WebShopEnv",
    levels="split",
    train_split="train",
    eval_splits=("eval",),
    eval_sizes={"eval": 500},
    limits=Limits(context=16384),
)

# HiddenRule (issue 31): 16 families of locked objects, each opened by its own secret action drawn from the run's
# seed; a lesson from one instance holds for its whole family. Held-out instances: new place names.
register(
    "comprl/HiddenRule-v0",
    "comprl_jax.envs.hidden_rule:HiddenRuleEnv",
    run_seed_kwarg="rule_seed",
    limits=Limits(max_turns=4),
)
# The same with 3 tries (issue 49 point 4: actions per success): a wrong action resets the lock with feedback.
register(
    "comprl/HiddenRule-3Tries-v0",
    "comprl_jax.envs.hidden_rule:HiddenRuleEnv",
    run_seed_kwarg="rule_seed",
    limits=Limits(max_turns=4),
    attempts=3,
)

# SWE-Lite (issue 32): procedural bugs in 9 pinned PyPI projects, fixed with the paper's tools in a bubblewrap
# sandbox; 238 training tasks of 6 projects, held out: the 3 other projects (100 tasks, the primary figure), then
# held-out tasks of the training projects (62); counts checked against the shipped file by tests/test_swe_env.py.
register(
    "comprl/SWE-Lite-v0",
    "comprl_jax.envs.swe.env:SWELiteEnv",
    levels="split",
    train_split="train",
    eval_splits=("eval", "same_project_eval"),
    eval_sizes={"eval": 100, "same_project_eval": 62},
    infra_counts_as_failure=True,
)

ENV_IDS: tuple[str, ...] = tuple(_REGISTRY)


def spec(env_id: str) -> EnvSpec:
    """The spec of ``env_id``; unknown ids raise ``KeyError`` listing the known ones."""
    try:
        return _REGISTRY[env_id]
    except KeyError:
        raise KeyError(f"unknown env id {env_id!r}; known ids: {sorted(_REGISTRY)}") from None


def load_entry_point(entry_point: str) -> type:
    """Imports ``"module:Class"`` and returns the class."""
    module_name, _, attr = entry_point.partition(":")
    if not module_name or not attr:
        raise ValueError(f"entry point must look like 'module:Class', got {entry_point!r}")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"entry point {entry_point!r}: module {module_name!r} has no {attr!r}") from None


def make_from_entry_point(entry_point: str, **kwargs: Any) -> TextEnv:
    """Builds ``Class(**kwargs)`` from a ``"module:Class"`` string (what pool worker processes use)."""
    return load_entry_point(entry_point)(**kwargs)


def make(env_id: str, **kwargs: Any) -> TextEnv:
    """Builds the environment ``env_id``; ``kwargs`` override the registered ones (e.g. ``max_turns=40``)."""
    s = spec(env_id)
    return make_from_entry_point(s.entry_point, **{**s.kwargs, **kwargs})


def run_kwargs(env_id: str, run_seed: int | None) -> dict[str, Any]:
    """The constructor arguments a run adds for ``env_id``: its seed where the env draws per-run rules from it
    (:attr:`EnvSpec.run_seed_kwarg`); ``{}`` otherwise or without a seed."""
    s = spec(env_id)
    return {s.run_seed_kwarg: int(run_seed)} if s.run_seed_kwarg and run_seed is not None else {}


def failure_reward(env_id: str) -> float:
    """Reward of an unsuccessful episode of ``env_id`` (success scores 1); unknown ids score 0."""
    s = _REGISTRY.get(env_id)
    return s.failure_reward if s is not None else 0.0


def capped(env_id: str, max_turns: int, turn_tokens: int, context: int) -> Limits:
    """``env_id``'s own limits, each capped by the run's (``env.max_turns``, ``actor.sampling.max_new_tokens``,
    ``rollout.max_context``; a :tiny run caps them all)."""
    own = spec(env_id).limits
    return Limits(min(own.max_turns, max_turns), min(own.turn_tokens, turn_tokens), min(own.context, context))


def widest(env_ids) -> Limits:
    """The largest of each limit over ``env_ids``: a mixture's run-wide caps (what its sampler and update are
    sized for), under which every env keeps its own."""
    ls = [spec(e).limits for e in env_ids]
    return Limits(max(x.max_turns for x in ls), max(x.turn_tokens for x in ls), max(x.context for x in ls))


def eval_size(env_id: str, split: str | None) -> int | None:
    """How many tasks ``split`` of ``env_id`` holds (None: seeded or fixed levels, no finite list)."""
    return spec(env_id).eval_sizes.get(split) if split is not None else None


def eval_splits(env_id: str, requested: str = "eval") -> tuple[str | None, ...]:
    """The held-out splits evaluation plays for ``env_id`` (config ``env.eval_split``).

    ``"eval"``: every registered held-out split (first = the primary figure); another name: just that split (for
    ``levels="split"`` envs). ``None`` stands for "no split argument" (seeded levels: held-out seeds; a fixed level:
    the training level, see :data:`FIXED_SPLIT`).
    """
    s = spec(env_id)
    if s.levels != "split":
        return (None,)
    return s.eval_splits if requested == "eval" else (requested,)


def register_with_gymnasium() -> None:
    """Registers every id with gymnasium (idempotent); the entry point stays lazy."""
    import gymnasium

    for s in _REGISTRY.values():
        if s.env_id not in gymnasium.registry:
            gymnasium.register(id=s.env_id, entry_point=s.entry_point, kwargs=dict(s.kwargs))
