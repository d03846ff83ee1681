"""Mixture-of-experts MLP (Qwen3-MoE): router softmax -> top-k -> SwiGLU experts, as pure jittable functions.

Numerics follow ``transformers``' ``Qwen3MoeSparseMoeBlock``: router logits ``x @ W_r``, softmax in float32 over
all ``E`` experts, top-k (ties to the lower expert id), optional renormalisation of the k weights
(``norm_topk_prob``), and ``sum_k w_k * expert_k(x)`` with expert ``SwiGLU(x) = down(silu(gate x) * up x)``.

Two dispatches, both static-shaped (one compilation per input shape):

* ``"dropless"`` (exact, the default): each batch row's ``T * k`` (token, expert) assignments are sorted by expert
  and the experts run as one grouped matmul (``jax.lax.ragged_dot_general`` with per-row group sizes ``[B, E]``;
  a native grouped GEMM on TPU/GPU, a masked dense product on CPU). Nothing is dropped, so the output equals the
  reference per-expert loop. Under a mesh the expert weights are gathered for the layer (FSDP style).
* ``"capacity"`` (GShard / Switch style): each expert gets ``C = min(T, ceil(capacity_factor * T * k / E))``
  slots per batch row; first choices claim slots before second choices, then in token order; assignments past
  ``C`` are dropped (the token keeps its residual). Tokens are gathered into a ``[B, E, C, D]`` buffer which,
  under a mesh, is moved from the batch layout to the expert layout (``sharding.expert_parallel_spec``: the
  all-to-all of expert parallelism), run through each device's own experts, and moved back.

Padding tokens (``valid`` false) never take capacity and are left out of the routing statistics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from comprl_jax.models.config import ModelConfig
from comprl_jax.runtime import sharding

# Stacked MoE parameter name -> (shape after the [L_moe] axis, logical axes after "layers"); D = hidden_size,
# E = num_experts, F = moe_intermediate_size. Stored [in, out] like the dense weights.
PARAM_AXES = {
    "router": ("embed", None),  # [D, E]: small, replicated over the expert axis
    "expert_gate": ("expert", "embed", "mlp"),  # [E, D, F]
    "expert_up": ("expert", "embed", "mlp"),  # [E, D, F]
    "expert_down": ("expert", "mlp", "embed"),  # [E, F, D]
}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of the MoE parameters (without the leading ``[L_moe]`` axis)."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return {"router": (d, e), "expert_gate": (e, d, f), "expert_up": (e, d, f), "expert_down": (e, f, d)}


def init_params(cfg: ModelConfig, rngs: nnx.Rngs) -> dict[str, nnx.Param]:
    """Random-init stacked MoE parameters ``[L_moe, ...]`` (HF init: normal(0.02) router and experts)."""
    n = len(cfg.moe_layers)
    pdt = jnp.dtype(cfg.param_dtype)
    normal = jax.nn.initializers.normal(0.02)
    return {
        name: nnx.Param(normal(rngs.params(), (n, *shape), pdt), out_sharding=("layers", *PARAM_AXES[name]))
        for name, shape in param_shapes(cfg).items()
    }


def capacity(cfg: ModelConfig, tokens_per_row: int) -> int:
    """Slots per expert and batch row of the ``"capacity"`` dispatch (an expert never gets more than T)."""
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    return max(1, min(tokens_per_row, math.ceil(cfg.capacity_factor * tokens_per_row * k / e)))


def route(cfg: ModelConfig, router: jax.Array, x: jax.Array):
    """Router: ``x [..., D]`` -> (probs ``[..., E]`` float32, top-k weights ``[..., k]`` float32, ids ``[..., k]``).

    The logits are computed in float32 whatever the compute dtype, so bf16 runs route like the float32
    reference as far as the inputs allow.
    """
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, ids.astype(jnp.int32)


def _constrain(x: jax.Array, spec_fn) -> jax.Array:
    """``with_sharding_constraint(x, spec_fn(mesh))`` under an ambient mesh (``jax.set_mesh``) when every sharded
    dimension divides; otherwise ``x`` unchanged (no mesh: one device, or GSPMD decides)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = spec_fn(mesh)
    for size, entry in zip(x.shape, spec, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if size % math.prod(mesh.shape[a] for a in axes):
            return x
    return jax.lax.with_sharding_constraint(x, spec)


def _batch_spec(mesh) -> PartitionSpec:
    return sharding.logical_to_spec(("batch",), mesh=mesh)


def _gathered_weight(w: jax.Array, names: tuple) -> jax.Array:
    """An expert weight with its expert axis gathered (``names`` without "expert"): the dropless path runs every
    expert on the device's own tokens, as FSDP does for a dense layer."""
    return _constrain(w, lambda mesh: sharding.logical_to_spec(names, mesh=mesh))


def _ragged(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul ``[B, M, K] x [E, K, N] -> [B, M, N]``: rows of batch b in group e (contiguous, sizes
    ``group_sizes[b, e]``) use ``rhs[e]``."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [1]), ([], [])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[0]
    )
    return jax.lax.ragged_dot_general(lhs, rhs.astype(lhs.dtype), group_sizes, dims)


def _dropless(cfg: ModelConfig, p: dict, x: jax.Array, ids: jax.Array) -> jax.Array:
    """Every assignment reaches its expert. x ``[B, T, D]``, ids ``[B, T, k]`` -> per-assignment outputs
    ``[B, T, k, D]`` (compute dtype)."""
    b, t, d = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    flat = ids.reshape(b, t * k)
    order = jnp.argsort(flat, axis=-1, stable=True)  # assignments grouped by expert, per row
    xs = jnp.take_along_axis(x, (order // k)[..., None], axis=1)  # [B, T*k, D]
    sizes = jax.vmap(lambda r: jnp.bincount(r, length=e))(flat).astype(jnp.int32)  # [B, E]
    gate = _gathered_weight(p["expert_gate"], (None, None, "mlp"))
    up = _gathered_weight(p["expert_up"], (None, None, "mlp"))
    down = _gathered_weight(p["expert_down"], (None, "mlp", None))
    h = jax.nn.silu(_ragged(xs, gate, sizes)) * _ragged(xs, up, sizes)
    ys = _ragged(h, down, sizes)  # [B, T*k, D], sorted order
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(ys, inverse[..., None], axis=1).reshape(b, t, k, d)


def _slots(ids: jax.Array, valid: jax.Array, e: int, c: int) -> jax.Array:
    """Capacity slots of one row: ids ``[T, k]``, valid ``[T]`` -> slot ``e * C + rank`` per assignment ``[T, k]``,
    or ``E * C`` (dropped / padding). Priority: choice rank first (all first choices), then token order."""
    t, k = ids.shape
    flat = jnp.where(valid[None, :], ids.T, e).reshape(-1)  # [k*T], k-major; padding -> sentinel group E
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=e + 1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(k * t) - starts[flat[order]]
    rank = jnp.zeros_like(flat).at[order].set(rank_sorted)
    keep = (flat < e) & (rank < c)
    return jnp.where(keep, flat * c + rank, e * c).reshape(k, t).T


def _capacity(cfg: ModelConfig, p: dict, x: jax.Array, ids: jax.Array, valid: jax.Array):
    """GShard-style dispatch. Returns (per-assignment outputs ``[B, T, k, D]``, kept mask ``[B, T, k]``)."""
    b, t, d = x.shape
    e = cfg.num_experts
    c = capacity(cfg, t)
    slots = jax.vmap(lambda i, v: _slots(i, v, e, c))(ids, valid)  # [B, T, k]
    tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], ids.shape[1:])

    def dispatch_row(xr, sr):
        # slot -> token (T = an all-zero row for empty slots); slot E*C (dropped) is out of range: discarded
        src = jnp.full((e * c,), t, jnp.int32).at[sr.reshape(-1)].set(tok.reshape(-1), mode="drop")
        return jnp.concatenate([xr, jnp.zeros((1, d), xr.dtype)])[src].reshape(e, c, d)

    buf = jax.vmap(dispatch_row)(x, slots)  # [B, E, C, D], batch layout
    buf = _constrain(buf, lambda mesh: sharding.expert_parallel_spec(mesh))  # all-to-all to the expert layout
    gate, up, down = (p[n].astype(x.dtype) for n in ("expert_gate", "expert_up", "expert_down"))
    h = jax.nn.silu(jnp.einsum("becd,edf->becf", buf, gate)) * jnp.einsum("becd,edf->becf", buf, up)
    out = jnp.einsum("becf,efd->becd", h, down)
    out = _constrain(out, _batch_spec)  # and back to the batch layout
    flat = jnp.concatenate([out.reshape(b, e * c, d), jnp.zeros((b, 1, d), out.dtype)], axis=1)
    per = jnp.take_along_axis(flat, slots.reshape(b, -1)[..., None], axis=1).reshape(*ids.shape, d)
    return per, slots < e * c


def moe_mlp(cfg: ModelConfig, p: dict, x: jax.Array, valid: jax.Array):
    """The MoE MLP of one layer (after the post-attention norm).

    Args:
      cfg: a ``qwen3_moe`` config. p: this layer's ``router [D, E]``, ``expert_gate/up [E, D, F]``,
        ``expert_down [E, F, D]``. x: ``[B, T, D]`` in the compute dtype. valid: ``[B, T]`` bool, real tokens.
    Returns:
      ``(y [B, T, D] in x.dtype, stats)``; stats (float32 unless noted): ``expert_counts [E]`` (assignments of
      valid tokens per expert), ``router_prob_sum [E]`` (summed router probabilities of valid tokens),
      ``tokens []`` (valid tokens), ``dropped []`` (valid assignments over capacity), ``experts [B, T, k]``
      int32 (the routing decision).
    """
    probs, weights, ids = route(cfg, p["router"], x)
    if cfg.moe_dispatch == "dropless":
        per = _dropless(cfg, p, x, ids)
        kept = jnp.ones(ids.shape, bool)
    else:
        per, kept = _capacity(cfg, p, x, ids, valid)
    w = jnp.where(kept, weights, 0.0)
    y = jnp.einsum("btkd,btk->btd", per.astype(jnp.float32), w).astype(x.dtype)
    v = valid.astype(jnp.float32)
    per_choice = jnp.broadcast_to(v[..., None], ids.shape)
    stats = {
        # a scatter-add, not a [B, T, k, E] one-hot (that would be E x the activations at long T)
        "expert_counts": jnp.zeros((cfg.num_experts,), jnp.float32)
        .at[ids.reshape(-1)]
        .add(per_choice.reshape(-1)),
        "router_prob_sum": jnp.einsum("bte,bt->e", probs, v),
        "tokens": jnp.sum(v),
        "dropped": jnp.sum(jnp.where(kept, 0.0, v[..., None])),
        "experts": ids,
    }
    return y, stats


def load_balancing_loss(stats: dict, num_experts: int) -> jax.Array:
    """Switch-Transformer auxiliary loss over all MoE layers, as ``transformers``' ``load_balancing_loss_func``:
    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of (valid token, choice) assignments and ``P_e`` the mean
    router probability of expert ``e``, both pooled over layers and tokens (each divided by layers x tokens).

    Args:
      stats: :func:`moe_mlp` stats stacked over the MoE layers (``expert_counts`` / ``router_prob_sum``
        ``[L_moe, E]``, ``tokens`` ``[L_moe]``).
    Returns:
      a float32 scalar; equals 1 under perfectly uniform routing with top-1, ``k`` with top-k. 0 with no tokens.
    """
    rows = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    f = jnp.sum(stats["expert_counts"], axis=0) / rows
    prob = jnp.sum(stats["router_prob_sum"], axis=0) / rows
    return num_experts * jnp.sum(f * prob)


def aux_outputs(cfg: ModelConfig, layer_stats: list[dict]) -> dict[str, jax.Array]:
    """The decoder's MoE auxiliaries from the per-segment scan outputs of :func:`moe_mlp` stats (layer order).

    Returns:
      ``load_balancing_loss`` [] float32 (:func:`load_balancing_loss`; 0 without MoE layers),
      ``dropped_fraction`` [] (valid assignments over capacity / all valid assignments), and with MoE layers
      ``expert_counts [L_moe, E]`` and ``experts [L_moe, B, T, k]`` int32 (routing decisions).
    """
    if not layer_stats:
        zero = jnp.zeros((), jnp.float32)
        return {"load_balancing_loss": zero, "dropped_fraction": zero}
    stats = {k: jnp.concatenate([s[k] for s in layer_stats]) for k in layer_stats[0]}
    assignments = jnp.maximum(jnp.sum(stats["tokens"]) * cfg.num_experts_per_tok, 1.0)
    return {
        "load_balancing_loss": load_balancing_loss(stats, cfg.num_experts),
        "dropped_fraction": jnp.sum(stats["dropped"]) / assignments,
        "expert_counts": stats["expert_counts"],
        "experts": stats["experts"],
    }
