"""Train state (params, AdamW state, step) as one registered pytree, and its optimizer / shardings.

The graphdef of the NNX model is *not* part of the state: it is static structure, closed over by the
``logits_fn`` the update step is built with. Parameters are an ``nnx.State`` whose Variables carry logical
axis names; optax moments mirror that tree (Variables included), so one call to
:func:`comprl_jax.runtime.sharding.state_shardings` lays out params *and* optimizer state consistently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from comprl_jax.runtime import sharding as shd


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with a constant learning rate and global-norm clipping (SPEC §2, §9).

    Attributes:
      lr: constant learning rate (1e-6 for real models; tiny CPU models need ~1e-3).
      b1, b2, eps: Adam moments.
      weight_decay: decoupled weight decay (0 in the paper).
      grad_clip: global-norm clip (1.0); <= 0 disables it.
    """

    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` then AdamW at constant ``lr`` (no schedule, no warm-up)."""
    # mu in float32 whatever the parameter dtype (f32 master weights: a no-op)
    adamw = optax.adamw(
        cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mu_dtype=jnp.float32
    )
    if cfg.grad_clip <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


@flax.struct.dataclass
class TrainState:
    """Everything an update changes. A pytree: jit, donate, shard and checkpoint it as one object.

    Attributes:
      params: ``nnx.State`` (or any pytree of arrays) of the model.
      opt_state: the optax state for ``params``.
      step: int32 scalar, optimizer steps taken.
    """

    params: Any
    opt_state: Any
    step: jax.Array


def train_state_shardings(state: TrainState, mesh: Mesh, rules=shd.DEFAULT_RULES) -> Any:
    """NamedShardings for a (possibly abstract) TrainState: Variables by their logical names (params and the
    Adam moments that mirror them), everything else (counts, step) replicated."""
    return shd.state_shardings(state, mesh, rules)


def create_train_state(
    params: Any, tx: optax.GradientTransformation, mesh: Mesh | None = None, rules=shd.DEFAULT_RULES
) -> TrainState:
    """A fresh TrainState at step 0; with a mesh, the optimizer state is created sharded inside one jit.

    Args:
      params: model parameters (already laid out, e.g. from ``init_decoder(..., mesh=mesh)``).
      tx: from :func:`make_optimizer`.
    """

    def init(p):
        return TrainState(params=p, opt_state=tx.init(p), step=jnp.zeros((), jnp.int32))

    if mesh is None:
        return jax.jit(init)(params)
    abstract = jax.eval_shape(init, params)
    shardings = train_state_shardings(abstract, mesh, rules)
    return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings)(params)
