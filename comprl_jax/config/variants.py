"""The ``--config`` flag's syntax: ``configs/x.py[:variant]``, a variant being ``scale[,method][,key=value...]``,
and :func:`build`, the common tail of every ``configs/*.py:get_config``."""

from __future__ import annotations

import ml_collections

from comprl_jax.config.methods import METHODS, apply_method
from comprl_jax.config.scales import SCALES, apply_scale
from comprl_jax.config.schema import base_config
from comprl_jax.config.validation import finalize


def parse_variant(arg: str | None) -> tuple[str, str | None, dict[str, str]]:
    """``"tiny"`` / ``"tiny,baseline"`` / ``"smollm,static_online"`` / ``""`` -> (scale, method or None, extras).

    Extras are ``key=value`` words (e.g. ``"tiny,tasks=3"``) that an experiment file may read.
    """
    scale, method, extras = "paper", None, {}
    for word in [w.strip() for w in (arg or "").split(",") if w.strip()]:
        if "=" in word:
            k, v = word.split("=", 1)
            extras[k] = v
        elif word in SCALES:
            scale = word
        elif word in METHODS:
            method = word
        else:
            raise ValueError(
                f"config variant word {word!r} unknown: use a scale {SCALES}, a method {METHODS}, "
                "or key=value"
            )
    return scale, method, extras


def load_file(path_variant: str) -> ml_collections.ConfigDict:
    """``"configs/x.py[:variant]"`` (the ``--config`` flag's syntax) -> that file's ``get_config(variant)``."""
    import importlib.util
    import os

    path, _, variant = path_variant.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} not found (from {path_variant!r})")
    name = "config_file_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def build(arg: str | None, experiment: str, edit=None, after_scale=None) -> ml_collections.ConfigDict:
    """The common tail of every ``configs/*.py:get_config``: base -> experiment edit -> scale -> the experiment's
    own sizes at that scale (``after_scale(c, scale)``, e.g. HiddenRule's tasks per step) -> method -> lock."""
    scale, method, extras = parse_variant(arg)
    c = base_config()
    c.experiment = experiment
    if edit is not None:
        edit(c, scale, extras)
    apply_scale(c, scale)
    if after_scale is not None:
        after_scale(c, scale)
    if method is not None:
        apply_method(c, method)
    return finalize(c)
