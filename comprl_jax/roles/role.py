"""A trained LLM role (actor or extractor): model, train state, jitted update / log-prob functions, sampler, mesh.

:func:`build_role` wires one role from its config section; :func:`dispatch_update` takes the optimizer steps of one
batch. Both roles train off-policy-correctly:

* the batch carries the sampler's own log-probabilities of the sampled tokens (``behaviour_logprobs``) next to the
  exact sampled ids, so nothing is re-encoded;
* the actor's ``old_logprobs`` (PPO's pi_old) are those of the pre-update weights, recomputed once for the whole
  batch before its first optimizer step; with ``actor.updates_per_batch > 1`` the later mini-batches see
  rho != 1 and the clip acts. With one step per batch pi_old *is* the current weights, so the update takes it
  from its own forward pass (no separate pass). ``logprob_mismatch`` reports |sampler - trainer| on the same
  weights (~1e-6 in float32: a larger value means the two code paths disagree);
* the extractor's ``old_logprobs`` are the behaviour log-probabilities of the weights that *wrote* each sample
  (it may have waited through several updates in the buffer), so CISPO's importance weight is the real one.

With ``{role}.pack`` each optimizer step's episodes are packed into shared rows (:mod:`comprl_jax.roles.packing`)
after the batch is cut into its strided mini-batches: same losses, metrics and gradients, fewer padded rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from comprl_jax.models import decoder
from comprl_jax.models.zoo import LoadedModel
from comprl_jax.rl import (
    create_train_state,
    make_logprob_fn,
    make_optimizer,
    make_update_fn,
    train_state_shardings,
)
from comprl_jax.rl import update as update_lib
from comprl_jax.rl.losses import EPISODE, EPISODES, SEGMENT_IDS, is_max_metric
from comprl_jax.rl.update import ChunkedHead
from comprl_jax.roles import packing
from comprl_jax.roles.role_config import RoleConfig
from comprl_jax.runtime import distributed as dist
from comprl_jax.runtime import sharding as shd
from comprl_jax.sampling import SamplerService, vocab_bytes
from comprl_jax.sampling.layout import RefreshTimer, RolloutLayout, rollout_layout

BEHAVIOUR = update_lib.BEHAVIOUR  # [R, T] float32, the sampler's logprob of each sampled token (0 elsewhere)
BEHAVIOUR_MASK = update_lib.BEHAVIOUR_MASK  # [R, T] float32, 1 where BEHAVIOUR is known and trained on
USE_BEHAVIOUR = "use_behaviour"  # [R] bool, rows whose old_logprobs are the behaviour ones (extractor)
SAMPLED_BY = "sampled_by"  # int: the role's weights version that sampled the batch (Role.version)


@dataclasses.dataclass
class Role:
    """One trained LLM. ``rows``: rows of each optimizer step's batch (the update is compiled for it)."""

    name: str
    model: LoadedModel
    state: Any
    update: Any
    logprobs: Any
    sampler: SamplerService
    mesh: Any = None  # the role's device mesh (None: one device, unsharded)
    rows: int = 0
    layout: RolloutLayout | None = (
        None  # the sampler's weight copy (sampling.layout); its mesh is sampler.mesh
    )
    refresh: RefreshTimer | None = None  # the last refresh of that copy (seconds: metric rollout_refresh_s)
    version: int = 0  # optimizer batches applied since the role was built
    # An update whose sampler refresh was deferred (dispatch_update(refresh=False)): its outputs, until
    # apply_refresh; meanwhile the sampler keeps sampling with the weights before it.
    deferred: Any = None
    # Sequence packing ({name}.pack): rows per micro-batch, and the batch devices each micro-batch's rows split over.
    pack: bool = False
    micro_rows: int = 0
    row_multiple: int = 1

    def refresh_sampler(self, updated) -> None:
        """Gives the sampler a fresh copy of the trained weights (cast and laid out for decoding); ``updated``:
        outputs of the update that produced them (timing starts when they are ready)."""
        copy = self.layout.refresh(self.state.params)
        self.sampler.update_params(copy)
        self.refresh = RefreshTimer(updated, copy, no_copy=self.layout.same)
        self.deferred = None

    def apply_refresh(self) -> bool:
        """The deferred refresh, if any (True when one was applied)."""
        if self.deferred is None:
            return False
        self.refresh_sampler(self.deferred)
        return True

    def refresh_seconds(self) -> float | None:
        """Device seconds of the last refresh (waits for it); None before any update."""
        return None if self.refresh is None else self.refresh.seconds()


