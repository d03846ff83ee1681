"""Start-up validation of a run config: :func:`validate` raises ValueError naming the first bad key."""

from __future__ import annotations

import ml_collections

from comprl_jax.config import keys
from comprl_jax.config.methods import METHOD_FLAGS, METHODS

BANK_KEYS = ("content", "query")
DISTILL_FROM = ("all", "guided")
DISTILL_OVERLAPS = ("auto", "rollout", "update")  # extractor.distill_overlap
PLACEMENTS = ("colocated", "disjoint")
DTYPES = ("float32", "bfloat16")  # actor/extractor.param_dtype and dtype (models.config.DTYPES allows these)


def finalize(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    validate(c)
    c.lock()
    return c


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key {key}: {msg}")


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad key."""
    # The allowed values live with the code that reads them (imported here: the schema itself stays free of JAX).
    from comprl_jax.experience.bank import PARTITIONS
    from comprl_jax.rl.advantages import ADV_NORMS

    _check(c.method in METHODS, "method", f"{c.method!r} not in {METHODS}")
    flags = METHOD_FLAGS.get(c.method, {})
    off = [
        f"{k}={keys.get(c, k)} (method {c.method!r} means {v})"
        for k, v in flags.items()
        if keys.get(c, k) != v
    ]
    _check(
        not off,
        "method",
        f"the method's flags were changed: {', '.join(off)}; pick the method with the config's variant word "
        f"(e.g. configs/x.py:tiny,baseline) or set --config.method=custom to combine flags freely",
    )
    _check(
        c.experience.enabled or not (c.extractor.train or c.bank.offline),
        "experience.enabled",
        "is False, so extractor.train and bank.offline must be False too (no bank, no extractor)",
    )
    _check(
        c.experience.enabled or not c.experience.blank,
        "experience.blank",
        "needs experience.enabled (the blanked block replaces retrieved experience)",
    )
    _check(len(c.env.tasks) >= 1, "env.tasks", "needs at least one env id")
    _check(c.env.max_turns > 0, "env.max_turns", "must be positive")
    _check(c.env.backend in ("thread", "process"), "env.backend", "must be 'thread' or 'process'")
    _check(
        c.rollout.group_size >= 2 and c.rollout.group_size % 2 == 0,
        "rollout.group_size",
        f"must be even and >= 2 (half guided, half free), got {c.rollout.group_size}",
    )
    _check(c.rollout.tasks_per_step >= 1, "rollout.tasks_per_step", "must be >= 1")
    _check(
        c.rollout.engine in ("continuous", "lockstep"),
        "rollout.engine",
        f"must be 'continuous' or 'lockstep', got {c.rollout.engine!r}",
    )
    _check(c.rollout.slots >= 0, "rollout.slots", "must be >= 0 (0 = one per episode)")
    _check(c.rollout.chunk_steps >= 1, "rollout.chunk_steps", "must be >= 1")
    _check(0.0 < c.rollout.exit_frac <= 1.0, "rollout.exit_frac", "must be in (0, 1]")
    _check(c.rollout.env_lag >= 1, "rollout.env_lag", "must be >= 1 (decode chunks)")
    _check(c.rollout.rows_per_wave >= 0, "rollout.rows_per_wave", "must be >= 0 (0 = all episodes at once)")
    episodes = c.rollout.tasks_per_step * c.rollout.group_size * len(c.env.tasks)
    _check(
        c.rollout.rows_per_wave == 0 or episodes % min(c.rollout.rows_per_wave, episodes) == 0,
        "rollout.rows_per_wave",
        f"={c.rollout.rows_per_wave} must divide the {episodes} episodes of a step "
        "(rollout.tasks_per_step x rollout.group_size x len(env.tasks)), or be 0 (all at once)",
    )
    _check(c.actor.updates_per_batch >= 1, "actor.updates_per_batch", "must be >= 1")
    _check(c.actor.self_distill_coef >= 0, "actor.self_distill_coef", "must be >= 0 (0 = off)")
    _check(c.extractor.cooldown >= 0, "extractor.cooldown", "must be >= 0 (trainer steps)")
    _check(c.extractor.alpha >= 0, "extractor.alpha", "must be >= 0")
    _check(c.extractor.recency_tau >= 0, "extractor.recency_tau", "must be >= 0 (0 = no recency factor)")
    _check(c.bank.offline_build_steps >= 1, "bank.offline_build_steps", "must be >= 1")
    _check(0 <= c.bank.offline_dedup <= 1, "bank.offline_dedup", "must be in [0, 1] (0 = no dedup pass)")
    _check(c.retrieval.search_and_ask_max >= 0, "retrieval.search_and_ask_max", "must be >= 0")
    _check(c.retrieval.window_steps >= 0, "retrieval.window_steps", "must be >= 0")
    _check(c.manager.embed_workers >= 1, "manager.embed_workers", "must be >= 1")
    _check(c.manager.search_workers >= 1, "manager.search_workers", "must be >= 1")
    _check(c.train.eval_every >= 0, "train.eval_every", "must be >= 0 (0 = only at the end)")
    _check(c.train.log_every >= 1, "train.log_every", "must be >= 1")
    _check(c.train.eval_tasks >= 1, "train.eval_tasks", "must be >= 1")
    _check(c.actor.adv_norm in ADV_NORMS, "actor.adv_norm", f"{c.actor.adv_norm!r} not in {ADV_NORMS}")
    from comprl_jax.rl.losses import (
        loss_config,  # (here, not at the top: the schema itself stays free of JAX)
    )

    for role in ("actor", "extractor"):
        loss_config(c, role)  # the loss dataclass checks its own values; the error names the config key
    _check(c.actor.lr > 0 and c.extractor.lr > 0, "actor.lr / extractor.lr", "must be positive")
    for role in ("actor", "extractor"):
        r = c[role]
        _check(r.trainable_layers >= 0, f"{role}.trainable_layers", "must be >= 0 (0 = every layer trains)")
        _check(
            not r.trainable_layers or r.weight_decay == 0,
            f"{role}.weight_decay",
            f"must be 0 with {role}.trainable_layers={r.trainable_layers} (decay would change the frozen weights)",
        )
        for key in ("param_dtype", "dtype"):
            _check(r[key] in DTYPES, f"{role}.{key}", f"{r[key]!r} not in {DTYPES}")
        _check(r.rollout_tensor >= 0, f"{role}.rollout_tensor", "must be >= 0 (0 = chosen by memory)")
    _check(c.extractor.buffer_size >= 1, "extractor.buffer_size", "must be >= 1")
    for role in ("actor", "extractor"):
        _check(c[role].logits_chunk >= 0, f"{role}.logits_chunk", "must be >= 0 (0 = full logits)")
    _check(c.mesh.extractor_tensor >= 0, "mesh.extractor_tensor", "must be >= 0 (0 = mesh.tensor)")
    _check(c.extractor.rows_per_call >= 0, "extractor.rows_per_call", "must be >= 0 (0 = all rows at once)")
    _check(c.extractor.distill_from in DISTILL_FROM, "extractor.distill_from", f"not in {DISTILL_FROM}")
    _check(
        c.extractor.distill_overlap in DISTILL_OVERLAPS,
        "extractor.distill_overlap",
        f"not in {DISTILL_OVERLAPS}",
    )
    _check(c.bank.key in BANK_KEYS, "bank.key", f"{c.bank.key!r} not in {BANK_KEYS}")
    _check(c.bank.partition in PARTITIONS, "bank.partition", f"{c.bank.partition!r} not in {PARTITIONS}")
    _check(c.bank.capacity >= 1, "bank.capacity", "must be >= 1")
    _check(
        c.bank.merge_every >= 1 and c.bank.merge_chunk >= 1,
        "bank.merge_every / bank.merge_chunk",
        "must be >= 1",
    )
    _check(
        c.retrieval.k >= 1 and c.retrieval.candidates >= c.retrieval.k,
        "retrieval.candidates",
        "must be >= retrieval.k >= 1",
    )
    _check(0.0 <= c.retrieval.dropout <= 1.0, "retrieval.dropout", "must be in [0, 1]")
    _check(c.retrieval.clock in ("step", "wall"), "retrieval.clock", "must be 'step' or 'wall'")
    _check(c.mesh.placement in PLACEMENTS, "mesh.placement", f"not in {PLACEMENTS}")
    _check(0.0 < c.mesh.actor_fraction < 1.0, "mesh.actor_fraction", "must be in (0, 1)")
    _check(c.mesh.num_devices >= 0, "mesh.num_devices", "must be >= 0 (0 = all devices)")
    for axis in ("data", "fsdp", "tensor"):
        _check(c.mesh[axis] == -1 or c.mesh[axis] >= 1, f"mesh.{axis}", "must be -1 (fill) or >= 1")
    _check(
        [c.mesh.data, c.mesh.fsdp, c.mesh.tensor].count(-1) <= 1,
        "mesh.data / mesh.fsdp / mesh.tensor",
        "at most one may be -1 (fill)",
    )
    _check(c.train.steps >= 1, "train.steps", "must be >= 1")
    _check(
        c.checkpoint.every >= 1 and c.checkpoint.max_to_keep >= 2,
        "checkpoint.every / checkpoint.max_to_keep",
        "every >= 1 and max_to_keep >= 2",
    )
