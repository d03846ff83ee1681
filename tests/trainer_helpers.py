"""Shared helpers for trainer tests: minimal overrides that keep a `:tiny` run to seconds per step."""

import os

from comprl_jax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Smallest settings that still exercise every part of a step (guided + free, distil, merge, extractor update).
MINI = {
    "rollout.tasks_per_step": 1,
    "rollout.group_size": 2,
    "env.max_turns": 3,
    "env.workers": 1,
    "train.steps": 2,
    "train.eval_tasks": 1,
    "extractor.buffer_size": 2,
    "actor.micro_batch": 1,
    "extractor.micro_batch": 1,
    "checkpoint.every": 1,
    "bank.merge_every": 1,
    "extractor.sampling.max_new_tokens": 128,
}


def load_config(name: str, variant: str = "tiny", **overrides):
    c = config_lib.load_file(os.path.join(REPO, "configs", f"{name}.py") + f":{variant}")
    for key, value in {**MINI, **overrides}.items():
        config_lib.set_key(c, key, value)
    return c


def flags(**overrides) -> list[str]:
    return [f"--config.{k}={v}" for k, v in {**MINI, **overrides}.items()]


# A persistent XLA cache shared by the runs of a test module (later runs reuse earlier runs' compiled programs).
# JAX writes cache files in place; without a size limit it also reads them without a lock, and a read that races
# a write of the same entry (another thread or process compiling the same program) crashes in deserialisation.
# A size limit turns on JAX's file lock around every read and write.
CACHE_MAX_BYTES = 16 * 2**30


def cache_env(cache_dir) -> dict[str, str]:
    """Environment variables that point a subprocess at a shared persistent cache (with the lock on)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(CACHE_MAX_BYTES),
    }


def use_cache(cache_dir) -> None:
    """The same for this process (``None``: off)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", None if cache_dir is None else str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES if cache_dir else -1)
    # JAX decides once per process whether (and where) the cache is used: make it decide again.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
