"""Continuous-batching rollouts: episodes flow through a fixed set of KV-cache slots while env steps run on the
pools, overlapped with decoding (the default engine, ``rollout.engine = "continuous"``).

Each episode owns one slot from its first turn to its end (its KV cache lives there, so every next turn is an
incremental prefill of the new observation). When a reply ends, the slot waits while its env step runs on the
pool, and the other slots keep decoding. When an episode ends, a waiting episode takes its slot. The host loop,
per chunk ``c``:

1. enter (one jitted prefill): the episodes whose next input is ready, and new episodes into free slots;
2. dispatch decode chunk ``c`` (one jitted call of up to ``rollout.chunk_steps`` positions; it ends early once
   ``rollout.exit_frac`` of the slots have finished);
3. while the device decodes, wait for the env steps submitted after chunk ``c - 1``. Their observations become
   the inputs entered before chunk ``c + 1``;
4. read chunk ``c``'s finished replies: search & ask questions are answered (one batched extractor call) and
   enter with the next chunk. Env actions are submitted to the pools.

The schedule depends only on what the device computed, never on timing: an env step submitted after chunk
``c`` is always consumed before chunk ``c + 2``, and the loop blocks when it is late. Sampling keys are per
(episode, turn), so a rollout is reproducible and a resumed run stays bit-identical. Greedy decoding gives the
same tokens as the lock-step engine (``tests/test_slot_rollout.py``).

Multi-process runs use the lock-step engine (:func:`comprl_jax.rollout.run_episodes`). There every process steps
only its own env rows and all-gathers the results after each round, so all processes issue identical jitted
calls. The chunk schedule here would need one all-gather of the finished rows' env results per chunk instead;
that is not built yet.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax

from comprl_jax.rollout import (
    ANSWER_OPEN,
    ASK_CLOSE,
    ASK_RE,
    EpisodeSpec,
    Pools,
    Trajectory,
    _Episode,
    _next_input,
    _slots,
    search_ask_prompt,
    start_episodes,
)
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


def run_episodes_continuous(
    pools: Pools,
    specs: Sequence[EpisodeSpec],
    resets: Sequence[tuple[str, dict]],
    sampler: Any,
    tokenizer: Any,
    sp: Any,
    key: jax.Array,
    *,
    max_turns: int,
    max_len: int,
    constraint_for: Any = None,
    stop_strings: Sequence[str] = ("</answer>",),
    ask: Any = None,
    ask_max: int = 2,
    slots: int = 0,
    chunk_steps: int = 16,
    exit_frac: float = 0.125,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Plays all episodes to the end on ``slots`` KV-cache rows (0 = one per episode). Same arguments and results
    as :func:`comprl_jax.rollout.run_episodes` (no ``gather``: single process), plus:

    Args:
      slots: KV-cache rows; more episodes than slots start as earlier ones end.
      chunk_steps: decode positions per jitted call at most.
      exit_frac: a chunk also ends once this fraction of the slots finished their replies in it.
    Returns:
      ``(trajectories in spec order, timing)``. ``timing``: ``gen_s`` (dispatching and waiting for the device),
      ``env_s`` (waiting for env steps not yet done when their results were due), ``decode_steps``,
      ``slot_steps`` (decode steps x slots) and ``generated`` (sampled tokens).
    """
    E = len(specs)
    lane = _slots(specs)
    tool_text = search_ask_prompt(ask_max) if ask is not None else ""
    im_end = tokenizer.special_ids.get("<|im_end|>")
    eps = start_episodes(pools, specs, resets, tokenizer, tool_text)
    ctx = [_Context() for _ in eps]
    if ask is not None:
        stop_strings = tuple(stop_strings) + (ASK_CLOSE,)

    def can_ask(e: _Episode) -> bool:
        return ask is not None and e.spec.can_ask and len(e.asked) < ask_max

    # Every (env id, may ask) constraint a row of this rollout can need, stacked into one automaton: all slots
    # decode in one call, each row starting in its own constraint's block.
    groups = sorted({(s.task.env_id, flag) for s in specs for flag in (False, ask is not None and s.can_ask)})
    automaton, starts = union([constraint_for(g, a) if constraint_for else None for g, a in groups])
    start_of = dict(zip(groups, starts, strict=True))
    nslots = min(slots or E, E)
    engine = SlotBatch(
        sampler,
        nslots,
        max_len,
        sp,
        stop_strings=stop_strings,
        constraint=sampler.replicate(automaton) if automaton is not None else None,
        chunk_steps=chunk_steps,
    )
    max_rounds = max_turns + (ask_max if ask is not None else 0)
    rounds = [0] * E  # replies generated per episode (its turn index in the sampling key)

    def entry(b: int) -> Entry | None:
        """The episode's next turn, or None when it ends here (context full / round limit)."""
        e = eps[b]
        if rounds[b] >= max_rounds:
            e.live = False
            return None
        if len(ctx[b].ids) + len(e.pending) + sp.max_new_tokens > max_len:
            # An episode whose context cannot hold another turn ends here (truncated, counted), never a crash.
            e.live, e.context_full = False, True
            return None
        row = ctx[b].feed(e.pending)
        return Entry(
            -1, row, False, sp.max_new_tokens, (b, rounds[b]), start_of[(e.spec.task.env_id, can_ask(e))]
        )

    replies: dict[int, str] = {}

    def on_replies(finished: list[tuple[int, Finished]]) -> dict[int, Any]:
        """This chunk's replies: search & ask questions answered (ready now), env actions submitted."""
        questions: dict[int, str] = {}
        for b, f in finished:
            ctx[b].reply(f.tokens, f.logprobs)
            rounds[b] += 1
            text = tokenizer.decode(f.tokens.tolist(), skip_special=True)
            replies[b] = text
            q = ASK_RE.search(text) if can_ask(eps[b]) else None
            if q and ANSWER_OPEN not in text:
                questions[b] = q.group(1).strip()
        out: dict[int, Any] = {}
        if questions:
            # Answered by the extractor as tool turns (no env step), in one batch per chunk.
            got = ask([(q, eps[b].obs, eps[b].spec.task.env_id) for b, q in questions.items()])
            for b, (answer, sample_key) in zip(questions, got, strict=True):
                e, text = eps[b], answer if answer is not None else "[No answer]"
                e.asked.append(sample_key)
                e.record(replies.pop(b))
                e.transcript.append((f"[search & ask answer] {text}", ""))  # reply: the next turn's
                e.pending = _next_input(ctx[b].ids, {"role": "tool", "content": text}, tokenizer, im_end)
                out[b] = None
        for b, _ in finished:
            if b not in questions:
                out[b] = pools.pools[eps[b].spec.task.env_id].submit_step(lane[b], replies[b])
        return out

    def on_result(b: int, result) -> bool:
        e = eps[b]
        if not e.step(replies.pop(b), result):
            return False
        e.pending = _next_input(
            ctx[b].ids, {"role": "user", "content": f"Observation: {e.obs}"}, tokenizer, im_end
        )
        return True

    timing = schedule(
        engine,
        key,
        [b for b, e in enumerate(eps) if e.live],
        entry,
        on_replies,
        on_result,
        exit_frac=exit_frac,
    )
    trajs = [e.trajectory(list(c.ids), list(c.mask), list(c.lps)) for e, c in zip(eps, ctx, strict=True)]
    return trajs, timing


