"""Mixture-of-experts MLP (Qwen3-MoE): router softmax -> top-k -> SwiGLU experts, as pure jittable functions.

Numerics follow ``transformers``' ``Qwen3MoeSparseMoeBlock``: router logits ``x @ W_r``, softmax in float32 over
all ``E`` experts, top-k (ties to the lower expert id), optional renormalisation of the k weights
(``norm_topk_prob``), and ``sum_k w_k * expert_k(x)`` with expert ``SwiGLU(x) = down(silu(gate x) * up x)``.

Three dispatches, all static-shaped (one compilation per input shape):

* ``"dropless"`` (exact, the default): each batch row's ``T * k`` (token, expert) assignments are sorted by expert
  and the experts run as one grouped matmul (``jax.lax.ragged_dot_general`` with per-row group sizes ``[B, E]``;
  a native grouped GEMM on TPU/GPU, a masked dense product on CPU). Nothing is dropped, so the output equals the
  reference per-expert loop. Under a mesh the expert weights are gathered for the layer (FSDP style).
* ``"capacity"`` (GShard / Switch style): each expert gets ``C = min(T, ceil(capacity_factor * T * k / E))``
  slots per batch row; first choices claim slots before second choices, then in token order; assignments past
  ``C`` are dropped (the token keeps its residual). Tokens are gathered into a ``[B, E, C, D]`` buffer which,
  under a mesh, is moved from the batch layout to the expert layout (``sharding.expert_parallel_spec``: the
  all-to-all of expert parallelism), run through each device's own experts, and moved back.

* ``"gmm"`` (exact, for accelerators): the ``B * T * k`` assignments of the whole local batch are sorted by
  expert and the SwiGLU matmuls run as 2-D grouped matmuls: on TPU the Pallas megablox kernel
  (``jax.experimental.pallas.ops.tpu.megablox.gmm``, whose custom VJP runs ``gmm`` / ``tgmm`` for the backward),
  elsewhere ``jax.lax.ragged_dot`` (chosen at lowering time by ``jax.lax.platform_dependent``, so an AOT compile
  for TPU from a CPU host gets the kernel). ``"gmm_interpret"`` runs the same kernel in Pallas interpret mode on
  any platform (CPU tests). Under an ambient mesh the layer runs in ``jax.shard_map``: each device sorts its own
  tokens; with an ``expert`` mesh axis (expert parallelism) the sorted assignments are exchanged with an
  all-to-all to the devices holding their experts, computed there against the local experts only, and sent back
  with a second all-to-all; the expert width stays split over ``tensor`` (partial sums ``psum``-ed). The
  exchange buffer is static and dropless: ``P x`` (local assignments) rows per device for ``P`` expert shards,
  i.e. the worst case (every assignment to one device), of which the kernel computes only the filled rows
  (its grid follows the group sizes); so a device's tokens go in rounds of ``ModelConfig.moe_exchange_tokens``
  (each rematerialised), which bounds that buffer by the round, not the sequence. Without a mesh (or when a
  shape does not divide) it runs locally.

Padding tokens (``valid`` false) never take capacity and are left out of the routing statistics.
"""

from __future__ import annotations

import functools
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


# --- "gmm" dispatch: sorted tokens, grouped matmuls (megablox on TPU), expert-parallel all-to-all ---------------

# Tile edge of the megablox kernel's (m, k, n) tiling. The TPU kernel needs blocks of whole (8, 128) tiles or whole
# array dimensions: a dimension below the tile is taken whole, a longer one that is not a multiple is masked by the
# kernel (k, n) or padded here (m).
GMM_TILE = 128


