"""The sampler service: :class:`SamplerService` (one model's weights, jitted generation under a lock) and
:class:`Conversation` (multi-turn, token in / token out, on a live KV cache). The package docstring
(:mod:`comprl_jax.sampling`) gives the API and the threading contract."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.runtime import sharding as shd
from comprl_jax.sampling.automaton import (
    TokenAutomaton,
    either,
    from_actions,
    from_regex,
    from_strings,
    from_token_sequences,
)
from comprl_jax.sampling.decode import (
    GenerationResult,
    make_decode_fn,
    row_keys,
)
from comprl_jax.sampling.filters import SamplingParams
from comprl_jax.sampling.pages import PageTable
from comprl_jax.sampling.stops import StopAutomaton, build_stop_automaton

# Smallest cache window a multi-turn turn runs on, and the size a conversation's cache starts at (the two agree, so
# a grown cache is exactly the window the turn would have sliced out of a larger one).
MIN_CACHE_SLOTS = 256


def bucket(n: int, minimum: int = 8, multiple: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)``, rounded up to a multiple of ``multiple``."""
    b = 1 << (max(int(n), int(minimum), 1) - 1).bit_length()
    return -(-b // multiple) * multiple


def cache_shardings(mesh, cfg, cache):
    """Shardings of a KV cache pytree (arrays or ShapeDtypeStructs) on ``mesh``, from the cache's logical axes
    (``cache.axes``, whatever its layout): dense ``k`` / ``v`` with rows over the batch axes and KV heads over
    ``tensor`` when they divide; ``lengths [B]`` over the batch axes. A paged cache's pool ``[L, Hkv, P, page, Dh]``
    splits only its KV heads (pages belong to no row); its page table ``[B, W]`` follows the rows."""
    kv_ok = getattr(cfg, "num_kv_heads", 0) % mesh.shape.get("tensor", 1) == 0

    def named(axes):
        return shd.named_sharding(mesh, tuple(None if a == "kv_heads" and not kv_ok else a for a in axes))

    k_axes, v_axes = cache.axes
    out = cache.replace(k=named(k_axes), v=named(v_axes), lengths=named(("batch",)))
    return out.replace(pages=named(("batch", None))) if hasattr(cache, "pages") else out


PREFILL_TOKENS = 16384  # SamplerService's default prefill_tokens


def prefill_groups(
    rows: int,
    width: int,
    prefill_tokens: int = PREFILL_TOKENS,
    multiple: int = 1,
    context_kernel: bool = False,
) -> int:
    """Row groups for a turn's input of ``rows x width`` tokens: halved while a group's share of one batch shard
    (``rows / groups / multiple`` rows, ``multiple`` the mesh's batch shards) exceeds ``prefill_tokens`` tokens
    (0 = one group) and each half still holds a multiple of ``multiple``. ``context_kernel``: the input attends to
    a cache's context through a kernel with no score matrix (``attention.context_kernel``): one group.

    A prefill onto context through splash (from 128 new tokens) or cuDNN takes one group: the groups bound the
    ``xla`` scores, which it does not have, and each group would copy its rows' share of the cache for the kernel
    (the TPU compiler: v5p-64 7B actor prefill, 256 rows x 2k onto 32k at tensor 2, temp 12.8 GiB in 2 groups,
    4.3 in one; tensor 4 6.6 in 4, 4.8 in one). A fresh prefill (``context_kernel`` False) keeps the budget: it
    reads no cache, and its groups bound the activations (the 4B extractor's 64 x 16k at tensor 4: 9.4 GiB in 8
    groups, 10.1 in one).

    The budget is per batch shard because the buffers it bounds are: each device holds its own rows' activations
    and (``xla`` attention) scores, and each group re-reads the weights. Per mesh, a pod split into groups of one
    row per chip whatever its memory (v5p-64 actor prefill, 256 rows x 2k onto a 32k cache: 8 groups, temp 16.0
    GiB; per shard, with ``decode.prefill``'s loop that does not carry the cache: one group, 3.7 GiB)."""
    if context_kernel:
        return 1
    g = 1
    while (
        prefill_tokens
        and (rows // g // multiple) * width > prefill_tokens
        and rows % (2 * g) == 0
        and (rows // (2 * g)) % multiple == 0
    ):
        g *= 2
    return g


def reads_context_through_kernel(cfg, width: int, fresh: bool) -> bool:
    """Whether a turn's input of ``width`` tokens attends to a cache's context (not ``fresh``) through a kernel
    with no score matrix (``attention.context_kernel`` for ``cfg``'s attention on the ambient mesh's platform):
    :func:`prefill_groups`' ``context_kernel``, for the service and ``launch/compile_check.py`` alike."""
    if fresh:
        return False
    from comprl_jax.models import attention  # lazy, as _decoder()

    return attention.context_kernel(cfg.attention, cfg.dtype, cfg.head_dim, width)


KV_CACHES = ("dense", "paged")


def _decoder():
    from comprl_jax.models import decoder  # lazy: keeps this module importable without the model layer

    return decoder


def _model_fns():
    return _decoder().extend, _decoder().init_cache


LAYER_BUFFERS = ("auto", "stacked", "per_layer")
# Where the host does not say (no sysfs): the last-level cache of the 2-core AMD EPYC this was measured on.
DEFAULT_LLC_BYTES = 32 * 2**20


def on_cpu(tree) -> bool:
    """Whether ``tree``'s (first) array lives on CPU devices (False for abstract leaves: an AOT compile)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and isinstance(leaves[0], jax.Array) and leaves[0].devices().pop().platform == "cpu"


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """Size of the host CPU's largest cache (Linux sysfs, cpu0), else :data:`DEFAULT_LLC_BYTES`."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else DEFAULT_LLC_BYTES


def auto_layer_buffers(params, default_model: bool) -> str:
    """``layer_buffers="auto"``: "per_layer" for weights on CPU whose one layer outgrows the last-level cache,
    else "stacked".

    Why (decode steps measured on a 2-core EPYC with 32 MiB of L3, 2026-12-06): a layer ``scan`` copies each
    layer's weights out of the stacks before its matmuls. Where a layer fits the cache, that copy streams the
    weights in faster than the matmul reads them itself, and the matmuls then hit the cache: the scan is faster
    (tiny 4 x 256 model 2.0 against 2.7 ms, SmolLM2-135M's shape, 14 MB a layer, 55 against 61 ms). Where it
    does not fit, the copy is one more pass over memory: the 8 x 1,024 model (50 MB a layer) 57 -> 36 ms,
    Qwen2.5-0.5B's shape (60 MB) 165 -> 92 ms with one buffer per layer.
    """
    if not default_model or not on_cpu(params):
        return "stacked"
    per_layer = _decoder().bytes_per_layer(params)
    return "per_layer" if per_layer > last_level_cache_bytes() else "stacked"


def _paged_fns():
    from comprl_jax.models import kv_cache

    return kv_cache.init_paged_cache, kv_cache.PAGE_SIZE


class SamplerService:
    """Owns one model (graphdef, params, config) and its compiled generation function.

    Args:
      graphdef: the model's NNX graph definition.
      params: its parameters (``nnx.State``; sharded already when a mesh is used).
      cfg: the model's ``ModelConfig`` (``init_cache`` needs it).
      vocab: ``[V]`` bytes per token id (:func:`vocab_bytes`); needed for stop strings and constraints.
      stop_token_ids: ids that end a reply (EOS, ``<|im_end|>``).
      pad_id: filler id for padding (inputs and outputs).
      mesh: optional device mesh; batch rows are sharded over its ``batch`` axes.
      extend_fn / init_cache_fn: the model layer's ``extend`` / ``init_cache`` (defaults:
        ``comprl_jax.models.decoder``); another model layer may pass its own with the same signature
        (``extend(graphdef, params, cache, tokens, num_new, logits_at, fresh=, write=) -> ([B, V] logits, cache)``;
        ``write=False`` returns the unwritten new keys and values in place of the cache, for the prefill's row
        groups, ``sampling.decode.prefill``).
      wrap: optional decorator for the traced function (tests: ``chex.assert_max_traces(n=...)``).
      prefill_tokens: a turn's input goes through the model in row groups of at most this many (padded) tokens
        per batch shard (halving the group while a shard's ``rows x width`` exceeds it; 0 = all rows at once). The prefill's attention
        buffers scale with the group: SmolLM2 at 32 rows x 2k tokens needs 4.4 GiB of XLA temp in one group and
        1.8 GiB in groups of 8 rows (``tests/test_sampling_memory.py``). Turns of a few hundred tokens are one group.
      kv_cache: "dense" (``[L, B, S, Hkv, Dh]``, on CPU ``KVCache.keys_last``; rows grow together) or "paged" (a page pool and a page table per
        row, ``models/kv_cache.py``): a :class:`Conversation` then allocates pages to the tokens its rows hold
        (:class:`~comprl_jax.sampling.pages.PageTable`), and each step gathers the pages of the live window. Same
        tokens and log-probabilities either way. :meth:`new_cache` gives a paged cache with every page assigned.
      page_size: positions per page of a paged cache.
      layer_buffers: how the service holds the model's layer weights. "stacked": as given (``[L, ...]``, read by
        a layer ``scan``); "per_layer": its own copy with one buffer per layer (``decoder.unstack_layers``, made
        again by :meth:`update_params`), which ``extend`` reads with a loop over the layers, so XLA:CPU no longer
        copies every layer's weights out of the stacks on every decode step; "auto" (default): per_layer for
        weights on CPU whose one layer outgrows the last-level cache (:func:`auto_layer_buffers`), else stacked
        (TPU and GPU, whose compilers read a scan's slices in place and keep its flat compile time).
    """

    def __init__(
        self,
        graphdef: Any,
        params: Any,
        cfg: Any,
        *,
        vocab: Sequence[bytes] | None = None,
        stop_token_ids: Sequence[int] = (),
        pad_id: int = 0,
        mesh: Any = None,
        extend_fn: Any = None,
        init_cache_fn: Any = None,
        wrap: Any = None,
        prefill_tokens: int = PREFILL_TOKENS,
        kv_cache: str = "dense",
        page_size: int = 0,
        layer_buffers: str = "auto",
    ):
        if kv_cache not in KV_CACHES:
            raise ValueError(f"SamplerService kv_cache={kv_cache!r}; use one of {KV_CACHES}")
        if layer_buffers not in LAYER_BUFFERS:
            raise ValueError(f"SamplerService layer_buffers={layer_buffers!r}; use one of {LAYER_BUFFERS}")
        if layer_buffers == "per_layer" and extend_fn is not None:
            raise ValueError(
                "SamplerService layer_buffers='per_layer' needs the default model layer (decoder.extend); with "
                "a custom extend_fn use 'stacked'"
            )
        self.kv_cache = kv_cache
        self.page_size = int(page_size) or _paged_fns()[1]
        if layer_buffers == "auto":
            layer_buffers = auto_layer_buffers(params, extend_fn is None)
        self.layer_buffers = layer_buffers
        if extend_fn is None or init_cache_fn is None:
            default_extend, default_init = _model_fns()
            extend_fn = extend_fn or default_extend
            init_cache_fn = init_cache_fn or default_init
        self.graphdef, self.params, self.cfg = graphdef, self._own(params), cfg
        self.vocab = list(vocab) if vocab is not None else None
        self.stop_token_ids = tuple(sorted({int(i) for i in stop_token_ids}))
        self.pad_id = int(pad_id)
        self.mesh = mesh
        self._init_cache = init_cache_fn
        self.extend_fn = extend_fn  # the slot engine (:mod:`.slots`) jits its own functions around it
        self._fn = make_decode_fn(extend_fn, wrap)
        self._lock = threading.Lock()
        self._batch_multiple = 1
        self.prefill_tokens = int(prefill_tokens)
        if mesh is not None:
            spec = shd.logical_to_spec(("batch",), mesh=mesh)
            axes = spec[0] if spec else None
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            self._batch_multiple = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1

    # -- set-up ----------------------------------------------------------------------------------------
    @property
    def owns_params(self) -> bool:
        """Whether the service holds its own copy of the weights (``layer_buffers="per_layer"``): a caller that
        donates the weights it passed in (an update) need not copy them first."""
        return self.layer_buffers == "per_layer"

    def _own(self, params: Any) -> Any:
        return _decoder().unstack_layers(params) if self.layer_buffers == "per_layer" else params

    def update_params(self, params: Any) -> None:
        """Swaps in new weights (e.g. after an RL update); same tree structure and shardings (per_layer: copied
        into one buffer per layer, asynchronously)."""
        params = self._own(params)
        with self._lock:
            self.params = params

    def _need_vocab(self, what: str) -> list[bytes]:
        if self.vocab is None:
            raise ValueError(
                f"SamplerService.{what} needs vocab= (token bytes), e.g. vocab_bytes(tokenizer, V)"
            )
        return self.vocab

    def replicate(self, tree):
        """``tree``'s leaves on device, replicated over the mesh (tables the jitted calls read, e.g. automata)."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    @functools.lru_cache(maxsize=32)  # noqa: B019 -- the service lives as long as its caches should
    def stop_automaton(self, stop_strings: tuple[str, ...]) -> StopAutomaton:
        """Device tables for ``stop_strings`` (cached per tuple)."""
        return self.replicate(build_stop_automaton(stop_strings, self._need_vocab("stop_automaton")))

    @functools.lru_cache(maxsize=32)  # noqa: B019
    def regex_constraint(self, pattern: str) -> TokenAutomaton:
        """Device automaton for a regex (``outlines-core``), allowing ``stop_token_ids`` at accepting states."""
        return self.replicate(from_regex(pattern, self._need_vocab("regex_constraint"), self.stop_token_ids))

    @functools.lru_cache(maxsize=32)  # noqa: B019
    def strings_constraint(self, strings: tuple[str, ...]) -> TokenAutomaton:
        """Device automaton accepting exactly one of ``strings`` (e.g. the action set)."""
        return self.replicate(
            from_strings(strings, self._need_vocab("strings_constraint"), self.stop_token_ids)
        )

    @functools.lru_cache(maxsize=32)  # noqa: B019
    def sequences_constraint(self, sequences: tuple[tuple[int, ...], ...], regex: str = "") -> TokenAutomaton:
        """Device automaton for exactly these token paths (:func:`from_token_sequences`: one tokenization each),
        or, with ``regex``, for those paths or the regex (any tokenization; :func:`either`)."""
        V = len(self._need_vocab("sequences_constraint"))
        auto = from_token_sequences(sequences, V, self.stop_token_ids)
        if regex:
            auto = either(auto, from_regex(regex, self.vocab, self.stop_token_ids))
        return self.replicate(auto)

    @functools.lru_cache(maxsize=32)  # noqa: B019
    def actions_constraint(
        self, actions: tuple[str, ...], template: str = "<answer>{}</answer>"
    ) -> TokenAutomaton:
        """Device automaton for a static action set in ``template``, each action in every natural spelling
        (:func:`~comprl_jax.sampling.automaton.action_spellings`: ``south-east`` / ``south east`` too)."""
        return self.replicate(
            from_actions(actions, self._need_vocab("actions_constraint"), self.stop_token_ids, template)
        )

    def batch_bucket(self, n: int) -> int:
        return bucket(n, minimum=1, multiple=self._batch_multiple)

    def new_cache(self, batch: int, max_len: int):
        """An empty KV cache ``[L, batch, max_len, ...]``, created sharded over the batch axes under a mesh.
        Paged (``kv_cache="paged"``): ``max_len`` rounded up to whole pages, every row given its own pages."""
        if self.kv_cache == "paged":
            n = -(-int(max_len) // self.page_size)
            table = np.arange(batch * n, dtype=np.int32).reshape(batch, n)
            cache = self.new_paged(batch, n * self.page_size, batch * n)
            return cache.replace(pages=self._put(table))
        with self._mesh_ctx():
            return self._cache_maker(int(batch), int(max_len))()

    def new_paged(self, batch: int, max_len: int, num_pages: int):
        """An empty paged cache: a pool of ``num_pages`` pages, ``batch`` rows of up to ``max_len`` positions (a
        multiple of ``page_size``) with no page assigned (:class:`~comprl_jax.sampling.pages.PageTable` assigns)."""
        with self._mesh_ctx():
            return self._paged_maker(int(batch), int(max_len), int(num_pages))()

    def grow_pool(self, cache, num_pages: int):
        """A paged ``cache`` whose pool has ``num_pages`` pages, the old pages copied to the same indices."""
        new = self.new_paged(cache.lengths.shape[0], cache.capacity, num_pages)
        new = new.replace(pages=cache.pages, lengths=cache.lengths)
        with self._lock, self._mesh_ctx():
            return _grow_fn(jax.tree.map(lambda x: x.sharding, new))(cache, new)

    def reserve_pages(self, cache, pages, needs: dict[int, int]):
        """Pages of ``pages`` (a :class:`~comprl_jax.sampling.pages.PageTable`) for ``needs[b]`` positions of row
        ``b``; the pool of the paged ``cache`` doubles until they fit. Returns the cache (grown or the same); the
        device copy of the page table is the caller's to refresh."""
        short = pages.missing(needs)
        if short:
            size = pages.num_pages
            while size - pages.num_pages < short:
                size *= 2
            cache = self.grow_pool(cache, size)
            pages.grow_to(size)
        pages.reserve(needs)
        return cache

    @functools.lru_cache(maxsize=16)  # noqa: B019 -- one compiled zeros-maker per pool shape
    def _paged_maker(self, batch: int, max_len: int, num_pages: int):
        init_paged = _paged_fns()[0]
        make = functools.partial(init_paged, self.cfg, batch, max_len, num_pages, self.page_size)
        if self.mesh is None:
            return jax.jit(make)
        return jax.jit(make, out_shardings=cache_shardings(self.mesh, self.cfg, jax.eval_shape(make)))

    def grow_cache(self, cache, max_len: int):
        """``cache`` with room for ``max_len`` tokens per row: its contents copied into the front of a new empty
        cache (same batch, same sharding). The old cache's buffers are freed once the caller drops it."""
        new = self.new_cache(cache.lengths.shape[0], max_len)
        with self._lock, self._mesh_ctx():
            return _grow_fn(jax.tree.map(lambda x: x.sharding, new))(cache, new)

    @functools.lru_cache(maxsize=16)  # noqa: B019 -- one compiled zeros-maker per cache shape
    def _cache_maker(self, batch: int, max_len: int):
        make = functools.partial(self._init_cache, self.cfg, batch, max_len)
        if self.mesh is None:
            return jax.jit(make)

        return jax.jit(make, out_shardings=cache_shardings(self.mesh, self.cfg, jax.eval_shape(make)))

    def prefill_groups(self, rows: int, width: int, fresh: bool = False) -> int:
        """Row groups for a turn's input of ``rows x width`` tokens (:func:`prefill_groups`); ``fresh``: onto an
        empty cache (``run(fresh=True)``), else onto context (one group where that attends through a kernel)."""
        with self._mesh_ctx():  # the platform is the mesh's devices'
            kernel = reads_context_through_kernel(self.cfg, width, fresh)
        return prefill_groups(rows, width, self.prefill_tokens, self._batch_multiple, kernel)

    def _mesh_ctx(self):
        # The model reads the ambient mesh (jax.set_mesh) to pin activations to the batch axes.
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _put(self, x: np.ndarray):
        return jnp.asarray(x) if self.mesh is None else shd.put_batch(x, self.mesh)

    # -- generation ------------------------------------------------------------------------------------
    def run(
        self,
        cache,
        rows: Sequence[Sequence[int]],
        max_new: Sequence[int],
        key,
        sp: SamplingParams,
        stop_strings: Sequence[str] = (),
        constraint: TokenAutomaton | None = None,
        context_need: int | None = None,
        key_ids: Sequence[tuple[int, int]] | None = None,
        fresh: bool = False,
    ) -> GenerationResult:
        """One jitted turn on an existing cache (its batch dim ``Bp >= len(rows)``); returns device arrays.

        ``rows[b]`` are the new input ids of row ``b`` (empty = idle row); rows past ``len(rows)`` are idle.
        ``context_need``: the most cache slots any row occupies after this turn (cached + new + max_new). When
        given, the turn runs on a power-of-two window of the cache that covers it (compiled once per window
        bucket), so attention costs scale with the live context rather than the cache capacity.
        ``key_ids``: ``(a, b)`` per row: row ``i`` samples with its own key ``fold_in(fold_in(key, a), b)``
        (:func:`~comprl_jax.sampling.decode.row_keys`, as the slot engine does), so its tokens depend on its
        context and ids only, not on the batch; default: one key for the batch.
        ``fresh``: the cache is empty (every row's length 0, e.g. just made by :meth:`new_cache`); the prompt then
        attends among its own tokens only, not to the cache's empty slots (``decode(fresh=True)``). Wrong logits if
        a row has context.
        """
        Bp = cache.lengths.shape[0]
        if len(rows) > Bp:
            raise ValueError(f"{len(rows)} rows do not fit a cache of batch {Bp}")
        T = bucket(max((len(r) for r in rows), default=1), minimum=16)
        toks = np.full((Bp, T), self.pad_id, np.int32)
        num_new = np.zeros((Bp,), np.int32)
        mx = np.zeros((Bp,), np.int32)
        for b, r in enumerate(rows):
            toks[b, : len(r)] = r
            num_new[b] = len(r)
            mx[b] = max_new[b] if len(r) else 0
        if mx.max(initial=0) > sp.max_new_tokens:
            raise ValueError(
                f"max_new {int(mx.max())} exceeds SamplingParams.max_new_tokens={sp.max_new_tokens}"
            )
        stops = self.stop_automaton(tuple(stop_strings)) if stop_strings else None
        if key_ids is not None:
            if len(key_ids) != len(rows):
                raise ValueError(f"key_ids has {len(key_ids)} entries for {len(rows)} rows")
            ids = np.zeros((Bp, 2), np.int32)
            ids[: len(rows)] = np.asarray(key_ids, np.int32).reshape(len(rows), 2)
            key = _row_keys(key, self._put(ids))
        S = cache.capacity
        window = None
        if context_need is not None:
            window = min(S, bucket(context_need, minimum=MIN_CACHE_SLOTS))
            window = None if window >= S else window
        with self._lock, self._mesh_ctx():
            args = (self._put(toks), self._put(num_new), self._put(mx), key, stops, constraint)
            return self._fn(
                self.graphdef, self.params, cache, *args, **self._static(sp, window, Bp, T, fresh)
            )

    def _static(self, sp: SamplingParams, window, rows: int, width: int, fresh: bool = False) -> dict:
        return dict(
            sp=sp,
            stop_ids=self.stop_token_ids,
            pad_id=self.pad_id,
            window=window,
            prefill_groups=self.prefill_groups(rows, width, fresh),
            fresh=fresh,
        )

    def lower(
        self,
        cache,
        width: int,
        key,
        sp: SamplingParams,
        stops=None,
        constraint=None,
        window=None,
        fresh: bool = False,
    ):
        """The jitted turn of :meth:`run` lowered (AOT, nothing runs) for a cache (arrays or abstract, e.g.
        ``jax.ShapeDtypeStruct`` with shardings) and ``width`` new input tokens per row, under the sampler's mesh
        and with its weights' layout. ``launch/compile_check.py`` and the HLO tests compile what it returns."""
        rows = cache.lengths.shape[0]
        batch = None if self.mesh is None else shd.named_sharding(self.mesh, ("batch",))

        def arr(shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch)

        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            self.params,
        )
        with self._mesh_ctx():
            return self._fn.lower(
                self.graphdef,
                params,
                cache,
                arr((rows, width)),
                arr((rows,)),
                arr((rows,)),
                key,
                stops,
                constraint,
                **self._static(sp, window, rows, width, fresh),
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        sp: SamplingParams,
        *,
        max_new: int | Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
        constraint: TokenAutomaton | None = None,
    ) -> GenerationResult:
        """Single-turn batched generation from token-id prompts (a fresh cache); numpy results for the rows.

        Args:
          prompts: ``B`` lists of ids (ragged, each non-empty).
          key: PRNG key.
          sp: sampling settings; ``sp.max_new_tokens`` is the output width ``N``.
          max_new: per-row limits (default ``sp.max_new_tokens``).
          stop_strings: texts that end a row (detected on device, incl. across tokens).
          constraint: optional token automaton (:meth:`regex_constraint` / :meth:`strings_constraint`).
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        B = len(prompts)
        mx = _per_row(max_new, B, sp.max_new_tokens)
        T = bucket(max(len(p) for p in prompts), minimum=16)
        cache = self.new_cache(self.batch_bucket(B), T + sp.max_new_tokens)
        return self.run(cache, prompts, mx, key, sp, stop_strings, constraint, fresh=True).to_numpy(B)

    def conversation(self, batch: int, max_len: int) -> Conversation:
        return Conversation(self, batch, max_len)


_row_keys = jax.jit(row_keys)

_GROWERS: dict[Any, Any] = {}


def _grow_fn(shardings):
    """Jitted copy of a cache into the front of a larger one (donated: the output reuses its buffers)."""
    key = jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings))
    if key not in _GROWERS:

        def grow(old, new):
            def one(o, n):
                return o if o.shape == n.shape else jax.lax.dynamic_update_slice(n, o, (0,) * n.ndim)

            return jax.tree.map(one, old, new)

        _GROWERS[key] = jax.jit(grow, donate_argnums=1, out_shardings=shardings)
    return _GROWERS[key]


def _per_row(max_new, B: int, default: int) -> list[int]:
    if max_new is None:
        return [default] * B
    if isinstance(max_new, int | np.integer):
        return [int(max_new)] * B
    if len(max_new) != B:
        raise ValueError(f"max_new has {len(max_new)} entries for {B} rows")
    return [int(m) for m in max_new]


class Conversation:
    """``batch`` multi-turn episodes on one live KV cache, token in / token out.

    The context of row ``b`` is held as token ids (``ids[b]``) with an assistant mask (1 on sampled tokens, 0 on
    prompt / observation tokens); generated text is never re-tokenised. Each :meth:`turn` appends the new input
    tokens (plus the previous turn's last sampled token, which the decode loop has not fed yet) to the cache with
    one incremental prefill, then generates.

    Args:
      service: the :class:`SamplerService` to run on.
      batch: number of episodes.
      max_len: the most tokens a row may hold (prompt + all turns); exceeding it raises naming the row.

    The cache starts at ``min(max_len, 256)`` slots per row and grows to the next power of two (capped at
    ``max_len``) when a turn needs more, so its memory follows the longest live context, not ``max_len``:
    ``[L, B, S, Hkv, Dh]`` (or the CPU layout, the same size) twice in the model's dtype (SmolLM2, 32 rows: 1.5 GB per 1,024 slots in float32;
    12 GB at ``max_len`` 8,192). Growing copies the cache once per bucket (at most ``log2(max_len / 256)``
    times per conversation) and a turn compiles once per cache length, as the attention window did before.
    """

    MIN_CACHE = MIN_CACHE_SLOTS

    def __init__(self, service: SamplerService, batch: int, max_len: int):
        self.service = service
        self.batch = int(batch)
        self.max_len = int(max_len)
        rows = service.batch_bucket(batch)
        self.pages = None
        if service.kv_cache == "paged":
            # The page table addresses max_len positions per row from the start; the pool holds the pages the
            # rows' tokens fill (MIN_CACHE positions per row to begin with) and doubles when they need more.
            ps = service.page_size
            cap = -(-self.max_len // ps) * ps
            first = rows * (-(-min(self.max_len, self.MIN_CACHE) // ps))
            self.pages = PageTable(rows, cap, ps, first)
            self.cache = service.new_paged(rows, cap, first)
        else:
            self.cache = service.new_cache(rows, min(self.max_len, self.MIN_CACHE))
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.mask: list[list[int]] = [[] for _ in range(batch)]
        self.lps: list[list[float]] = [[] for _ in range(batch)]  # sampling-time logprobs, 0.0 off the mask
        self.cached = [0] * batch  # ids[b][:cached[b]] are in the cache

    @property
    def cache_len(self) -> int:
        """Slots per row the cache holds now (dense: grows with the context, up to ``max_len``; paged: the page
        table's reach, ``max_len`` in whole pages)."""
        return int(self.cache.capacity)

    def tokens(self, b: int) -> tuple[list[int], list[int]]:
        """Row ``b``'s full token context and assistant mask (for the trainer)."""
        return list(self.ids[b]), list(self.mask[b])

    def logprobs(self, b: int) -> list[float]:
        """Row ``b``'s per-token logprobs at sampling time (aligned with ``tokens(b)``; 0.0 where mask is 0)."""
        return list(self.lps[b])

    def turn(
        self,
        new_tokens: Sequence[Sequence[int] | None],
        key: jax.Array,
        sp: SamplingParams,
        *,
        max_new: int | Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
        constraint: TokenAutomaton | None = None,
        key_ids: Sequence[tuple[int, int]] | None = None,
    ) -> GenerationResult:
        """Appends ``new_tokens[b]`` to row ``b`` and generates its reply; ``None`` = row sits this turn out.

        ``key_ids``: per-row sampling keys (see :meth:`SamplerService.run`), one ``(a, b)`` per row.
        Returns numpy results for the ``batch`` rows (idle rows have length 0).
        """
        if len(new_tokens) != self.batch:
            raise ValueError(f"turn got {len(new_tokens)} rows for a conversation of batch {self.batch}")
        mx = _per_row(max_new, self.batch, sp.max_new_tokens)
        rows: list[list[int]] = []
        for b, new in enumerate(new_tokens):
            if new is None:
                rows.append([])
                mx[b] = 0
                continue
            row = self.ids[b][self.cached[b] :] + [int(t) for t in new]
            if not row:
                raise ValueError(f"row {b}: a turn needs at least one input token")
            need = self.cached[b] + len(row) + mx[b]
            if need > self.max_len:
                raise ValueError(
                    f"row {b}: context {need} tokens exceeds the conversation's max_len={self.max_len}"
                )
            rows.append(row)
        need = max((self.cached[b] + len(r) + mx[b] for b, r in enumerate(rows) if r), default=0)
        if self.pages is not None:
            self._reserve_pages({b: self.cached[b] + len(r) + mx[b] for b, r in enumerate(rows) if r})
        elif need > self.cache_len:
            self.cache = self.service.grow_cache(
                self.cache, min(self.max_len, bucket(need, minimum=self.MIN_CACHE))
            )
        res = self.service.run(
            self.cache, rows, mx, key, sp, stop_strings, constraint, context_need=need, key_ids=key_ids
        )
        self.cache = res.cache
        out = res.to_numpy(self.batch)
        for b, new in enumerate(new_tokens):
            if new is None:
                continue
            n = int(out.lengths[b])
            self.ids[b] += [int(t) for t in new]
            self.mask[b] += [0] * len(new)
            self.lps[b] += [0.0] * len(new)
            self.cached[b] = len(self.ids[b])
            self.ids[b] += out.tokens[b, :n].tolist()
            self.mask[b] += [1] * n
            self.lps[b] += out.logprobs[b, :n].tolist()
            self.cached[b] += max(n - 1, 0)  # the last sampled token is fed at the start of the next turn
        return out

    def _reserve_pages(self, needs: dict[int, int]) -> None:
        """Pages for each row's positions this turn (the pool doubles until they fit), then the device's table."""
        self.cache = self.service.reserve_pages(self.cache, self.pages, needs)
        self.cache = self.cache.replace(pages=self.service._put(self.pages.table()))
