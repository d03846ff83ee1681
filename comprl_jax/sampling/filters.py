"""Token selection: greedy / temperature / top-k / top-p, with an explicit PRNG key.

Order (as in HF ``transformers``): constraint mask -> temperature -> top-k -> top-p -> sample. The logprob
returned for the chosen token is under the *unmodified* model distribution (``log_softmax`` of the raw fp32
logits: no mask, no temperature, no truncation), which is what the RL ratio needs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from comprl_jax.runtime.fields import check

NEG_INF = -jnp.inf


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


def filter_logits(logits: jax.Array, sp: SamplingParams, allowed: jax.Array | None = None) -> jax.Array:
    """Scaled, truncated logits whose softmax is the sampling distribution (removed entries are ``-inf``).

    Args:
      logits: ``[B, V]`` float32 raw model logits.
      sp: sampling settings (static).
      allowed: optional ``[B, V]`` bool constraint mask (at least one True per row).
    Returns:
      ``[B, V]`` float32.
    """
    x = logits.astype(jnp.float32)
    if allowed is not None:
        x = jnp.where(allowed, x, NEG_INF)
    if sp.greedy:
        return x
    x = x / sp.temperature
    V = x.shape[-1]
    if 0 < sp.top_k < V:
        top = jax.lax.top_k(x, sp.top_k)[0]  # [B, k] sorted descending
        # Ties with the k-th value are kept (same rule as HF: remove only strictly smaller logits).
        x = jnp.where(x < top[:, -1:], NEG_INF, x)
    else:
        top = None
    if sp.top_p < 1.0:
        # With top-k on, the nucleus lies inside the top-k values: sort only those.
        srt = top if top is not None else -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(srt, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Keep a token while the mass of strictly better tokens is < top_p (the first is always kept).
        keep = mass_before < sp.top_p
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < thresh, NEG_INF, x)
    return x


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
        tok = jnp.argmax(x, axis=-1)
    else:
        if key.ndim:
            tok = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, x)
        else:
            tok = jax.random.categorical(key, x, axis=-1)
    tok = tok.astype(jnp.int32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
