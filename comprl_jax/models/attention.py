"""Attention backends of the full-sequence forward (``Decoder.__call__``: training, scoring, embedding).

Every backend computes what :func:`comprl_jax.models.layers.attention` (the ``xla`` reference) computes for a
causal self-attention: query ``t`` of row ``b`` sees key ``s`` iff ``s <= t`` (column order), ``mask[b, s]`` (a
valid token) and, with segment ids (packed rows), ``segment_ids[b, s] == segment_ids[b, t]``. Rows of invalid
queries are meaningless (the decoder never reads them) and may differ between backends; valid rows and every
gradient that reaches them agree to float32 rounding (tests/test_attention_backends.py).

The choice is ``ModelConfig.attention`` (run config keys ``actor.attention`` / ``extractor.attention``), a run-time
choice that is never written to a checkpoint:

============  ==========  =====================================================  ==========================================
backend       platform    masks (causal + mask + segment ids)                    why
============  ==========  =====================================================  ==========================================
``xla``       any (CPU    everything, exactly (``layers.visible``)               the reference; 512-query chunks, f32
              default)                                                           scores: portable, O(T * 512) memory
``cudnn``     NVIDIA GPU  causal + padding: each row's valid tokens are gathered  cuDNN flash attention: no T x T scores
              (bf16/f16)  to the front (left, right or holes), then causal +      in memory, fused backward. Packed rows
                          ``key_value_seq_lengths``; segment ids as a boolean     cost a [B, 1, T, T] mask (the THD
                          ``mask`` (cuDNN adds it as a bias: O(T^2) bytes)        offsets layout is not public API)
``splash``    TPU         causal (a static ``CausalMask``: fully masked blocks   the Pallas/Mosaic kernel shipped in jax:
                          are skipped) + segment ids; padding is one more         block-sparse flash attention, fused
                          segment (invalid tokens get an id no valid one has)    masks, custom backward kernels
============  ==========  =====================================================  ==========================================

``auto`` picks by the platform the computation is compiled for: the ambient mesh's devices
(``jax.sharding.get_abstract_mesh()``, so an ahead-of-time compile for a TPU topology on a CPU host picks
``splash``), else ``jax.default_backend()``: ``tpu`` -> splash, ``gpu`` (CUDA) -> cudnn when the compute dtype is
bfloat16 / float16, everything else -> xla.

Where a backend truly cannot run, the call falls back to ``xla`` and logs the reason once:
  - ``cudnn`` with float32 q/k/v (cuDNN's flash attention takes fp16 / bf16 only), a head_dim that is not a
    multiple of 8 or above 256, or on a platform other than a GPU;
  - ``splash`` on a GPU (a Mosaic TPU kernel). On CPU it runs in Pallas' interpreter (``interpret=True``: slow,
    for the parity tests). Sequence lengths that are not a multiple of 128 are padded (the kernel's kv blocks are
    multiples of the 128 TPU lanes; the padding is its own segment and sliced off); blocks are the largest of
    512 / 256 / 128 dividing the padded length. GQA: the kernel's multi-head variant reads k/v head ``h // G``
    for query head ``h`` (H = G * Hkv), so k/v are never repeated.

Under an ambient mesh the kernels run inside ``shard_map``: rows split over the ``batch`` mesh axes and heads over
``tensor`` (where they divide), since GSPMD cannot partition a custom call (it would gather every row onto every
device).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from comprl_jax.models import layers as L
from comprl_jax.runtime import sharding

log = logging.getLogger(__name__)

BACKENDS = ("xla", "cudnn", "splash")
CHOICES = ("auto", *BACKENDS)  # models.config.ATTENTION
_LANES = 128  # TPU lane width: splash's kv blocks are multiples of it
_BLOCKS = (512, 256, 128)
_warned: set[str] = set()


def _fallback(backend: str, reason: str) -> str:
    msg = f"attention={backend!r} falls back to 'xla': {reason}"
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)
    return "xla"


def resolve(choice: str, dtype, head_dim: int, platform: str | None = None) -> str:
    """The backend that runs for config value ``choice`` (``auto`` or one of :data:`BACKENDS`) with q/k/v of
    ``dtype`` and ``head_dim`` on ``platform`` (default: :func:`comprl_jax.runtime.sharding.target_platform`); a fallback is logged once."""
    if choice not in CHOICES:
        raise ValueError(f"attention={choice!r}; use one of {CHOICES}")
    platform = platform or sharding.target_platform()
    low_precision = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if choice == "auto":
        if platform == "tpu":
            return "splash"
        if platform == "gpu" and low_precision and head_dim % 8 == 0 and head_dim <= 256:
            return "cudnn"
        return "xla"
    if choice == "cudnn":
        if platform != "gpu":
            return _fallback(choice, f"cuDNN needs an NVIDIA GPU, the target platform is {platform!r}")
        if not low_precision:
            return _fallback(choice, f"cuDNN flash attention takes bfloat16/float16, got {jnp.dtype(dtype)}")
        if head_dim % 8 or head_dim > 256:
            return _fallback(
                choice, f"cuDNN flash attention needs head_dim % 8 == 0 and <= 256, got {head_dim}"
            )
    if choice == "splash" and platform not in ("tpu", "cpu"):
        return _fallback(choice, f"splash is a Mosaic TPU kernel, the target platform is {platform!r}")
    return choice


def context_kernel(choice: str, dtype, head_dim: int, t: int, platform: str | None = None) -> bool:
    """Whether a prefill of ``t`` new tokens onto a cache's context (:func:`context_attention`) attends through a
    kernel that holds no score matrix (splash from 128 new tokens, cuDNN) rather than ``xla``'s float32 scores.
    ``choice`` / ``dtype`` / ``head_dim`` / ``platform`` as in :func:`resolve`."""
    name = resolve(choice, dtype, head_dim, platform)
    return name == "cudnn" or (name == "splash" and t >= _LANES)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """Causal self-attention of a full sequence by ``backend`` (see the module docstring).

    Args:
      q: ``[B, T, H, Dh]``. k, v: ``[B, T, Hkv, Dh]`` (H a multiple of Hkv). mask: ``[B, T]`` bool valid tokens.
      segment_ids: optional ``[B, T]`` int32 (packed rows).
      backend: ``auto`` or one of :data:`BACKENDS`.
      interpret: splash only: run the Pallas kernel in the interpreter (default: when the platform is CPU).
    Returns:
      ``[B, T, H * Dh]`` in ``q.dtype``.
    """
    b, t, h, dh = q.shape
    platform = sharding.target_platform()
    name = resolve(backend, q.dtype, dh, platform)
    mask = jnp.broadcast_to(mask.astype(bool), (b, t))
    if segment_ids is not None:
        segment_ids = jnp.broadcast_to(segment_ids.astype(jnp.int32), (b, t))
    if name == "cudnn":
        return cudnn_attention(q, k, v, mask, segment_ids)
    if name == "splash":
        return splash_attention(
            q, k, v, mask, segment_ids, interpret=platform != "tpu" if interpret is None else interpret
        )
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    return L.attention(q, k, v, q_pos, mask, causal=True, segment_ids=segment_ids)


# ----------------------------------------------------------------------------------------------------------- cudnn


def compact_order(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(order [B, T], counts [B])``: a stable permutation putting each row's valid columns first (in column
    order), and the number of valid columns. Causal among valid tokens in column order is then causal in the
    compacted order with the keys cut at ``counts`` (left padding, right padding and holes alike)."""
    order = jnp.argsort(~mask, axis=1, stable=True).astype(jnp.int32)
    return order, mask.sum(axis=1).astype(jnp.int32)


