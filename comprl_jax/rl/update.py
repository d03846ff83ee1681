"""Jitted RL update steps: one rollout batch = one optimizer step, with exact micro-batch accumulation.

``logits_fn(params, tokens [B,T], positions [B,T], attn_mask [B,T]) -> logits [B,T,V]`` is the model (for the
decoder: ``functools.partial(models.decoder.forward, graphdef)``); everything here is generic over it.

Micro-batching: the full-batch aggregation weights are computed first (:mod:`comprl_jax.rl.losses`), then the
batch ``[B, ...]`` is viewed as ``[M, B/M, ...]`` *strided* (micro-batch m = rows m, m+M, ...). Strided rather
than contiguous so that, with the batch sharded over the ``(data, fsdp)`` axes, every device holds its share of
every micro-batch and the split is a local reshape (needs ``B / num_batch_devices`` divisible by M). A
``lax.scan`` sums float32 gradients and metric (numerator, denominator) pairs; nothing is divided until the end.

Packed batches (:mod:`comprl_jax.roles.packing`; the layout in :mod:`comprl_jax.rl.losses`): the rows are split the
same way, ``segment_ids`` reach the model (a token attends only within its segment), and the per-episode arrays
``batch["episodes"]`` are not split: every micro-batch sees all of them (the loss indexes them by each token's
episode). With ``micro_rows`` the number of micro-batches is taken from the batch (``ceil(rows / micro_rows)``), so
one update function serves packed batches of any bucketed row count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from comprl_jax.rl.losses import (
    EPISODES,
    SEGMENT_IDS,
    accumulate_pairs,
    chunked_token_logprobs,
    finalize_metrics,
    loss_functions,
    token_logprobs,
)
from comprl_jax.rl.train_state import TrainState
from comprl_jax.runtime import sharding as shd

LogitsFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ChunkedHead:
    """A model given as trunk + output head, so updates score ``chunk`` positions at a time.

    Pass one wherever a ``logits_fn`` is taken: the full ``[B, T, V]`` logits are then never materialised
    (:func:`comprl_jax.rl.losses.chunked_token_logprobs`); values and gradients equal the plain path.

    Attributes:
      hidden_fn: ``(params, tokens, positions, attn_mask) -> hidden [B, T, D]``.
      head_fn: ``(params, hidden [B, C, D]) -> logits [B, C, V]``.
      chunk: positions per chunk (a sequence no longer than this takes one chunk).
    """

    hidden_fn: Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]
    head_fn: Callable[[Any, jax.Array], jax.Array]
    chunk: int


def model_logprobs(logits_fn, params, mb, compute_entropy: bool = False):
    """``(logprobs [B, T], entropy or None)`` of ``mb["tokens"]``: through the full logits of a plain
    ``logits_fn``, or chunk by chunk for a :class:`ChunkedHead`. A packed ``mb`` passes its ``segment_ids`` to the
    model (``segment_ids=`` keyword); a segment's first token then gets a meaningless logprob, which the loss
    never reads (it is out of ``loss_mask``)."""
    kw = {"segment_ids": mb[SEGMENT_IDS]} if SEGMENT_IDS in mb else {}
    if isinstance(logits_fn, ChunkedHead):
        hidden = logits_fn.hidden_fn(params, mb["tokens"], mb["positions"], mb["attn_mask"], **kw)
        return chunked_token_logprobs(
            lambda h: logits_fn.head_fn(params, h), hidden, mb["tokens"], logits_fn.chunk, compute_entropy
        )
    logits = logits_fn(params, mb["tokens"], mb["positions"], mb["attn_mask"], **kw)
    return token_logprobs(logits, mb["tokens"], compute_entropy)


MODEL_KEYS = ("tokens", "positions", "attn_mask", "loss_mask")


def micro_batches_for(rows: int, micro_rows: int) -> int:
    """Micro-batches of a ``rows``-row batch cut into at most ``micro_rows`` rows each (must divide evenly)."""
    m = -(-rows // micro_rows)
    if rows % m:
        raise ValueError(
            f"a batch of {rows} rows does not split into {m} micro-batches of <= {micro_rows} rows each"
        )
    return m


def _num_micro(batch, num_micro_batches: int, micro_rows: int | None) -> int:
    if micro_rows is None:
        return num_micro_batches
    return micro_batches_for(batch["tokens"].shape[0], micro_rows)


def split_micro_batches(x: jax.Array, num_micro_batches: int) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]``, micro-batch m holding rows ``m, m + M, m + 2M, ...``."""
    b = x.shape[0]
    if b % num_micro_batches:
        raise ValueError(f"batch size {b} is not divisible by num_micro_batches={num_micro_batches}")
    return x.reshape((b // num_micro_batches, num_micro_batches) + x.shape[1:]).swapaxes(0, 1)


def merge_micro_batches(x: jax.Array) -> jax.Array:
    """Inverse of :func:`split_micro_batches`: ``[M, B/M, ...] -> [B, ...]``."""
    return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _constrain_micro(tree, mesh, rules):
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: shd.constrain(x, mesh, (None, "batch"), rules), tree)


def compute_logprobs(
    logits_fn: LogitsFn, params, batch, num_micro_batches: int = 1, mesh=None, rules=shd.DEFAULT_RULES
):
    """Token logprobs ``[B, T]`` of ``batch["tokens"]`` under ``params``, zeroed outside ``loss_mask``.

    Used for ``old_logprobs`` (a forward pass with the pre-update parameters). Micro-batched with ``lax.map`` so
    only ``[B/M, T, V]`` logits are live at once.
    """
    model_in = {k: batch[k] for k in MODEL_KEYS + (SEGMENT_IDS,) if k in batch}
    micro = _constrain_micro(
        jax.tree.map(lambda x: split_micro_batches(x, num_micro_batches), model_in), mesh, rules
    )

    def one(mb):
        logp, _ = model_logprobs(logits_fn, params, mb)
        return logp * mb["loss_mask"].astype(jnp.float32)

    if num_micro_batches == 1:
        return one(jax.tree.map(lambda x: x[0], micro))
    return merge_micro_batches(jax.lax.map(one, micro))


# Optional batch keys: the sampler's log-probability of each sampled token and where it is known. With them the
# update reports ``logprob_mismatch`` (mean |trainer - sampler| there) when it computes pi_old itself.
BEHAVIOUR = "behaviour_logprobs"  # [B, T] float32 (0 elsewhere)
BEHAVIOUR_MASK = "behaviour_mask"  # [B, T] float32


def loss_and_metrics(logits_fn: LogitsFn, cfg, params, batch):
    """Forward + loss for one micro-batch (its ``token_weight`` already set from the full batch); ``cfg``'s type
    selects the loss (:func:`~comprl_jax.rl.losses.loss_functions`).

    A batch without ``old_logprobs`` is one optimizer step on samples of the current weights: pi_old is then
    this forward pass's own log-probabilities (stop-gradient; rho = 1 exactly), which saves the separate pi_old
    pass. Same loss and gradient as passing them in (rho = 1 up to float rounding there)."""
    loss_fn, _ = loss_functions(cfg)
    logp, ent = model_logprobs(logits_fn, params, batch, cfg.compute_entropy)
    if "old_logprobs" in batch:
        return loss_fn(logp, ent, batch, cfg)
    old = jax.lax.stop_gradient(logp) * batch["loss_mask"].astype(jnp.float32)
    loss, metrics = loss_fn(logp, ent, {**batch, "old_logprobs": old}, cfg)
    if BEHAVIOUR in batch:
        bmask = batch[BEHAVIOUR_MASK].astype(jnp.float32)
        gap = jnp.sum(jnp.abs(old - batch[BEHAVIOUR]) * bmask)
        metrics = {**metrics, "logprob_mismatch": (gap, jnp.sum(bmask))}
    return loss, metrics


def accumulate_gradients(
    logits_fn: LogitsFn,
    cfg,
    params,
    batch,
    num_micro_batches: int = 1,
    mesh: Mesh | None = None,
    rules=shd.DEFAULT_RULES,
    grad_shardings=None,
):
    """Exact full-batch gradient and metric pairs, accumulated over ``num_micro_batches`` with ``lax.scan``.

    Args:
      cfg: the loss, by its config (``ActorLossConfig`` / ``ExtractorLossConfig`` or any type registered with
        :func:`~comprl_jax.rl.losses.register_loss`).
      batch: the layout of :mod:`comprl_jax.rl.losses`, ``[B, ...]``.
      grad_shardings: optional shardings to pin the float32 accumulator to (the params' layout).
    Returns:
      ``(grads: float32 tree like params, metrics: {name: (num, den)})`` summed over micro-batches.
    """
    _, weights_fn = loss_functions(cfg)
    batch = {**batch, **weights_fn(batch, cfg)}  # per-sequence normalisation: over the full batch, once
    episodes = batch.pop(EPISODES, None)  # packed: per-episode arrays, seen whole by every micro-batch
    micro = _constrain_micro(
        jax.tree.map(lambda x: split_micro_batches(x, num_micro_batches), batch), mesh, rules
    )

    def loss_of(p, mb):
        if episodes is not None:
            mb = {**mb, EPISODES: episodes}
        return loss_and_metrics(logits_fn, cfg, p, mb)

    grad_fn = jax.grad(loss_of, has_aux=True)

    def pin(g):
        return g if grad_shardings is None else jax.lax.with_sharding_constraint(g, grad_shardings)

    if num_micro_batches == 1:  # no accumulator: saves a params-sized zero-fill and add per step
        grads, pairs = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
        return pin(jax.tree.map(lambda g: g.astype(jnp.float32), grads)), pairs

    first = jax.tree.map(lambda x: x[0], micro)
    metric_shapes = jax.eval_shape(grad_fn, params, first)[1]
    zeros = (
        pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)),
        jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), metric_shapes),
    )

    def body(carry, mb):
        g, m = grad_fn(params, mb)
        g_acc = pin(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry[0], g))
        return (g_acc, accumulate_pairs(carry[1], m)), None

    (grads, pairs), _ = jax.lax.scan(body, zeros, micro)
    return grads, pairs