def scorer(graphdef, remat: bool, logits_chunk: int, frozen_layers: int = 0):
    """The model as the updates see it: plain logits, or trunk + output head scored ``logits_chunk`` positions
    at a time (:class:`~comprl_jax.rl.update.ChunkedHead`); ``remat`` recomputes each layer in the backward;
    ``frozen_layers`` > 0 trains only the layers above them and the final norm (``decoder.forward``)."""
    fwd = functools.partial(decoder.forward, graphdef, remat=remat, frozen_layers=frozen_layers)
    if not logits_chunk:
        return fwd
    return ChunkedHead(
        functools.partial(fwd, return_hidden=True),
        functools.partial(decoder.logits_from_hidden, graphdef, frozen_head=frozen_layers > 0),
        logits_chunk,
    )


def frozen_layers(model: LoadedModel, name: str, trainable_layers: int) -> int:
    """Layers below the trained ones for ``{name}.trainable_layers`` (0: every layer trains, nothing frozen)."""
    n = model.cfg.num_layers
    if not 0 <= trainable_layers <= n:
        raise ValueError(
            f"config key {name}.trainable_layers={trainable_layers} must be in [0, {n}] for {name}.model "
            f"({n} layers; 0 trains every parameter)"
        )
    return n - trainable_layers if trainable_layers else 0


class MeshSampler(SamplerService):
    """A sampler on a mesh whose results are replicated on device before the host reads them (multi-process: each
    process reads its own full copy; the KV cache stays sharded)."""

    def run(
        self,
        cache,
        rows,
        max_new,
        key,
        sp,
        stop_strings=(),
        constraint=None,
        context_need=None,
        key_ids=None,
        fresh=False,
    ):
        res = super().run(
            cache, rows, max_new, key, sp, stop_strings, constraint, context_need, key_ids, fresh
        )
        if not dist.multi() or self.mesh is None:
            return res
        rep = NamedSharding(self.mesh, PartitionSpec())
        small = (res.tokens, res.lengths, res.finish_reason, res.logprobs, res.steps)
        with self._lock:
            small = dist.replicate_fn(rep)(small)
        return type(res)(*small[:4], cache=res.cache, steps=small[4])


