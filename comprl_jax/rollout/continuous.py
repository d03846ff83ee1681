"""Continuous-batching rollouts: episodes flow through a fixed set of KV-cache slots while env steps run on the
pools, overlapped with decoding (the default engine, ``rollout.engine = "continuous"``).

An episode takes a slot for its first turn, and every next turn is an incremental prefill of the new observation
onto its KV row. When a reply ends, the episode's env step runs on the pool while the other slots keep decoding.
With fewer slots than episodes (``rollout.slots``), an episode waiting on its env step gives its slot up when a
ready episode needs one: its KV row is parked (copied into a parking store) and later continues in whichever slot
is free. The host loop, per chunk ``c``:

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
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax

from comprl_jax.rollout.engine import Rollout
from comprl_jax.rollout.episodes import EpisodeSpec, Trajectory, start_episodes
from comprl_jax.rollout.pools import lanes
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
      env_lag: chunks an env step has before its result is due (:func:`schedule`).
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
        steps x slots), ``generated`` (sampled tokens), ``device_idle_s`` and ``parked`` (:func:`schedule`)."""
        E = len(specs)
        lane = lanes(specs)
        sa, sp, tok, im_end = r.search_ask, r.sp, r.tokenizer, r.im_end
        eps = start_episodes(r.pools.system_prompts, specs, resets, tok, sa.tool_text)
        ctx = [_Context() for _ in eps]
        # Every (env id, may ask) constraint a row of this rollout can need, stacked into one automaton: all slots
        # decode in one call, each row starting in its own constraint's block.
        groups = sorted({(s.task.env_id, flag) for s in specs for flag in (False, sa.enabled and s.can_ask)})
        constraints = [r.constraint_for(g, a) if r.constraint_for else None for g, a in groups]
        automaton, starts = union(constraints)
        start_of = dict(zip(groups, starts, strict=True))
        engine = SlotBatch(
            r.sampler,
            min(self.slots or E, E),
            r.max_len,
            sp,
            stop_strings=sa.stop_strings(r.stop_strings),
            constraint=r.sampler.replicate(automaton) if automaton is not None else None,
            chunk_steps=self.chunk_steps,
        )
        rounds = [0] * E  # replies generated per episode (its turn index in the sampling key)

        def entry(b: int) -> Entry | None:
            """The episode's next turn, or None when it ends here (context full / round limit)."""
            e = eps[b]
            if rounds[b] >= r.max_rounds:
                e.live = False
                return None
            if len(ctx[b].ids) + len(e.pending) + e.spec.max_new(sp) > e.spec.max_len(r.max_len):
                # An episode whose context cannot hold another turn ends here (truncated, counted), never a crash.
                e.live, e.context_full = False, True
                return None
            row = ctx[b].feed(e.pending)
            start = start_of[(e.spec.task.env_id, sa.may_ask(e))]
            return Entry(-1, row, False, e.spec.max_new(sp), (b, rounds[b]), start)

        replies: dict[int, str] = {}
        reply_len: dict[int, int] = {}
        # One thread answers search & ask batches in submission (chunk) order: the extractor's calls, and so its
        # sampling keys and the bank's retrieval statistics, follow the schedule, never timing.
        asker = cf.ThreadPoolExecutor(1, thread_name_prefix="search-ask") if sa.enabled else None

        def on_replies(finished: list[tuple[int, Finished]]) -> dict[int, Any]:
            """This chunk's replies: search & ask questions and env actions submitted (results: on_result)."""
            questions: dict[int, str] = {}
            for b, f in finished:
                ctx[b].reply(f.tokens, f.logprobs)
                rounds[b] += 1
                replies[b] = tok.decode(f.tokens.tolist(), skip_special=True)
                reply_len[b] = len(f.tokens)
                q = sa.question(eps[b], replies[b])
                if q is not None:
                    questions[b] = q
            out: dict[int, Any] = {}
            if questions:
                # Answered by the extractor as tool turns (no env step), in one batch per chunk.
                batch = asker.submit(sa.ask, sa.items([(eps[b], q) for b, q in questions.items()]))
                for i, b in enumerate(questions):
                    out[b] = _AskResult(batch, i)
            for b, _ in finished:
                if b not in questions:
                    out[b] = r.pools.pools[eps[b].spec.task.env_id].submit_step(lane[b], replies[b])
            return out

        def on_result(b: int, result) -> bool:
            e = eps[b]
            if isinstance(result, _Answer):
                sa.answer(e, replies.pop(b), result.text, result.key, ctx[b].ids, reply_len[b], tok, im_end)
                return True
            return e.observe(replies.pop(b), result, ctx[b].ids, tok, im_end)

        try:
            live = [b for b, e in enumerate(eps) if e.live]
            timing = schedule(
                engine,
                key,
                live,
                entry,
                on_replies,
                on_result,
                exit_frac=self.exit_frac,
                env_lag=self.env_lag,
            )
        finally:
            if asker is not None:
                asker.shutdown(wait=True)
        trajs = [e.trajectory(list(c.ids), list(c.mask), list(c.lps)) for e, c in zip(eps, ctx, strict=True)]
        return trajs, timing


