"""Shared helpers for trainer tests: minimal overrides that keep a `:tiny` run to seconds per step."""

import os

from comprl_jax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU_DIR = os.path.join(REPO, ".libtpu")  # `make libtpu`: the TPU compiler for AOT compiles on this CPU


def libtpu_path() -> str | None:
    """Where libtpu is: "" when installed in the environment, ``LIBTPU_DIR`` when `make libtpu` put it there,
    else None (the TPU-compile tests skip)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        return ""
    return LIBTPU_DIR if os.path.isdir(os.path.join(LIBTPU_DIR, "libtpu")) else None


# Smallest settings that still exercise every part of a step (guided + free, distil, merge, extractor update).
MINI = {
    "rollout.tasks_per_step": 1,
    "rollout.group_size": 2,
    "env.max_turns": 3,
    "env.workers": 1,
    "train.steps": 2,
    "train.eval_tasks": 1,
    "extractor.buffer.batch_size": 2,
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


# Keys a :tiny complementary run on one device does not read, and why (record_config_reads). Any other unread key
# is an option that silently does nothing in the run, e.g. one that only a class the trainer never builds reads.
NOT_READ_BY_A_TINY_RUN = {
    "experiment": "a label for launch/, tables and plots",
    "bank.offline_build_steps": "Offline Exp. only (bank.offline)",
    "bank.offline_dedup": "Offline Exp. only (bank.offline)",
    "retrieval.window_s": "retrieval.clock='wall' only",
    "mesh.actor_fraction": "several devices only (mesh.num_devices = 1 at :tiny)",
    "mesh.data": "several devices only",
    "mesh.fsdp": "several devices only",
    "mesh.tensor": "several devices only",
    "mesh.extractor_tensor": "several devices only",
}


def record_config_reads(config, monkeypatch) -> set[str]:
    """The dotted keys of the run config read from now on (the returned set fills as the run reads them).

    The trainer opens the ``ConfigDict`` once, as a typed ``RunConfig`` (issue 29); a key counts as read when the
    run consults its field on a section dataclass of that RunConfig (or a ``dataclasses.replace`` copy of one):
    not the dataclasses' own ``__init__`` / ``__post_init__`` checks, ``__eq__`` / ``__hash__`` / ``__repr__``,
    or ``asdict`` (persistence)."""
    import dataclasses
    import typing

    from comprl_jax.config.run import SECTIONS, RunConfig

    del config  # (the run builds its own RunConfig from it; its sections are registered as they are built)
    paths: dict[int, str] = {}
    alive: list = []  # registered instances stay alive, so their ids are not reused
    reads: set[str] = set()
    quiet = [0]

    def register(obj, prefix):
        paths[id(obj)] = prefix
        alive.append(obj)
        for f in dataclasses.fields(obj):
            v = object.__getattribute__(obj, f.name)
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                register(v, f"{prefix}{f.name}.")

    classes: set[type] = set()

    def collect(cls):
        classes.add(cls)
        for t in typing.get_type_hints(cls).values():
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                collect(t)

    for cls in SECTIONS.values():
        collect(cls)
    of = RunConfig.__dict__["of"].__func__

    def of_recorded(cls, c):
        rc = of(cls, c)
        for name in SECTIONS:
            register(object.__getattribute__(rc, name), f"{name}.")
        paths[id(rc)] = ""
        alive.append(rc)
        return rc

    monkeypatch.setattr(RunConfig, "of", classmethod(of_recorded))
    classes.add(RunConfig)

    def quietly(fn):
        def wrapped(*a, **k):
            quiet[0] += 1
            try:
                return fn(*a, **k)
            finally:
                quiet[0] -= 1

        return wrapped

    for cls in classes:
        names = frozenset(f.name for f in dataclasses.fields(cls))

        def getattribute(self, name, _names=names):
            value = object.__getattribute__(self, name)
            if not quiet[0] and name in _names and id(self) in paths:
                if not (dataclasses.is_dataclass(value) and not isinstance(value, type)):
                    reads.add(paths[id(self)] + name)
            return value

        monkeypatch.setattr(cls, "__getattribute__", getattribute)
        for dunder in ("__init__", "__eq__", "__hash__", "__repr__"):
            if dunder in cls.__dict__ and cls.__dict__[dunder] is not None:
                monkeypatch.setattr(cls, dunder, quietly(cls.__dict__[dunder]))
    replace = dataclasses.replace

    def replace_recorded(obj, /, **changes):
        out = quietly(replace)(obj, **changes)
        if id(obj) in paths:
            register(out, paths[id(obj)])
        return out

    monkeypatch.setattr(dataclasses, "replace", replace_recorded)
    monkeypatch.setattr(dataclasses, "asdict", quietly(dataclasses.asdict))
    return reads


def unread_keys(config, reads: set[str]) -> list[str]:
    from launch.common import config_tree, flatten

    keys = flatten(config_tree(config))
    return sorted(k for k in keys if k not in reads and not any(r.startswith(k + ".") for r in reads))


# Two processes x 4 fake CPU devices, 8 episodes per step: one row per device of the (data 8) actor mesh spanning
# both processes (tests/test_multihost.py, tests/test_pod_standins.py).
TWO_PROCESS_OVER = {
    "mesh.num_devices": 0,
    "rollout.tasks_per_step": 2,
    "rollout.group_size": 4,
    "actor.micro_batch": 8,
    "extractor.micro_batch": 8,
    "extractor.buffer.batch_size": 8,
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
