"""The decoder (Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama) as a Flax NNX module plus a pure, jittable API.

Layer parameters are *stacked* along a leading ``layers`` axis and the forward pass is one ``lax.scan``: compile
time stays flat in depth (28-36 layers for the real models) and the dense KV cache is one array per k / v
(``[L, B, S, Hkv, Dh]``; on CPU ``[L, B, Hkv, Dh, S]`` / ``[L, B, Hkv, S, Dh]``, ``models/kv_cache.py``). Every
parameter carries logical axis names (``out_sharding=``) resolved by
``comprl_jax.runtime.sharding.DEFAULT_RULES``. Weight matrices are stored ``[in, out]`` (HF stores ``[out, in]``;
``hf_io`` transposes on the way in and out).

Qwen3-MoE: the layers listed in ``cfg.moe_layers`` use the mixture-of-experts MLP of ``models.moe`` (expert
weights stacked ``[L_moe, E, ...]``, logical axis ``expert``); the others keep the dense SwiGLU (stacked over
``cfg.dense_layers``). Each run of consecutive layers of one kind is one ``lax.scan`` (a single scan for every
released Qwen3-MoE, where all layers are MoE).

Pure API (graphdef static under jit):
  forward(graphdef, params, tokens, positions, mask) -> logits          (training / scoring, no cache)
  forward(..., return_aux=True) -> (logits, aux)                         (MoE: load-balancing loss, routing)
  extend(graphdef, params, cache, tokens, num_new) -> (logits, cache)   (prefill and decode through the cache)
  extend(..., logits_at=idx [B]) -> ([B, V] logits, cache)             (the sampler: only where a token is drawn)
  extend(..., fresh=True)                                               (the first prefill of an empty cache)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from comprl_jax.models import kv_cache, moe
from comprl_jax.models import layers as L
from comprl_jax.models.config import ModelConfig
from comprl_jax.runtime import sharding

# The caches live in kv_cache.py; these names stay importable from here.
CACHE_AXES = kv_cache.CACHE_AXES
KVCache = kv_cache.KVCache
PagedKVCache = kv_cache.PagedKVCache
init_cache = kv_cache.init_cache
init_paged_cache = kv_cache.init_paged_cache


def constrain_batch(x: jax.Array) -> jax.Array:
    """Pins an activation ``[B, ...]`` to the batch mesh axes of the ambient mesh (``jax.set_mesh``).

    Without it GSPMD may shard activations along ``embed`` like the fsdp weights and replicate the batch. A no-op
    with no ambient mesh, or when B does not divide (e.g. a single-row decode on a data-parallel mesh).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = sharding.logical_to_spec(("batch",), mesh=mesh)
    if not spec or spec[0] is None:
        return x
    axes = (spec[0],) if isinstance(spec[0], str) else spec[0]
    if x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(spec[0]))


# The dense MLP's stacked parameters (over ``cfg.dense_layers``); the MoE ones are ``moe.PARAM_AXES``.
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# The MLP parameter names of each layer kind (is_moe -> names), stacked over that kind's layers only.
MLP_NAMES = {False: frozenset(DENSE_MLP), True: frozenset(moe.PARAM_AXES)}


def layer_segments(cfg: ModelConfig) -> tuple[tuple[bool, int, int, int], ...]:
    """Runs of consecutive layers of one kind: ``(is_moe, first, end, offset in that kind's stack)``."""
    segs: list[list] = []
    seen = {False: 0, True: 0}
    for i in range(cfg.num_layers):
        kind = cfg.is_moe_layer(i)
        if segs and segs[-1][0] == kind:
            segs[-1][2] = i + 1
        else:
            segs.append([kind, i, i + 1, seen[kind]])
        seen[kind] += 1
    return tuple(tuple(s) for s in segs)


