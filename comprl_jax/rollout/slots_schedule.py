"""The continuous engine's host loop over a :class:`~comprl_jax.sampling.slots.SlotBatch` (steps 1-4 of
:mod:`comprl_jax.rollout.continuous`): which episode holds which slot, which idle slot is parked, which env step
is waited for and when. It knows episodes only by id and talks to them through three callbacks (``entry``,
``on_replies``, ``on_result``), so the rollout benchmark (``launch/bench/rollout.py``) drives it on a scripted
workload too.

The schedule depends only on what the device computed, never on timing: every decision below follows from counts
of episodes and slots, and the loop blocks when a step it needs is late.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax

from comprl_jax.sampling.slots import Entry, Finished, SlotBatch


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
    """Drives ``episodes`` through the engine's slots to their ends (the loop of
    :mod:`comprl_jax.rollout.continuous`'s docstring).

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
    s = _Scheduler(engine, key, episodes, entry, on_replies, on_result, exit_frac, env_lag)
    while s.chunk_once():
        pass
    return s.timing()


class _Scheduler:
    """:func:`schedule`'s state between chunks: the slot map, the parked rows, the episodes ready or waiting on an
    env step, and the timing counters. One instance drives one rollout."""

    def __init__(self, engine, key, episodes, entry, on_replies, on_result, exit_frac, env_lag):
        self.engine, self.key = engine, key
        self.entry, self.on_replies, self.on_result = entry, on_replies, on_result
        self.exit_frac, self.env_lag = exit_frac, env_lag
        self.waiting = deque(episodes)  # not started yet
        self.free = list(range(engine.B))
        self.occupant: dict[int, int] = {}  # slot -> episode
        self.slot_of: dict[int, int] = {}  # episode -> slot
        self.park_row: dict[int, int] = {}  # episode -> its parked row (it holds no slot)
        self.ready: list[int] = []  # episodes whose next input is ready, in the order they became ready
        self.pending: deque[tuple[int, Any]] = deque()  # submitted env steps, oldest first: (episode, future)
        self.due_at: dict[int, int] = {}  # episode -> the chunk its env step is due at the latest
        self.exit_done = max(1, int(round(exit_frac * engine.B)))
        self.t_gen = self.t_env = self.idle = 0.0
        self.generated = 0
        # when the host last got the device's results (the device idles until the next dispatch)
        self.t_back = None
        self.chunk = 0

    def chunk_once(self) -> bool:
        """One pass of the loop (steps 1-4) around decode chunk ``self.chunk``. False once every episode ended."""
        eng = self.engine
        self._compact_tail()
        # 1. Enter (one jitted call): ready episodes, then new ones; every other replying slot decodes a position.
        entries = self._entries(*self._place())
        t0 = time.perf_counter()
        self.idle += t0 - self.t_back if self.t_back is not None else 0.0
        eng.enter(entries, self.key)
        # 2. Dispatch the decode chunk (asynchronous: the device works while the host waits for env steps).
        handle = eng.advance(self.exit_done)
        t1 = time.perf_counter()
        # 3. While the device decodes, wait for env steps.
        self._wait_env()
        t2 = time.perf_counter()
        if handle is None or handle.is_ready():  # the chunk was done before the env steps: count it all idle
            self.idle += t2 - t1
        # 4. This chunk's finished replies.
        finished = [(self.occupant[f.slot], f) for f in eng.collect(handle)]
        t3 = self.t_back = time.perf_counter()
        self.t_gen += (t1 - t0) + (t3 - t2)
        self.t_env += t2 - t1
        self.generated += sum(len(f.tokens) for _, f in finished)
        self._submit(finished)
        self.chunk += 1
        return bool(eng.replying or self.pending or self.ready or self.waiting)

    def _end(self, b: int) -> None:
        """Episode ``b`` ended: its slot is free, its parked row (if any) released."""
        if b in self.slot_of:
            s = self.slot_of.pop(b)
            del self.occupant[s]
            self.free.append(s)
            self.engine.vacate([s])  # a paged cache takes its pages back now (dense: nothing to free)
        if b in self.park_row:
            self.engine.release([self.park_row.pop(b)])

    def _compact_tail(self) -> None:
        """The tail: every episode has started, none is parked and half the slots are empty: a smaller batch (the
        engine renumbers the occupied slots; ``moved``: old slot -> new slot)."""
        if (
            not self.occupant  # nothing to keep (a play whose every reset failed): nothing to shrink to
            or self.waiting
            or self.park_row
            or 2 * len(self.occupant) > self.engine.B
            or self.engine.B <= 1
        ):
            return
        moved = self.engine.compact(sorted(self.occupant))
        self.occupant = {moved[s]: b for s, b in self.occupant.items()}
        self.slot_of = {b: s for s, b in self.occupant.items()}
        self.free = [s for s in range(self.engine.B) if s not in self.occupant]
        self.exit_done = max(1, int(round(self.exit_frac * self.engine.B)))

    def _place(self) -> tuple[list[int], list[int]]:
        """Step 1's slot choice. Ready episodes that hold their slot continue in it; the others (parked) take free
        slots, then new episodes do. With no free slot, the idle slot whose env step is due last is parked for
        them. Returns ``(going, placed)``: the ready episodes in their own slot, and those given a slot now (in
        that order); ready episodes left without a slot stay ready for the next chunk."""
        evict, placed = [], []
        going = [b for b in self.ready if b in self.slot_of]
        queue = [b for b in self.ready if b not in self.slot_of] + [("new", b) for b in self.waiting]
        self.ready = []
        idle_slots = sorted(
            (self.due_at[b], b)
            for b in self.slot_of
            if b in self.due_at and self.occupant.get(self.slot_of[b]) == b
        )  # occupants waiting on an env step, parkable; the one due last is parked first
        for item in queue:
            new = isinstance(item, tuple)
            b = item[1] if new else item
            if self.free:
                self.free.sort()
                s = self.free.pop(0)
            elif idle_slots:
                _, v = idle_slots.pop()
                s = self.slot_of.pop(v)
                evict.append((v, s))
                del self.occupant[s]
            else:
                if not new:
                    self.ready.append(b)  # waits for a slot
                continue
            if new:
                self.waiting.remove(b)
            self.occupant[s], self.slot_of[b] = b, s
            placed.append(b)
        if evict:
            # One park call for every evicted slot: their rows move to the parking store before new rows enter.
            for (v, _), row in zip(evict, self.engine.park([s for _, s in evict]), strict=True):
                self.park_row[v] = row
        return going, placed

    def _entries(self, going: list[int], placed: list[int]) -> list[Entry]:
        """Step 1's inputs: each placed episode's next turn in its slot (``reset``: a new occupant's row starts
        empty; ``park_row``: a parked row continues here). An episode with no next turn ends now."""
        entries = []
        for b in sorted(going) + placed:
            got = self.entry(b)
            if got is None:
                self._end(b)
                continue
            got.slot = self.slot_of[b]
            got.reset = b not in going and b not in self.park_row
            got.park_row = self.park_row.pop(b, -1)
            entries.append(got)
        return entries

    def _wait_env(self) -> None:
        """Step 3. Env steps, oldest first: those due now, then as many as the next chunk can take (the slots
        free or held by an episode waiting on its env, and the slots expected to finish in this chunk) beyond the
        episodes already ready. Their episodes enter with the next chunk. Counts of what the device computed
        decide how many are taken, never timing, so the schedule is reproducible."""
        room = len(self.free) + sum(1 for b in self.occupant.values() if b in self.due_at) + self.exit_done
        while self.pending and (
            self.due_at[self.pending[0][0]] <= self.chunk or len(self.ready) + len(self.waiting) < room
        ):
            b, fut = self.pending.popleft()
            del self.due_at[b]
            if self.on_result(b, fut.result()):
                self.ready.append(b)
            else:
                self._end(b)

    def _submit(self, finished: list[tuple[int, Finished]]) -> None:
        """Step 4's hand-off: each finished reply's follow-up is ready now (None) or an env step (a future) due
        ``env_lag`` chunks from now."""
        for b, fut in self.on_replies(finished).items():
            if fut is None:
                self.ready.append(b)
            else:
                self.pending.append((b, fut))
                self.due_at[b] = self.chunk + self.env_lag

    def timing(self) -> dict[str, float]:
        """:func:`schedule`'s timing dict (see its docstring)."""
        eng = self.engine
        return {
            "gen_s": self.t_gen,
            "env_s": self.t_env,
            "device_idle_s": self.idle,
            "decode_steps": float(eng.decode_steps),
            "slot_steps": float(eng.slot_steps),
            "generated": float(self.generated),
            "parked": float(eng.parked),
        }