class _Answer:
    """A search & ask answer for ``on_result`` (an env step's result is a tuple)."""

    __slots__ = ("text", "key")

    def __init__(self, text: str | None, key):
        self.text, self.key = text, key


class _AskResult:
    """Episode ``i``'s answer in a batched search & ask call, as a future-like ``result()`` for :func:`schedule`."""

    __slots__ = ("batch", "i")

    def __init__(self, batch: cf.Future, i: int):
        self.batch, self.i = batch, i

    def result(self) -> _Answer:
        answer, key = self.batch.result()[self.i]
        return _Answer(answer, key)


def schedule(
    engine: SlotBatch,
    key: jax.Array,
    episodes: Sequence[int],
    entry: Callable[[int], Entry | None],
    on_replies: Callable[[list[tuple[int, Finished]]], dict[int, Any]],
    on_result: Callable[[int, Any], bool],
    *,
    exit_frac: float = 0.125,
    env_lag: int = 32,
) -> dict[str, float]:
    """Drives ``episodes`` through the engine's slots to their ends (the loop of the module docstring).

    Args:
      engine: the slots. key: the sampling key (row keys fold in each entry's ``key_ids``).
      episodes: episode ids in the order they take free slots.
      entry: ``b -> Entry`` (its ``slot``, ``reset`` and ``park_row`` are filled in here) for episode ``b``'s
        next turn, or None when the episode ends instead.
      on_replies: the chunk's finished replies ``[(b, Finished)]`` -> ``{b: future | None}``: a future (an env
        step; its result goes to ``on_result`` ``env_lag`` chunks later) or None (the next input is ready now).
      on_result: ``(b, result) -> bool``, False when the episode ended.
      env_lag: an env step submitted after chunk ``c`` is waited for while chunk ``c + env_lag`` decodes at the
        latest (its episode enters with the next chunk). Earlier, while a chunk decodes, the oldest env steps are
        waited for only as far as the next chunk has room for their episodes, so slower env steps run behind
        decoding while other episodes fill the slots. The schedule depends on what the device computed, never on
        timing.
    Returns:
      Timing: ``gen_s`` (dispatching and waiting for the device), ``env_s`` (waiting for env steps that were not
      done when due), ``device_idle_s`` (an upper bound: host work between chunks, and env waits that outlasted
      the chunk), ``decode_steps``, ``slot_steps`` (decode steps x the slots each ran on), ``generated`` (sampled
      tokens) and ``parked`` (rows moved to the parking store).
    """
    waiting = deque(episodes)  # not started yet
    free = list(range(engine.B))
    occupant: dict[int, int] = {}  # slot -> episode
    slot_of: dict[int, int] = {}  # episode -> slot
    park_row: dict[int, int] = {}  # episode -> its parked row (it holds no slot)
    ready: list[int] = []  # episodes whose next input is ready, in the order they became ready
    pending: deque[tuple[int, Any]] = deque()  # submitted env steps, oldest first: (episode, future)
    due_at: dict[int, int] = {}  # episode -> the chunk its env step is due at the latest
    exit_done = max(1, int(round(exit_frac * engine.B)))
    t_gen = t_env = idle = 0.0
    generated = 0
    t_back = None  # when the host last got the device's results (the device idles until the next dispatch)
    chunk = 0

    def end(b: int) -> None:
        if b in slot_of:
            s = slot_of.pop(b)
            del occupant[s]
            free.append(s)
        if b in park_row:
            engine.release([park_row.pop(b)])

    while True:
        if not waiting and not park_row and 2 * len(occupant) <= engine.B and engine.B > 1:
            # The tail: every episode has started, none is parked and half the slots are empty: a smaller batch.
            moved = engine.compact(sorted(occupant))
            occupant = {moved[s]: b for s, b in occupant.items()}
            slot_of = {b: s for s, b in occupant.items()}
            free = [s for s in range(engine.B) if s not in occupant]
            exit_done = max(1, int(round(exit_frac * engine.B)))
        # 1. Enter. Ready episodes that hold their slot continue in it; the others (parked) take free slots, then
        # new episodes do. With no free slot, the idle slot whose env step is due last is parked for them.
        entries, evict, placed = [], [], []
        going = [b for b in ready if b in slot_of]
        queue = [b for b in ready if b not in slot_of] + [("new", b) for b in waiting]
        ready = []
        idle_slots = sorted(
            (due_at[b], b) for b in slot_of if b in due_at and occupant.get(slot_of[b]) == b
        )  # occupants waiting on an env step, parkable; the one due last is parked first
        for item in queue:
            new = isinstance(item, tuple)
            b = item[1] if new else item
            if free:
                free.sort()
                s = free.pop(0)
            elif idle_slots:
                _, v = idle_slots.pop()
                s = slot_of.pop(v)
                evict.append((v, s))
                del occupant[s]
            else:
                if not new:
                    ready.append(b)  # waits for a slot
                continue
            if new:
                waiting.remove(b)
            occupant[s], slot_of[b] = b, s
            placed.append((b, new))
        if evict:
            for (v, _), row in zip(evict, engine.park([s for _, s in evict]), strict=True):
                park_row[v] = row
        for b in sorted(going) + [b for b, _ in placed]:
            got = entry(b)
            if got is None:
                end(b)
                continue
            got.slot = slot_of[b]
            got.reset = b not in going and b not in park_row
            got.park_row = park_row.pop(b, -1)
            entries.append(got)
        t0 = time.perf_counter()
        idle += t0 - t_back if t_back is not None else 0.0
        engine.enter(entries, key)
        # 2. Dispatch the decode chunk (asynchronous: the device works while the host waits for env steps).
        handle = engine.advance(exit_done)
        t1 = time.perf_counter()
        # 3. Env steps, oldest first: those due now, then as many as the next chunk can take (the slots free or
        # held by an episode waiting on its env, and the slots expected to finish in this chunk) beyond the
        # episodes already ready. Their episodes enter with the next chunk. Counts of what the device computed
        # decide how many are taken, never timing, so the schedule is reproducible.
        room = len(free) + sum(1 for b in occupant.values() if b in due_at) + exit_done
        while pending and (due_at[pending[0][0]] <= chunk or len(ready) + len(waiting) < room):
            b, fut = pending.popleft()
            del due_at[b]
            if on_result(b, fut.result()):
                ready.append(b)
            else:
                end(b)
        t2 = time.perf_counter()
        if handle is None or handle.is_ready():  # the chunk was done before the env steps: count it all idle
            idle += t2 - t1
        # 4. This chunk's finished replies.
        finished = [(occupant[f.slot], f) for f in engine.collect(handle)]
        t3 = t_back = time.perf_counter()
        t_gen += (t1 - t0) + (t3 - t2)
        t_env += t2 - t1
        generated += sum(len(f.tokens) for _, f in finished)
        for b, fut in on_replies(finished).items():
            if fut is None:
                ready.append(b)
            else:
                pending.append((b, fut))
                due_at[b] = chunk + env_lag
        chunk += 1
        if not (engine.replying or pending or ready or waiting):
            break
    return {
        "gen_s": t_gen,
        "env_s": t_env,
        "device_idle_s": idle,
        "decode_steps": float(engine.decode_steps),
        "slot_steps": float(engine.slot_steps),
        "generated": float(generated),
        "parked": float(engine.parked),
    }
