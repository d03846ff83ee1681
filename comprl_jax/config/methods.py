"""Methods (SPEC §8) as data: :data:`METHOD_FLAGS` maps each variant word to the flags the trainer reads
(``actor.train``, ``extractor.train``, ``experience.enabled``, ``bank.offline``, ...); ``method`` itself is a label
for tables and plots. Adding a baseline = one entry here."""

from __future__ import annotations

import ml_collections

from comprl_jax.config import keys

# SPEC §8: what each method trains and uses. "custom": any flags (set them with --config.<key>=...).
METHOD_FLAGS = {
    "complementary": {
        "actor.train": True,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
    },
    # Outcome-only GRPO: no experience, all K rollouts free, no extractor.
    "baseline": {
        "actor.train": True,
        "extractor.train": False,
        "experience.enabled": False,
        "bank.offline": False,
        "experience.blank": False,
    },
    # The full loop with a frozen extractor.
    "static_online": {
        "actor.train": True,
        "extractor.train": False,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
    },
    # The extractor is trained, the actor frozen.
    "exp_only": {
        "actor.train": False,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
    },
    # A fixed bank built before training by the frozen extractor from the frozen actor's rollouts, merged once.
    "offline": {
        "actor.train": True,
        "extractor.train": False,
        "experience.enabled": True,
        "bank.offline": True,
        "experience.blank": False,
    },
    # Complementary RL with self-distillation (paper §4.3, SPEC §7): an SFT term on the guided trajectories that
    # beat their group's free mean, experience stripped. The coefficient is ours (the paper gives none).
    "self_distill": {
        "actor.train": True,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
        "actor.self_distill_coef": 0.1,
    },
    # Control arm (issue 19): the full loop, but the guided half's experience block is blanked (header, "[No
    # experience found]" and filler to the same token length) and search & ask is off: what the subgroup split and
    # the longer prompt do on their own, without any experience content.
    "blank_exp": {
        "actor.train": True,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": True,
        "retrieval.search_and_ask": False,
    },
}
METHODS = (*METHOD_FLAGS, "custom")


def apply_method(c: ml_collections.ConfigDict, method: str) -> ml_collections.ConfigDict:
    """SPEC §8 methods as config flags (:data:`METHOD_FLAGS`); ``method`` becomes the run's label."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} unknown; choose one of {METHODS} (config key method)")
    c.method = method
    for key, value in METHOD_FLAGS.get(method, {}).items():
        keys.set_key(c, key, value)
    return c
