"""One interface for the rollout engines: a :class:`Rollout` (what every engine plays with) and
``Engine.play(rollout, specs, resets, key) -> (trajectories in spec order, timing)``.

Two engines implement it and play the very same trajectories, sampled or greedy (``tests/test_slot_rollout.py``):
reply ``i`` of episode ``b`` samples with ``fold_in(fold_in(key, b), i)`` in both.

* :class:`comprl_jax.rollout.lockstep.Lockstep`: one sampler call per turn for every live episode, then every env
  step; the multi-process engine (``gather``: every process steps its own env lanes, results all-gathered).
* :class:`comprl_jax.rollout.continuous.Continuous` (the default): episodes flow through KV-cache slots, env steps
  and search & ask overlap decoding. Single process.

:func:`comprl_jax.rollout.engines.make_engine` picks one from the run config's ``rollout`` section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from comprl_jax.rollout.episodes import EpisodeSpec, Trajectory
from comprl_jax.rollout.pools import Pools
from comprl_jax.rollout.search_ask import NO_SEARCH_ASK, SearchAsk


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What an engine plays a batch of episodes with.

    Attributes:
      pools: the env pools (one per env id) and each env's system prompt.
      sampler: the actor's ``SamplerService``; tokenizer: its ``Tokenizer``; sp: ``SamplingParams`` (each episode's
        own tokens per reply and context cap it: ``EpisodeSpec.max_new`` / ``max_len``).
      max_turns: env actions per episode (the env truncates there); search & ask turns do not count.
      max_len: the actor's context (token ids per episode).
      constraint_for: ``(env_id, may_ask) -> TokenAutomaton | None`` (constrained decoding for tiny models);
        ``may_ask``: the row may still use search & ask this turn, so its automaton also allows the tool tag.
      stop_strings: a reply ends at any of these (and at the search & ask closing tag when the tool is on).
      search_ask: the tool (SPEC §5) for episodes with ``spec.can_ask``; its sample keys come back per trajectory in
        ``Trajectory.ask_keys`` so the trainer can reward those extractor samples with the episode's outcome.
      constraint_groups: every ``(env_id, may_ask)`` constraint a play of the run can need. The continuous engine
        stacks them all into each play's automaton (plus any a play needs beyond them), so its shape, hence the
        compiled decode programs, stay one per run: evaluation plays one env and mode at a time and would otherwise
        compile a new automaton for each. Blocks no row starts in are never reached (same tokens either way).
    """

    pools: Pools
    sampler: Any
    tokenizer: Any
    sp: Any
    max_turns: int
    max_len: int
    constraint_for: Callable[[str, bool], Any] | None = None
    stop_strings: tuple[str, ...] = ("</answer>",)
    search_ask: SearchAsk = NO_SEARCH_ASK
    constraint_groups: tuple[tuple[str, bool], ...] = ()

    @property
    def im_end(self) -> int | None:
        return self.tokenizer.special_ids.get("<|im_end|>")

    @property
    def max_rounds(self) -> int:
        """Replies per episode at most: its env actions and its questions."""
        return self.max_turns + self.search_ask.extra_turns


class Engine(Protocol):
    def play(
        self,
        rollout: Rollout,
        specs: Sequence[EpisodeSpec],
        resets: Sequence[tuple[str, dict]],
        key: jax.Array,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Plays every episode (``resets``: their ``(obs, info)`` from :func:`comprl_jax.rollout.pools.reset_all`)
        to its end. Returns the trajectories in spec order and timing (``gen_s``, ``env_s``, engine extras)."""
        ...