class Layers(nnx.Module):
    """All transformer blocks' parameters, stacked along a leading ``[L]`` axis (the MLP's over its layer kind)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        pdt = jnp.dtype(cfg.param_dtype)
        normal = jax.nn.initializers.normal(0.02)  # HF initializer_range
        self.cfg = cfg

        def w(shape, names, count=n):
            return nnx.Param(normal(rngs.params(), (count, *shape), pdt), out_sharding=("layers", *names))

        def const(shape, names, value):
            return nnx.Param(jnp.full((n, *shape), value, pdt), out_sharding=("layers", *names))

        self.attn_norm = const((d,), ("norm",), 1.0)
        self.q_proj = w((d, qd), ("embed", "q_heads_dim"))
        self.k_proj = w((d, kvd), ("embed", "kv_heads_dim"))
        self.v_proj = w((d, kvd), ("embed", "kv_heads_dim"))
        self.o_proj = w((qd, d), ("q_heads_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = const((qd,), ("q_heads_dim",), 0.0)
            self.k_bias = const((kvd,), ("kv_heads_dim",), 0.0)
            self.v_bias = const((kvd,), ("kv_heads_dim",), 0.0)
        if cfg.qk_norm:
            self.q_norm = const((cfg.head_dim,), ("head_dim",), 1.0)
            self.k_norm = const((cfg.head_dim,), ("head_dim",), 1.0)
        self.mlp_norm = const((d,), ("norm",), 1.0)
        nd = len(cfg.dense_layers)
        if nd:
            self.gate_proj = w((d, f), ("embed", "mlp"), nd)
            self.up_proj = w((d, f), ("embed", "mlp"), nd)
            self.down_proj = w((f, d), ("mlp", "embed"), nd)
        if cfg.moe_layers:
            for name, param in moe.init_params(cfg, rngs).items():
                setattr(self, name, param)

    def params(self) -> dict[str, nnx.Param]:
        return {k: v for k, v in vars(self).items() if isinstance(v, nnx.Param)}

    def per_layer(self) -> bool:
        """Whether the weights are one buffer per layer (:func:`unstack_layers`, the sampler's CPU layout)."""
        return isinstance(self.attn_norm.get_value(), tuple)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked arrays by name, in the compute dtype (:func:`compute_cast`)."""
        if self.per_layer():
            raise ValueError(
                "these parameters are one buffer per layer (decoder.unstack_layers: a sampler's CPU layout), which "
                "only extend() reads; pass the stacked parameters (decoder.stack_layers) to forward()"
            )
        return {k: compute_cast(self.cfg, k, v[...]) for k, v in self.params().items()}

    def layer(self, i: int) -> dict[str, jax.Array]:
        """Layer ``i``'s weights by name in the compute dtype: the attention's at ``i``, the MLP's at ``i``'s place
        in its kind's stack (dense or MoE). On a per-layer layout these are the layer's own buffers."""
        kind = self.cfg.is_moe_layer(i)
        at = sum(self.cfg.is_moe_layer(j) == kind for j in range(i))  # its place among its kind's layers
        out = {}
        for k, v in self.params().items():
            if k in MLP_NAMES[not kind]:
                continue
            out[k] = compute_cast(self.cfg, k, v.get_value()[at if k in MLP_NAMES[kind] else i])
        return out

    def segments(self) -> list[tuple[tuple[bool, int, int, int], dict[str, jax.Array]]]:
        """``(segment, xs)`` per :func:`layer_segments` run: ``xs`` holds the run's slice of the attention stacks
        and of its own MLP kind's stack (the ``xs`` of one layer scan)."""
        arrays, n = self.arrays(), self.cfg.num_layers
        out = []
        for seg in layer_segments(self.cfg):
            is_moe, a, b, off = seg
            xs = {}
            for k, v in arrays.items():
                if k in MLP_NAMES[is_moe]:
                    xs[k] = v if off == 0 and b - a == v.shape[0] else v[off : off + b - a]
                elif k not in MLP_NAMES[not is_moe]:
                    xs[k] = v if a == 0 and b == n else v[a:b]
            out.append((seg, xs))
        return out


# Kept in their stored dtype: the MoE router's logits are float32 (HF), so its weights must not be rounded first.
KEEP_DTYPE = ("router",)


def compute_cast(cfg: ModelConfig, name: str, w: jax.Array) -> jax.Array:
    """A stored weight in the compute dtype, cast *before* the layer scan: under FSDP the cast runs on each
    device's shard and the per-layer all-gather then moves ``dtype`` bytes (half of float32 for bfloat16). The
    result equals casting at each use (``layers.dense`` and ``rms_norm`` cast to the activations' dtype);
    gradients flow back to the float32 master weights through the cast."""
    if name in KEEP_DTYPE or not jnp.issubdtype(w.dtype, jnp.floating):
        return w
    return w.astype(jnp.dtype(cfg.dtype))


def _qkv(cfg: ModelConfig, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """Pre-norm, projections, optional bias / q-k norm, RoPE. x ``[B, T, D]`` -> q ``[B,T,H,Dh]``, k/v ``[B,T,Hkv,Dh]``."""
    b, t, _ = x.shape
    h = L.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q = L.dense(h, p["q_proj"], p.get("q_bias")).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = L.dense(h, p["k_proj"], p.get("k_bias")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = L.dense(h, p["v_proj"], p.get("v_bias")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim of each head, before RoPE
        q = L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = L.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin), v


def _finish(cfg: ModelConfig, p: dict, x: jax.Array, attn: jax.Array, valid: jax.Array):
    """Output projection + residual, then the pre-norm MLP (SwiGLU, or the MoE for a layer with a router) +
    residual. Returns ``(x, MoE stats or None)``; ``valid [B, T]`` marks real tokens (MoE dispatch, stats)."""
    x = x + L.dense(attn, p["o_proj"])
    h = L.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if "router" in p:
        y, stats = moe.moe_mlp(cfg, p, h, valid)
        return x + y, stats
    return x + L.swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"]), None


def _split_frozen(segments, frozen_layers: int):
    """``(xs, frozen)`` per layer scan: each :meth:`Layers.segments` run cut at layer ``frozen_layers`` (the
    layers below it are frozen)."""
    out = []
    for (_, a, b, _), xs in segments:
        k = min(max(frozen_layers - a, 0), b - a)  # this run's frozen layers
        if k:
            out.append(({n: v[:k] for n, v in xs.items()}, True))
        if k < b - a:
            out.append(({n: v[k:] for n, v in xs.items()} if k else xs, False))
    return out


def _causal_self_attention(cfg: ModelConfig, q, k, v, valid: jax.Array, segment_ids=None) -> jax.Array:
    """Causal attention of a sequence to itself (a forward, or a prefill on an empty cache) by ``cfg.attention``:
    ``xla`` (query chunks in causal bands; visibility rebuilt per chunk from column order and ``valid``,
    ``layers.visible``, so no ``[B, T, T]`` mask), else the platform's kernel (``models.attention``: cudnn / splash,
    or xla where none runs). q ``[B, T, H, Dh]``, k / v ``[B, T, Hkv, Dh]``, valid ``[B, T]`` -> ``[B, T, H * Dh]``."""
    if cfg.attention == "xla":
        q_pos = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
        return L.attention(q, k, v, q_pos, valid, causal=True, segment_ids=segment_ids)
    from comprl_jax.models import attention  # the backends (cfg.attention)

    return attention.causal_attention(q, k, v, valid, segment_ids, backend=cfg.attention)


class Decoder(nnx.Module):
    """Decoder-only transformer. Use through :func:`forward` / :func:`extend` on ``nnx.split`` state."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        d, v = cfg.hidden_size, cfg.vocab_size
        normal = jax.nn.initializers.normal(0.02)
        self.embed = nnx.Param(normal(rngs.params(), (v, d), pdt), out_sharding=("vocab", "embed"))
        self.layers = Layers(cfg, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((d,), pdt), out_sharding=("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (d, v), pdt), out_sharding=("embed", "vocab"))

    def _embed(self, tokens: jax.Array) -> jax.Array:
        # mode="clip": a padding id such as -1 must not become a NaN row (jnp.take's default fill), since
        # 0 * NaN in the masked attention sum would poison the valid rows of the batch.
        table = compute_cast(self.cfg, "embed", self.embed[...])
        return jnp.take(table, tokens, axis=0, mode="clip")

    def _head(self, x: jax.Array, return_hidden: bool, frozen_head: bool = False) -> jax.Array:
        h = L.rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)
        if return_hidden:
            return h.astype(jnp.float32)
        return self.logits(h, frozen_head)

    def logits(self, h: jax.Array, frozen_head: bool = False) -> jax.Array:
        """Final-normed hidden ``[B, T, D]`` in the compute dtype -> logits ``[B, T, V]`` float32.
        ``frozen_head``: no gradient reaches the output head's weights (gradients still reach ``h``)."""
        grad = jax.lax.stop_gradient if frozen_head else (lambda w: w)
        if self.cfg.tie_word_embeddings:
            w = compute_cast(self.cfg, "embed", grad(self.embed[...])).astype(h.dtype)
            return jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
        w = compute_cast(self.cfg, "lm_head", grad(self.lm_head[...])).astype(h.dtype)
        return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens,
        positions,
        mask,
        *,
        return_hidden: bool = False,
        remat: bool = False,
        return_aux: bool = False,
        frozen_layers: int = 0,
        segment_ids=None,
    ):
        """See :func:`forward`."""
        cfg = self.cfg
        cos, sin = L.rope_cos_sin(cfg, positions)
        # Causal in column order among valid (mask) keys; positions only drive RoPE.
        valid = mask.astype(bool)

        def body(x, p):
            q, k, v = _qkv(cfg, p, x, cos, sin)
            attn = _causal_self_attention(cfg, q, k, v, valid, segment_ids)
            x, stats = _finish(cfg, p, x, attn, valid)
            return constrain_batch(x), stats

        if remat:
            body = jax.checkpoint(body)
        x = constrain_batch(self._embed(tokens))
        moe_stats = []
        for xs, frozen in _split_frozen(self.layers.segments(), frozen_layers):
            if frozen:  # no gradient into these layers or below: JAX builds no backward pass for them
                x, xs = jax.lax.stop_gradient((x, xs))
            x, stats = jax.lax.scan(body, x, xs)
            if stats is not None:
                moe_stats.append(stats)
        out = self._head(x, return_hidden, frozen_head=frozen_layers > 0)
        return (out, moe.aux_outputs(cfg, moe_stats)) if return_aux else out

    def extend(
        self,
        cache,
        tokens: jax.Array,
        num_new: jax.Array,
        logits_at: jax.Array | None = None,
        fresh: bool = False,
        write: bool = True,
    ):
        """See :func:`extend`."""
        cfg = self.cfg
        b, t = tokens.shape
        positions = cache.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]; RoPE position = cache position
        valid = jnp.arange(t)[None, :] < num_new[:, None]
        cos, sin = L.rope_cos_sin(cfg, positions)
        # A paged cache's decode step on TPU / GPU: a Pallas paged-attention kernel ("tpu" / "gpu"); else None.
        kernel = None if fresh else kv_cache.decode_kernel(cache, t)
        if kernel is not None and not write:
            raise ValueError(
                "extend(write=False) is for prefills; a paged decode step's kernel writes in the scan"
            )

        def body(carry, xs):
            x, pools = carry
            p, layer = xs
            q, k, v = _qkv(cfg, p, x, cos, sin)
            if fresh:
                # An empty cache: the new tokens attend causally to each other only, as in a forward (causal
                # bands, or the platform's flash kernel), not to the cache's empty window.
                attn = _causal_self_attention(cfg, q, k, v, valid)
            elif kernel is None:
                # Read the layer's context from the (loop-invariant) cache; the new keys and values leave the scan
                # and are written once, after every layer (kv_cache.write: in place, no copy of the cache).
                k_ctx, v_ctx, ctx_valid, specs = kv_cache.context(cache, layer)
                attn = kv_cache.attention_over_cache(
                    q, k_ctx, v_ctx, ctx_valid, k, v, num_new, specs, backend=cfg.attention
                )
            else:
                # The kernel attends to the pool only: the layer's new key / value go into the carried pools first.
                pools = kv_cache.write_layer(cache, pools, layer, k, v, num_new)
                attn = kv_cache.attention_via_kernel(cache, pools, layer, q, kernel)
            x, _ = _finish(cfg, p, x, attn, valid)
            return (constrain_batch(x), pools), (k, v)

        x = constrain_batch(self._embed(tokens))
        pools = None if kernel is None else (cache.k, cache.v)
        new_k, new_v = [], []
        if self.layers.per_layer():
            # One buffer per layer (unstack_layers: a sampler on CPU whose layers outgrow the cache): a Python loop
            # hands each layer's weights to its matmuls in place, where a scan would first copy them out of the
            # stacks (XLA:CPU writes every dynamic slice to a new buffer, on every decode step).
            for i in range(cfg.num_layers):
                (x, pools), (k, v) = body((x, pools), (self.layers.layer(i), jnp.int32(i)))
                new_k.append(k[None])
                new_v.append(v[None])
            # The write after the loop must follow every layer's read of the cache, but the last layer's new key
            # and value do not depend on its own attention (the read). Unordered, XLA copies the whole cache
            # twice per step to keep the read's value; this zero ties them to the last hidden state (a scan
            # orders them itself). A non-finite hidden state would make the logits NaN in any case.
            tie = (x[:, :1, :1] * 0.0)[None, ..., None].astype(new_k[-1].dtype)  # [1, B, 1, 1, 1]
            new_k[-1] = new_k[-1] + tie
            new_v[-1] = new_v[-1] + tie
        else:
            for (_, a, end, _), xs in self.layers.segments():
                (x, pools), (k, v) = jax.lax.scan(body, (x, pools), (xs, jnp.arange(a, end)))
                new_k.append(k)
                new_v.append(v)
        cat = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts)  # noqa: E731
        if write:
            new_cache = kv_cache.write(
                cache, cat(new_k), cat(new_v), num_new.astype(jnp.int32), written=pools
            )
        else:
            new_cache = (cat(new_k), cat(new_v))
        if logits_at is not None:
            # Gather the hidden rows before the head: [B, T, V] float32 logits of a long prefill (32 x 2k x 49k
            # = 13 GB for SmolLM2) would dwarf the model, and the sampler only reads one position per row.
            at = jnp.clip(logits_at.astype(jnp.int32), 0, t - 1)
            x = jnp.take_along_axis(x, at[:, None, None], axis=1)  # [B, 1, D]
            return self._head(x, False)[:, 0], new_cache
        return self._head(x, False), new_cache


