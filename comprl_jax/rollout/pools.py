"""The env pools of a rollout: one :class:`EnvPool` per env id of the mixture, each env's system prompt and action
space, and the resets that start a batch of episodes.

Multi-process (``gather`` given): every process holds every episode's host state, but steps only the env lanes it
owns (:func:`comprl_jax.runtime.distributed.owned_rows`); the results are all-gathered after each reset / step, so
all processes build identical sampler inputs and issue identical jitted calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from comprl_jax.envs.pool import EnvPool

if TYPE_CHECKING:
    from comprl_jax.rollout.episodes import EpisodeSpec


class Pools:
    """One :class:`EnvPool` per env id of the mixture, each with ``slots`` lanes, plus each env's system prompt and
    action space (``actions``: a static action set, or ``action_regex``: the action syntax; for constrained decoding)."""

    def __init__(
        self,
        env_ids: Sequence[str],
        slots_per_env: int,
        workers: int,
        backend: str,
        max_turns: int | Mapping[str, int],
        timeout_s: float,
        env_kwargs: dict | None = None,
        run_seed: int | None = None,
    ):
        """``max_turns``: one value for every env, or one per env id; ``env_kwargs``: extra constructor arguments of
        every env (e.g. ``{"split": "valid_unseen"}``); ``run_seed``: the run's seed, for envs that draw per-run
        rules from it (``registry.run_kwargs``: HiddenRule's ``rule_seed``)."""
        from comprl_jax.envs import registry

        self.pools: dict[str, EnvPool] = {}
        self.system_prompts: dict[str, str] = {}
        self.action_spaces: dict[str, tuple[tuple[str, ...] | None, str | None]] = {}
        for env_id in env_ids:
            turns = max_turns[env_id] if isinstance(max_turns, Mapping) else max_turns
            kwargs = {"max_turns": int(turns), **registry.run_kwargs(env_id, run_seed), **(env_kwargs or {})}
            self.pools[env_id] = EnvPool(
                env_id,
                slots_per_env,
                num_workers=workers,
                backend=backend,
                env_kwargs=kwargs,
                timeout_s=timeout_s,
            )
            # System prompt and action space are static per env class; read them off one local instance (no reset).
            env = registry.make(env_id, **kwargs)
            try:
                self.system_prompts[env_id] = env.system_prompt()
                actions = getattr(env, "actions", None)
                self.action_spaces[env_id] = (
                    tuple(actions) if actions else None,
                    getattr(env, "action_regex", None),
                )
            finally:
                env.close()

    def close(self) -> None:
        for p in self.pools.values():
            p.close()


def reset_all(pools: Pools, specs: Sequence[EpisodeSpec], gather: Any = None) -> list[tuple[str, dict]]:
    """Resets every episode (the K of a group share the task seed) and returns ``(obs, info)`` per spec.

    ``gather``: multi-process exchange (``{row: value} -> {row: value}`` over all processes); this process then
    resets only the rows it owns.
    """
    slot_of = lanes(specs)
    rows = own_rows(len(specs), gather)
    futs = {i: pools.pools[specs[i].task.env_id].submit_reset(slot_of[i], specs[i].task.seed) for i in rows}
    if gather is None:
        return [futs[i].result() for i in rows]
    got = gather({i: list(f.result()) for i, f in futs.items()})
    return [(got[i][0], got[i][1]) for i in range(len(specs))]


def own_rows(n: int, gather: Any) -> range:
    """The rows of ``n`` this process steps: all of them, or (multi-process, ``gather`` given) its own."""
    if gather is None:
        return range(n)
    from comprl_jax.runtime.distributed import owned_rows

    return owned_rows(n)


def lanes(specs: Sequence[EpisodeSpec]) -> list[int]:
    """The env pool lane (slot) of each spec, counted per env id in order."""
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        out.append(seen.get(s.task.env_id, 0))
        seen[s.task.env_id] = out[-1] + 1
    return out
