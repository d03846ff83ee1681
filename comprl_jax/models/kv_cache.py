"""KV caches for :func:`comprl_jax.models.decoder.extend`: a dense cache and a paged one, behind three operations.

======================  ===========================================  ==========================================
                        :class:`KVCache` (dense)                     :class:`PagedKVCache`
======================  ===========================================  ==========================================
storage                 ``k, v [L, B, S, Hkv, Dh]`` (on CPU: ``k [L,   ``k, v [L, Hkv, P, page, Dh]``: a pool of
                        B, Hkv, Dh, S]``, ``v [L, B, Hkv, S,         ``P`` pages; ``pages [B, W]`` maps row
                        Dh]``); row ``b`` owns ``S`` slots
                                                                     ``b``'s position ``s`` to page
                                                                     ``pages[b, s // page]``, offset
                                                                     ``s % page`` (``P`` = no page)
memory                  ``B x S`` positions (the longest row's)      the pages the host allocated: the rows'
                                                                     live tokens, rounded up to a page each
window (a turn's view)  the first ``w`` slots: a copy of ``B x w``   ``pages[:, :w // page]``: ints only
:func:`context`         ``k[layer]``, ``v[layer]`` (views)           gathers the row's ``W`` pages: ``[B, Hkv,
                                                                     W * page, Dh]``, cost follows ``W``
:func:`write`           one scatter of every layer's new keys and values after the layer scan (in place: no
                        read of the cache follows it inside a step)
======================  ===========================================  ==========================================

Why the dense cache has a CPU layout (``KVCache.keys_last``, chosen by :func:`init_cache` for the platform the
cache is built for): a decode step's scores are ``q [G, Dh] @ k [Dh, S]`` and its output ``p [G, S] @ v [S, Dh]``
per row and KV head, and XLA's CPU dots take their right operand with the contracted dim major. Stored ``[.., S,
Hkv, Dh]``, every layer of every step transposed its whole context first: at SmolLM2's shape (16 rows, 3 KV heads
x 3 queries, 4,096 positions) one layer's decode attention took 69 ms that way and 10 ms with ``k [.., Hkv, Dh,
S]`` and ``v [.., Hkv, S, Dh]``, bit-equal (WORKSPACE "Decode attention layout"). Prefill transposes the context
once per turn instead. The TPU compiler goes the other way: with the CPU layout a 16-row decode at 32k slots
needs 1.51 GiB of temporaries per chip against 0.16 (``tests/test_compile_check.py``), so TPU and GPU keep
``[L, B, S, Hkv, Dh]``.

Why the write comes after the layers: a decode step used to scatter each layer's new key into the loop-carried
``[L, B, S, Hkv, Dh]`` cache and then read that layer back for attention; XLA kept the old buffer alive for the
read and copied the whole cache around each scatter (5.5 / 21.9 / 103.9 ms per step at 256 / 1k / 4k positions for
a 4-layer toy, WORKSPACE). Now a step reads the cache (the context) and attends to the new tokens' own keys
separately (:func:`comprl_jax.models.layers.attention_with_context`), and the single scatter at the end has no
reader after it, so XLA updates the donated buffer in place.

A paged cache's decode step (``T = 1``) runs the Pallas ``paged_attention`` kernels on TPU / GPU
(``models/paged_kernels.py``): each layer writes its new key and value into the pool (:func:`write_layer`, the pool
carried through the layer scan) and the kernel attends over ``lengths + 1`` positions, since it returns no
log-sum-exp to merge the new key's softmax part with; :func:`write` then only advances ``lengths``
(``written=``). Prefills, dense caches and CPU keep the gather above (:func:`decode_kernel` says which). On CPU
the sampler's turn (``sampling.decode``) runs on a dense copy of the rows' pages instead
(:meth:`PagedKVCache.dense_turn`): one gather and one scatter per turn rather than a gather per layer and step.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from comprl_jax.models import paged_kernels
from comprl_jax.models.config import ModelConfig
from comprl_jax.runtime import sharding

# Logical axes of the dense KV cache arrays (for the sampler to place the cache on a mesh).
CACHE_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")  # k and v [L, B, S, Hkv, Dh]
K_AXES_CPU = ("layers", "batch", "kv_heads", "head_dim", "cache_length")  # keys_last: k [L, B, Hkv, Dh, S]
V_AXES_CPU = ("layers", "batch", "kv_heads", "cache_length", "head_dim")  # and v [L, B, Hkv, S, Dh]
# The paged pool [L, P, page, Hkv, Dh]: pages are not rows, so they are not split over the batch axes.
PAGED_AXES = ("layers", "kv_heads", None, None, "head_dim")
PAGE_SIZE = 64  # positions per page (SamplerService(page_size=...)); a window is a whole number of pages


@flax.struct.dataclass
class KVCache:
    """Dense KV cache pytree.

    Attributes:
      k, v: ``[L, B, S, Hkv, Dh]`` keys (after RoPE) and values; with ``keys_last`` (the CPU layout, see the
        module docstring) ``k [L, B, Hkv, Dh, S]`` and ``v [L, B, Hkv, S, Dh]``. Slot ``s`` of row ``b`` holds
        position ``s``.
      lengths: ``[B]`` int32, number of filled slots per row.
      keys_last: static; which layout ``k`` and ``v`` have.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    keys_last: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def capacity(self) -> int:
        """Positions per row the cache can hold (static)."""
        return int(self.k.shape[4] if self.keys_last else self.k.shape[2])

    @property
    def axes(self) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
        """Logical axes of ``k`` and ``v`` (for the sampler to place the cache on a mesh)."""
        return (K_AXES_CPU, V_AXES_CPU) if self.keys_last else (CACHE_AXES, CACHE_AXES)

    def window(self, w: int | None) -> KVCache:
        """The first ``w`` positions of every row (a copy; ``None`` or ``w >= S``: the cache itself)."""
        if w is None or w >= self.capacity:
            return self
        if self.keys_last:
            return self.replace(k=self.k[..., :w], v=self.v[:, :, :, :w])
        return self.replace(k=self.k[:, :, :w], v=self.v[:, :, :w])

    def unwindow(self, view: KVCache) -> KVCache:
        """``view`` (from :meth:`window`) written back into the front of this cache."""
        if view.k.shape == self.k.shape:
            return view
        zero = (0,) * self.k.ndim
        return self.replace(
            k=jax.lax.dynamic_update_slice(self.k, view.k, zero),
            v=jax.lax.dynamic_update_slice(self.v, view.v, zero),
            lengths=view.lengths,
        )


