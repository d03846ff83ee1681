"""Advantages for the actor (SPEC §2, subgroup-normalised GRPO) and the extractor (SPEC §3, §7).

Everything here is pure ``jax.numpy`` on small arrays (one scalar per trajectory / per bank entry), so the
functions run equally under ``jax.jit`` or eagerly on numpy inputs from the trainer's host code.

Actor: a *group* is the K rollouts of one task (same env seed). Each group is split into subgroups by
``subgroup`` (0 = experience-free, 1 = experience-guided). Rewards are normalised inside each (group, subgroup)
cell, never across the whole group: mixing the two subgroups would shift the free rollouts' baseline by the
guided rollouts' success (and vice versa), the bias behind the paper's Fig. 3c collapse. The outcome-only GRPO
baseline is the same code with every rollout in subgroup 0.
"""

from __future__ import annotations

import jax.numpy as jnp

ADV_NORMS = ("mean_std", "mean")
NUM_SUBGROUPS = 2  # 0 = free (c = ∅), 1 = guided (c = m)

# SPEC §7 actor-critic judgement -> score s; the extractor's reward becomes s + r(m).
CRITIC_SCORES = {"accept": 1.0, "refine": 0.5, "reject": 0.0}


def subgroup_advantages(
    rewards,
    subgroup,
    mode: str = "mean_std",
    eps: float = 1e-6,
    ddof: int = 1,
    zero_std_tol: float = 1e-6,
    valid=None,
):
    """Normalises rewards within each (group, subgroup) cell.

    ``mean_std`` (paper Eq. 5): ``(r - mean_c) / (std_c + eps)``; a cell whose std is below ``zero_std_tol``
    (all rollouts equally good) gets advantages exactly 0 -- it carries no learning signal.
    ``mean`` (released code): ``r - mean_c``.

    Args:
      rewards: ``[G, K]`` float, one scalar outcome per rollout (G tasks, K rollouts each).
      subgroup: ``[G, K]`` int, 0 = free, 1 = guided. Cells may have any size (including 0 or 1).
      mode: ``"mean_std"`` | ``"mean"`` (config ``actor.adv_norm``).
      eps: added to the std (Eq. 5).
      ddof: std degrees of freedom; 1 = unbiased, like ``torch.std`` in the reference GRPO code. A cell of
        one rollout has std 0 and so gets advantage 0.
      zero_std_tol: std at or below this counts as zero variance.
      valid: optional ``[G, K]`` bool; False rollouts (infrastructure failures: the env raised, hung or its
        worker died) are left out of their cell's statistics and get advantage 0.

    Returns:
      ``[G, K]`` float32 advantages.
    """
    if mode not in ADV_NORMS:
        raise ValueError(f"actor.adv_norm must be one of {ADV_NORMS}, got {mode!r}")
    r = jnp.asarray(rewards, jnp.float32)
    sg = jnp.asarray(subgroup, jnp.int32)
    if r.ndim != 2 or r.shape != sg.shape:
        raise ValueError(f"rewards {r.shape} and subgroup {sg.shape} must both be [G, K]")
    ok = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    out = jnp.zeros_like(r)
    for c in range(NUM_SUBGROUPS):
        m = ((sg == c) & ok).astype(jnp.float32)
        n = m.sum(-1, keepdims=True)
        mean = (r * m).sum(-1, keepdims=True) / jnp.maximum(n, 1.0)
        centred = (r - mean) * m
        if mode == "mean":
            adv = centred
        else:
            var = (centred**2).sum(-1, keepdims=True) / jnp.maximum(n - ddof, 1.0)
            std = jnp.sqrt(var)
            adv = jnp.where(std > zero_std_tol, centred / (std + eps), 0.0)
        out = out + adv * m
    return out


def whole_group_advantages(rewards, mode: str = "mean_std", eps: float = 1e-6, ddof: int = 1):
    """Normalisation across the whole group (guided and free mixed): the biased estimate the paper rejects.

    Kept for the notebook and for the outcome-only baseline (where it equals :func:`subgroup_advantages`
    with all-zero ``subgroup``).
    """
    r = jnp.asarray(rewards, jnp.float32)
    return subgroup_advantages(r, jnp.zeros(r.shape, jnp.int32), mode, eps, ddof)


def self_distillation_select(rewards, subgroup, valid=None):
    """SPEC §7 self-distillation: which guided rollouts beat their group's free-subgroup mean reward.

    The trainer re-encodes the selected trajectories with the experience stripped from their context and adds
    them to the actor batch as SFT rows (``sft_row = 1``, see :mod:`comprl_jax.rl.losses`).

    Args:
      rewards: ``[G, K]``; subgroup: ``[G, K]`` (1 = guided); valid: optional ``[G, K]`` bool (infra failures
        neither count in the free mean nor get selected).
    Returns:
      ``[G, K]`` bool. A group without (valid) free rollouts selects nothing.
    """
    r = jnp.asarray(rewards, jnp.float32)
    sg = jnp.asarray(subgroup, jnp.int32)
    ok = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    free = ((sg == 0) & ok).astype(jnp.float32)
    n_free = free.sum(-1, keepdims=True)
    free_mean = (r * free).sum(-1, keepdims=True) / jnp.maximum(n_free, 1.0)
    return (sg == 1) & ok & (n_free > 0) & (r > free_mean)


def extractor_advantages(rewards):
    """SPEC §3: batch-mean baseline, no std: ``A_i = r_i - mean_j r_j``.

    The mean runs over the whole popped batch (64), including samples whose Eq. 7 weight is 0 (cooling down), as
    the spec states. The weight itself is applied by the loss from the batch's ``sample_weight`` (so the batch
    carries both, and metrics can report the unweighted advantages).

    Args:
      rewards: ``[N]``.
    Returns:
      ``[N]`` float32.
    """
    r = jnp.asarray(rewards, jnp.float32)
    return r - r.mean()


def count_aware_weight(
    train_count, steps_since_trained, alpha: float = 0.5, cooldown: int = 1, recency_tau: float = 0.0
):
    """Eq. 7: ``w = 0`` while cooling down (``t - t_last < δ``), else
    ``(1 + c_train)^(-α) · (1 - exp(-(t - t_last) / τ))`` (the recency factor only when ``τ > 0``).

    ``t`` counts extractor updates. The experience buffer owns the counters
    (:func:`comprl_jax.experience.buffer.count_aware_weights` calls this); the notebook plots it.

    Args:
      train_count: ``[N]`` times each entry was trained on.
      steps_since_trained: ``[N]`` ``t - t_last_trained`` in extractor updates (``inf`` for never-trained entries:
        weight 1).
      alpha: α; cooldown: δ; recency_tau: τ (0 = count factor only, the released code).
    """
    c = jnp.asarray(train_count, jnp.float32)
    dt = jnp.asarray(steps_since_trained, jnp.float32)
    w = (1.0 + c) ** (-alpha)
    if recency_tau > 0:
        w = w * -jnp.expm1(-dt / recency_tau)
    return jnp.where(dt < cooldown, 0.0, w)
