"""Continuous-batching rollouts: episodes flow through a fixed set of KV-cache slots while env steps run on the
pools, overlapped with decoding (the default engine, ``rollout.engine = "continuous"``).

An episode takes a slot for its first turn, and every next turn is an incremental prefill of the new observation
onto its KV row. When a reply ends, the episode's env step runs on the pool while the other slots keep decoding.
With fewer slots than episodes (``rollout.slots``), an episode waiting on its env step gives its slot up when a
ready episode needs one: its KV row is parked (dense cache: copied into a parking store; paged: its page list moves
to a park row on the host) and later continues in whichever slot is free. The host loop, per chunk ``c``:

1. enter (one jitted call): ready episodes (in their own slot, or a free / freed one), then new episodes. The
   same call advances every other replying slot by one position;
2. dispatch decode chunk ``c`` (one jitted call of up to ``rollout.chunk_steps`` positions; it ends early once
   ``rollout.exit_frac`` of the slots have finished);
3. while the device decodes, wait for env steps, oldest first: every one submitted ``rollout.env_lag`` chunks ago,
   and more as far as the next chunk has free slots for their episodes. Their observations become inputs entered
   before chunk ``c + 1``;
4. read chunk ``c``'s finished replies: search & ask questions go to the extractor (one batched call per chunk,
   on the engine's own ask thread, in submission order) and env actions to the pools; both are results that the
   loop waits for like env steps (step 3), so the actor's other slots keep decoding while the extractor answers
   (on its own devices with disjoint placement).

The schedule depends only on what the device computed, never on timing: which env steps are waited for, and when,
follows from counts of episodes and slots, and the loop blocks when a step it needs is late. Sampling keys are per
(episode, reply): reply ``i`` of episode ``b`` draws with ``fold_in(fold_in(key, b), i)`` in both engines, so a
rollout is reproducible, a resumed run stays bit-identical, and the lock-step engine plays the very same
trajectories, sampled or greedy (``tests/test_slot_rollout.py``).

Multi-process runs use the lock-step engine (:class:`comprl_jax.rollout.lockstep.Lockstep`). There every process
steps only its own env rows and all-gathers the results after each round, so all processes issue identical jitted
calls. The chunk schedule here would need one all-gather of the finished rows' env results per chunk instead;
that is not built yet.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from comprl_jax.rollout.engine import Rollout
from comprl_jax.rollout.episodes import Episode, EpisodeSpec, Trajectory, start_episodes
from comprl_jax.rollout.pools import lanes
from comprl_jax.rollout.slots_schedule import schedule  # also this module's API (launch/bench/rollout.py)
from comprl_jax.sampling.automaton import union
from comprl_jax.sampling.slots import Entry, Finished, SlotBatch


class _Context:
    """An episode's token record: exactly the ids fed and sampled, the assistant mask and sampling logprobs."""

    __slots__ = ("ids", "mask", "lps", "cached")

    def __init__(self):
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.lps: list[float] = []
        self.cached = 0  # ids[:cached] are in the slot's cache

    def feed(self, new: Sequence[int]) -> list[int]:
        """Records input ``new``; returns what the cache must be extended with (the unfed last reply token first)."""
        row = self.ids[self.cached :] + [int(t) for t in new]
        self.ids += [int(t) for t in new]
        self.mask += [0] * len(new)
        self.lps += [0.0] * len(new)
        self.cached = len(self.ids)
        return row

    def reply(self, tokens, logprobs) -> None:
        n = len(tokens)
        self.ids += [int(t) for t in tokens]
        self.mask += [1] * n
        self.lps += [float(x) for x in logprobs]
        self.cached += max(n - 1, 0)  # the last sampled token is fed at the start of the next turn