def init_decoder(cfg: ModelConfig, seed: int = 0, mesh=None, rules=sharding.DEFAULT_RULES):
    """Random-init decoder (HF init: normal(0.02) weights, unit norms, zero biases).

    Args:
      cfg: the config. seed: PRNG seed. mesh: when given, parameters are created sharded inside one jit.
    Returns:
      ``(graphdef, params)``; ``params`` is an ``nnx.State`` of ``nnx.Param``.
    """
    factory = lambda: Decoder(cfg, rngs=nnx.Rngs(params=seed))  # noqa: E731
    if mesh is not None:
        return sharding.create_sharded(factory, mesh, rules)
    # Jitted like the sharded path, so the same seed gives bit-identical values with and without a mesh.
    graphdef, _ = sharding.abstract_module(factory)
    with sharding.own_sharding_rules():
        return graphdef, jax.jit(lambda: nnx.split(factory())[1])()


def abstract_decoder(cfg: ModelConfig):
    """``(graphdef, abstract params)`` without allocating (``jax.eval_shape``)."""
    return sharding.abstract_module(lambda: Decoder(cfg, rngs=nnx.Rngs(params=0)))


def forward(
    graphdef,
    params,
    tokens,
    positions,
    mask,
    *,
    return_hidden: bool = False,
    remat: bool = False,
    return_aux: bool = False,
    frozen_layers: int = 0,
    segment_ids=None,
):
    """Full-sequence forward pass without a cache (training, scoring, embedding).

    Args:
      tokens: ``[B, T]`` int32. positions: ``[B, T]`` int32 RoPE positions. mask: ``[B, T]`` bool valid tokens;
        each token attends causally (column order) to valid tokens.
      return_hidden: return the final-normed hidden state instead of logits.
      remat: rematerialise each layer in the backward pass (saves activation memory).
      return_aux: also return the MoE auxiliaries (:func:`comprl_jax.models.moe.aux_outputs`): the
        load-balancing loss over the valid tokens (0 for a dense model; add ``coef * aux["load_balancing_loss"]``
        to a loss to use it), per-expert counts, the dropped fraction and the routing decisions. Whatever the
        caller does not use is removed by XLA.
      frozen_layers: partial fine-tuning: no gradient reaches the embedding, the first ``frozen_layers`` layers
        or the output head (0: every parameter trains). Values are unchanged; the backward pass stops at the
        first trained layer, so it costs what the trained layers cost.
      segment_ids: optional ``[B, T]`` int32, sequence packing: a token attends only to tokens of its own segment
        (and, as always, valid and not after it). ``positions`` then restart per segment (RoPE); a packed row gives
        each segment the logits it would get alone.
    Returns:
      logits ``[B, T, V]`` float32, or hidden ``[B, T, D]`` float32. Rows of invalid tokens are meaningless.
      With ``return_aux``: ``(that, aux)``.
    """
    model = nnx.merge(graphdef, params)
    return model(
        tokens,
        positions,
        mask,
        return_hidden=return_hidden,
        remat=remat,
        return_aux=return_aux,
        frozen_layers=frozen_layers,
        segment_ids=segment_ids,
    )


