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
    """The dotted keys of ``config`` read from now on (the returned set fills as the run reads them): every
    ``ConfigDict`` item access on ``config``, its sub-dicts and their ``copy_and_resolve_references`` copies;
    ``to_dict`` of a sub-dict reads its keys, of the whole config (printing it) none."""
    import ml_collections

    paths: dict[int, str] = {}
    reads: set[str] = set()
    quiet = [0]

    def register(cd, prefix):
        paths[id(cd)] = prefix
        for k, v in cd._fields.items():
            if isinstance(v, ml_collections.ConfigDict):
                register(v, f"{prefix}{k}.")

    register(config, "")
    get, copy, to_dict = (
        ml_collections.ConfigDict.__getitem__,
        ml_collections.ConfigDict.copy_and_resolve_references,
        ml_collections.ConfigDict.to_dict,
    )

    def getitem(self, key):
        if not quiet[0] and id(self) in paths:
            reads.add(paths[id(self)] + key)
        return get(self, key)

    def copied(self, *a, **k):
        quiet[0] += 1
        try:
            out = copy(self, *a, **k)
        finally:
            quiet[0] -= 1
        if id(self) in paths:
            register(out, paths[id(self)])
        return out

    def as_dict(self, *a, **k):
        quiet[0] += paths.get(id(self)) == ""  # the whole config: a print, not a read
        try:
            return to_dict(self, *a, **k)
        finally:
            quiet[0] -= paths.get(id(self)) == ""

    monkeypatch.setattr(ml_collections.ConfigDict, "__getitem__", getitem)
    monkeypatch.setattr(ml_collections.ConfigDict, "copy_and_resolve_references", copied)
    monkeypatch.setattr(ml_collections.ConfigDict, "to_dict", as_dict)
    return reads


def unread_keys(config, reads: set[str]) -> list[str]:
    from launch.common import config_tree, flatten

    keys = flatten(config_tree(config))
    return sorted(k for k in keys if k not in reads and not any(r.startswith(k + ".") for r in reads))


def record_field_reads(classes, monkeypatch) -> tuple[set[str], set[str]]:
    """``(read, given)``: ``"Class.field"`` for every dataclass field of ``classes`` read from now on, outside
    ``dataclasses``'s own helpers (``asdict`` for persistence, ``__eq__``/``__repr__``), and for every field passed
    explicitly to a constructor: what the run hands the components it builds, and what they actually consult."""
    import dataclasses

    reads: set[str] = set()
    given: set[str] = set()
    quiet = [0]
    for cls in classes:
        names = [f.name for f in dataclasses.fields(cls)]

        def getattribute(self, name, _names=frozenset(names), _cls=cls):
            if name in _names and not quiet[0]:
                reads.add(f"{_cls.__name__}.{name}")
            return object.__getattribute__(self, name)

        def init(self, *args, _init=cls.__init__, _names=names, _cls=cls, **kwargs):
            given.update(f"{_cls.__name__}.{n}" for n in [*_names[: len(args)], *kwargs])
            quiet[0] += 1  # the dataclass's own __init__ / __post_init__ checks are not uses
            try:
                _init(self, *args, **kwargs)
            finally:
                quiet[0] -= 1

        monkeypatch.setattr(cls, "__getattribute__", getattribute)
        monkeypatch.setattr(cls, "__init__", init)
    asdict = dataclasses.asdict

    def quiet_asdict(obj, *a, **k):
        quiet[0] += 1
        try:
            return asdict(obj, *a, **k)
        finally:
            quiet[0] -= 1

    monkeypatch.setattr(dataclasses, "asdict", quiet_asdict)
    return reads, given