@dataclasses.dataclass(frozen=True)
class Continuous:
    """The continuous-batching engine (:class:`comprl_jax.rollout.engine.Engine`; single process).

    Attributes:
      slots: KV-cache rows (0 = one per episode); more episodes than slots start as earlier ones end.
      chunk_steps: decode positions per jitted call at most.
      exit_frac: a chunk also ends once this fraction of the slots finished their replies in it.
      env_lag: chunks an env step has before its result is due
        (:func:`~comprl_jax.rollout.slots_schedule.schedule`).
    """

    slots: int = 0
    chunk_steps: int = 16
    exit_frac: float = 0.125
    env_lag: int = 32

    def play(
        self, r: Rollout, specs: Sequence[EpisodeSpec], resets: Sequence[tuple[str, dict]], key: jax.Array
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Plays all episodes to the end. Timing: ``gen_s`` (dispatching and waiting for the device), ``env_s``
        (waiting for env steps not yet done when their results were due), ``decode_steps``, ``slot_steps`` (decode
        steps x slots), ``generated`` (sampled tokens), ``device_idle_s`` and ``parked``
        (:func:`~comprl_jax.rollout.slots_schedule.schedule`)."""
        eps = start_episodes(r.pools.system_prompts, specs, resets, r.tokenizer, r.search_ask.tool_text)
        engine, start_of = self._slot_batch(r, specs)
        turns = _Turns(r, eps, start_of)
        try:
            live = [b for b, e in enumerate(eps) if e.live]
            timing = schedule(
                engine,
                key,
                live,
                turns.entry,
                turns.on_replies,
                turns.on_result,
                exit_frac=self.exit_frac,
                env_lag=self.env_lag,
            )
        finally:
            turns.close()
        return turns.trajectories(), timing

    def _slot_batch(
        self, r: Rollout, specs: Sequence[EpisodeSpec]
    ) -> tuple[SlotBatch, dict[tuple[str, bool], int]]:
        """The slots for ``specs`` (``min(slots or E, E)`` rows for ``E`` episodes) and each ``(env id, may ask)``
        constraint's start state in their automaton."""
        E, sa = len(specs), r.search_ask
        # Every (env id, may ask) constraint a row of this rollout can need, stacked into one automaton: all slots
        # decode in one call, each row starting in its own constraint's block. The union is over the run's groups
        # too (sorted), so every play of the run builds the same automaton (Rollout.constraint_groups).
        need = {(s.task.env_id, flag) for s in specs for flag in (False, sa.enabled and s.can_ask)}
        groups = sorted(set(r.constraint_groups) | need)
        constraints = [r.constraint_for(g, a) if r.constraint_for else None for g, a in groups]
        automaton, starts = union(constraints)
        engine = SlotBatch(
            r.sampler,
            min(self.slots or E, E),
            r.max_len,
            r.sp,
            stop_strings=sa.stop_strings(r.stop_strings),
            constraint=r.sampler.replicate(automaton) if automaton is not None else None,
            chunk_steps=self.chunk_steps,
        )
        return engine, dict(zip(groups, starts, strict=True))


class _Turns:
    """The episodes of one :meth:`Continuous.play` as the schedule sees them: each one's next turn (:meth:`entry`),
    its finished replies (:meth:`on_replies`) and their results (:meth:`on_result`), all by episode id ``b``."""

    def __init__(self, r: Rollout, eps: list[Episode], start_of: dict[tuple[str, bool], int]):
        self.r, self.eps, self.start_of = r, eps, start_of
        self.lane = lanes([e.spec for e in eps])
        self.ctx = [_Context() for _ in eps]
        self.rounds = [0] * len(eps)  # replies generated per episode (its turn index in the sampling key)
        self.replies: dict[int, str] = {}  # each episode's latest reply until its result comes back
        self.reply_len: dict[int, int] = {}
        # One thread answers search & ask batches in submission (chunk) order: the extractor's calls, and so its
        # sampling keys and the bank's retrieval statistics, follow the schedule, never timing.
        self.asker = (
            cf.ThreadPoolExecutor(1, thread_name_prefix="search-ask") if r.search_ask.enabled else None
        )

    def entry(self, b: int) -> Entry | None:
        """The episode's next turn, or None when it ends here (context full / round limit)."""
        r, e, ctx = self.r, self.eps[b], self.ctx[b]
        if self.rounds[b] >= r.max_rounds:
            e.live = False
            return None
        if len(ctx.ids) + len(e.pending) + e.spec.max_new(r.sp) > e.spec.max_len(r.max_len):
            # An episode whose context cannot hold another turn ends here (truncated, counted), never a crash.
            e.live, e.context_full = False, True
            return None
        row = ctx.feed(e.pending)
        start = self.start_of[(e.spec.task.env_id, r.search_ask.may_ask(e))]
        return Entry(-1, row, False, e.spec.max_new(r.sp), (b, self.rounds[b]), start)

    def on_replies(self, finished: list[tuple[int, Finished]]) -> dict[int, Any]:
        """This chunk's replies: search & ask questions and env actions submitted (results: :meth:`on_result`)."""
        sa, eps = self.r.search_ask, self.eps
        questions: dict[int, str] = {}
        for b, f in finished:
            self.ctx[b].reply(f.tokens, f.logprobs)
            self.rounds[b] += 1
            self.replies[b] = self.r.tokenizer.decode(f.tokens.tolist(), skip_special=True)
            self.reply_len[b] = len(f.tokens)
            q = sa.question(eps[b], self.replies[b])
            if q is not None:
                questions[b] = q
        out: dict[int, Any] = {}
        if questions:
            # Answered by the extractor as tool turns (no env step), in one batch per chunk.
            batch = self.asker.submit(sa.ask, sa.items([(eps[b], q) for b, q in questions.items()]))
            for i, b in enumerate(questions):
                out[b] = _AskResult(batch, i)
        for b, _ in finished:
            if b not in questions:
                out[b] = self.r.pools.pools[eps[b].spec.task.env_id].submit_step(
                    self.lane[b], self.replies[b]
                )
        return out

    def on_result(self, b: int, result) -> bool:
        """Applies an env step's result or a search & ask answer to episode ``b``; False when it ended."""
        r, e = self.r, self.eps[b]
        if isinstance(result, _Answer):
            r.search_ask.answer(
                e,
                self.replies.pop(b),
                result.text,
                result.key,
                self.ctx[b].ids,
                self.reply_len[b],
                r.tokenizer,
                r.im_end,
            )
            return True
        return e.observe(self.replies.pop(b), result, self.ctx[b].ids, r.tokenizer, r.im_end)

    def close(self) -> None:
        """Waits for the ask thread's last batch (if any) and stops it."""
        if self.asker is not None:
            self.asker.shutdown(wait=True)

    def trajectories(self) -> list[Trajectory]:
        """Every episode's trajectory, in spec order (from copies of its token record)."""
        return [
            e.trajectory(list(c.ids), list(c.mask), list(c.lps))
            for e, c in zip(self.eps, self.ctx, strict=True)
        ]


class _Answer:
    """A search & ask answer for ``on_result`` (an env step's result is a tuple)."""

    __slots__ = ("text", "key")

    def __init__(self, text: str | None, key):
        self.text, self.key = text, key


class _AskResult:
    """Episode ``i``'s answer in a batched search & ask call, as a future-like ``result()`` for
    :func:`~comprl_jax.rollout.slots_schedule.schedule`."""

    __slots__ = ("batch", "i")

    def __init__(self, batch: cf.Future, i: int):
        self.batch, self.i = batch, i

    def result(self) -> _Answer:
        answer, key = self.batch.result()[self.i]
        return _Answer(answer, key)