def cudnn_attention(q, k, v, mask, segment_ids=None, *, implementation: str = "cudnn") -> jax.Array:
    """``jax.nn.dot_product_attention(is_causal=True)`` on rows compacted by :func:`compact_order`.

    ``implementation="xla"`` runs the same arguments through JAX's reference (the CPU tests); ``"cudnn"`` is the
    GPU kernel. Lengths are clamped to >= 1 so a row without a valid token stays finite.
    """
    b, t, h, dh = q.shape
    order, counts = compact_order(mask)
    take = lambda x: jnp.take_along_axis(x, order[:, :, None, None], axis=1)  # noqa: E731
    qc, kc, vc = take(q), take(k), take(v)
    seg_mask = None
    if segment_ids is not None:
        sc = jnp.take_along_axis(segment_ids, order, axis=1)
        seg_mask = (sc[:, :, None] == sc[:, None, :])[:, None]  # [B, 1, T, T]
    lengths = jnp.maximum(counts, 1)
    out = jax.nn.dot_product_attention(
        qc,
        kc,
        vc,
        mask=seg_mask,
        scale=dh**-0.5,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )  # [B, T, H, Dh] in compacted order
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    out = jnp.take_along_axis(out, inverse[:, :, None, None], axis=1)
    return out.reshape(b, t, h * dh).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------- splash

# A segment id no valid token has: padding columns (invalid tokens, and the columns added to reach a multiple of
# 128) form their own segment, so causal + segments never leaves a query row without a key (the kernel needs one).
PAD_SEGMENT = -(2**31)


def block_size(t: int) -> int:
    """The largest of 512 / 256 / 128 dividing ``t`` (a multiple of 128)."""
    return next(bs for bs in _BLOCKS if t % bs == 0)