def build_role(model: LoadedModel, name: str, cfg: RoleConfig, loss_cfg, rows: int, mesh=None) -> Role:
    """A role from its config section ``cfg`` (:class:`~comprl_jax.roles.role_config.ActorConfig` /
    ``ExtractorConfig``).

    Args:
      loss_cfg: the loss, by its config (``ActorLossConfig`` / ``ExtractorLossConfig``: the type selects the
        loss functions, :data:`comprl_jax.rl.losses.LOSSES`).
      rows: rows of each optimizer step (one rollout mini-batch / one buffer pop); fixed, so the update compiles
        once.
    """
    if rows % cfg.micro_batch:
        raise ValueError(
            f"config key {name}.micro_batch={cfg.micro_batch} must divide the {rows} rows of each {name} "
            "optimizer step"
        )
    nb = dist.batch_devices(mesh)
    if cfg.micro_batch % nb:
        raise ValueError(
            f"config key {name}.micro_batch={cfg.micro_batch} must be a multiple of the {nb} devices the {name} "
            f"batch is split over (mesh.data x mesh.fsdp of its mesh {dict(mesh.shape)}); raise "
            f"{name}.micro_batch, or put devices on mesh.tensor / use fewer with mesh.num_devices"
        )
    pack = getattr(cfg, "pack", False)
    if pack and model.cfg.num_experts and model.cfg.moe_dispatch == "capacity":
        raise ValueError(
            f"config key {name}.pack=True with {name}.model's moe_dispatch='capacity': an expert's capacity is per "
            f"batch row, so packing would change which tokens are dropped; set {name}.pack=False or use the "
            "dropless dispatch"
        )
    tx = make_optimizer(cfg.optim)
    state = create_train_state(model.params, tx, mesh)
    frozen = frozen_layers(model, name, cfg.trainable_layers)
    logits_fn = scorer(model.graphdef, cfg.remat, cfg.logits_chunk, frozen)
    shardings = None if mesh is None else train_state_shardings(state, mesh)
    # Micro-batches of micro_batch rows, their number taken from each batch (rows // micro_batch unpacked; fewer
    # for a packed batch's bucketed rows).
    update = make_update_fn(
        logits_fn, loss_cfg, tx, micro_rows=cfg.micro_batch, mesh=mesh, state_shardings=shardings
    )
    logprobs = make_logprob_fn(
        logits_fn,
        micro_rows=cfg.micro_batch,
        mesh=mesh,
        param_shardings=None if shardings is None else shardings.params,
    )
    tok = model.tokenizer
    stop_ids = [i for i in (tok.eos_id, tok.special_ids.get("<|im_end|>")) if i is not None]
    # The sampler decodes from its own copy of the weights, in the compute dtype on a decode mesh (tensor-parallel
    # and/or replicated), never from the FSDP training layout (sampling.layout).
    layout = rollout_layout(state.params, model.cfg, mesh, cfg.rollout_tensor)
    sampler = (SamplerService if mesh is None else MeshSampler)(
        model.graphdef,
        layout.refresh(state.params),
        model.cfg,
        vocab=vocab_bytes(tok, model.cfg.vocab_size),
        stop_token_ids=stop_ids,
        pad_id=tok.pad_id,
        mesh=layout.mesh,
        kv_cache=cfg.kv_cache,
    )
    return Role(
        name, model, state, update, logprobs, sampler, mesh, rows, layout,
        pack=pack, micro_rows=cfg.micro_batch, row_multiple=nb,
    )  # fmt: skip