def extend(
    graphdef,
    params,
    cache,
    tokens: jax.Array,
    num_new: jax.Array,
    logits_at: jax.Array | None = None,
    fresh: bool = False,
    write: bool = True,
):
    """Appends ``tokens[b, :num_new[b]]`` to row ``b`` of the cache and returns their logits.

    Token ``t`` of row ``b`` goes to position ``lengths[b] + t`` (its RoPE position) and attends causally to the
    row's cache. Columns ``>= num_new[b]`` are padding: not written, their logits meaningless. Positions past the
    cache (or, paged, without a page) are dropped silently, so callers must size the cache. Prefill = extend on
    an empty cache; a decode step = extend with ``T = 1, num_new = 1``. Every layer reads the cache before any
    write, and the new keys and values are written after the last layer (``models/kv_cache.py``).

    Args:
      cache: a dense :class:`KVCache` (``[L, B, S, Hkv, Dh]``, or its CPU layout) or a :class:`PagedKVCache` (page pool + page
        table; the host assigns the pages the new positions need). tokens: ``[B, T]`` int32. num_new: ``[B]`` int32.
      logits_at: optional ``[B]`` int32 column per row (clipped to ``[0, T)``); when given, only those columns go
        through the output head (a sampler needs one position per row, e.g. ``num_new - 1``).
      fresh: static; the caller promises the cache is empty (every ``lengths`` 0, e.g. just made by
        ``init_cache``): the new tokens then attend causally to each other only (the forward's attention, with its
        causal bands or the platform's flash kernel) instead of to the cache's whole window plus themselves, whose
        empty slots a long prefill would otherwise pay for. Same logits and cache; wrong if a row has context.
      write: static; False returns the new keys and values (``(k, v)`` each ``[L, B, T, Hkv, Dh]``) in place of
        the cache, unwritten, for a caller that writes several calls' at once (``sampling.decode.prefill``'s row
        groups: ``kv_cache.write`` of them all after its loop, so the loop never carries the cache).
    Returns:
      ``(logits [B, T, V] float32, cache)`` with ``lengths += num_new``; with ``logits_at``, logits ``[B, V]``
      (row ``b``'s logits at column ``logits_at[b]``, equal to the full call's ``logits[b, logits_at[b]]``).
    """
    model = nnx.merge(graphdef, params)
    return model.extend(cache, tokens, num_new, logits_at, fresh, write)


