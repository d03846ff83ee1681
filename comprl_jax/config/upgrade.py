"""Saved configs of older runs: keys removed, renamed and added since a run wrote its ``config.json``, and
:func:`upgrade_saved`, which brings such a tree to the current schema so the run resumes without a spurious change."""

from __future__ import annotations

import copy

from comprl_jax.config import keys

# Keys renamed since older run directories wrote their config.json: old dotted key -> current dotted key.
# Keys that no longer exist, dropped from a saved config: manager.t_max_ms (the paper's 1 ms micro-batch wait) was
# read only by the threaded serving manager; training searches a whole wave's queries in one call, where a time bound
# has nothing to wait for (ThreadedExperienceManager keeps its t_max_s argument).
REMOVED_KEYS = ("manager.t_max_ms",)

RENAMED_KEYS = {
    "actor.clip_eps": "actor.loss.clip_eps",
    "actor.ratio": "actor.loss.ratio",
    "actor.loss_agg": "actor.loss.loss_agg",
    "actor.subgroup_mean": "actor.loss.subgroup_mean",
    "extractor.cispo_eps": "extractor.loss.clip_eps",
    "extractor.loss_agg": "extractor.loss.loss_agg",
    # issue 29: each config section is its dataclass's arguments
    "extractor.buffer_size": "extractor.buffer.batch_size",
    "extractor.cooldown": "extractor.buffer.cooldown",
    "extractor.alpha": "extractor.buffer.alpha",
    "extractor.recency_tau": "extractor.buffer.recency_tau",
    "extractor.max_entry_chars": "bank.max_entry_chars",
}


# Keys added since older run directories wrote their config.json: dotted key -> the value that reproduces what
# those runs did (an older run resumes with it, not with a spurious config change).
ADDED_KEYS = {
    "actor.trainable_layers": 0,
    "extractor.trainable_layers": 0,
    # runs before issue 27 computed everything in float32 and sampled from the training layout
    "actor.param_dtype": "float32",
    "actor.dtype": "float32",
    "actor.rollout_tensor": 0,
    "extractor.param_dtype": "float32",
    "extractor.dtype": "float32",
    "extractor.rollout_tensor": 0,
    # runs before issue 30 ran the chunked XLA attention everywhere; "auto" picks it on CPU and a kernel with the
    # same math elsewhere (a run-time choice, like the mesh)
    "actor.attention": "auto",
    "extractor.attention": "auto",
    "actor.kv_cache": "dense",  # runs before issue 30 had only the dense cache
    "extractor.kv_cache": "dense",
    # runs before issue 28: evaluation played min(eval_tasks, ...) tasks, the offline bank was not deduplicated
    "train.eval_full_splits": False,
    "bank.offline_dedup": 0.0,
    # runs before issue 28's producer-consumer distillation applied a step's lessons within the step
    "extractor.distill_overlap": "update",
    # runs before issue 30's sequence packing trained on one episode per row
    "actor.pack": False,
    "extractor.pack": False,
    # runs before the MoE dispatch became a config key used the model's own (dropless) in one exchange round
    # (an exchange only exists with "gmm"; the rounds change no number)
    "actor.moe_dispatch": "",
    "extractor.moe_dispatch": "",
    "actor.moe_exchange_tokens": 4096,
    "extractor.moe_exchange_tokens": 4096,
    # runs before issue 49's warm actor answered without a think
    "actor.think_chars": 0,
}


def upgrade_saved(tree: dict) -> dict:
    """A saved config tree (a run's ``config.json``) with :data:`REMOVED_KEYS` dropped, :data:`RENAMED_KEYS` moved
    to their current place and :data:`ADDED_KEYS` filled in where missing (a copy), so an older run resumes and
    evaluates without a spurious config change."""
    tree = copy.deepcopy(tree)
    for key in REMOVED_KEYS:
        node, leaf = keys.parent(tree, key)
        if node is not None:
            node.pop(leaf, None)
    for key, value in ADDED_KEYS.items():
        node, leaf = keys.parent(tree, key)
        if node is not None:
            node.setdefault(leaf, value)
    for old, new in RENAMED_KEYS.items():
        node, leaf = keys.parent(tree, old)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        dest, new_leaf = keys.parent(tree, new, create=True)
        dest.setdefault(new_leaf, value)
    return tree
