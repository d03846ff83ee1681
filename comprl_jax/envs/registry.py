"""Our environment ids -> implementing class, with lazy imports.

The table is static text (``"module:Class"`` plus keyword arguments), so importing ``comprl_jax.envs`` does not
import NLE, TextWorld or the WebShop catalogue; the class module is imported on the first ``make``. The same ids
are registered with gymnasium (``gymnasium.make("comprl/MiniHack-Room-5x5-v0")`` works once ``comprl_jax.envs``
is imported). Worker processes of the env pool resolve an id to ``(entry_point, kwargs)`` in the parent and
rebuild it in the child from that JSON-able pair.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from comprl_jax.envs.base import TextEnv


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """How to build one registered environment."""

    env_id: str
    entry_point: str  # "package.module:ClassName"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


_MH = "comprl_jax.envs.minihack_env:MiniHackTextEnv"
_REGISTRY: dict[str, EnvSpec] = {}


def register(env_id: str, entry_point: str, **kwargs: Any) -> EnvSpec:
    """Adds (or replaces) ``env_id``; ``entry_point`` is ``"module:Class"``. Returns the spec."""
    if ":" not in entry_point:
        raise ValueError(f"entry_point for {env_id!r} must look like 'module:Class', got {entry_point!r}")
    spec = EnvSpec(env_id, entry_point, dict(kwargs))
    _REGISTRY[env_id] = spec
    return spec


for _name in (
    "MiniHack-Room-Ultimate-5x5-v0",
    "MiniHack-Room-5x5-v0",
    "MiniHack-MazeWalk-9x9-v0",
    "MiniHack-KeyRoom-Dark-S5-v0",
    "MiniHack-River-Narrow-v0",
):
    register(f"comprl/{_name}", _MH, env_name=_name)
register("comprl/Sokoban-6x6-2-v0", "comprl_jax.envs.sokoban_env:SokobanTextEnv", dim=6, num_boxes=2)
register("comprl/ALFWorld-v0", "comprl_jax.envs.alfworld:ALFWorldEnv")
register("comprl/WebShop-v0", "comprl_jax.envs.webshop.env:WebShopEnv")

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


def register_with_gymnasium() -> None:
    """Registers every id with gymnasium (idempotent); the entry point stays lazy."""
    import gymnasium

    for s in _REGISTRY.values():
        if s.env_id not in gymnasium.registry:
            gymnasium.register(id=s.env_id, entry_point=s.entry_point, kwargs=dict(s.kwargs))