def _splash_kernel(heads: int, t: int, interpret: bool, kv_len: int | None = None):
    """The kernel for ``t`` queries over ``kv_len`` keys (default ``t``), the queries being the last ``t`` key
    columns (``CausalMask`` offset ``kv_len - t``: query ``i`` sees keys ``<= kv_len - t + i``)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    kv_len = t if kv_len is None else kv_len
    bq, bkv = block_size(t), block_size(kv_len)
    sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((t, kv_len), offset=kv_len - t) for _ in range(heads)])
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q, k, v, q_seg, kv_seg, interpret: bool):
    """The kernel on local arrays: q ``[B, T, H, Dh]``, k/v ``[B, S, Hkv, Dh]`` (``S >= T``, the queries being the
    last ``T`` key columns), q_seg ``[B, T]``, kv_seg ``[B, S]`` (T and S multiples of 128)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, h, dh = q.shape
    # Built per trace (not cached): its mask info becomes jnp arrays of the trace that builds it.
    kernel = _splash_kernel(h, t, interpret, kv_len=k.shape[1])
    qh = (q * jnp.asarray(dh**-0.5, q.dtype)).swapaxes(1, 2)  # [B, H, T, Dh]; the kernel does not scale
    kh, vh = k.swapaxes(1, 2), v.swapaxes(1, 2)
    one = lambda q_, k_, v_, qs, ks: kernel(q_, k_, v_, segment_ids=SegmentIds(q=qs, kv=ks))  # noqa: E731
    out = jax.vmap(one)(qh, kh, vh, q_seg, kv_seg)  # [B, H, T, Dh]
    return out.swapaxes(1, 2)


