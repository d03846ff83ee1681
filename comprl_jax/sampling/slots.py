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
from the rows' live context. On a paged cache (``SamplerService(kv_cache="paged")``) rows move by their page
lists on the host (:class:`~comprl_jax.sampling.pages.PageTable`): parking and compaction copy nothing on device,
and :func:`enter` gathers the entering rows' page-table rows instead of their keys and values.
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
from comprl_jax.sampling.decode import FINISH_LENGTH, FINISH_STOP, advance_rows, prefill, row_keys
from comprl_jax.sampling.filters import SamplingParams, select_tokens
from comprl_jax.sampling.pages import PageTable
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
    return cache.window(window)


def _unwindow(full, view, window):
    return full.unwindow(view)


def _decode_step(
    graphdef, params, view, st: SlotState, skip, sp, stops, constraint, stop_arr, pad_id, extend_fn
):
    """One decode position for the replying rows not in ``skip [B]`` (skipped when there are none)."""
    run = st.replace(done=st.done | skip)

    def step(v):
        zero_col = jnp.zeros(st.done.shape, jnp.int32)
        logits, v = extend_fn(graphdef, params, v, run.tok[:, None], (~run.done).astype(jnp.int32), zero_col)
        out = _emit(run, logits, sp, stops, constraint, stop_arr, pad_id)
        return v, out.replace(done=jnp.where(skip, st.done, out.done))

    return jax.lax.cond(jnp.all(run.done), lambda v: (v, st), step, view)


def enter(
    graphdef,
    params,
    cache,
    state: SlotState,
    park,
    slots: jax.Array,
    tokens: jax.Array,
    num_new: jax.Array,
    reset: jax.Array,
    src: jax.Array,
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
    start: jax.Array | None = None,
):
    """New input for ``n`` slots (prefill, first token, fresh reply state), and one decode position for every
    other replying slot in the same call. Pure; jit with the keywords static.

    Args:
      cache: the ``B``-slot KV cache (dense, or paged: then the host has given every entering slot its pages in
        the page table, a parked row's included); state: their :class:`SlotState`.
      park: None, or the parking store (a dense cache of ``P`` rows with the same ``S``) that parked rows come from
        (dense only).
      slots: ``[n]`` int32 slot per entering row (``B`` = padding row, ignored).
      tokens: ``[n, T]`` int32 input, right-padded; num_new: ``[n]`` valid columns (>= 1 for real rows).
      reset: ``[n]`` bool, a new occupant: the slot's cache row starts empty.
      src: ``[n]`` int32, the park row whose context the entering row continues (-1: the slot's own row).
      max_new: ``[n]`` int32 reply limit (<= ``sp.max_new_tokens``); cstart: ``[n]`` constraint start state.
      key: PRNG key; key_ids: ``[n, 2]`` int32, row key ``fold_in(fold_in(key, a), b)``.
      window: static; the first ``window`` cache positions hold every entering row's context + input and every
        replying row's context + one token.
      start: paged cache only: ``[n]`` int32, each entering row's cache length before its input (0 for a new
        occupant, the park length for a parked row). A paged row's prefill gathers page-table rows, not k / v
        rows, and writes into the shared pool (the replying rows' pages are disjoint from the entering rows').
    Returns:
      ``(cache, state)``.
    """
    view = _window(cache, window)
    B = state.done.shape[0]
    stop_arr = _stop_arr(stop_ids)
    entering = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
    # The slots already replying advance one position while the entering rows prefill (their rows are disjoint):
    # no slot waits for another's prefill.
    view, state = _decode_step(
        graphdef, params, view, state, entering, sp, stops, constraint, stop_arr, pad_id, extend_fn
    )
    paged = hasattr(view, "pages")
    if (
        paged
    ):  # the entering rows' page-table rows over the whole pool; a padding row's: out of range, no page
        sub = view.replace(
            pages=view.pages.at[slots].get(mode="fill", fill_value=jnp.iinfo(jnp.int32).max),
            lengths=start.astype(jnp.int32),
        )
    else:
        sub = view.replace(
            k=view.k.at[:, slots].get(mode="fill", fill_value=0),
            v=view.v.at[:, slots].get(mode="fill", fill_value=0),
            lengths=jnp.where(reset, 0, view.lengths.at[slots].get(mode="fill", fill_value=0)),
        )
    if park is not None:
        pview = _window(park, window)
        parked = src >= 0
        rows = jnp.where(parked, src, park.lengths.shape[0])
        pick = lambda x, y: jnp.where(parked[None, :, None, None, None], x, y)  # noqa: E731
        sub = sub.replace(
            k=pick(pview.k.at[:, rows].get(mode="fill", fill_value=0), sub.k),
            v=pick(pview.v.at[:, rows].get(mode="fill", fill_value=0), sub.v),
            lengths=jnp.where(parked, pview.lengths.at[rows].get(mode="fill", fill_value=0), sub.lengths),
        )
    last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
    logits, sub = prefill(graphdef, params, sub, tokens, num_new, last, extend_fn, prefill_groups)
    row_key = row_keys(key, key_ids)
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
    fresh = _emit(fresh, logits, sp, stops, constraint, stop_arr, pad_id)
    if paged:  # the pool came back from the prefill; the page table is the host's
        view = view.replace(k=sub.k, v=sub.v, lengths=view.lengths.at[slots].set(sub.lengths, mode="drop"))
    else:
        view = view.replace(
            k=view.k.at[:, slots].set(sub.k, mode="drop"),
            v=view.v.at[:, slots].set(sub.v, mode="drop"),
            lengths=view.lengths.at[slots].set(sub.lengths, mode="drop"),
        )
    state = jax.tree.map(lambda s, f: s.at[slots].set(f, mode="drop"), state, fresh)
    return _unwindow(cache, view, window), state