def _put(role: Role, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    if role.mesh is None:
        return jax.tree.map(jnp.asarray, batch)
    return shd.put_batch(batch, role.mesh)  # each process feeds the rows its devices hold


def pack_step(role: Role, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One optimizer step's row-layout batch packed for ``role`` (:func:`comprl_jax.roles.packing.pack_batch`:
    rows of the batch's length, bucketed row count); the extractor's per-row ``USE_BEHAVIOUR`` flag becomes
    per-token."""
    out = packing.pack_batch(
        batch,
        micro_rows=role.micro_rows,
        pad_id=role.model.tokenizer.pad_id,
        row_multiple=role.row_multiple,
        max_rows=role.rows,
    )
    use = out[EPISODES].pop(USE_BEHAVIOUR, None)
    if use is not None:
        out[USE_BEHAVIOUR] = np.asarray(use, bool)[out[EPISODE]] & (out[SEGMENT_IDS] > 0)
    return out


def dispatch_update(role: Role, batch: dict[str, np.ndarray], refresh: bool = True) -> dict[str, jax.Array]:
    """The optimizer steps of one batch: ``len(batch) / role.rows`` strided mini-batches, each one step.

    ``old_logprobs`` of every mini-batch are computed with the pre-update weights before the first step; rows
    flagged in ``batch[USE_BEHAVIOUR]`` use ``batch[BEHAVIOUR]`` instead (the extractor's stale samples). The
    behaviour keys are optional and never reach the loss. ``refresh=False`` defers the sampler's refresh to
    :meth:`Role.apply_refresh` (the sampler keeps its copy of the weights before the update meanwhile, so it can
    answer while the update runs). ``batch[SAMPLED_BY]`` (the :attr:`Role.version` whose
    sampler produced the batch) is required for the one-step shortcut, which takes pi_old from the current weights. The sampler gets a fresh copy of the new weights at the
    end (:meth:`Role.refresh_sampler`; its device time is :meth:`Role.refresh_seconds`).

    Returns the metrics as device arrays (mean over mini-batches; ``*_max`` the max; ``step`` the last), plus
    ``logprob_mismatch``: mean |recomputed - behaviour| over ``batch[BEHAVIOUR_MASK]`` tokens. Nothing here waits
    for the device (async dispatch).
    """
    if not refresh and role.layout.same and role.deferred is None and not role.sampler.owns_params:
        # The sampler reads the training state itself, which the update donates: it keeps a copy of the weights
        # before the update until the deferred refresh (only where neither the layout nor the sampler makes a
        # copy of its own: one device in the parameter dtype, stacked layer buffers).
        role.sampler.update_params(jax.tree.map(jnp.copy, role.state.params))
    host = dict(batch)
    sampled_by = host.pop(SAMPLED_BY, None)
    total = host["tokens"].shape[0]
    if total % role.rows:
        raise ValueError(f"{role.name} batch of {total} rows is not a multiple of its step size {role.rows}")
    n = total // role.rows
    parts = [host] if n == 1 else [{k: v[i::n] for k, v in host.items()} for i in range(n)]
    if role.pack:
        parts = [pack_step(role, p) for p in parts]
    behaviour = [p.pop(BEHAVIOUR, None) for p in parts]
    bmask = [p.pop(BEHAVIOUR_MASK, None) for p in parts]
    use = [p.pop(USE_BEHAVIOUR, None) for p in parts]
    if n == 1 and use[0] is None:
        # One optimizer step on fresh samples: pi_old is the current weights, and the update takes it from its
        # own forward pass (rl.update.loss_and_metrics) instead of a separate pass over the batch. Only true if the
        # current weights sampled the batch: a batch from older weights (an asynchronous actor) would silently
        # lose its importance correction, so it must say which weights sampled it.
        if sampled_by is None or int(sampled_by) != role.version:
            raise ValueError(
                f"{role.name} batch sampled by weights version {sampled_by} but the {role.name} is at version "
                f"{role.version}: one optimizer step takes pi_old from the current weights, which is only right "
                f"for samples of these weights; pass {SAMPLED_BY}={role.version} for fresh samples, or the "
                f"behaviour logprobs with {USE_BEHAVIOUR} for older ones"
            )
        step = parts[0]
        if behaviour[0] is not None:
            step.update({BEHAVIOUR: behaviour[0], BEHAVIOUR_MASK: bmask[0]})
        role.state, m = role.update(role.state, _put(role, step))
        role.version += 1
        _refresh(role, m, refresh)
        return _combine([m], [])
    dev = [_put(role, p) for p in parts]
    old = [role.logprobs(role.state.params, d) for d in dev]  # pi_old: the weights before this batch's steps
    gaps = []
    for i in range(n):
        if behaviour[i] is None:
            continue
        flag = np.zeros(parts[i]["tokens"].shape[:1], bool) if use[i] is None else use[i]
        b = _put(role, {"b": behaviour[i], "m": bmask[i], "u": flag})
        old[i], num, den = _with_behaviour(old[i], b["b"], b["m"], b["u"])
        gaps.append((num, den))
    steps = []
    for d, o in zip(dev, old, strict=True):
        d["old_logprobs"] = o
        role.state, m = role.update(role.state, d)
        steps.append(m)
    role.version += 1
    _refresh(role, steps[-1], refresh)
    return _combine(steps, gaps)


def _refresh(role: Role, updated, now: bool) -> None:
    if now:
        role.refresh_sampler(updated)
    else:
        role.deferred = updated


@jax.jit
def _with_behaviour(old, behaviour, mask, use):
    """Rows (``[R]``; packed: tokens ``[R, L]``) flagged ``use`` take the behaviour logprobs as pi_old; also
    (sum |old - behaviour|, tokens) on ``mask`` (one jitted call, not a handful of eager ops)."""
    num = jnp.sum(jnp.abs(old - behaviour) * mask)
    flag = use if use.ndim == old.ndim else use[:, None]
    return jnp.where(flag, behaviour, old), num, jnp.sum(mask)


@jax.jit
def _combine(steps, gaps):
    """Metrics of a batch's optimizer steps: the mean (``*_max``: the max, ``step``: the last) and
    ``logprob_mismatch``."""
    out = {}
    for k in steps[0]:
        vals = jnp.stack([m[k] for m in steps])
        out[k] = vals[-1] if k == "step" else (jnp.max(vals) if is_max_metric(k) else jnp.nanmean(vals))
    if gaps:
        num = sum(g[0] for g in gaps)
        den = sum(g[1] for g in gaps)
        out["logprob_mismatch"] = jnp.where(den > 0, num / jnp.maximum(den, 1.0), jnp.nan)
    return out
