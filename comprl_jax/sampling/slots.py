"""Slot-based continuous batching: a fixed set of KV-cache rows ("slots") that replies enter and leave between
decode chunks, with static shapes (compiled once per bucket, never per schedule).

Two jitted functions act on a cache of ``B`` slots and a :class:`SlotState` (each slot's decode state, kept on
device from call to call):

* :func:`enter`: ``n`` slots (a power-of-two bucket of rows, padding rows index ``B`` and are dropped) get new
  input. Their cache rows are gathered, a new occupant's row is reset to length 0, the input is prefilled
  (incremental: it is appended to what the row holds), the reply's first token is sampled, and rows and state
  are scattered back.
* :func:`advance`: up to ``steps`` decode positions for every slot still replying. It ends early when every slot
  is done, or when ``exit_done`` slots have finished in this call, so the host can refill them.

A slot whose reply ended keeps its cache and waits (``done``) until the host enters its occupant's next input,
or a new occupant (``reset``). Sampling is per row: token ``i`` of a reply draws with ``fold_in(row_key, i)``,
where ``row_key = fold_in(fold_in(key, a), b)`` for the host's ``(a, b)`` (an episode and its turn). A row's
tokens therefore do not depend on which rows share the batch or on when it entered.

:class:`SlotBatch` is the host side. It holds the cache, the state and a mirror of each slot's cache length,
grows the cache like :class:`~comprl_jax.sampling.Conversation` does, and picks each call's attention window
from the rows' live context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.sampling.automaton import TokenAutomaton
from comprl_jax.sampling.decode import FINISH_LENGTH, FINISH_STOP, advance_rows, prefill
from comprl_jax.sampling.filters import SamplingParams, select_tokens
from comprl_jax.sampling.stops import StopAutomaton


@flax.struct.dataclass
class SlotState:
    """Per-slot decode state (device arrays; ``B`` slots, ``N = sp.max_new_tokens``).

    Attributes:
      tok: ``[B]`` int32, the last sampled token (not in the cache yet: it is fed at the next step).
      done: ``[B]`` bool, the slot's reply has ended (or it never started).
      lengths: ``[B]`` int32, tokens of the current reply so far.
      max_new: ``[B]`` int32, the reply's limit.
      finish: ``[B]`` int32, ``FINISH_STOP`` / ``FINISH_LENGTH`` once done.
      cstate / sstate: ``[B]`` int32 constraint / stop-string automaton states.
      key: ``[B, ...]`` uint32 key data of each row's reply key.
      out_tok / out_lp: ``[B, N]`` the reply's tokens (``pad_id`` past ``lengths``) and their log-probabilities.
    """

    tok: Any
    done: Any
    lengths: Any
    max_new: Any
    finish: Any
    cstate: Any
    sstate: Any
    key: Any
    out_tok: Any
    out_lp: Any


def init_state(batch: int, max_new_tokens: int, pad_id: int) -> SlotState:
    """Every slot empty and done."""
    kd = jax.random.key_data(jax.random.key(0))
    return SlotState(
        tok=jnp.full((batch,), pad_id, jnp.int32),
        done=jnp.ones((batch,), bool),
        lengths=jnp.zeros((batch,), jnp.int32),
        max_new=jnp.zeros((batch,), jnp.int32),
        finish=jnp.full((batch,), FINISH_LENGTH, jnp.int32),
        cstate=jnp.zeros((batch,), jnp.int32),
        sstate=jnp.zeros((batch,), jnp.int32),
        key=jnp.zeros((batch,) + kd.shape, kd.dtype),
        out_tok=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        out_lp=jnp.zeros((batch, max_new_tokens), jnp.float32),
    )


def _emit(st: SlotState, logits, sp, stops, constraint, stop_arr, pad_id) -> SlotState:
    """Samples the next token of every replying row (at its own column ``lengths[b]``) and updates its state."""
    B, N = st.out_tok.shape
    active = ~st.done
    allowed = None if constraint is None else constraint.allowed[st.cstate]
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(st.key), st.lengths)
    tok, lp = select_tokens(logits.astype(jnp.float32), keys, sp, allowed)
    tok = jnp.where(active, tok, pad_id)
    rows = jnp.arange(B)
    col = jnp.where(active, st.lengths, N)  # column N is out of bounds: inactive rows write nothing
    out_tok = st.out_tok.at[rows, col].set(tok, mode="drop")
    out_lp = st.out_lp.at[rows, col].set(lp, mode="drop")
    lengths = st.lengths + active.astype(jnp.int32)
    done, finish, cstate, sstate = advance_rows(
        tok,
        active,
        lengths,
        st.max_new,
        st.done,
        st.finish,
        st.cstate,
        st.sstate,
        stops,
        constraint,
        stop_arr,
    )
    tok = jnp.where(active, tok, st.tok)
    return st.replace(
        tok=tok,
        done=done,
        lengths=lengths,
        finish=finish,
        cstate=cstate,
        sstate=sstate,
        out_tok=out_tok,
        out_lp=out_lp,
    )


def _window(cache, window):
    return cache if window is None else cache.replace(k=cache.k[:, :, :window], v=cache.v[:, :, :window])


def _unwindow(full, view, window):
    if window is None:
        return view
    return full.replace(
        k=jax.lax.dynamic_update_slice(full.k, view.k, (0,) * full.k.ndim),
        v=jax.lax.dynamic_update_slice(full.v, view.v, (0,) * full.v.ndim),
        lengths=view.lengths,
    )


def enter(
    graphdef,
    params,
    cache,
    state: SlotState,
    slots: jax.Array,
    tokens: jax.Array,
    num_new: jax.Array,
    reset: jax.Array,
    max_new: jax.Array,
    cstart: jax.Array,
    key: jax.Array,
    key_ids: jax.Array,
    stops: StopAutomaton | None,
    constraint: TokenAutomaton | None,
    *,
    sp: SamplingParams,
    stop_ids: tuple[int, ...],
    pad_id: int,
    extend_fn: Any,
    window: int | None = None,
    prefill_groups: int = 1,
):
    """New input for ``n`` slots: prefill, first token, fresh reply state. Pure; jit with the keywords static.

    Args:
      cache: the ``B``-slot KV cache; state: their :class:`SlotState`.
      slots: ``[n]`` int32 slot per entering row (``B`` = padding row, ignored).
      tokens: ``[n, T]`` int32 input, right-padded; num_new: ``[n]`` valid columns (>= 1 for real rows).
      reset: ``[n]`` bool, a new occupant: the slot's cache row starts empty.
      max_new: ``[n]`` int32 reply limit (<= ``sp.max_new_tokens``); cstart: ``[n]`` constraint start state.
      key: PRNG key; key_ids: ``[n, 2]`` int32, row key ``fold_in(fold_in(key, a), b)``.
      window: static; the first ``window`` cache positions hold every entering row's context + input.
    Returns:
      ``(cache, state)``.
    """
    view = _window(cache, window)
    sub = view.replace(
        k=view.k.at[:, slots].get(mode="fill", fill_value=0),
        v=view.v.at[:, slots].get(mode="fill", fill_value=0),
        lengths=jnp.where(reset, 0, view.lengths.at[slots].get(mode="fill", fill_value=0)),
    )
    last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
    logits, sub = prefill(graphdef, params, sub, tokens, num_new, last, extend_fn, prefill_groups)
    row_key = jax.vmap(lambda a, b: jax.random.fold_in(jax.random.fold_in(key, a), b))(
        key_ids[:, 0], key_ids[:, 1]
    )
    n, N = tokens.shape[0], sp.max_new_tokens
    idle = max_new <= 0
    fresh = SlotState(
        tok=jnp.full((n,), pad_id, jnp.int32),
        done=idle,
        lengths=jnp.zeros((n,), jnp.int32),
        max_new=max_new.astype(jnp.int32),
        finish=jnp.where(idle, FINISH_LENGTH, FINISH_STOP).astype(jnp.int32),
        cstate=cstart.astype(jnp.int32),
        sstate=jnp.zeros((n,), jnp.int32),
        key=jax.random.key_data(row_key),
        out_tok=jnp.full((n, N), pad_id, jnp.int32),
        out_lp=jnp.zeros((n, N), jnp.float32),
    )
    fresh = _emit(fresh, logits, sp, stops, constraint, _stop_arr(stop_ids), pad_id)
    view = view.replace(
        k=view.k.at[:, slots].set(sub.k, mode="drop"),
        v=view.v.at[:, slots].set(sub.v, mode="drop"),
        lengths=view.lengths.at[slots].set(sub.lengths, mode="drop"),
    )
    state = jax.tree.map(lambda s, f: s.at[slots].set(f, mode="drop"), state, fresh)
    return _unwindow(cache, view, window), state


def advance(
    graphdef,
    params,
    cache,
    state: SlotState,
    exit_done: jax.Array,
    stops: StopAutomaton | None,
    constraint: TokenAutomaton | None,
    *,
    sp: SamplingParams,
    stop_ids: tuple[int, ...],
    pad_id: int,
    extend_fn: Any,
    steps: int,
    window: int | None = None,
):
    """Up to ``steps`` decode positions for the replying slots. Pure; jit with the keywords static.

    Ends early when no slot is replying or ``exit_done`` (a dynamic int32) slots finished in this call. A finished
    slot feeds nothing (``num_new = 0``): its cache stays exactly its context + reply (less the last token).

    Returns:
      ``(cache, state, steps_run)``.
    """
    stop_arr = _stop_arr(stop_ids)
    done0 = state.done
    B = done0.shape[0]
    zero_col = jnp.zeros((B,), jnp.int32)

    def cond(c):
        i, _, st = c
        newly = jnp.sum(st.done & ~done0)
        return (i < steps) & ~jnp.all(st.done) & (newly < exit_done)

    def body(c):
        i, view, st = c
        logits, view = extend_fn(
            graphdef, params, view, st.tok[:, None], (~st.done).astype(jnp.int32), zero_col
        )
        return i + 1, view, _emit(st, logits, sp, stops, constraint, stop_arr, pad_id)

    i, view, state = jax.lax.while_loop(cond, body, (jnp.int32(0), _window(cache, window), state))
    return _unwindow(cache, view, window), state, i


@jax.jit
def _take_rows(tree, idx):
    """Rows ``idx`` of every ``[B, ...]`` state leaf / ``[L, B, ...]`` cache leaf (cache k, v have L first)."""

    def take(x):
        return x[:, idx] if x.ndim == 5 else x[idx]

    return jax.tree.map(take, tree)


def _stop_arr(stop_ids):
    return jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)


_JITTED: dict[Any, Any] = {}


def _jitted(extend_fn):
    """``(enter, advance)`` jitted for one model's ``extend`` (cache and state donated)."""
    if extend_fn not in _JITTED:

        def enter_fn(graphdef, params, cache, state, *args, **kw):
            return enter(graphdef, params, cache, state, *args, extend_fn=extend_fn, **kw)

        def advance_fn(graphdef, params, cache, state, *args, **kw):
            return advance(graphdef, params, cache, state, *args, extend_fn=extend_fn, **kw)

        static = ("sp", "stop_ids", "pad_id", "window", "prefill_groups")
        _JITTED[extend_fn] = (
            jax.jit(enter_fn, static_argnums=(0,), static_argnames=static, donate_argnums=(2, 3)),
            jax.jit(
                advance_fn,
                static_argnums=(0,),
                static_argnames=("sp", "stop_ids", "pad_id", "window", "steps"),
                donate_argnums=(2, 3),
            ),
        )
    return _JITTED[extend_fn]