@flax.struct.dataclass
class PagedKVCache:
    """Paged KV cache pytree: a pool of pages and a page table per row (the host allocates pages; see
    :class:`comprl_jax.sampling.pages.PageTable`).

    Attributes:
      k, v: ``[L, Hkv, P, page, Dh]`` the page pool (keys after RoPE, values). Heads before pages: a row's
        gathered pages are then ``[B, Hkv, W * page, Dh]`` (:func:`context`), contiguous per row and head, the
        layout the attention dot reads without a transpose (pages-first measured 1.4x slower per decode step on
        CPU); the Pallas kernels read this pool as it is.
      pages: ``[B, W]`` int32, row ``b``'s ``i``-th page (positions ``i * page ...``); ``P`` marks no page
        (reads give zeros, writes are dropped).
      lengths: ``[B]`` int32, positions filled per row.
    """

    k: jax.Array
    v: jax.Array
    pages: jax.Array
    lengths: jax.Array

    @property
    def page_size(self) -> int:
        return int(self.k.shape[3])

    @property
    def axes(self) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
        """Logical axes of the ``k`` and ``v`` pools (no row axis: a page belongs to no row)."""
        return PAGED_AXES, PAGED_AXES

    @property
    def capacity(self) -> int:
        """Positions per row the page table can address (static)."""
        return int(self.pages.shape[1]) * self.page_size

    def window(self, w: int | None) -> PagedKVCache:
        """A view addressing the first ``w`` positions of every row: the page table's first ``w / page``
        columns. Nothing is copied; attention then gathers only those pages."""
        if w is None or w >= self.capacity:
            return self
        return self.replace(pages=self.pages[:, : -(-w // self.page_size)])

    def unwindow(self, view: PagedKVCache) -> PagedKVCache:
        """The full page table again, with ``view``'s pool and lengths."""
        return view.replace(pages=self.pages)

    def dense_turn(self) -> KVCache | None:
        """A dense copy of the rows' pages for one turn on CPU (a dense cache of the page table's width, the CPU
        layout), or None where the turn should run on the pages (TPU / GPU: the decode kernels read them in
        place). :meth:`end_dense_turn` writes it back.

        Why: without a kernel every decode step gathers every layer's pages (per step a copy of the live window);
        one gather per turn, dense steps and one scatter back cost that copy twice per turn instead (the tiny
        Tunix model's paged decode step 2.36 -> 1.95 ms, the dense cache's). Memory during the turn: the window's
        ``B x W x page`` positions, as a dense turn's window.
        """
        if sharding.target_platform() != "cpu" or decode_kernel(self, 1) is not None:
            return None
        v = gather_pages(self.v, self.pages)  # [L, B, Hkv, S, Dh]
        k = jnp.swapaxes(gather_pages(self.k, self.pages), 3, 4)  # keys_last: [L, B, Hkv, Dh, S]
        return KVCache(k=k, v=v, lengths=self.lengths, keys_last=True)

    def end_dense_turn(self, dense: KVCache) -> PagedKVCache:
        """``dense`` (from :meth:`dense_turn`, after the turn) written back into the rows' pages: every position
        below its new length (those before the turn rewrite their own values); ``lengths`` = ``dense``'s."""
        k = jnp.moveaxis(dense.k, 4, 2)  # [L, B, Hkv, Dh, S] -> [L, B, S, Hkv, Dh]
        v = jnp.swapaxes(dense.v, 2, 3)  # [L, B, Hkv, S, Dh] -> [L, B, S, Hkv, Dh]
        return write(self.replace(lengths=jnp.zeros_like(self.lengths)), k, v, dense.lengths)


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype=None, keys_last: bool | None = None
) -> KVCache:
    """An empty cache (``lengths = 0``) for ``batch`` rows of up to ``max_len`` tokens; dtype defaults to cfg.dtype.
    ``keys_last`` (default: whether the cache is built for CPU, :func:`comprl_jax.runtime.sharding.target_platform`:
    the ambient mesh's devices, else the default backend) picks the CPU layout (see :class:`KVCache`)."""
    if keys_last is None:
        keys_last = sharding.target_platform() == "cpu"
    L, h, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    dt = jnp.dtype(dtype or cfg.dtype)
    ks, vs = (
        ((L, batch, h, d, max_len), (L, batch, h, max_len, d))
        if keys_last
        else ((L, batch, max_len, h, d),) * 2
    )
    return KVCache(
        k=jnp.zeros(ks, dt),
        v=jnp.zeros(vs, dt),
        lengths=jnp.zeros((batch,), jnp.int32),
        keys_last=bool(keys_last),
    )


def init_paged_cache(
    cfg: ModelConfig, batch: int, max_len: int, num_pages: int, page_size: int = PAGE_SIZE, dtype=None
) -> PagedKVCache:
    """An empty paged cache: a pool of ``num_pages`` pages and, for ``batch`` rows of up to ``max_len`` positions
    (a multiple of ``page_size``), a page table with no page assigned (every entry ``num_pages``)."""
    if max_len % page_size:
        raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return PagedKVCache(
        k=jnp.zeros(shape, dt),
        v=jnp.zeros(shape, dt),
        pages=jnp.full((batch, max_len // page_size), num_pages, jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


# context()'s k and v dims as einsum letters (b row, k KV head, s position, d Dh), per cache layout
DENSE_SPECS = ("bskd", "bskd")
DENSE_SPECS_CPU = ("bkds", "bksd")  # KVCache.keys_last
PAGED_SPECS = ("bksd", "bksd")


def gather_pages(pool: jax.Array, pages: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """Each row's pages in position order, rows first: pool ``[..., Hkv, P, page, Dh]`` (a layer's, or every
    layer's with a leading ``L``) and page table ``[B, W]`` -> ``[..., B, Hkv, W * page, Dh]``; page id ``P`` reads
    zeros. One gather: the table's (B, W) land at the output dims before Hkv and before page. Heads-first
    (``[Hkv, B, ...]``, ``jnp.take``'s order) made the decode dot transpose every layer's gathered context on every
    step (tiny Tunix model 3.3 -> 2.4 ms a step).

    ``layer``: an int32 scalar; the pool is every layer's ``[L, Hkv, P, page, Dh]`` and the gather reads layer
    ``layer``'s pages from it (``[B, Hkv, W * page, Dh]``). ``pool[layer]`` first would copy the layer's whole
    pool out of the stack (the TPU compiler: a 128 MiB slice per layer for 16 rows of 32k positions per chip).
    """
    if layer is not None:
        _, hkv, _, ps, dh = pool.shape
        b, w = pages.shape
        # page id P is out of range: mode="fill" reads zeros for its whole [Hkv, page, Dh] slice
        at = jnp.broadcast_to(jnp.asarray(layer, pages.dtype), pages.shape)
        dims = jax.lax.GatherDimensionNumbers(
            offset_dims=(1, 3, 4), collapsed_slice_dims=(0, 2), start_index_map=(0, 2)
        )
        idx = jnp.stack([at, pages], axis=-1)  # [B, W, 2]: (layer, page)
        got = jax.lax.gather(pool, idx, dims, (1, hkv, 1, ps, dh), mode="fill", fill_value=0)
        return got.reshape(b, hkv, w * ps, dh)
    lead = pool.ndim - 4
    *pre, hkv, _, ps, dh = pool.shape
    b, w = pages.shape
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(*range(lead), lead + 1, lead + 3, lead + 4),
        collapsed_slice_dims=(lead + 1,),
        start_index_map=(lead + 1,),
    )
    got = jax.lax.gather(pool, pages[..., None], dims, (*pre, hkv, 1, ps, dh), mode="fill", fill_value=0)
    return got.reshape(*pre, b, hkv, w * ps, dh)


def context(cache, layer: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, tuple[str, str]]:
    """Layer ``layer``'s cached keys and values per row and which positions hold a token.

    Returns:
      ``(k, v, valid [B, S] bool, specs)``, ``specs`` the dims of ``k`` and ``v`` as einsum letters: dense:
      ``[B, S, Hkv, Dh]`` each (views of the cache, ``S`` its window), :data:`DENSE_SPECS`, or with ``keys_last``
      ``k [B, Hkv, Dh, S]``, ``v [B, Hkv, S, Dh]``, :data:`DENSE_SPECS_CPU`; paged: ``[B, Hkv, S, Dh]`` each,
      gathered from the pool (``S`` = the page table's columns x page size), :data:`PAGED_SPECS`.
    """
    if isinstance(cache, PagedKVCache):
        k, v = gather_pages(cache.k, cache.pages, layer), gather_pages(cache.v, cache.pages, layer)
        s, specs = k.shape[2], PAGED_SPECS
    else:
        k, v = cache.k[layer], cache.v[layer]
        specs = DENSE_SPECS_CPU if cache.keys_last else DENSE_SPECS
        s = v.shape[specs[1].index("s")]
    valid = jnp.arange(s)[None, :] < cache.lengths[:, None]
    return k, v, valid, specs


def page_slots(cache: PagedKVCache, pos: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Where positions ``pos [B, T]`` of a paged cache's rows live: ``(page, offset)``, each ``[B, T]`` int32.
    ``page`` is the pool's page count ``P`` (out of bounds: a scatter drops it) where ``valid`` is False, the
    position is past the page table, or the row has no page there."""
    ps, n_pages = cache.page_size, cache.k.shape[2]
    col = jnp.clip(pos // ps, 0, cache.pages.shape[1] - 1)
    page = jnp.take_along_axis(cache.pages, col, axis=1)
    return jnp.where(valid & (pos < cache.capacity), page, n_pages), pos % ps


def write(cache, k_new: jax.Array, v_new: jax.Array, num_new: jax.Array, written=None):
    """Appends every layer's new keys and values: column ``t < num_new[b]`` of row ``b`` goes to position
    ``lengths[b] + t``; positions past the cache (or without a page) are dropped. ``lengths += num_new``.

    Args:
      k_new, v_new: ``[L, B, T, Hkv, Dh]``. num_new: ``[B]`` int32.
      written: a paged decode step's ``(k, v)`` pools that already hold the new keys and values (the kernel
        path's :func:`write_layer` inside the layer scan): they become the cache's pools, nothing is scattered.
    """
    if written is not None:
        return cache.replace(k=written[0], v=written[1], lengths=(cache.lengths + num_new).astype(jnp.int32))
    L, b, t = k_new.shape[:3]
    pos = cache.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
    valid = jnp.arange(t)[None, :] < num_new[:, None]
    # [B, T, L, Hkv, Dh]: the (row, column) index dims first (small: T columns); the windows differ by layout below.
    upd_k, upd_v = (jnp.moveaxis(x, 0, 2) for x in (k_new, v_new))
    slot = jnp.where(valid, pos, cache.capacity)  # a dense cache's [B, T] slots; past the cache: dropped
    if isinstance(cache, PagedKVCache):
        page, off = page_slots(cache, pos, valid)
        # Layers and KV heads are batch dims of the scatter, each update one [Dh] row at (page, offset), as the
        # kernel path's write_layer. With the layers inside the window ([L, Hkv, Dh]) the TPU compiler relaid the
        # pool out for the scatter and copied K and V there and back (v5p, 4 KV heads at tensor 4: decode temp 1.0
        # GiB, the pool's size); with [Hkv, Dh] windows it did so where a chip holds 2 heads (4.0 GiB at data 2 x
        # tensor 2). This form: 0.51 GiB at tensor 1, 2 and 4 (tests/test_compile_check.py).
        hkv = cache.k.shape[1]
        idx = jnp.stack([page, off], axis=-1)  # [B, T, 2]
        # every layer and head at its row's slot: [B, T, L, Hkv, 2]
        idx = jnp.broadcast_to(idx[:, :, None, None, :], (b, t, L, hkv, 2))
        dims_k = dims_v = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(4,),  # Dh
            inserted_window_dims=(2, 3),  # one page, one offset
            scatter_dims_to_operand_dims=(2, 3),
            operand_batching_dims=(0, 1),  # layer l, head h: their own indices and updates
            scatter_indices_batching_dims=(2, 3),
        )
    elif cache.keys_last:
        idx = slot[..., None]  # [B, T, 1]

        def slot_dims(s_axis: int):  # the slot's axis: 4 in k [L, B, Hkv, Dh, S], 3 in v [L, B, Hkv, S, Dh]
            return jax.lax.ScatterDimensionNumbers(
                update_window_dims=(2, 3, 4),  # L, Hkv, Dh
                inserted_window_dims=(s_axis,),  # one slot
                scatter_dims_to_operand_dims=(s_axis,),
                # Row b of the cache takes row b's indices and updates: with rows sharded over the batch axes each
                # device writes its own rows (explicit row indices made the SPMD partitioner all-gather them).
                operand_batching_dims=(1,),
                scatter_indices_batching_dims=(0,),
            )

        dims_k, dims_v = slot_dims(4), slot_dims(3)
    else:
        # [L, B, S, Hkv, Dh] (TPU / GPU): the layers are a batch dim of the scatter like the rows, each update a
        # [Hkv, Dh] window. With the layers inside the window ([L, Hkv, Dh], as above) the TPU compiler gave the
        # decode loop's carried cache the layout that window wants (layers next to Dh) wherever a shard holds one
        # KV head (tensor parallelism = Hkv, e.g. Qwen2.5-7B at tensor 4), and copied the whole K and V into it
        # and back: temp 16.7 GiB per v5p chip for the paper's 256-row decode, 0.74 with this write.
        # [B, T, L, 1]: each layer at its row's slot
        idx = jnp.broadcast_to(slot[:, :, None, None], (b, t, L, 1))
        dims_k = dims_v = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(3, 4),  # Hkv, Dh
            inserted_window_dims=(2,),  # one slot
            scatter_dims_to_operand_dims=(2,),
            operand_batching_dims=(0, 1),  # layer l, row b: their own indices and updates (see above)
            scatter_indices_batching_dims=(2, 0),
        )
    mode = jax.lax.GatherScatterMode.FILL_OR_DROP
    k = jax.lax.scatter(cache.k, idx, upd_k.astype(cache.k.dtype), dims_k, mode=mode)
    v = jax.lax.scatter(cache.v, idx, upd_v.astype(cache.v.dtype), dims_v, mode=mode)
    return cache.replace(k=k, v=v, lengths=(cache.lengths + num_new).astype(jnp.int32))


def attention_over_cache(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_valid: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    num_new: jax.Array,
    specs: tuple[str, str] = DENSE_SPECS,
    backend: str = "xla",
) -> jax.Array:
    """Attention of new tokens to a row's cached context and, causally, to each other; nothing is written.

    Every cached position precedes every new token, so a query sees all valid context keys and the new keys at
    or before its own column (and ``< num_new``). One new token (a decode step) merges two softmax parts: the
    context's scores and its own key's, with a shared maximum, so the context is read once and never copied
    next to the new key. Longer inputs (a prefill) go through the attention backend ``backend``
    (``ModelConfig.attention``: :func:`comprl_jax.models.attention.context_attention`; ``xla`` concatenates
    context and new keys into :func:`comprl_jax.models.layers.attention`, query-chunked; splash / cuDNN never
    hold the f32 scores).

    Args:
      q: ``[B, T, H, Dh]``. k_ctx, v_ctx: a layer's context from :func:`context`, with dims ``specs`` (einsum
        letters); ctx_valid: ``[B, S]`` bool.
      k_new, v_new: ``[B, T, Hkv, Dh]``; num_new: ``[B]`` int32 valid new columns.
    Returns:
      ``[B, T, H * Dh]`` in ``q.dtype`` (rows of padding columns are meaningless).
    """
    from comprl_jax.models import layers as L

    b, t, h, dh = q.shape
    new_valid = jnp.arange(t)[None, :] < num_new[:, None]
    if t > 1:
        from comprl_jax.models import attention  # the backends (ModelConfig.attention)

        # a prefill: the context once into the row-major layout (its cost is the prefill's)
        k_ctx, v_ctx = (jnp.einsum(f"{spec}->bskd", x) for spec, x in zip(specs, (k_ctx, v_ctx), strict=True))
        return attention.context_attention(
            q, k_ctx, v_ctx, ctx_valid, k_new, v_new, new_valid, backend=backend
        )
    hkv = k_ctx.shape[specs[0].index("k")]
    f32 = jnp.float32
    kspec, vspec = specs
    qg = q.reshape(b, hkv, h // hkv, dh).astype(f32)  # [B, Hkv, G, Dh]
    scale = dh**-0.5
    # The cache's dtype meets q's in the dot with a float32 accumulator (no float32 copy of the context).
    s_ctx = (
        jnp.einsum(f"bkgd,{kspec}->bkgs", qg.astype(k_ctx.dtype), k_ctx, preferred_element_type=f32) * scale
    )
    s_ctx = jnp.where(ctx_valid[:, None, None, :], s_ctx, L.NEG_INF)
    s_new = jnp.einsum("bkgd,bkd->bkg", qg, k_new[:, 0].astype(f32)) * scale  # its own key: always visible
    m = jnp.maximum(jnp.max(s_ctx, axis=-1), s_new)
    p_ctx = jnp.exp(s_ctx - m[..., None])
    p_new = jnp.exp(s_new - m)
    den = jnp.sum(p_ctx, axis=-1) + p_new
    o = jnp.einsum(f"bkgs,{vspec}->bkgd", p_ctx, v_ctx.astype(f32))
    o = (o + p_new[..., None] * v_new[:, 0, :, None, :].astype(f32)) / den[..., None]
    return o.reshape(b, 1, h * dh).astype(q.dtype)


# ------------------------------------------------------------------------------ paged decode through a Pallas kernel


def decode_kernel(cache, t: int) -> str | None:
    """``"tpu"`` / ``"gpu"`` when a step of ``t`` new tokens per row on ``cache`` attends through that Pallas
    kernel (a paged cache's decode step on that platform, or forced: :func:`paged_kernels.forced`); None: the
    gather path (:func:`context` + :func:`attention_over_cache`)."""
    return paged_kernels.choose(cache, t)


def write_layer(cache: PagedKVCache, pools, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, num_new):
    """The kernel path's in-scan write: layer ``layer``'s new key and value of a decode step into ``pools``
    (the ``(k, v)`` pools carried through the layer scan) at position ``lengths[b]`` of each row with
    ``num_new[b] > 0``; no page there (or past the page table): dropped, as in :func:`write`.

    Args:
      pools: ``(k, v)`` each ``[L, Hkv, P, page, Dh]``. k_new, v_new: ``[B, 1, Hkv, Dh]``. num_new: ``[B]``.
    Returns:
      the updated ``(k, v)``.
    """
    page, off = (x[:, 0] for x in page_slots(cache, cache.lengths[:, None], (num_new > 0)[:, None]))

    b, hkv = page.shape[0], cache.k.shape[1]
    # Each (row, KV head) writes one [Dh] row at (layer, page, offset); the KV heads are a batch dim of the
    # scatter, as the pool's split is. A flat [L * Hkv * P, page, Dh] view of the pool (the kernels' view) merged
    # the head axis, which the pool splits over `tensor`: the TPU compiler all-gathered the whole pool for every
    # layer of every step (v5p, 4 KV heads at tensor 4: temp 2.0 GiB against the 1 GiB pool).
    idx = jnp.stack([jnp.broadcast_to(layer, page.shape).astype(jnp.int32), page, off], axis=-1)  # [B, 3]
    idx = jnp.broadcast_to(idx[:, None, :], (b, hkv, 3))
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2,),  # Dh
        inserted_window_dims=(0, 2, 3),  # one layer, page, offset
        scatter_dims_to_operand_dims=(0, 2, 3),
        operand_batching_dims=(1,),  # KV head h takes the indices and update of head h
        scatter_indices_batching_dims=(1,),
    )
    mode = jax.lax.GatherScatterMode.FILL_OR_DROP

    def put(pool, new):
        return jax.lax.scatter(pool, idx, new[:, 0].astype(pool.dtype), dims, mode=mode)

    return put(pools[0], k_new), put(pools[1], v_new)


def attention_via_kernel(
    cache: PagedKVCache, pools, layer: jax.Array, q: jax.Array, kernel: str
) -> jax.Array:
    """A decode step's attention of ``q [B, 1, H, Dh]`` by the Pallas ``kernel`` over each row's context and its
    own new key (written by :func:`write_layer` into ``pools``): ``lengths + 1`` positions (clamped to the page
    table's capacity). Returns ``[B, 1, H * Dh]`` in ``q.dtype``."""
    lengths = jnp.minimum(cache.lengths + 1, cache.capacity)
    return paged_kernels.decode_attention(q, pools[0], pools[1], layer, cache.pages, lengths, kernel=kernel)
