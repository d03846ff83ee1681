"""The jitted generation step: ragged prefill through ``extend`` + a ``lax.while_loop`` decode.

One call = one turn for a batch of rows sharing a KV cache. Row ``b`` appends ``tokens[b, :num_new[b]]`` to its
cache (a first prompt, or the next turn's observation on a live cache), then samples up to ``max_new[b]``
tokens. The loop runs while any row is still going, so finished rows cost no steps beyond the longest row
(they ride along in the batched compute with ``num_new = 0``: nothing is written to their cache).

Token convention: a sampled token is fed to the model at the *next* step, so the last token of each row (the
stop token, or the last one at the length limit) is *not* in the returned cache: ``cache.lengths[b] =
old + num_new[b] + lengths[b] - 1`` for rows that generated. The multi-turn :class:`~comprl_jax.sampling.Conversation`
prepends it to the next turn's input.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from comprl_jax.sampling.automaton import TokenAutomaton
from comprl_jax.sampling.filters import SamplingParams, select_tokens
from comprl_jax.sampling.stops import StopAutomaton

FINISH_STOP = 0  # a stop token id or stop string ended the row
FINISH_LENGTH = 1  # the row reached its max_new


@flax.struct.dataclass
class GenerationResult:
    """Output of one generation call (device arrays, or numpy after :meth:`to_numpy`).

    Attributes:
      tokens: ``[B, N]`` int32 generated ids; entries at ``>= lengths[b]`` are ``pad_id``.
      lengths: ``[B]`` int32 number of generated tokens (incl. the stop token).
      finish_reason: ``[B]`` int32, ``FINISH_STOP`` (0) or ``FINISH_LENGTH`` (1).
      logprobs: ``[B, N]`` float32 log-probability of each token under the unmodified model; 0 past lengths.
      cache: the updated KV cache (model layer's ``KVCache``); ``None`` once dropped on the host side.
      steps: scalar int32, decode positions the loop ran (``max(lengths)``: finished rows cost no extra steps).
    """

    tokens: Any
    lengths: Any
    finish_reason: Any
    logprobs: Any
    cache: Any = None
    steps: Any = None

    def to_numpy(self, batch: int | None = None) -> GenerationResult:
        """Host copy of the first ``batch`` rows (drops the cache)."""
        sl = slice(None) if batch is None else slice(0, batch)
        get = jax.device_get((self.tokens, self.lengths, self.finish_reason, self.logprobs))
        return GenerationResult(*(x[sl] for x in get), cache=None, steps=jax.device_get(self.steps))


def decode(
    graphdef: Any,
    params: Any,
    cache: Any,
    tokens: jax.Array,
    num_new: jax.Array,
    max_new: jax.Array,
    key: jax.Array,
    stops: StopAutomaton | None,
    constraint: TokenAutomaton | None,
    *,
    sp: SamplingParams,
    stop_ids: tuple[int, ...],
    pad_id: int,
    extend_fn: Any,
    window: int | None = None,
    prefill_groups: int = 1,
    fresh: bool = False,
) -> GenerationResult:
    """Prefill + decode for one turn. Pure; jit it with the keyword-only arguments static.

    Args:
      graphdef: model graph definition (static).
      params: model parameters (``nnx.State``).
      cache: KV cache with room for ``num_new + max_new`` more tokens per row.
      tokens: ``[B, T]`` int32 new input tokens, right-padded.
      num_new: ``[B]`` int32 valid columns of ``tokens`` per row (>= 1 for rows with ``max_new > 0``).
      max_new: ``[B]`` int32 per-row generation limit, ``<= sp.max_new_tokens``; 0 = row is idle.
      key: PRNG key; step ``i`` uses ``fold_in(key, i)``. Or ``[B]`` keys, one per row (:func:`row_keys`): row
        ``b``'s token ``i`` then draws with ``fold_in(key[b], i)``, so its reply does not depend on the batch (the
        slot engine draws the same way, so both engines sample the same tokens).
      stops: stop-string detector or None.
      constraint: token automaton or None; every row starts in its state 0.
      sp: sampling settings (static; ``sp.max_new_tokens`` is the buffer length ``N``).
      stop_ids: token ids that end a row (static).
      pad_id: filler for unused output slots (static).
      extend_fn: the model's ``extend(graphdef, params, cache, tokens, num_new, logits_at) -> (logits, cache)``
        (static); ``logits_at [B]`` is the one input column per row whose logits ``[B, V]`` it returns.
      window: static; when set below the cache length S, the turn runs on the first ``window`` slots only (every
        row's context + this turn fits in them) and writes them back at the end. Attention cost per step then
        scales with the live context, not with the cache's capacity.
      prefill_groups: static; the input goes through the model in this many row groups (a divisor of B), which
        bounds the prefill's attention buffers to ``B / prefill_groups`` rows (see :func:`prefill`).
      fresh: static; the cache is empty (every row's length 0, as :meth:`SamplerService.generate` makes it): the
        prefill attends among the new tokens only (``extend_fn(..., fresh=True)``), not to the empty window.
    Returns:
      A :class:`GenerationResult` with device arrays and the updated cache.
    """
    full = cache
    cache = cache.window(
        window
    )  # dense: a copy of the first `window` positions; paged: the page table's front
    # A paged cache on CPU: the turn runs on a dense copy of the window's pages (one gather, one scatter back),
    # not a gather of every layer's pages per step (PagedKVCache.dense_turn; None on TPU / GPU).
    paged, dense = cache, (cache.dense_turn() if hasattr(cache, "dense_turn") else None)
    cache = cache if dense is None else dense
    B = tokens.shape[0]
    N = sp.max_new_tokens
    stop_arr = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
    # Only each row's last valid input column goes through the output head (the distribution of its first new
    # token): full [B, T, V] float32 logits of a 32 x 2k prefill are 12 GiB for SmolLM2's 49k vocabulary.
    last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
    pf = functools.partial(extend_fn, fresh=True) if fresh else extend_fn
    first_logits, cache = prefill(graphdef, params, cache, tokens, num_new, last, pf, prefill_groups)
    first_logits = first_logits.astype(jnp.float32)

    def emit(c, step_logits):
        """Selects the token at position c['step'] for every row and updates the per-row bookkeeping."""
        active = ~c["done"]
        allowed = None if constraint is None else constraint.allowed[c["cstate"]]  # [B, V]
        step_key = (
            jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, c["step"])
            if key.ndim
            else jax.random.fold_in(key, c["step"])
        )
        tok, lp = select_tokens(step_logits, step_key, sp, allowed)
        tok = jnp.where(active, tok, pad_id)
        col = c["step"]
        out_tok = jax.lax.dynamic_update_slice(c["out_tok"], tok[:, None], (0, col))
        out_lp = jax.lax.dynamic_update_slice(c["out_lp"], jnp.where(active, lp, 0.0)[:, None], (0, col))
        lengths = c["lengths"] + active.astype(jnp.int32)
        done, finish, cstate, sstate = advance_rows(
            tok,
            active,
            lengths,
            max_new,
            c["done"],
            c["finish"],
            c["cstate"],
            c["sstate"],
            stops,
            constraint,
            stop_arr,
        )
        return dict(
            step=col + 1,
            tok=tok,
            cache=c["cache"],
            out_tok=out_tok,
            out_lp=out_lp,
            lengths=lengths,
            done=done,
            finish=finish,
            cstate=cstate,
            sstate=sstate,
        )

    idle = max_new <= 0
    carry = dict(
        step=jnp.int32(0),
        tok=jnp.full((B,), pad_id, jnp.int32),
        cache=cache,
        out_tok=jnp.full((B, N), pad_id, jnp.int32),
        out_lp=jnp.zeros((B, N), jnp.float32),
        lengths=jnp.zeros((B,), jnp.int32),
        done=idle,
        finish=jnp.where(idle, FINISH_LENGTH, FINISH_STOP).astype(jnp.int32),
        cstate=jnp.zeros((B,), jnp.int32),
        sstate=jnp.zeros((B,), jnp.int32),
    )
    carry = emit(carry, first_logits)

    zero_col = jnp.zeros((B,), jnp.int32)

    def cond(c):
        return (c["step"] < N) & ~jnp.all(c["done"])

    def body(c):
        # Finished rows feed nothing (num_new = 0): their cache stays exactly prompt + generated tokens.
        step_logits, new_cache = extend_fn(
            graphdef, params, c["cache"], c["tok"][:, None], (~c["done"]).astype(jnp.int32), zero_col
        )
        return emit(dict(c, cache=new_cache), step_logits.astype(jnp.float32))

    carry = jax.lax.while_loop(cond, body, carry)
    if dense is not None:
        carry["cache"] = paged.end_dense_turn(carry["cache"])
    carry["cache"] = full.unwindow(carry["cache"])
    return GenerationResult(
        tokens=carry["out_tok"],
        lengths=carry["lengths"],
        finish_reason=carry["finish"],
        logprobs=carry["out_lp"],
        cache=carry["cache"],
        steps=carry["step"],
    )


def row_keys(key: jax.Array, ids: jax.Array) -> jax.Array:
    """``[n]`` reply keys ``fold_in(fold_in(key, a), b)`` for ``ids [n, 2] = (a, b)`` (an episode and its turn)."""
    return jax.vmap(lambda a, b: jax.random.fold_in(jax.random.fold_in(key, a), b))(ids[:, 0], ids[:, 1])


def advance_rows(tok, active, lengths, max_new, done, finish, cstate, sstate, stops, constraint, stop_arr):
    """Per-row bookkeeping after token ``tok [B]`` was emitted by the ``active [B]`` rows (``lengths`` already
    counts it): automaton states move, a stop token / stop string / the length limit ends the row.

    Returns:
      ``(done, finish, cstate, sstate)``, each ``[B]``.
    """
    is_stop = jnp.isin(tok, stop_arr)
    if constraint is not None:
        cstate = jnp.where(active, constraint.next_state[cstate, tok], cstate)
    if stops is not None:
        is_stop = is_stop | stops.hit[sstate, tok]
        sstate = jnp.where(active, stops.next_state[sstate, tok], sstate)
    end_stop = active & is_stop
    end_len = active & ~is_stop & (lengths >= max_new)
    finish = jnp.where(end_stop, FINISH_STOP, jnp.where(end_len, FINISH_LENGTH, finish))
    return done | end_stop | end_len, finish, cstate, sstate


def prefill(graphdef, params, cache, tokens, num_new, last, extend_fn, groups: int):
    """The turn's input through ``extend_fn``, ``groups`` row groups one after another (a ``scan``).

    Why: attention over a long input holds ``[rows, heads, QUERY_CHUNK, S]`` float32 scores per query chunk on the
    ``xla`` backend; for 32 rows x 2k tokens of SmolLM2 that is gigabytes. Groups bound it to ``rows / groups``.
    Group ``g`` is rows ``g, g + groups, ...`` (strided), so on a mesh every device keeps its share of every
    group. Same values as one call: rows are independent. Each group runs ``extend_fn(..., write=False)`` and
    the new keys and values of every row are written once after the loop.

    Returns:
      ``(logits [B, V] at column last[b], cache)``.
    """
    if groups <= 1:
        return extend_fn(graphdef, params, cache, tokens, num_new, last)
    B, T = tokens.shape
    if B % groups:
        raise ValueError(f"prefill_groups={groups} must divide the batch {B}")
    r = B // groups

    def split(x, axis):  # [..., B, ...] -> [..., r, groups, ...]: row b = (b // groups, b % groups)
        return x.reshape(x.shape[:axis] + (r, groups) + x.shape[axis + 1 :])

    toks, nn, at = split(tokens, 0), split(num_new, 0), split(last, 0)
    lens = split(cache.lengths, 0)
    # The loop reads the cache and never carries it: each group returns its rows' new keys and values, and one
    # write after the loop puts every row's in place (kv_cache.write, as a single extend does). A loop that
    # carried the dense cache split as [L, r, groups, ...] made the TPU compiler hold a second copy of the cache
    # in the loop's layout (7 GiB per v5p chip for the paper's actor). Paged: each group's page-table rows.
    if hasattr(cache, "pages"):
        pages = split(cache.pages, 0)
        sub_of = lambda g: cache.replace(pages=pages[:, g], lengths=lens[:, g])  # noqa: E731
    else:
        ks, vs = split(cache.k, 1), split(cache.v, 1)
        sub_of = lambda g: cache.replace(k=ks[:, :, g], v=vs[:, :, g], lengths=lens[:, g])  # noqa: E731

    def body(_, g):
        lg, (k_new, v_new) = extend_fn(
            graphdef, params, sub_of(g), toks[:, g], nn[:, g], at[:, g], write=False
        )
        return None, (lg.astype(jnp.float32), k_new, v_new)

    _, (logits, k_new, v_new) = jax.lax.scan(body, None, jnp.arange(groups))

    def merge(x, axis):  # [groups, ..., r (at axis), ...] -> [..., B, ...]: row b = (b // groups, b % groups)
        x = jnp.moveaxis(x, 0, axis + 1)
        return x.reshape(x.shape[:axis] + (B,) + x.shape[axis + 2 :])

    from comprl_jax.models import kv_cache  # the model layer's cache write

    return merge(logits, 0), kv_cache.write(
        cache, merge(k_new, 1), merge(v_new, 1), num_new.astype(jnp.int32)
    )


def make_decode_fn(extend_fn: Any, wrap: Any = None):
    """``jax.jit`` of :func:`decode` for one model's ``extend``; the cache argument is donated.

    Args:
      extend_fn: the model's ``extend`` (with the ``logits_at`` argument, see :func:`decode`).
      wrap: optional decorator applied before jit (tests pass ``chex.assert_max_traces(n=...)``).
    Returns:
      ``fn(graphdef, params, cache, tokens, num_new, max_new, key, stops, constraint, *, sp, stop_ids, pad_id)``.
    """

    def fn(
        graphdef,
        params,
        cache,
        tokens,
        num_new,
        max_new,
        key,
        stops,
        constraint,
        *,
        sp,
        stop_ids,
        pad_id,
        window=None,
        prefill_groups=1,
        fresh=False,
    ):
        return decode(
            graphdef,
            params,
            cache,
            tokens,
            num_new,
            max_new,
            key,
            stops,
            constraint,
            sp=sp,
            stop_ids=stop_ids,
            pad_id=pad_id,
            extend_fn=extend_fn,
            window=window,
            prefill_groups=prefill_groups,
            fresh=fresh,
        )

    if wrap is not None:
        fn = wrap(fn)
    return jax.jit(
        fn,
        static_argnums=(0,),
        static_argnames=("sp", "stop_ids", "pad_id", "window", "prefill_groups", "fresh"),
        donate_argnums=(2,),
    )