@dataclasses.dataclass
class Entry:
    """One slot's next input for :meth:`SlotBatch.enter`.

    ``tokens``: the ids to append (the previous reply's last token first, when it was never fed); ``reset``: a
    new occupant (its row starts empty); ``key_ids``: ``(a, b)`` of its reply key; ``cstart``: its constraint's
    start state.
    """

    slot: int
    tokens: Sequence[int]
    reset: bool
    max_new: int
    key_ids: tuple[int, int]
    cstart: int = 0


@dataclasses.dataclass
class Finished:
    """A slot whose reply ended in the last :meth:`SlotBatch.advance`: its tokens and logprobs (numpy)."""

    slot: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finish: int


class SlotBatch:
    """Host side of the slot engine on one :class:`~comprl_jax.sampling.SamplerService`.

    Args:
      service: the sampler (model, weights, lock, mesh).
      slots: KV-cache rows (rounded up to the mesh's batch multiple).
      max_len: the most positions any row may use; the cache starts at ``MIN_CACHE_SLOTS`` and doubles on need.
      sp: sampling settings (``max_new_tokens`` is the output buffer width).
      stop_strings / constraint: shared by every row; rows choose their constraint by start state
        (:func:`~comprl_jax.sampling.automaton.union`).
      chunk_steps: decode positions per :meth:`advance` at most (static: one compile per window bucket).
    """

    def __init__(
        self,
        service,
        slots: int,
        max_len: int,
        sp: SamplingParams,
        *,
        stop_strings: Sequence[str] = (),
        constraint: TokenAutomaton | None = None,
        chunk_steps: int = 16,
    ):
        from comprl_jax.sampling import MIN_CACHE_SLOTS

        self.svc = service
        self.sp = sp
        self.max_len = int(max_len)
        self.chunk_steps = int(chunk_steps)
        self.min_window = MIN_CACHE_SLOTS
        self.B = service.batch_bucket(slots)
        self.cache = service.new_cache(self.B, min(self.max_len, MIN_CACHE_SLOTS))
        self.state = jax.tree.map(
            lambda x: service._put(np.asarray(x)), init_state(self.B, sp.max_new_tokens, service.pad_id)
        )
        self.stops = service.stop_automaton(tuple(stop_strings)) if stop_strings else None
        self.constraint = constraint
        self.lengths = np.zeros(self.B, np.int64)  # host mirror of cache.lengths
        self.reserved = np.zeros(self.B, np.int64)  # the most positions the row's current reply may reach
        self.replying: set[int] = set()
        self.decode_steps = 0  # decode positions run: advance steps + one per enter call
        self.slot_steps = (
            0  # the same, each times the slots it ran on (the batch shrinks in a rollout's tail)
        )
        self._enter, self._advance = _jitted(service.extend_fn)

    @property
    def cache_len(self) -> int:
        return int(self.cache.k.shape[2])

    def _window_for(self, need: int) -> int | None:
        from comprl_jax.sampling import bucket

        w = min(self.cache_len, bucket(need, minimum=self.min_window))
        return None if w >= self.cache_len else w

    def enter(self, entries: Sequence[Entry], key) -> None:
        """Prefills each entry into its slot and samples its reply's first token (dispatched, not awaited)."""
        from comprl_jax.sampling import bucket

        if not entries:
            return
        for e in entries:
            if not e.tokens:
                raise ValueError(f"slot {e.slot}: an entry needs at least one input token")
            if e.slot in self.replying:
                raise ValueError(f"slot {e.slot} is still replying")
            if e.max_new > self.sp.max_new_tokens:
                raise ValueError(
                    f"max_new {e.max_new} exceeds SamplingParams.max_new_tokens={self.sp.max_new_tokens}"
                )
            start = 0 if e.reset else int(self.lengths[e.slot])
            need = start + len(e.tokens) + e.max_new
            if need > self.max_len:
                raise ValueError(f"slot {e.slot}: context {need} tokens exceeds max_len={self.max_len}")
            self.lengths[e.slot] = start + len(e.tokens)
            self.reserved[e.slot] = need
        grow = int(max(self.reserved[list(self.replying | {e.slot for e in entries})]))
        if grow > self.cache_len:
            self.cache = self.svc.grow_cache(
                self.cache, min(self.max_len, bucket(grow, minimum=self.min_window))
            )
        n = bucket(len(entries), minimum=1)
        T = bucket(max(len(e.tokens) for e in entries), minimum=16)
        slots = np.full((n,), self.B, np.int32)
        toks = np.full((n, T), self.svc.pad_id, np.int32)
        num_new = np.zeros((n,), np.int32)
        reset = np.zeros((n,), bool)
        mx = np.zeros((n,), np.int32)
        cstart = np.zeros((n,), np.int32)
        ids = np.zeros((n, 2), np.int32)
        for i, e in enumerate(entries):
            slots[i], num_new[i], reset[i], mx[i], cstart[i] = (
                e.slot,
                len(e.tokens),
                e.reset,
                e.max_new,
                e.cstart,
            )
            toks[i, : len(e.tokens)] = e.tokens
            ids[i] = e.key_ids
            self.replying.add(e.slot)
        window = self._window_for(int(max(self.lengths[e.slot] for e in entries)))
        # The prefill call samples one position for the entering rows while the other slots wait: it counts as a
        # decode step of every slot (as the lock-step engine's first position does).
        self.decode_steps += 1
        self.slot_steps += self.B
        put = jnp.asarray
        with self.svc._lock, self.svc._mesh_ctx():
            self.cache, self.state = self._enter(
                self.svc.graphdef,
                self.svc.params,
                self.cache,
                self.state,
                put(slots),
                put(toks),
                put(num_new),
                put(reset),
                put(mx),
                put(cstart),
                key,
                put(ids),
                self.stops,
                self.constraint,
                sp=self.sp,
                stop_ids=self.svc.stop_token_ids,
                pad_id=self.svc.pad_id,
                window=window,
                prefill_groups=self.svc.prefill_groups(n, T) if n % 2 == 0 else 1,
            )

    def advance(self, exit_done: int = 1):
        """Dispatches one decode chunk (up to ``chunk_steps`` positions); :meth:`collect` waits for it."""
        if not self.replying:
            return None
        rows = sorted(self.replying)
        need = int(max(min(self.lengths[b] + self.chunk_steps, self.reserved[b]) for b in rows))
        with self.svc._lock, self.svc._mesh_ctx():
            self.cache, self.state, steps = self._advance(
                self.svc.graphdef,
                self.svc.params,
                self.cache,
                self.state,
                jnp.int32(max(int(exit_done), 1)),
                self.stops,
                self.constraint,
                sp=self.sp,
                stop_ids=self.svc.stop_token_ids,
                pad_id=self.svc.pad_id,
                steps=self.chunk_steps,
                window=self._window_for(need),
            )
        return steps

    def compact(self, keep: Sequence[int]) -> dict[int, int]:
        """Moves the slots ``keep`` into a cache of ``batch_bucket(len(keep))`` rows when that is smaller (the tail
        of a rollout: fewer live episodes than slots, and a decode step's cost follows the rows it runs).

        Returns:
          ``{old slot: new slot}`` (identity when nothing shrinks).
        """
        keep = sorted(int(b) for b in keep)
        newB = self.svc.batch_bucket(max(len(keep), 1))
        if newB >= self.B:
            return {b: b for b in keep}
        idx = np.asarray(keep + [keep[0]] * (newB - len(keep)), np.int32)
        pad = np.arange(newB) >= len(keep)
        with self.svc._lock, self.svc._mesh_ctx():
            self.cache = _take_rows(self.cache, jnp.asarray(idx))
            state = _take_rows(self.state, jnp.asarray(idx))
            self.state = state.replace(done=state.done | jnp.asarray(pad))  # padding rows never reply
        self.lengths, self.reserved = self.lengths[idx].copy(), self.reserved[idx].copy()
        self.lengths[pad] = self.reserved[pad] = 0
        mapping = {b: i for i, b in enumerate(keep)}
        self.replying = {mapping[b] for b in self.replying}
        self.B = newB
        return mapping

    def collect(self, steps) -> list[Finished]:
        """Waits for the chunk; returns the slots whose replies ended (ascending slot order)."""
        if steps is None:
            return []
        st = self.state
        steps, done, lengths, finish, clen, out_tok, out_lp = jax.device_get(
            (steps, st.done, st.lengths, st.finish, self.cache.lengths, st.out_tok, st.out_lp)
        )
        self.decode_steps += int(steps)
        self.slot_steps += int(steps) * self.B
        self.lengths[:] = clen
        out = []
        for b in sorted(self.replying):
            if done[b]:
                n = int(lengths[b])
                out.append(Finished(b, out_tok[b, :n].copy(), out_lp[b, :n].copy(), int(finish[b])))
        self.replying -= {f.slot for f in out}
        return out
