"""Start-up validation of a run config: :func:`validate` raises ValueError naming the first bad key.

Each section is checked by the dataclass it builds (``runtime.fields.from_section``: unknown keys, bad values),
where the code that reads it is; the checks that span sections are :class:`comprl_jax.config.run.RunConfig`'s.
"""

from __future__ import annotations

import ml_collections

from comprl_jax.config.run import RunConfig


def validate(c) -> RunConfig:
    """The config's :class:`RunConfig` (raises ValueError naming the first bad key)."""
    return RunConfig.of(c)


def finalize(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    validate(c)
    c.lock()
    return c
