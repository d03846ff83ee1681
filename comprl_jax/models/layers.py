"""Pure building blocks of the decoder: RMSNorm, RoPE (with HF-compatible scaling), GQA attention, SwiGLU.

All functions are pure jnp code on explicit arrays so that the decoder can ``lax.scan`` over stacked layer
parameters. Numerics follow Hugging Face ``transformers`` (Qwen2/Qwen3/Llama) so that fp32 logits agree to 1e-4:
norms and softmax run in float32, RoPE uses the rotate-half layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.models.config import ModelConfig
from comprl_jax.runtime import sharding

# Masked attention scores use a large finite value, not -inf: a query row with no visible key (a padding column)
# then gets a uniform softmax instead of NaN, and NaNs never leak into gradients through jnp.where.
NEG_INF = -1e30


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32 (as HF), result in ``x.dtype``.

    Args:
      x: ``[..., D]``. w: ``[D]``.
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * w.astype(x.dtype)


def _yarn(inv_freq: np.ndarray, dim: int, base: float, sc: dict, max_pos: int) -> tuple[np.ndarray, float]:
    """YaRN frequency blend and attention factor, as ``transformers`` ``_compute_yarn_parameters``."""
    # transformers 5 uses the configured factor; the original context defaults to max_position_embeddings.
    factor = float(sc["factor"])
    orig = sc.get("original_max_position_embeddings") or max_pos

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = sc.get("attention_factor")
    if attn is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attn = get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else get_mscale(factor)
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrap = 1.0 - ramp
    inv = (inv_freq / factor) * (1 - extrap) + inv_freq * extrap
    return inv, float(attn)


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin attention factor for ``cfg``.

    Computed on the host from the static config (trace-time constants). Mirrors ``transformers``'
    ``ROPE_INIT_FUNCTIONS`` for "default", "linear", "llama3" and "yarn".
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    # HF: 1 / base ** (arange(0, dim, 2).float() / dim), in float32.
    inv = (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    sc = cfg.rope_scaling_dict
    if sc is None:
        return inv, 1.0
    kind = sc["rope_type"]
    if kind == "linear":
        return (inv / float(sc["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if kind == "yarn":
        inv, attn = _yarn(inv, dim, base, sc, cfg.max_position_embeddings)
        return inv.astype(np.float32), attn
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables ``[B, T, head_dim]`` (float32) for integer ``positions [B, T]``."""
    inv, attn = rope_inv_freq(cfg)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [B, T, Dh/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang) * attn, jnp.sin(ang) * attn


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: ``[B, T, H, Dh]``; cos/sin: ``[B, T, Dh]``. Returns ``x.dtype``."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


# Queries per attention chunk. Scores are [B, Hkv, G, T, S] float32: at T = S = 4096 that is gigabytes per layer
# (and the backward pass keeps them), so long inputs are processed in query chunks of this size, each chunk
# rematerialised in the backward pass. Short inputs (decode steps, small prefills) take the direct path.
QUERY_CHUNK = 512
# Causal self-attention splits the query chunks into this many bands; band i needs only the key prefix up to
# its end, so the work is (bands + 1) / (2 bands) of the full T x S (5/8 with 4). Within a band the chunks go
# through one lax.map, which XLA runs one at a time: scores live for one chunk, not for all of T (an unrolled
# Python loop of chunks lets XLA's scheduler keep every chunk's scores alive in the backward pass: O(T^2)).
CAUSAL_BANDS = 4


