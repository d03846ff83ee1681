"""The run configuration (ml_collections): schema, methods, scales, validation and older runs' upgrade.

Every experiment file in ``configs/`` builds on :func:`base_config` (the paper's hyperparameters, SPEC §9) and
applies a variant: ``""`` (paper scale, real model names), ``"tiny"`` (this CPU: tiny random-init models,
constrained decoding, small batches), ``"cpu"`` (tiny, sized to learn on 2 cores) or ``"smollm"``
(SmolLM2-135M-Instruct as actor and extractor), then a method (SPEC §8). Configs are locked: a typo in
``--config.actor.lr`` fails at parse time, and :func:`validate` names any bad value.

Modules: ``schema`` (every key, its default and comment), ``methods`` (:data:`METHOD_FLAGS`), ``scales``
(variants and the paper's task mixtures), ``validation`` and ``run`` (:class:`RunConfig`: the typed sections), ``upgrade`` (saved configs of older runs), ``variants``
(the ``--config`` syntax and :func:`build`), ``keys`` (the one dotted-key walker).
"""

from comprl_jax.config.keys import set_key
from comprl_jax.config.methods import METHOD_FLAGS, METHODS, apply_method
from comprl_jax.config.run import RunConfig
from comprl_jax.config.scales import (
    MIXTURE_STEPS,
    SCALES,
    SINGLE_TASK_STEPS,
    TASKS1,
    TASKS3,
    TASKS6,
    apply_scale,
    apply_tasks,
    with_optional_swe,
)
from comprl_jax.config.schema import base_config
from comprl_jax.config.upgrade import ADDED_KEYS, REMOVED_KEYS, RENAMED_KEYS, upgrade_saved
from comprl_jax.config.validation import finalize, validate
from comprl_jax.config.variants import build, load_file, parse_variant

__all__ = [
    "ADDED_KEYS",
    "METHODS",
    "METHOD_FLAGS",
    "MIXTURE_STEPS",
    "REMOVED_KEYS",
    "RENAMED_KEYS",
    "RunConfig",
    "SCALES",
    "SINGLE_TASK_STEPS",
    "TASKS1",
    "TASKS3",
    "TASKS6",
    "apply_method",
    "apply_scale",
    "apply_tasks",
    "with_optional_swe",
    "base_config",
    "build",
    "finalize",
    "load_file",
    "parse_variant",
    "set_key",
    "upgrade_saved",
    "validate",
]