def park_rows(cache, park, slots: jax.Array, rows: jax.Array):
    """Copies the KV rows of ``slots [n]`` into park rows ``rows [n]`` (padding: slot ``B``, row ``P``, dropped).

    Returns:
      the parking store.
    """
    return park.replace(
        k=park.k.at[:, rows].set(cache.k.at[:, slots].get(mode="fill", fill_value=0), mode="drop"),
        v=park.v.at[:, rows].set(cache.v.at[:, slots].get(mode="fill", fill_value=0), mode="drop"),
        lengths=park.lengths.at[rows].set(
            cache.lengths.at[slots].get(mode="fill", fill_value=0), mode="drop"
        ),
    )


def advance(
    graphdef,
    params,
    cache,
    state: SlotState,
    watch: jax.Array,
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

    Ends early when no slot is replying or ``exit_done`` (a dynamic int32) of the ``watch [B]`` slots (the ones
    the host has seen replying) are done, counting those that finished in :func:`enter`'s decode step. A finished
    slot feeds nothing (``num_new = 0``): its cache stays exactly its context + reply (less the last token).

    Returns:
      ``(cache, state, steps_run)``.
    """
    stop_arr = _stop_arr(stop_ids)
    B = state.done.shape[0]
    zero_col = jnp.zeros((B,), jnp.int32)

    def cond(c):
        i, _, st = c
        newly = jnp.sum(st.done & watch)
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


@jax.jit
def _take_lengths(lengths, idx, pad):
    """Paged compaction: rows ``idx`` of the cache lengths, 0 on padding rows."""
    return jnp.where(pad, 0, lengths[idx]).astype(lengths.dtype)


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


_park = jax.jit(park_rows, donate_argnums=1)


@dataclasses.dataclass
class Entry:
    """One slot's next input for :meth:`SlotBatch.enter`.

    ``tokens``: the ids to append (the previous reply's last token first, when it was never fed); ``reset``: a
    new occupant (its row starts empty); ``key_ids``: ``(a, b)`` of its reply key; ``cstart``: its constraint's
    start state; ``park_row``: the park row (:meth:`SlotBatch.park`) holding the context it continues, -1 when
    the slot's own row holds it (or ``reset``).
    """

    slot: int
    tokens: Sequence[int]
    reset: bool
    max_new: int
    key_ids: tuple[int, int]
    cstart: int = 0
    park_row: int = -1


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

    Parking: :meth:`park` moves idle slots' KV rows into a parking store (a second cache, allocated on first use,
    rows in power-of-two buckets, the same positions as the slots' cache), so their slots can take other rows;
    an :class:`Entry` with ``park_row`` continues a parked row in any slot.

    Paged (``service.kv_cache == "paged"``): the slots' cache is a page pool with a page table of ``B`` rows that
    each address ``max_len`` positions (in whole pages), and a :class:`~comprl_jax.sampling.pages.PageTable` on
    the host says which pages each row owns. Each :meth:`enter` reserves pages for every entering row's context +
    input + reply and the replying rows' replies (the pool doubles when short) and sends the table before the
    call. Rows move by their page lists, on the host: a new occupant (``reset``) releases its slot's pages first,
    :meth:`park` moves a slot's pages and length to a park row (no device copy, no parking store), a parked row
    continues in a slot by giving it those pages, :meth:`release` and :meth:`vacate` free pages, and
    :meth:`compact` permutes page-table rows (the pool stays). Same tokens and log-probabilities as dense.
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
        from comprl_jax.sampling.service import MIN_CACHE_SLOTS

        self.svc = service
        self.sp = sp
        self.max_len = int(max_len)
        self.chunk_steps = int(chunk_steps)
        self.min_window = MIN_CACHE_SLOTS
        self.B = service.batch_bucket(slots)
        self.pages: PageTable | None = None  # paged: which pages each slot's row owns
        self.park_pages: list[list[int]] = []  # paged: each park row's pages (moved off its slot)
        self._table_stale = False  # paged: the device's page table lags self.pages
        if getattr(service, "kv_cache", "dense") == "paged":
            # The table addresses max_len positions per row from the start; the pool holds MIN_CACHE_SLOTS
            # positions per slot to begin with (the dense cache's first size) and doubles when rows need more.
            ps = service.page_size
            cap = -(-self.max_len // ps) * ps
            first = self.B * -(-min(self.max_len, MIN_CACHE_SLOTS) // ps)
            self.pages = PageTable(self.B, cap, ps, first)
            self.cache = service.new_paged(self.B, cap, first)
        else:
            self.cache = service.new_cache(self.B, min(self.max_len, MIN_CACHE_SLOTS))
        self.state = jax.tree.map(
            lambda x: service._put(np.asarray(x)), init_state(self.B, sp.max_new_tokens, service.pad_id)
        )
        self.stops = service.stop_automaton(tuple(stop_strings)) if stop_strings else None
        self.constraint = constraint
        self.lengths = np.zeros(self.B, np.int64)  # host mirror of cache.lengths (an upper bound mid-reply)
        self.reserved = np.zeros(self.B, np.int64)  # the most positions the row's current reply may reach
        self.replying: set[int] = set()
        self.park_store = None  # a dense KVCache of park rows once a row was parked
        self.park_lengths = np.zeros(0, np.int64)
        self.park_free: list[int] = []
        self.parked = 0  # rows moved into the store so far
        # Decode positions run (advance steps + one per enter call: its decode step) and the same, each times the
        # slots it ran on (the batch shrinks in a rollout's tail).
        self.decode_steps = 0
        self.slot_steps = 0
        self._enter, self._advance = _jitted(service.extend_fn)

    @property
    def cache_len(self) -> int:
        """Positions per row the cache addresses now (dense: grows with the rows; paged: ``max_len`` in pages)."""
        return int(self.cache.capacity)

    def _window_for(self, need: int) -> int | None:
        from comprl_jax.sampling.service import bucket

        w = min(self.cache_len, bucket(need, minimum=self.min_window))
        return None if w >= self.cache_len else w

    def _grow(self, need: int) -> None:
        """Room for ``need`` positions per row in the slots' cache and in the parking store alike."""
        from comprl_jax.sampling.service import bucket

        if self.pages is not None:  # the page table addresses max_len already; pages are reserved per row
            return
        if need > self.cache_len:
            size = min(self.max_len, bucket(need, minimum=self.min_window))
            self.cache = self.svc.grow_cache(self.cache, size)
        if self.park_store is not None and self.park_store.capacity < self.cache_len:
            self.park_store = self.svc.grow_cache(self.park_store, self.cache_len)

    def _reserve_pages(self, needs: dict[int, int]) -> None:
        """Paged: pages for ``needs[b]`` positions of slot ``b`` (the pool doubles until they fit)."""
        self.cache = self.svc.reserve_pages(self.cache, self.pages, needs)
        self._table_stale = True

    def _send_table(self) -> None:
        """Paged: the host's page table to the device (before a call that reads it)."""
        if self.pages is not None and self._table_stale:
            self.cache = self.cache.replace(pages=self.svc._put(self.pages.table()))
            self._table_stale = False

    def park(self, slots: Sequence[int]) -> list[int]:
        """Moves the KV rows of ``slots`` (idle: not replying) into free park rows; the slots are then free.
        Paged: their page lists and lengths move to the park rows on the host; nothing is copied on device.

        Returns:
          the park row of each slot, for the :class:`Entry` that continues it (which frees the park row).
        """
        from comprl_jax.sampling.service import bucket

        slots = [int(s) for s in slots]
        if not slots:
            return []
        self._grow(0)  # the store holds the same positions as the slots' cache
        for s in slots:
            if s in self.replying:
                raise ValueError(f"slot {s} is still replying; only an idle slot can be parked")
        if len(self.park_free) < len(slots):
            rows = self.park_lengths.shape[0]
            size = self.svc.batch_bucket(rows + len(slots) - len(self.park_free))
            if self.pages is None:
                new = self.svc.new_cache(size, self.cache_len)
                if self.park_store is not None:
                    with self.svc._lock, self.svc._mesh_ctx():
                        new = _grow_rows(self.park_store, new)
                self.park_store = new
            else:
                self.park_pages += [[] for _ in range(size - rows)]
            self.park_free += list(range(rows, size))
            self.park_lengths = np.concatenate([self.park_lengths, np.zeros(size - rows, np.int64)])
        self.park_free.sort()
        rows = [self.park_free.pop(0) for _ in slots]
        if self.pages is None:
            n = bucket(len(slots), minimum=1)
            src = np.full((n,), self.B, np.int32)
            dst = np.full((n,), self.park_lengths.shape[0], np.int32)
            src[: len(slots)], dst[: len(slots)] = slots, rows
            with self.svc._lock, self.svc._mesh_ctx():
                self.park_store = _park(self.cache, self.park_store, jnp.asarray(src), jnp.asarray(dst))
        else:  # the slot's page list is the parked row (the device's table is sent before the next call)
            for s, r in zip(slots, rows, strict=True):
                self.park_pages[r] = self.pages.take(s)
            self._table_stale = True
        for s, r in zip(slots, rows, strict=True):
            self.park_lengths[r] = self.lengths[s]
            self.lengths[s] = self.reserved[s] = 0
        self.parked += len(slots)
        return rows

    def release(self, rows: Sequence[int]) -> None:
        """Frees park rows that will not be continued (their episode ended while parked); paged: their pages."""
        for r in rows:
            if r in self.park_free or not 0 <= r < self.park_lengths.shape[0]:
                raise ValueError(f"park row {r} holds no parked row")
            self.park_free.append(int(r))
            self.park_lengths[r] = 0
            if self.pages is not None:
                self.pages.free_pages(self.park_pages[r])
                self.park_pages[r] = []

    def vacate(self, slots: Sequence[int]) -> None:
        """Slots whose occupant ended (idle): paged, their pages go back to the pool now rather than when a new
        occupant enters (``reset``). Dense: nothing to free. A vacated slot's next entry is a new occupant or a
        parked row."""
        for s in slots:
            if s in self.replying:
                raise ValueError(f"slot {s} is still replying")
            if self.pages is not None:
                self.pages.release(int(s))
                self.lengths[s] = self.reserved[s] = 0
                self._table_stale = True

    def enter(self, entries: Sequence[Entry], key) -> None:
        """Prefills each entry into its slot and samples its reply's first token, while every other replying slot
        decodes one position (dispatched, not awaited)."""
        from comprl_jax.sampling.service import bucket

        if not entries:
            return
        starts: list[int] = []  # each entry's cache length before its input
        for e in entries:
            if not e.tokens:
                raise ValueError(f"slot {e.slot}: an entry needs at least one input token")
            if e.slot in self.replying:
                raise ValueError(f"slot {e.slot} is still replying")
            if e.max_new > self.sp.max_new_tokens:
                raise ValueError(
                    f"max_new {e.max_new} exceeds SamplingParams.max_new_tokens={self.sp.max_new_tokens}"
                )
            if e.park_row >= 0 and (
                e.reset or e.park_row in self.park_free or e.park_row >= self.park_lengths.shape[0]
            ):
                raise ValueError(f"slot {e.slot}: park row {e.park_row} holds no parked row to continue")
            if e.reset:
                start = 0
            elif e.park_row >= 0:
                start = int(self.park_lengths[e.park_row])
            else:
                start = int(self.lengths[e.slot])
            need = start + len(e.tokens) + e.max_new
            if need > self.max_len:
                raise ValueError(f"slot {e.slot}: context {need} tokens exceeds max_len={self.max_len}")
            starts.append(start)
            self.lengths[e.slot] = start + len(e.tokens)
            self.reserved[e.slot] = need
        going = sorted(self.replying)  # they decode one position in this call
        if self.pages is not None:
            for e in entries:  # the slot's old context goes for a new occupant or a parked row
                if e.reset or e.park_row >= 0:
                    self.pages.release(e.slot)
                if e.park_row >= 0:
                    self.pages.give(e.slot, self.park_pages[e.park_row])
                    self.park_pages[e.park_row] = []
            self._reserve_pages({b: int(self.reserved[b]) for b in going + [e.slot for e in entries]})
        else:
            self._grow(int(max(self.reserved[going + [e.slot for e in entries]])))
        n = bucket(len(entries), minimum=1)
        T = bucket(max(len(e.tokens) for e in entries), minimum=16)
        slots = np.full((n,), self.B, np.int32)
        toks = np.full((n, T), self.svc.pad_id, np.int32)
        num_new = np.zeros((n,), np.int32)
        reset = np.zeros((n,), bool)
        src = np.full((n,), -1, np.int32)
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
            src[i] = e.park_row
            toks[i, : len(e.tokens)] = e.tokens
            ids[i] = e.key_ids
        for b in going:
            self.lengths[b] = min(self.lengths[b] + 1, self.reserved[b])
        window = self._window_for(int(max(self.lengths[going + [e.slot for e in entries]])))
        self.decode_steps += 1
        self.slot_steps += self.B
        put = jnp.asarray
        use_park = self.pages is None and bool((src >= 0).any())
        extra = {}
        if self.pages is not None:
            start = np.zeros((n,), np.int32)
            start[: len(entries)] = starts
            extra["start"] = put(start)
            self._send_table()
        with self.svc._lock, self.svc._mesh_ctx():
            self.cache, self.state = self._enter(
                self.svc.graphdef,
                self.svc.params,
                self.cache,
                self.state,
                self.park_store if use_park else None,
                put(slots),
                put(toks),
                put(num_new),
                put(reset),
                put(src),
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
                **extra,
            )
        for e in entries:
            self.replying.add(e.slot)
            if e.park_row >= 0:
                self.park_free.append(e.park_row)
                self.park_lengths[e.park_row] = 0

    def advance(self, exit_done: int = 1):
        """Dispatches one decode chunk (up to ``chunk_steps`` positions); :meth:`collect` waits for it. The chunk
        ends early once ``exit_done`` replying slots are done (those done in :meth:`enter`'s step count)."""
        if not self.replying:
            return None
        rows = sorted(self.replying)
        need = int(max(min(self.lengths[b] + self.chunk_steps, self.reserved[b]) for b in rows))
        watch = np.zeros((self.B,), bool)
        watch[rows] = True
        self._send_table()
        with self.svc._lock, self.svc._mesh_ctx():
            self.cache, self.state, steps = self._advance(
                self.svc.graphdef,
                self.svc.params,
                self.cache,
                self.state,
                jnp.asarray(watch),
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

        Paged: the kept rows' page-table rows and lengths are permuted (the pool stays); the other rows' pages
        are freed.

        Returns:
          ``{old slot: new slot}`` (identity when nothing shrinks).
        """
        keep = sorted(int(b) for b in keep)
        if not keep:
            raise ValueError("SlotBatch.compact needs at least one slot to keep (keep=[])")
        newB = self.svc.batch_bucket(len(keep))
        if newB >= self.B:
            return {b: b for b in keep}
        idx = np.asarray(keep + [keep[0]] * (newB - len(keep)), np.int32)
        pad = np.arange(newB) >= len(keep)
        with self.svc._lock, self.svc._mesh_ctx():
            if self.pages is None:
                self.cache = _take_rows(self.cache, jnp.asarray(idx))
            else:
                self.pages.keep_rows(keep, newB)  # padding rows own no page
                lengths = _take_lengths(self.cache.lengths, jnp.asarray(idx), jnp.asarray(pad))
                self.cache = self.cache.replace(pages=self.svc._put(self.pages.table()), lengths=lengths)
                self._table_stale = False
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
        if self.pages is not None:  # a slot whose pages moved away (parked, vacated) holds nothing
            self.lengths[np.array([not p for p in self.pages.owned], bool)] = 0
        out = []
        for b in sorted(self.replying):
            if done[b]:
                n = int(lengths[b])
                out.append(Finished(b, out_tok[b, :n].copy(), out_lp[b, :n].copy(), int(finish[b])))
        self.replying -= {f.slot for f in out}
        return out


@jax.jit
def _grow_rows(old, new):
    """``old``'s rows copied into the first rows of the larger (same positions) ``new``."""
    return jax.tree.map(lambda o, n: jax.lax.dynamic_update_slice(n, o, (0,) * n.ndim), old, new)