def unstack_layers(params):
    """The layer stacks as one buffer per layer: each ``[L, ...]`` parameter under ``layers`` becomes a tuple of
    ``L`` arrays (the MLP's over its kind's layers). :func:`extend` reads this layout with a Python loop over the
    layers instead of a ``scan``; :func:`forward` needs the stacks (:func:`stack_layers`). A jitted copy (the
    input is not donated); on a decode mesh each layer's array keeps its stack's split less the layer axis
    (``tests/test_layer_buffers.py``).

    Why: a ``scan`` over stacked weights slices each layer's out of the stacks, and XLA:CPU writes every slice to a
    new buffer, on every decode step; for a layer larger than the CPU's cache that is one more pass over memory
    (``SamplerService``'s ``layer_buffers``, ``sampling.service.auto_layer_buffers``).
    """
    return _unstack(params)


def bytes_per_layer(params) -> int:
    """Bytes of the layer weights (arrays or abstract, stacked or not) divided by the number of layers."""
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params["layers"]))
    norms = jax.tree.leaves(params["layers"]["attn_norm"])  # one [L, D] stack, or L arrays [D]
    return total // (norms[0].shape[0] if norms[0].ndim == 2 else len(norms))


def stack_layers(params):
    """Inverse of :func:`unstack_layers` (stacked parameters pass through unchanged)."""
    return _stack(params)


