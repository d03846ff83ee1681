"""Token selection: greedy / temperature / top-k / top-p, with an explicit PRNG key.

Order (as in HF ``transformers``): constraint mask -> temperature -> top-k -> top-p -> sample. The logprob
returned for the chosen token is under the *unmodified* model distribution (``log_softmax`` of the raw fp32
logits: no mask, no temperature, no truncation), which is what the RL ratio needs.

Top-p without top-k does not sort the vocabulary (152k entries for Qwen) on every step: the nucleus is computed
inside the ``TOP_P_CAP`` largest logits (``jax.lax.top_k``), and only when some row's nucleus may extend past them
(their mass is below ``top_p``: rare for trained models, common for flat random ones) does a ``jax.lax.cond`` take the
full sort. See :func:`filter_logits`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from comprl_jax.runtime.fields import check

NEG_INF = -jnp.inf
# Top-p without top-k looks for the nucleus among this many largest logits first (a static shape).
TOP_P_CAP = 1024
# A row takes the full sort when the cap's mass is below ``top_p + _CAP_MARGIN``. The margin (~8 ulps of 1.0) covers
# the float rounding of the cumulative sums past the cap, so a row that skips the sort provably keeps nothing past it.
_CAP_MARGIN = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings (hashable: a static jit argument; each distinct value compiles once).

    Attributes:
      max_new_tokens: the decode buffer length ``N`` (a shape bucket); per-row limits go in ``max_new [B]``.
      temperature: > 0; ignored when ``greedy``.
      top_k: keep the ``k`` largest logits (0 = off).
      top_p: nucleus mass in (0, 1] (1 = off).
      greedy: argmax of the (constrained) logits.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        check(self.max_new_tokens > 0, "max_new_tokens", "must be positive", self.max_new_tokens)
        check(
            self.greedy or self.temperature > 0,
            "temperature",
            "must be > 0 (or greedy=True)",
            self.temperature,
        )
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)", self.top_k)
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)


def filter_logits(
    logits: jax.Array, sp: SamplingParams, allowed: jax.Array | None = None, *, top_p_cap: int = TOP_P_CAP
) -> jax.Array:
    """Scaled, truncated logits whose softmax is the sampling distribution (removed entries are ``-inf``).

    Top-k keeps every logit tied with the k-th largest. Top-p walks the kept logits in descending order and keeps a
    token while the mass of the tokens before it (``cumsum(p) - p``) is ``< top_p`` (the first is always kept); every
    logit ``>=`` the last kept one survives (ties with it included). With top-k on, the walk covers the top-k values
    (their softmax). With top-k off, the walk never needs the whole vocabulary sorted:

    * the ``K = min(top_p_cap, V)`` largest logits come from ``jax.lax.top_k``; their probabilities are
      ``exp(v - max) / D`` with ``D`` the sum over the whole vocabulary, and the nucleus is computed inside them;
    * when the cap's mass ``c[K-1]`` is ``>= top_p + _CAP_MARGIN``, every token past the cap has at least that mass
      before it (up to an ulp of rounding, which the margin covers), so none is kept and the cap's answer is the full
      one. Otherwise (any row of the batch) a ``jax.lax.cond`` sorts the vocabulary and continues the walk past the
      cap, reusing the cap's sums for the first ``K`` entries (same values, same ops), so either branch gives a row the
      same bits and a row's result does not depend on the other rows of the batch.

    Why a ``top_k`` cap rather than a threshold search (bisection on the logit value with a mass reduction per step):
    the search takes ~30 passes over ``[B, V]`` and its masses are sums in another order than the walk's cumulative
    sums, so it cannot be bit-compatible with the tie and boundary rules above; the cap computes the walk's own
    quantities. Against the previous filter (a full sort and ``softmax`` of the sorted row) the only change is the
    summation order of ``D`` (vocabulary order instead of sorted order), which can move a kept set only when a
    cumulative mass lies within float rounding (~1e-7) of ``top_p``.

    Args:
      logits: ``[B, V]`` float32 raw model logits.
      sp: sampling settings (static).
      allowed: optional ``[B, V]`` bool constraint mask (at least one True per row).
      top_p_cap: static number of largest logits searched before falling back to the full sort.
    Returns:
      ``[B, V]`` float32.
    """
    x = _scaled(logits, sp, allowed)
    if sp.greedy:
        return x
    V = x.shape[-1]
    if 0 < sp.top_k < V:
        top = jax.lax.top_k(x, sp.top_k)[0]  # [B, k] sorted descending
        # Ties with the k-th value are kept (same rule as HF: remove only strictly smaller logits).
        x = jnp.where(x < top[:, -1:], NEG_INF, x)
        if sp.top_p < 1.0:
            # The nucleus lies inside the top-k values: walk only those.
            probs = jax.nn.softmax(top, axis=-1)
            thresh = _walk(top, probs, jnp.cumsum(probs, axis=-1), sp.top_p)
            x = jnp.where(x < thresh, NEG_INF, x)
    elif sp.top_p < 1.0:
        x = jnp.where(x < _nucleus_threshold(x, sp.top_p, top_p_cap), NEG_INF, x)
    return x


def top_p_fallback_rows(
    logits: jax.Array, sp: SamplingParams, allowed: jax.Array | None = None, *, top_p_cap: int = TOP_P_CAP
) -> jax.Array:
    """``[B]`` bool: the rows whose top-p nucleus may extend past the ``top_p_cap`` largest logits.

    :func:`filter_logits` sorts the whole vocabulary (its ``jax.lax.cond`` predicate) iff any entry is True; all False
    when top-p is off, top-k is on or the cap covers the vocabulary (no sort is ever needed then).
    """
    x = _scaled(logits, sp, allowed)
    B, V = x.shape
    if sp.greedy or sp.top_p >= 1.0 or 0 < sp.top_k < V or min(top_p_cap, V) >= V:
        return jnp.zeros((B,), bool)
    return _capped_nucleus(x, sp.top_p, top_p_cap)[-1]


def _scaled(logits: jax.Array, sp: SamplingParams, allowed: jax.Array | None) -> jax.Array:
    x = logits.astype(jnp.float32)
    if allowed is not None:
        x = jnp.where(allowed, x, NEG_INF)
    if sp.greedy:
        return x
    return x / sp.temperature


def _walk(srt: jax.Array, probs: jax.Array, csum: jax.Array, top_p: float) -> jax.Array:
    """``[B, 1]`` smallest kept value of a descending walk (``+inf`` when none is kept)."""
    # Keep a token while the mass of strictly better tokens is < top_p (the first is always kept).
    keep = csum - probs < top_p
    return jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)


def _capped_nucleus(x: jax.Array, top_p: float, cap: int):
    """The walk inside the ``K`` largest logits: ``(threshold [B,1], csum [B,K], max [B,1], D [B,1], fallback [B])``."""
    K = min(cap, x.shape[-1])
    top = jax.lax.top_k(x, K)[0]  # [B, K] descending: the first K entries of the sorted row, same values
    # The max from x, not top[:, :1] (same value): XLA:CPU keeps a top_k whose only users are [0:K] slices as its
    # TopK kernel, and another slice of it turns the top_k back into a full sort.
    m = jnp.max(x, axis=-1, keepdims=True)
    D = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
    probs = jnp.exp(top - m) / D
    csum = jnp.cumsum(probs, axis=-1)
    thresh = _walk(top, probs, csum, top_p)
    return thresh, csum, m, D, csum[:, -1] < top_p + _CAP_MARGIN


def _nucleus_threshold(x: jax.Array, top_p: float, cap: int) -> jax.Array:
    K = min(cap, x.shape[-1])
    thresh, csum, m, D, fallback = _capped_nucleus(x, top_p, cap)
    if K == x.shape[-1]:
        return thresh

    def full(_):
        # The rare path: sort the vocabulary and continue the walk past the cap (the first K entries are the cap's).
        rest = (-jnp.sort(-x, axis=-1))[:, K:]
        probs = jnp.exp(rest - m) / D
        csum_rest = csum[:, -1:] + jnp.cumsum(probs, axis=-1)
        return jnp.minimum(thresh, _walk(rest, probs, csum_rest, top_p))

    return jax.lax.cond(jnp.any(fallback), full, lambda _: thresh, None)


def first_max(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first maximum; a row's first NaN if it has one) as a max, a compare and a
    min over the indices: XLA:CPU runs argmax's variadic (value, index) reduce 4x slower (16 x 2,048 logits: 75
    against 17 us, once per decode step). ``x``: ``[..., V]`` -> ``[...]`` int32."""
    v = x.shape[-1]
    hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def select_tokens(
    logits: jax.Array, key: jax.Array, sp: SamplingParams, allowed: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row.

    Args:
      logits: ``[B, V]`` raw model logits.
      key: PRNG key for this step (unused when greedy): one key for the batch (``[]``), or one per row (``[B]``,
        so a row's draw does not depend on which rows share the batch: the slot engine's rows come and go).
      sp: sampling settings.
      allowed: optional ``[B, V]`` bool constraint mask.
    Returns:
      ``(tokens [B] int32, logprobs [B] float32)``, logprobs under the unmodified ``softmax(logits)``.
    """
    x = filter_logits(logits, sp, allowed)
    if sp.greedy:
        tok = first_max(x)
    else:
        if key.ndim:
            tok = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, x)
        else:
            tok = jax.random.categorical(key, x, axis=-1)
    tok = tok.astype(jnp.int32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