def make_update_fn(
    logits_fn: LogitsFn,
    loss_cfg,
    tx: optax.GradientTransformation,
    *,
    num_micro_batches: int = 1,
    mesh: Mesh | None = None,
    state_shardings: Any = None,
    rules=shd.DEFAULT_RULES,
    max_traces: int | None = None,
    micro_rows: int | None = None,
):
    """The jitted update ``(state, batch) -> (state, metrics)``; ``state`` is donated.

    Args:
      logits_fn: the model (see module docstring).
      loss_cfg: the loss, by its config (``ActorLossConfig`` / ``ExtractorLossConfig``).
      tx: from :func:`comprl_jax.rl.train_state.make_optimizer`.
      num_micro_batches: M; the batch size must be divisible by M (and by M times the batch-sharding devices).
      mesh, state_shardings: with a mesh, the state's shardings
        (:func:`~comprl_jax.rl.train_state.train_state_shardings`); the batch is sharded over ``("batch",)``.
      max_traces: wrap in ``chex.assert_max_traces`` (1 = fail loudly on any recompile).
      micro_rows: instead of ``num_micro_batches``: micro-batches of at most this many rows, their number taken
        from each batch's row count (:func:`micro_batches_for`; packed batches of bucketed row counts).
    Returns:
      A ``jax.jit`` function; with a mesh wrapped to trace, lower and run under it
      (:class:`~comprl_jax.runtime.sharding.MeshFn`: the model's batch constraints act). ``metrics`` is a dict of float32 scalars: the loss terms, ``clipfrac``,
      ``approx_kl``, ``entropy``, ``ratio``, per-subgroup clip fractions and advantage mean / std (actor),
      ``grad_norm`` (before clipping) and ``step``.
    """
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if mesh is not None and state_shardings is None:
        raise ValueError(
            "make_update_fn(mesh=...) needs state_shardings (train_state_shardings(state, mesh))"
        )
    grad_shardings = None if state_shardings is None else state_shardings.params

    def update(state: TrainState, batch):
        num = _num_micro(batch, num_micro_batches, micro_rows)
        grads, pairs = accumulate_gradients(
            logits_fn, loss_cfg, state.params, batch, num, mesh, rules, grad_shardings
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = finalize_metrics(pairs)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["step"] = (state.step + 1).astype(jnp.float32)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    if max_traces is not None:
        update = chex.assert_max_traces(update, n=max_traces)
    if mesh is None:
        return jax.jit(update, donate_argnums=0)
    batch_sharding = shd.named_sharding(mesh, ("batch",), rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(
        update,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    return shd.under_mesh(jitted, mesh)  # traced and run under the mesh: activations stay batch-sharded


def make_logprob_fn(
    logits_fn: LogitsFn,
    *,
    num_micro_batches: int = 1,
    mesh: Mesh | None = None,
    param_shardings: Any = None,
    rules=shd.DEFAULT_RULES,
    micro_rows: int | None = None,
):
    """Jitted :func:`compute_logprobs`: ``(params, batch) -> old_logprobs [B, T]`` (batch-sharded with a mesh);
    ``micro_rows`` as for :func:`make_update_fn`."""

    def fn(params, batch):
        num = _num_micro(batch, num_micro_batches, micro_rows)
        return compute_logprobs(logits_fn, params, batch, num, mesh, rules)

    if mesh is None:
        return jax.jit(fn)
    if param_shardings is None:
        raise ValueError(
            "make_logprob_fn(mesh=...) needs param_shardings (train_state_shardings(...).params)"
        )
    batch_sharding = shd.named_sharding(mesh, ("batch",), rules)
    jitted = jax.jit(fn, in_shardings=(param_shardings, batch_sharding), out_shardings=batch_sharding)
    return shd.under_mesh(jitted, mesh)