def _megablox_gmm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # the custom-VJP op (gmm / tgmm backward)

    m, kd = lhs.shape
    n = rhs.shape[2]
    tm = min(GMM_TILE, -(-m // 16) * 16)
    mp = -(-m // tm) * tm
    lhs_p = jnp.pad(lhs, ((0, mp - m), (0, 0))) if mp != m else lhs
    tiling = (tm, min(GMM_TILE, kd), min(GMM_TILE, n))
    t_rhs = rhs_transposed(kd, n)
    # positional: the op's non-differentiable arguments (dtype, tiling, transpose_rhs, interpret) are static
    out = gmm(
        lhs_p, rhs.swapaxes(1, 2) if t_rhs else rhs, sizes, lhs.dtype, tiling, None, None, t_rhs, interpret
    )
    return out[:m]


def rhs_transposed(k: int, n: int) -> bool:
    """Whether the megablox kernel takes an expert weight ``[G, K, N]`` as ``[G, N, K]`` (its ``transpose_rhs``):
    where ``N`` is not a whole number of 128-lane tiles and ``K`` is. The TPU lays such an array out with ``K``
    minor (no padding), and the kernel reading ``N`` minor made XLA copy the weights into a padded layout on every
    call: for Qwen3-30B-A3B's gate and up at tensor 4 (``N`` = 768 / 4 = 192, ``K`` = 2,048) two 6.4 GB copies per
    v5p chip, the gmm extractor decode's temp 12.4 GiB against 0.4 this way (WORKSPACE)."""
    return n % GMM_TILE != 0 and k % GMM_TILE == 0


def _grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, kernel: str) -> jax.Array:
    """``lhs [M, K]`` (rows grouped by expert, contiguous, ``sizes [G]`` int32, ``sum(sizes) <= M``) x
    ``rhs [G, K, N]`` -> ``[M, N]`` in ``lhs.dtype``; rows past ``sum(sizes)`` are zero.

    kernel: "interpret" (the megablox kernel in Pallas interpret mode) or "auto" (the kernel on TPU,
    ``jax.lax.ragged_dot`` on other platforms, resolved when lowering)."""
    rhs = rhs.astype(lhs.dtype)
    if kernel == "interpret":
        out = _megablox_gmm(lhs, rhs, sizes, interpret=True)
    else:
        out = jax.lax.platform_dependent(
            lhs,
            rhs,
            sizes,
            tpu=functools.partial(_megablox_gmm, interpret=False),
            default=lambda a, b, g: jax.lax.ragged_dot(a, b, g),
        )
    # the kernel leaves rows past the last group unwritten: zero them (their cotangent is then zero too)
    rows = jnp.arange(lhs.shape[0], dtype=jnp.int32) < jnp.sum(sizes)
    return jnp.where(rows[:, None], out, jnp.zeros((), out.dtype))


def _expert_swiglu(xs, sizes, gate, up, down, kernel: str) -> jax.Array:
    """SwiGLU of each expert over its contiguous rows: ``xs [M, D]`` -> ``[M, D]`` (rows past the groups: 0)."""
    h = jax.nn.silu(_grouped_matmul(xs, gate, sizes, kernel)) * _grouped_matmul(xs, up, sizes, kernel)
    return _grouped_matmul(h, down, sizes, kernel)


def _gmm_local(x2: jax.Array, ids2: jax.Array, gate, up, down, kernel: str) -> jax.Array:
    """Every assignment of ``x2 [N, D]`` / ``ids2 [N, k]`` through its expert on this device (all ``E`` experts
    here) -> ``[N, k, D]``."""
    n, d = x2.shape
    k, e = ids2.shape[1], gate.shape[0]
    flat = ids2.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    ys = _expert_swiglu(x2[order // k], sizes, gate, up, down, kernel)
    return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(n, k, d)


# The token exchange: None = ``jax.lax.ragged_all_to_all`` on TPU (only the filled rows travel) and a dense
# ``all_to_all`` of the whole static blocks elsewhere (XLA:CPU has no ragged all-to-all); True = ragged everywhere
# (tests substitute a reference of its documented semantics on CPU). Both give the same result.
RAGGED_EXCHANGE: bool | None = None


def _exchange(buf, fill, send_sizes, recv_sizes, ep, num_shards: int):
    """``buf [P * S, ...]`` holds block ``j`` (rows ``[j S, j S + send_sizes[j])``, the rest ``fill``) for shard
    ``j`` of the ``ep`` axes; returns ``[P * S, ...]`` whose block ``j`` is what shard ``j`` sent here
    (``recv_sizes[j]`` rows, the rest ``fill``)."""
    s = buf.shape[0] // num_shards

    def dense(b, *_):
        return jax.lax.all_to_all(b, ep, 0, 0, tiled=True)

    def ragged(b, send, recv):
        starts = jnp.arange(num_shards, dtype=jnp.int32) * s
        here = jnp.full(
            (num_shards,), jax.lax.axis_index(ep) * s, jnp.int32
        )  # where my block lands on a peer
        return jax.lax.ragged_all_to_all(b, jnp.full_like(b, fill), starts, send, here, recv, axis_name=ep)

    if RAGGED_EXCHANGE:
        return ragged(buf, send_sizes, recv_sizes)
    return jax.lax.platform_dependent(buf, send_sizes, recv_sizes, tpu=ragged, default=dense)


def _gmm_expert_parallel(x2, ids2, gate, up, down, kernel: str, ep, num_shards: int) -> jax.Array:
    """Inside ``shard_map``: this device's assignments to the devices of the ``ep`` mesh axes holding their experts
    (``gate.shape[0]`` local experts each, shard ``r`` holding experts ``[r E_loc, (r + 1) E_loc)``), computed
    there, and back. Exact: each destination gets a static block of ``N k`` rows (the worst case), so nothing
    can overflow."""
    n, d = x2.shape
    k, e_loc = ids2.shape[1], gate.shape[0]
    nk = n * k
    flat = ids2.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination shard
    sid = flat[order]
    dest = sid // e_loc
    counts = jnp.bincount(dest, length=num_shards)
    rank = jnp.arange(nk, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest]
    slot = (dest * nk + rank).astype(jnp.int32)  # row of the send buffer [P * N k]
    send = jnp.zeros((num_shards * nk, d), x2.dtype).at[slot].set(x2[order // k], unique_indices=True)
    local_e = sid - dest * e_loc
    send_e = jnp.full((num_shards * nk,), e_loc, jnp.int32).at[slot].set(local_e, unique_indices=True)
    counts = counts.astype(jnp.int32)
    counts_in = jax.lax.all_to_all(counts, ep, 0, 0, tiled=True)  # rows each shard sends here
    # block j of recv: what shard j sent here (its empty rows: zeros, and expert E_loc in recv_e)
    recv = _exchange(send, 0, counts, counts_in, ep, num_shards)
    recv_e = _exchange(send_e, e_loc, counts, counts_in, ep, num_shards)
    lorder = jnp.argsort(recv_e, stable=True)  # by local expert; empty rows last
    sizes = jnp.bincount(recv_e, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    ys = _expert_swiglu(recv[lorder], sizes, gate, up, down, kernel)  # empty rows: 0
    back = jnp.zeros_like(ys).at[lorder].set(ys, unique_indices=True)
    back = _exchange(back, 0, counts_in, counts, ep, num_shards)  # [P * N k] in this device's send layout
    return jnp.zeros((nk, d), ys.dtype).at[order].set(back[slot], unique_indices=True).reshape(n, k, d)


def _gmm_exchange_rounds(x2, ids2, gate, up, down, kernel, ep, num_shards: int, max_tokens: int) -> jax.Array:
    """:func:`_gmm_expert_parallel` over ``r = ceil(N / max_tokens)`` rounds of ``ceil(N / r)`` of this device's
    ``N`` tokens (0 or ``N <= max_tokens``: one round). Tokens are independent in the layer, so the result is the
    one-round result; each round is rematerialised, so the backward holds one round's ``P x k`` exchange rows at a
    time instead of all tokens' (ModelConfig.moe_exchange_tokens). Balanced rounds pad fewer than ``r`` tokens
    (zeros routed to experts 0..k-1, their outputs dropped)."""
    n, d = x2.shape
    k = ids2.shape[1]
    if not max_tokens or n <= max_tokens:
        return _gmm_expert_parallel(x2, ids2, gate, up, down, kernel, ep, num_shards)
    r = -(-n // max_tokens)
    c = -(-n // r)
    pad = r * c - n
    if pad:
        x2 = jnp.concatenate([x2, jnp.zeros((pad, d), x2.dtype)])
        ids2 = jnp.concatenate([ids2, jnp.broadcast_to(jnp.arange(k, dtype=ids2.dtype), (pad, k))])
    one = jax.checkpoint(lambda xc, ic: _gmm_expert_parallel(xc, ic, gate, up, down, kernel, ep, num_shards))
    out = jax.lax.map(lambda a: one(*a), (x2.reshape(r, c, d), ids2.reshape(r, c, k)))
    return out.reshape(r * c, k, d)[:n]


def _mesh_axes(mesh, name: str) -> tuple[str, ...]:
    target = dict(sharding.DEFAULT_RULES).get(name)
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    return tuple(a for a in targets if mesh.shape.get(a, 1) > 1)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _gmm(cfg: ModelConfig, p: dict, x: jax.Array, ids: jax.Array) -> jax.Array:
    """The ``"gmm"`` dispatch: x ``[B, T, D]``, ids ``[B, T, k]`` -> per-assignment outputs ``[B, T, k, D]``."""
    b, t, d = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    kernel = "interpret" if cfg.moe_dispatch == "gmm_interpret" else "auto"
    gate, up, down = (p[n] for n in ("expert_gate", "expert_up", "expert_down"))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        rows, ep, tp = _mesh_axes(mesh, "batch"), _mesh_axes(mesh, "expert"), _mesh_axes(mesh, "mlp")
        n_rows, n_ep, n_tp = (math.prod(mesh.shape[a] for a in axes) for axes in (rows, ep, tp))
        if (
            set(ep) <= set(rows)
            and not set(tp) & set(rows)
            and b % n_rows == 0
            and e % n_ep == 0
            and cfg.moe_intermediate_size % n_tp == 0
        ):
            xs_spec = PartitionSpec(_entry(rows))
            w_in = PartitionSpec(
                _entry(ep), None, _entry(tp)
            )  # [E, D, F]: experts over ep, width over tensor
            w_out = PartitionSpec(_entry(ep), _entry(tp), None)  # [E, F, D]

            def body(xl, il, g, u, dn):
                bl = xl.shape[0]
                x2, i2 = xl.reshape(bl * t, d), il.reshape(bl * t, k)
                if n_ep > 1:
                    per = _gmm_exchange_rounds(
                        x2, i2, g, u, dn, kernel, _entry(ep), n_ep, cfg.moe_exchange_tokens
                    )
                else:
                    per = _gmm_local(x2, i2, g, u, dn, kernel)
                if tp:  # each tensor shard holds a slice of the expert width: partial sums of the down matmul
                    per = jax.lax.psum(per, _entry(tp))
                return per.reshape(bl, t, k, d)

            return jax.shard_map(
                body,
                in_specs=(xs_spec, xs_spec, w_in, w_in, w_out),
                out_specs=xs_spec,
                check_vma=False,  # the megablox pallas_call declares no varying-axes types
            )(x, ids, gate.astype(x.dtype), up.astype(x.dtype), down.astype(x.dtype))
    gate = _gathered_weight(gate, (None, None, "mlp"))
    up = _gathered_weight(up, (None, None, "mlp"))
    down = _gathered_weight(down, (None, "mlp", None))
    return _gmm_local(x.reshape(b * t, d), ids.reshape(b * t, k), gate, up, down, kernel).reshape(b, t, k, d)


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
    elif cfg.moe_dispatch in ("gmm", "gmm_interpret"):
        per = _gmm(cfg, p, x, ids)
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
