"""A paged cache's decode step through the Pallas paged-attention kernels (TPU: Mosaic, GPU: Triton).

``Decoder.extend`` with one new token per row (``T = 1``) on a :class:`~comprl_jax.models.kv_cache.PagedKVCache`
runs, per layer, ``jax.experimental.pallas.ops.tpu.paged_attention.paged_attention`` on TPU and
``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`` on GPU; everything else (prefills, dense
caches, CPU) keeps the pure-JAX gather path of ``models/kv_cache.py``.

Design (both kernels take ``q [B, H, Dh]``, pools ``[Hkv, P, page, Dh]``, a page table ``[B, pages_per_seq]``
and ``lengths [B]``; they attend to ``lengths`` cached positions and return no log-sum-exp):

- **The new token's own key goes into the pool first.** The gather path merges two softmax parts (the context's
  scores and the new key's); the kernels return only the normalised output, so instead each layer scatters its
  new key / value into the row's page at position ``lengths[b]`` (the slot :func:`kv_cache.write` would fill
  after the scan anyway) and the kernel runs over ``lengths + 1``. The pool is then carried through the layer
  scan (updated in place: a scatter of one ``Dh`` row per (row, KV head) into the pool viewed as ``[L * Hkv * P,
  page, Dh]``, so XLA keeps the pool's layout, the kernel's; ``[B, Hkv, Dh]`` windows of the 5-D pool made XLA
  pick another layout for the loop and copy the whole pool twice per layer around the kernel: 6 pool copies
  and 14.4 MB of temporaries against 0 and 1.0 MB for an 8.4 MB pool, v5p compile of the tiny model), and the
  after-scan write only advances
  ``lengths`` (its scatter would write the same values again). Rows with ``num_new = 0`` (idle rows of a
  batch) write nothing; the kernel still reads ``lengths + 1`` positions for them and their (meaningless)
  output sees whatever that slot holds; ``lengths + 1`` is clamped to the page table's capacity.
- **No per-layer copy of the pool: the layer and the KV head are folded into the page index.** ``cache.k[layer]``
  inside the scan is a dynamic slice that XLA would materialise as a copy of a whole layer's pool for the custom
  call (per step: the whole pool, i.e. cost following the allocation, not the live length). Instead the pool
  ``[L, Hkv, P, page, Dh]`` is reshaped (free: contiguous) to ``[1, L * Hkv * P, page, Dh]`` and every
  (row, KV head) pair becomes one kernel "sequence" with a single KV head: ``q [B * Hkv, G, Dh]`` (its ``G = H /
  Hkv`` query heads, GQA), pages ``(layer * Hkv + h) * P + pages[b]``, length ``lengths[b] + 1``. The kernel's
  work is the same as with ``Hkv`` heads (its grid walks batch x heads either way); only the live pages are read.
- **Page table padding**: entries ``P`` (no page) are clamped to page 0 of the (layer, head) before the fold;
  the kernels may DMA those pages but mask every position ``>= length``.
- **Scaling**: neither kernel scales the scores, so ``q`` is multiplied by ``Dh ** -0.5`` first, in float32. The
  TPU kernel takes that float32 ``q`` as is (it computes in float32 and reads a bf16 pool into a float32 dot,
  as the gather path does); the GPU kernel's Triton dot wants one dtype, so ``q`` is cast to the pool's dtype
  there.
- **Blocks**: TPU ``pages_per_compute_block`` = the largest power of two <= ``512 / page`` dividing the page
  table's width; GPU ``k_splits`` = the largest power of two <= 16 dividing it and ``pages_per_compute_block``
  the largest <= 8 dividing a split, ``block_h = 16`` (the kernel pads ``G`` up to it).
- **Platform constraints** (else the gather path, reason logged once): TPU (Mosaic) ``head_dim % 128 == 0`` and
  a bfloat16 pool (the kernel's page loader casts every page to bfloat16 before its float32 dots, so a float32
  pool would silently lose precision: it keeps the exact gather path); GPU (Triton) ``page`` and ``head_dim``
  powers of two, ``head_dim >= 16``. In interpret mode (tests on CPU) they are not checked.
- **Trace time**: the choice is made when ``extend`` is traced; ``jax.jit`` caches by function, so a test that
  flips :data:`KERNEL` must trace a fresh function (e.g. a new lambda), not a cached ``jit(extend)``.
- **Meshes**: a custom call cannot be partitioned by GSPMD, so under an ambient mesh the kernel runs inside
  ``shard_map``: rows over the ``batch`` axes, query / KV heads over ``tensor`` where the KV heads divide (the
  pool is split only over KV heads: ``sampling/service.cache_shardings``). The in-scan write stays outside the
  ``shard_map`` (a GSPMD scatter of ``[B, Hkv, Dh]`` into the head-split pool).

The choice (:func:`choose`): ``KERNEL = "auto"`` picks ``"tpu"`` / ``"gpu"`` by
:func:`comprl_jax.runtime.sharding.target_platform` (the ambient mesh's devices, else the default backend) and
the gather path elsewhere; tests set ``KERNEL = "tpu"`` or ``"gpu"`` (or use :func:`forced`) to run a kernel on
CPU, where it runs in Pallas' interpreter (``INTERPRET = None``: interpret when the platform is not the kernel's;
TPU: ``pltpu.force_tpu_interpret_mode()``, the TPU op exposes no ``interpret`` argument; GPU: the op's
``interpret=True``).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from comprl_jax.runtime import sharding

log = logging.getLogger(__name__)

KERNELS = ("tpu", "gpu")
CHOICES = ("auto", "gather", *KERNELS)
KERNEL = "auto"  # module switch: "auto" | "gather" | "tpu" | "gpu"
INTERPRET: bool | None = None  # None: interpret when the target platform is not the kernel's
_warned: set[str] = set()


@contextlib.contextmanager
def forced(kernel: str, interpret: bool | None = None):
    """Within the block, :func:`choose` returns ``kernel`` for every paged decode step (tests: ``"tpu"`` or
    ``"gpu"`` with ``interpret=True`` on CPU; ``"gather"`` for the pure-JAX path)."""
    global KERNEL, INTERPRET
    if kernel not in CHOICES:
        raise ValueError(f"paged kernel {kernel!r}; use one of {CHOICES}")
    prev = KERNEL, INTERPRET
    KERNEL, INTERPRET = kernel, interpret
    try:
        yield
    finally:
        KERNEL, INTERPRET = prev


def _fallback(kernel: str, reason: str) -> None:
    msg = f"paged decode kernel {kernel!r} falls back to the gather path: {reason}"
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def choose(cache, t: int) -> str | None:
    """``"tpu"`` / ``"gpu"``: the kernel a step of ``t`` new tokens per row on ``cache`` runs; None: the gather
    path (dense caches, prefills, CPU, or a shape the kernel cannot take; the last logged once)."""
    # A paged cache is the one with a page table (kv_cache imports this module: no import back).
    if not hasattr(cache, "pages") or t != 1 or KERNEL == "gather":
        return None
    if KERNEL not in CHOICES:
        raise ValueError(f"paged kernel {KERNEL!r}; use one of {CHOICES}")
    platform = sharding.target_platform()
    kernel = platform if KERNEL == "auto" else KERNEL
    if kernel not in KERNELS:
        return None
    if _interpret(kernel, platform):
        return kernel
    if kernel != platform:
        _fallback(kernel, f"the target platform is {platform!r}")
        return None
    dh, ps = int(cache.k.shape[-1]), cache.page_size
    if kernel == "tpu" and dh % 128:
        _fallback(kernel, f"Mosaic needs head_dim % 128 == 0, got {dh}")
        return None
    if kernel == "tpu" and jnp.dtype(cache.k.dtype) != jnp.dtype(jnp.bfloat16):
        _fallback(
            kernel, f"the TPU kernel reads every page as bfloat16, the pool is {jnp.dtype(cache.k.dtype)}"
        )
        return None
    if kernel == "gpu" and not (_pow2(dh) and _pow2(ps) and dh >= 16):
        _fallback(kernel, f"Triton needs power-of-two head_dim (>= 16) and page size, got {dh} and {ps}")
        return None
    return kernel


def _interpret(kernel: str, platform: str | None = None) -> bool:
    if INTERPRET is not None:
        return bool(INTERPRET)
    return (platform or sharding.target_platform()) != kernel


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _fold(k_pool, v_pool, layer, pages, lengths):
    """Pools ``[L, Hkv, P, page, Dh]`` -> ``[1, L * Hkv * P, page, Dh]`` (a reshape); page table ``[B, W]`` ->
    ``[B * Hkv, W]`` global page ids of ``layer``; lengths ``[B]`` -> ``[B * Hkv]``."""
    n_layers, hkv, n_pages, ps, dh = k_pool.shape
    b, w = pages.shape
    local = jnp.where(
        (pages >= 0) & (pages < n_pages), pages, 0
    )  # no page: any valid page (masked by length)
    base = (layer * hkv + jnp.arange(hkv, dtype=jnp.int32)) * n_pages  # [Hkv]
    idx = (base[None, :, None] + local[:, None, :]).reshape(b * hkv, w).astype(jnp.int32)
    flat = lambda x: x.reshape(1, n_layers * hkv * n_pages, ps, dh)  # noqa: E731
    return flat(k_pool), flat(v_pool), idx, jnp.repeat(lengths.astype(jnp.int32), hkv)


def _local(q, k_pool, v_pool, layer, pages, lengths, *, kernel: str, interpret: bool):
    """The kernel on local arrays: q ``[B, H, Dh]`` float32 pre-scaled, pools ``[L, Hkv, P, page, Dh]``, pages
    ``[B, W]`` (``P`` = none), lengths ``[B]`` (positions to attend, incl. the new one). -> ``[B, H, Dh]``."""
    b, h, dh = q.shape
    hkv, w = k_pool.shape[1], pages.shape[1]
    kp, vp, idx, lens = _fold(k_pool, v_pool, layer, pages, lengths)
    qf = q.reshape(b * hkv, h // hkv, dh)
    if kernel == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        ppcb = _largest_pow2_divisor(w, max(1, 512 // k_pool.shape[3]))
        call = functools.partial(paged_attention, qf, kp, vp, lens, idx, pages_per_compute_block=ppcb)
        if interpret:
            from jax.experimental.pallas import tpu as pltpu

            with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
                out = call()
        else:
            out = call()
    else:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        splits = _largest_pow2_divisor(w, 16)
        ppcb = _largest_pow2_divisor(w // splits, 8)
        out = paged_attention(
            qf.astype(kp.dtype),
            kp,
            vp,
            idx,
            lens,
            block_h=16,
            pages_per_compute_block=ppcb,
            k_splits=splits,
            interpret=interpret,
        )
    return out.reshape(b, h, dh)


def decode_attention(q, k_pool, v_pool, layer, pages, lengths, *, kernel: str) -> jax.Array:
    """Attention of a decode step's query to ``lengths[b]`` positions of row ``b`` (the new key already written
    at ``lengths[b] - 1``) by the Pallas kernel ``kernel`` (``"tpu"`` / ``"gpu"``), in ``shard_map`` under a mesh.

    Args:
      q: ``[B, 1, H, Dh]``. k_pool, v_pool: ``[L, Hkv, P, page, Dh]``. layer: int32 scalar. pages: ``[B, W]``.
      lengths: ``[B]`` int32 (1 .. W * page).
    Returns:
      ``[B, 1, H * Dh]`` in ``q.dtype``.
    """
    from comprl_jax.models.attention import _axes

    b, _, h, dh = q.shape
    hkv = k_pool.shape[1]
    qs = q[:, 0].astype(jnp.float32) * jnp.float32(dh**-0.5)  # the kernels do not scale
    fn = functools.partial(_local, kernel=kernel, interpret=_interpret(kernel))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and not mesh.manual_axes:
        rows = _axes(mesh, "batch", b)
        heads = _axes(mesh, "kv_heads", hkv)
        if heads is not None and _axes(mesh, "heads", h) != heads:
            heads = None
        pool = P(None, heads, None, None, None)
        fn = jax.shard_map(
            fn,
            in_specs=(P(rows, heads, None), pool, pool, P(), P(rows, None), P(rows)),
            out_specs=P(rows, heads, None),
            check_vma=False,
        )
    out = fn(qs, k_pool, v_pool, jnp.asarray(layer, jnp.int32), pages, lengths.astype(jnp.int32))
    return out.reshape(b, 1, h * dh).astype(q.dtype)