def _splash_sharded(fn, q, k, v, q_seg, kv_seg):
    """``fn(q, k, v, q_seg, kv_seg)`` inside ``shard_map`` under an ambient mesh (GSPMD cannot partition the
    custom call): rows over the ``batch`` axes, heads over ``tensor`` where they divide both head counts."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and not mesh.manual_axes:
        b, _, h, _ = q.shape
        rows = _axes(mesh, "batch", b)
        heads = _axes(mesh, "heads", math.gcd(h, k.shape[2]))
        qs = P(rows, None, heads, None)
        fn = jax.shard_map(
            fn, in_specs=(qs, qs, qs, P(rows, None), P(rows, None)), out_specs=qs, check_vma=False
        )
    return fn(q, k, v, q_seg, kv_seg)


def _pad_columns(x, n: int, value=0):
    """``x`` ``[B, T, ...]`` padded with ``value`` to ``n`` columns (axis 1)."""
    if x.shape[1] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def splash_attention(q, k, v, mask, segment_ids=None, *, interpret: bool = False) -> jax.Array:
    """The splash kernel (causal + segment ids; padding = :data:`PAD_SEGMENT`), in ``shard_map`` under a mesh."""
    b, t, h, dh = q.shape
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
    seg = jnp.where(mask, seg, PAD_SEGMENT)
    tp = _lanes(t)  # whole 128-lane blocks: the padding is its own segment, sliced off below
    q, k, v = (_pad_columns(x, tp) for x in (q, k, v))
    seg = _pad_columns(seg, tp, PAD_SEGMENT)
    fn = functools.partial(_splash_local, interpret=interpret)
    out = _splash_sharded(fn, q, k, v, seg, seg)[:, :t]
    return out.reshape(b, t, h * dh).astype(q.dtype)


def _lanes(n: int) -> int:
    return -(-n // _LANES) * _LANES


def _axes(mesh, logical: str, size: int):
    """The mesh axes ``logical`` maps to on ``mesh`` when their product divides ``size``, else None."""
    spec = sharding.logical_to_spec((logical,), mesh=mesh)
    if not spec or spec[0] is None:
        return None
    axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    if size % math.prod(mesh.shape[a] for a in axes):
        return None
    return spec[0]


# ------------------------------------------------------------------------------------- a prefill onto cached context


def context_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_valid: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_valid: jax.Array,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """New tokens' attention to a row's cached context and, causally, to each other (a later turn's prefill).

    Every cached position precedes every new token: query ``i`` sees the valid context keys and the valid new
    keys ``j <= i`` (:func:`comprl_jax.models.kv_cache.attention_over_cache`'s ``T > 1`` case). The keys are laid
    out as ``[context window (S) | new (T)]``, so the causal diagonal sits at the same offset ``S`` in every row
    and each backend takes the row's holes as padding:

    - ``xla``: :func:`comprl_jax.models.layers.attention` with ``q_pos = S + i`` (512-query chunks, f32 scores
      ``[B, H, 512, S + T]`` per chunk: at a 32k window that is 1.8 GiB per row and chunk for 28 heads);
    - ``splash``: the kernel with a ``CausalMask`` of offset ``S`` over ``[T, S + T]`` (both parts padded to
      128 lanes), invalid keys and queries in :data:`PAD_SEGMENT` (every query still sees its own column).
      Inputs shorter than 128 tokens keep ``xla``: the kernel would pad them to a 128-query block, and their
      f32 scores are smaller than the kernel's head-major copy of the window (a decode turn's 16-token first
      step onto a 32k cache: temp 0.16 GiB on ``xla``, 0.64 through the kernel, ``tests/test_compile_check.py``);
    - ``cudnn``: ``jax.nn.dot_product_attention`` with a ``[B, 1, T, S + T]`` boolean mask (the offset diagonal
      and the holes are not expressible by sequence lengths; the mask is 1 byte per score, not the f32 scores of
      every head), each query's own column always visible so no row is empty.

    Args:
      q: ``[B, T, H, Dh]``. k_ctx, v_ctx: ``[B, S, Hkv, Dh]``; ctx_valid ``[B, S]`` bool.
      k_new, v_new: ``[B, T, Hkv, Dh]``; new_valid ``[B, T]`` bool.
      backend: ``auto`` or one of :data:`BACKENDS` (``ModelConfig.attention``).
      interpret: splash only, as in :func:`causal_attention`.
    Returns:
      ``[B, T, H * Dh]`` in ``q.dtype`` (rows of invalid queries are meaningless).
    """
    b, t, h, dh = q.shape
    s = k_ctx.shape[1]
    platform = sharding.target_platform()
    name = resolve(backend, q.dtype, dh, platform)
    if name == "splash" and t >= _LANES:
        return splash_context(
            q, k_ctx, v_ctx, ctx_valid, k_new, v_new, new_valid,
            interpret=platform != "tpu" if interpret is None else interpret,
        )  # fmt: skip
    dt = k_ctx.dtype
    k = jnp.concatenate([k_ctx, k_new.astype(dt)], axis=1)
    v = jnp.concatenate([v_ctx, v_new.astype(dt)], axis=1)
    kv_valid = jnp.concatenate([ctx_valid, new_valid], axis=1)
    if name == "cudnn":
        return cudnn_context(q, k, v, kv_valid, s)
    q_pos = s + jnp.arange(t, dtype=jnp.int32)[None, :]
    return L.attention(q, k, v, q_pos, kv_valid)


def cudnn_context(q, k, v, kv_valid, s: int, *, implementation: str = "cudnn") -> jax.Array:
    """:func:`context_attention` by ``jax.nn.dot_product_attention`` with a boolean mask: q ``[B, T, H, Dh]`` are
    the last ``T`` of the keys ``k / v [B, S + T, Hkv, Dh]`` (``kv_valid [B, S + T]``); ``implementation="xla"``
    runs JAX's reference (the CPU tests)."""
    b, t, h, dh = q.shape
    j = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]
    own = s + jnp.arange(t, dtype=jnp.int32)[None, :, None]
    mask = (kv_valid[:, None, :] & (j <= own)) | (j == own)  # [B, T, S + T]
    out = jax.nn.dot_product_attention(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        mask=mask[:, None],
        scale=dh**-0.5,
        implementation=implementation,
    )
    return out.reshape(b, t, h * dh).astype(q.dtype)


def splash_context(q, k_ctx, v_ctx, ctx_valid, k_new, v_new, new_valid, *, interpret: bool = False):
    """:func:`context_attention` by the splash kernel (arguments as there), in ``shard_map`` under a mesh."""
    b, t, h, dh = q.shape
    s = k_ctx.shape[1]
    sp, tp = _lanes(s), _lanes(t)
    seg = lambda valid: jnp.where(valid, 0, PAD_SEGMENT).astype(jnp.int32)  # noqa: E731
    dt = q.dtype
    k = jnp.concatenate([_pad_columns(k_ctx.astype(dt), sp), _pad_columns(k_new.astype(dt), tp)], axis=1)
    v = jnp.concatenate([_pad_columns(v_ctx.astype(dt), sp), _pad_columns(v_new.astype(dt), tp)], axis=1)
    kv_seg = jnp.concatenate(
        [_pad_columns(seg(ctx_valid), sp, PAD_SEGMENT), _pad_columns(seg(new_valid), tp, PAD_SEGMENT)], axis=1
    )
    q_seg = _pad_columns(seg(new_valid), tp, PAD_SEGMENT)
    fn = functools.partial(_splash_local, interpret=interpret)
    out = _splash_sharded(fn, _pad_columns(q, tp), k, v, q_seg, kv_seg)[:, :t]
    return out.reshape(b, t, h * dh).astype(q.dtype)