def visible(
    q_pos: jax.Array,
    k_valid: jax.Array,
    k_start: int = 0,
    q_seg: jax.Array | None = None,
    k_seg: jax.Array | None = None,
) -> jax.Array:
    """Which keys each query sees, ``[B, T, S]`` bool, built from per-row vectors where it is used (one query
    chunk at a time) instead of carried through the model: key ``k_start + s`` is visible to query ``t`` of row
    ``b`` iff it is valid (``k_valid[b, s]``), not after the query (``k_start + s <= q_pos[b, t]``) and, with
    segment ids (packed rows), in the query's segment (``k_seg[b, s] == q_seg[b, t]``).

    Args:
      q_pos: ``[B, T]`` int32, the key index (column) each query sits at. k_valid: ``[B, S]`` bool.
      q_seg, k_seg: optional ``[B, T]`` / ``[B, S]`` int32 segment ids (both or neither).
    """
    key = k_start + jnp.arange(k_valid.shape[1], dtype=jnp.int32)
    vis = (key[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if q_seg is not None:
        vis = vis & (q_seg[:, :, None] == k_seg[:, None, :])
    return vis


def _attention_dense(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_valid: jax.Array,
    q_seg: jax.Array | None = None,
    k_seg: jax.Array | None = None,
) -> jax.Array:
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    g = h // hkv
    f32 = jnp.float32
    vis = visible(q_pos, k_valid, 0, q_seg, k_seg)[:, None, None]  # [B, 1, 1, T, S]
    if sharding.target_platform() == "cpu":
        # A KV head's G query heads and T queries form one matmul dimension (M = G * T) of both dots, batched over
        # [B, Hkv]: the sums of the form below, which XLA:CPU runs faster this way (WORKSPACE "Attention's
        # matmuls with G * T rows": a forward + backward of 4 x 4,096 tokens 19.9 -> 13.6 s; the Tunix line's sampler
        # call 216 -> 211 ms, log-probabilities bit-equal).
        qg = q.astype(f32).reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
        s = jnp.einsum("bkmd,bskd->bkms", qg, k.astype(f32)).reshape(b, hkv, g, t, -1) * (dh**-0.5)
        p = jax.nn.softmax(jnp.where(vis, s, NEG_INF), axis=-1).reshape(b, hkv, g * t, -1)
        o = jnp.einsum("bkms,bskd->bkmd", p, v.astype(f32)).reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4)
    else:
        # Accelerators keep [B, T, Hkv, G, Dh] queries and outputs. The TPU compiler gives the form above more
        # temporaries: with its value dot a decode's 16-token first step onto a 32k cache on v5p:2x2x1 took 0.38
        # against 0.16 GiB (tests/test_compile_check.py; the extra is one layer's values in float32), and its
        # score dot alone took the paper's 256-row decode on v5p-64 from 0.74 to 0.85 GiB.
        qg = q.astype(f32).reshape(b, t, hkv, g, dh)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(f32)) * (dh**-0.5)
        p = jax.nn.softmax(jnp.where(vis, s, NEG_INF), axis=-1)
        o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(f32))
    return o.reshape(b, t, h * dh).astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_valid: jax.Array,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention, plain einsum + mask + softmax in float32 (query-chunked when long).

    No ``[B, T, S]`` mask is taken or kept: the visibility of a query chunk's keys is rebuilt from ``q_pos`` and
    ``k_valid`` inside the chunk (:func:`visible`), so nothing quadratic in the length outlives one chunk (a
    carried ``[B, T, T]`` bool mask is 1 GiB per row at 32k tokens, 4 GiB at 64k).

    Args:
      q: ``[B, T, H, Dh]`` queries. k, v: ``[B, S, Hkv, Dh]`` keys/values (H a multiple of Hkv).
      q_pos: ``[B, T]`` int32, each query's own key index: it sees keys ``<= q_pos`` (causal). A full forward
        passes ``arange(T)``; a cache extend passes each token's cache slot.
      k_valid: ``[B, S]`` bool, keys that exist (not padding, inside the row's filled cache).
      causal: keys are the queries' own sequence (S == T, ``q_pos = arange(T)``), so a band of query chunks only
        needs the key prefix up to its end (``CAUSAL_BANDS``).
      segment_ids: optional ``[B, T]`` int32 (self-attention only, S == T): packed rows, a query sees only keys
        of its own segment (queries and keys share the ids).
    Returns:
      ``[B, T, H * Dh]`` in ``q.dtype``. Chunking only changes the peak memory, not the result: each query row's
      softmax sees the same keys.
    """
    b, t, h, dh = q.shape
    q_pos = jnp.broadcast_to(q_pos.astype(jnp.int32), (b, t))
    k_valid = jnp.broadcast_to(k_valid.astype(bool), (b, k.shape[1]))
    seg = None
    if segment_ids is not None:
        if k.shape[1] != t:
            raise ValueError(f"segment_ids need self-attention (S == T), got T={t}, S={k.shape[1]}")
        seg = jnp.broadcast_to(segment_ids.astype(jnp.int32), (b, t))
    c = QUERY_CHUNK
    if t <= c or t % c:
        return _attention_dense(q, k, v, q_pos, k_valid, seg, seg)
    n = t // c
    if causal and k.shape[1] == t:
        bands = max(d for d in range(1, min(CAUSAL_BANDS, n) + 1) if n % d == 0)
        w = t // bands  # queries (and key-prefix growth) per band
        outs = []
        for i in range(bands):
            e = (i + 1) * w  # band i's queries see keys [:e] at most
            qs = None if seg is None else seg[:, i * w : e]
            ks = None if seg is None else seg[:, :e]
            outs.append(
                _chunked_queries(
                    q[:, i * w : e], k[:, :e], v[:, :e], q_pos[:, i * w : e], k_valid[:, :e], qs, ks
                )
            )
        return jnp.concatenate(outs, axis=1)
    return _chunked_queries(q, k, v, q_pos, k_valid, seg, seg)


def _chunked_queries(q, k, v, q_pos, k_valid, q_seg=None, k_seg=None):
    """Dense attention QUERY_CHUNK queries at a time (one lax.map, each chunk rematerialised)."""
    b, t, h, dh = q.shape
    c = QUERY_CHUNK
    n = t // c
    qc = q.reshape(b, n, c, h, dh).swapaxes(0, 1)  # [n, B, c, H, Dh]
    pc = q_pos.reshape(b, n, c).swapaxes(0, 1)  # [n, B, c]
    sc = pc if q_seg is None else q_seg.reshape(b, n, c).swapaxes(0, 1)  # [n, B, c] (unused without segments)

    def one(qps):
        qs = None if q_seg is None else qps[2]
        return _attention_dense(qps[0], k, v, qps[1], k_valid, qs, k_seg)

    out = jax.lax.map(jax.checkpoint(one), (qc, pc, sc))  # [n, B, c, H*Dh]
    return out.swapaxes(0, 1).reshape(b, t, h * dh)


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w (+ b)`` in ``x.dtype`` (the compute dtype); w is ``[in, out]``."""
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
    return y if b is None else y + b.astype(x.dtype)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """SwiGLU MLP: ``down(silu(gate x) * up x)``. x: ``[..., D]``; gate/up ``[D, F]``; down ``[F, D]``."""
    return dense(jax.nn.silu(dense(x, gate)) * dense(x, up), down)