def schedule(
    engine: SlotBatch,
    key: jax.Array,
    episodes: Sequence[int],
    entry: Callable[[int], Entry | None],
    on_replies: Callable[[list[tuple[int, Finished]]], dict[int, Any]],
    on_result: Callable[[int, Any], bool],
    *,
    exit_frac: float = 0.125,
) -> dict[str, float]:
    """Drives ``episodes`` through the engine's slots to their ends (the loop of the module docstring).

    Args:
      engine: the slots. key: the sampling key (row keys fold in each entry's ``key_ids``).
      episodes: episode ids in the order they take free slots.
      entry: ``b -> Entry`` (its ``slot`` and ``reset`` are filled in here) for episode ``b``'s next turn, or
        None when the episode ends instead.
      on_replies: the chunk's finished replies ``[(b, Finished)]`` -> ``{b: future | None}``: a future (an env
        step; its result goes to ``on_result`` before the chunk after next) or None (the next input is ready now).
      on_result: ``(b, result) -> bool``, False when the episode ended.
    Returns:
      Timing: ``gen_s`` (dispatching and waiting for the device), ``env_s`` (waiting for env steps that were not
      done when due), ``device_idle_s`` (an upper bound: host work between chunks, and env waits that outlasted
      the chunk), ``decode_steps``, ``slot_steps`` (decode steps x the slots each ran on) and ``generated`` (sampled tokens).
    """
    waiting = deque(episodes)  # not started yet
    free = list(range(min(engine.B, len(episodes))))
    occupant: dict[int, int] = {}  # slot -> episode
    slot_of: dict[int, int] = {}  # episode -> slot
    ready: list[int] = []  # episodes whose next input enters with the next chunk
    stepping: dict[int, Any] = {}  # episode -> env-step future submitted after the previous chunk
    exit_done = max(1, int(round(exit_frac * len(free))))
    t_gen = t_env = idle = 0.0
    generated = 0
    t_back = None  # when the host last got the device's results (the device idles until the next dispatch)

    def release(b: int) -> None:
        free.append(slot_of.pop(b))
        del occupant[free[-1]]

    def place(b: int, reset: bool) -> Entry | None:
        got = entry(b)
        if got is None:
            release(b)
            return None
        got.slot, got.reset = slot_of[b], reset
        return got

    while True:
        if not waiting and 2 * len(occupant) <= engine.B and engine.B > 1:
            # The tail: every episode has started and half the slots are empty; continue on a smaller batch.
            moved = engine.compact(sorted(occupant))
            occupant = {moved[s]: b for s, b in occupant.items()}
            slot_of = {b: s for s, b in occupant.items()}
            free = []
            exit_done = max(1, int(round(exit_frac * engine.B)))
        # 1. Enter: ready episodes (in episode order), then new episodes into free slots (lowest first).
        entries = [e for b in sorted(ready) if (e := place(b, False)) is not None]
        ready = []
        while free and waiting:
            b = waiting.popleft()
            free.sort()
            s = free.pop(0)
            occupant[s], slot_of[b] = b, s
            if (e := place(b, True)) is not None:
                entries.append(e)
        t0 = time.perf_counter()
        idle += t0 - t_back if t_back is not None else 0.0
        engine.enter(entries, key)
        # 2. Dispatch the decode chunk (asynchronous: the device works while the host waits for env steps).
        handle = engine.advance(exit_done)
        t1 = time.perf_counter()
        # 3. Env steps submitted after the previous chunk: their observations enter with the next chunk.
        for b in sorted(stepping):
            if on_result(b, stepping[b].result()):
                ready.append(b)
            else:
                release(b)
        stepping = {}
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
                stepping[b] = fut
        if not (engine.replying or stepping or ready or waiting):
            break
    return {
        "gen_s": t_gen,
        "env_s": t_env,
        "device_idle_s": idle,
        "decode_steps": float(engine.decode_steps),
        "slot_steps": float(engine.slot_steps),
        "generated": float(generated),
    }