def _map_layers(fn, params):
    out = jax.tree.map(lambda x: x, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out["layers"] = jax.tree.map(
        lambda v: v.replace(fn(v.get_value())),
        params["layers"],
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return out


_unstack = jax.jit(
    lambda params: _map_layers(
        lambda x: x if isinstance(x, tuple) else tuple(x[i] for i in range(len(x))), params
    )
)
_stack = jax.jit(lambda params: _map_layers(lambda x: jnp.stack(x) if isinstance(x, tuple) else x, params))


def count_params(params) -> int:
    """Total number of parameter elements in a (possibly abstract) state."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def logits_from_hidden(graphdef, params, hidden: jax.Array, frozen_head: bool = False) -> jax.Array:
    """The output head alone: ``hidden [B, C, D]`` (from ``forward(..., return_hidden=True)``) -> logits
    ``[B, C, V]`` float32, equal to ``forward``'s logits at those positions (chunked scoring in updates).
    ``frozen_head``: no gradient reaches the head's weights (``forward(frozen_layers > 0)``'s head)."""
    model = nnx.merge(graphdef, params)
    # back to the trunk's compute dtype: the float32 cast in forward(return_hidden=True) was lossless
    return model.logits(hidden.astype(jnp.dtype(model.cfg.dtype)), frozen_head)
