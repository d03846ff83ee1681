"""Multi-controller runtime (SPEC §6): process start-up, actor / extractor device meshes, host-state exchange,
and replica digests.

The design is a *replicated host state machine over SPMD device state*:

* Device state (parameters, optimizer states, KV caches) lives in global arrays on the meshes; every process
  issues the same jitted calls in the same order, from the main thread only (the extractor track runs inline
  when ``jax.process_count() > 1``; overlap comes from async dispatch onto disjoint meshes).
* Host state (episodes, experience bank, extractor buffer, task sampler, counters) is replicated: every process
  runs the same control flow on the same inputs. Inputs that exist on one process only are exchanged first:
  each process steps the env slots it owns (:func:`owned_rows`) and the results are all-gathered
  (:func:`allgather_objects`); sampler outputs are replicated on device before they reach the host
  (``roles.role.MeshSampler``, through :func:`replicate_fn`). Retrieval is exact search (deterministic numpy) in multi-process runs, so identical
  banks answer identical queries identically.
* :func:`host_digest` / :func:`check_replicas` hash that state and compare it across processes at every
  checkpoint: a divergence raises instead of silently training on different banks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from comprl_jax.runtime.fields import check

PLACEMENTS = ("colocated", "disjoint")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Config section ``mesh``: each role's ``(data, fsdp, tensor)`` mesh over its devices (one -1 = fill),
    ``colocated`` (both roles on the same devices) or ``disjoint`` (``actor_fraction`` of each process's devices
    for the actor, the rest for the extractor); ``extractor_tensor`` (0 = ``tensor``); ``num_devices`` (0 = all)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    extractor_tensor: int = 0
    placement: str = "colocated"
    actor_fraction: float = 0.5
    num_devices: int = 0

    def __post_init__(self):
        for axis in ("data", "fsdp", "tensor"):
            v = getattr(self, axis)
            check(v == -1 or v >= 1, axis, "must be -1 (fill) or >= 1", v)
        axes = [self.data, self.fsdp, self.tensor]
        check(axes.count(-1) <= 1, "data", "at most one of mesh.data / fsdp / tensor may be -1 (fill)", axes)
        check(
            self.extractor_tensor >= 0,
            "extractor_tensor",
            "must be >= 0 (0 = mesh.tensor)",
            self.extractor_tensor,
        )
        check(self.placement in PLACEMENTS, "placement", f"must be one of {PLACEMENTS}", self.placement)
        check(0.0 < self.actor_fraction < 1.0, "actor_fraction", "must be in (0, 1)", self.actor_fraction)
        check(self.num_devices >= 0, "num_devices", "must be >= 0 (0 = all devices)", self.num_devices)


log = logging.getLogger(__name__)


# -- start-up -------------------------------------------------------------------------------------------
def initialize(
    auto: bool = False,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Starts JAX's multi-controller runtime (call before any other JAX use).

    Args:
      auto: ``jax.distributed.initialize()`` with no arguments (TPU pods, SLURM, ... are auto-detected).
      coordinator / num_processes / process_id: explicit start-up (``host:port`` of process 0).
    """
    if not auto and coordinator is None:
        return
    if coordinator is not None and (num_processes is None or process_id is None):
        raise ValueError("--coordinator needs --num_processes and --process_id")
    # CPU processes need a collectives backend for cross-process computations (tests, CPU clusters).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator, int(num_processes), int(process_id))
    log.info(
        "process %d of %d: %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def multi() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    if multi():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# -- meshes ---------------------------------------------------------------------------------------------
def _per_process_devices() -> list[list[jax.Device]]:
    by: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        by.setdefault(d.process_index, []).append(d)
    return [sorted(by[p], key=lambda d: d.id) for p in sorted(by)]


def role_devices(mesh_cfg: Any) -> tuple[list[jax.Device], list[jax.Device]] | None:
    """(actor devices, extractor devices) from the ``mesh`` config section, or None for the single-device path.

    ``mesh.num_devices`` (0 = all) takes the same number of devices from every process. ``colocated``: both roles
    on all of them. ``disjoint``: each process gives ``round(actor_fraction * local)`` of its devices to the actor
    and the rest to the extractor, so every process feeds both meshes (env pools and sampler inputs stay local).
    """
    per = _per_process_devices()
    total = sum(len(p) for p in per)
    n = int(mesh_cfg.num_devices) or total
    if n > total or n % len(per):
        raise ValueError(
            f"config key mesh.num_devices={mesh_cfg.num_devices}: {total} devices over {len(per)} processes; "
            f"use 0 (all) or a multiple of {len(per)} up to {total}"
        )
    local = n // len(per)
    per = [p[:local] for p in per]
    if mesh_cfg.placement == "colocated":
        devs = [d for p in per for d in p]
        if len(devs) == 1:
            return None  # one device: the unsharded path (bit-identical to runs without a mesh)
        return devs, devs
    k = round(mesh_cfg.actor_fraction * local)
    if not 0 < k < local:
        raise ValueError(
            f"config key mesh.actor_fraction={mesh_cfg.actor_fraction}: {local} devices per process leave no "
            "device for the actor or the extractor; change the fraction or use mesh.placement='colocated'"
        )
    return [d for p in per for d in p[:k]], [d for p in per for d in p[k:]]


def build_meshes(mesh_cfg: Any):
    """(actor mesh, extractor mesh) over :func:`role_devices`; both None on the single-device path."""
    from comprl_jax.runtime import sharding as shd

    devs = role_devices(mesh_cfg)
    if devs is None:
        return None, None
    axes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
    ext_axes = {**axes, "tensor": mesh_cfg.extractor_tensor or mesh_cfg.tensor}
    out = []
    for role, d, ax in zip(("actor", "extractor"), devs, (axes, ext_axes), strict=True):
        try:
            out.append(shd.make_mesh(ax, d))
        except ValueError as e:
            raise ValueError(
                f"config keys mesh.data/fsdp/tensor{'/extractor_tensor' * (role == 'extractor')}={ax} do not fit "
                f"the {role}'s {len(d)} devices (placement {mesh_cfg.placement!r}): {e}"
            ) from None
    if devs[0] is devs[1] and ext_axes == axes:
        return out[0], out[0]
    return out[0], out[1]


def batch_devices(mesh) -> int:
    """Devices the ``batch`` logical axis is split over (batch sizes must be multiples of it)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in ("data", "fsdp"))


# -- host-state exchange --------------------------------------------------------------------------------
def owned_rows(n: int) -> range:
    """The contiguous block of ``n`` rows (episodes) whose env slots this process steps."""
    p, P = jax.process_index(), jax.process_count()
    return range(n * p // P, n * (p + 1) // P)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    return str(x)


def _gather_mesh(devices: Sequence[jax.Device] | None):
    """A 1-D mesh over the first of ``devices`` on each process (host exchanges touch only those devices)."""
    from jax.sharding import Mesh

    firsts: dict[int, jax.Device] = {}
    for d in sorted(devices if devices is not None else jax.devices(), key=lambda d: d.id):
        firsts.setdefault(d.process_index, d)
    if len(firsts) != jax.process_count():
        raise ValueError("host exchange devices must include a device of every process")
    return Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("p",))


def allgather_rows(x: np.ndarray, devices: Sequence[jax.Device] | None = None) -> np.ndarray:
    """``[...]`` per process -> ``[P, ...]`` on every process (one jitted all-gather over one device per process;
    the same shape on every process)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _gather_mesh(devices)
    x = np.asarray(x)[None]
    shape = (mesh.size,) + x.shape[1:]
    g = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("p")), x, shape)
    return np.asarray(replicate_fn(NamedSharding(mesh, PartitionSpec()))(g))


def allgather_objects(local: dict[int, Any], devices: Sequence[jax.Device] | None = None) -> dict[int, Any]:
    """Every process contributes ``{row: JSON-able value}``; every process gets the union (JSON round trip, so
    the values are identical on all processes, the local ones included). Two small collectives over one device
    per process of ``devices`` (default: all devices; the trainer passes the actor's, so an extractor update
    in flight on disjoint devices is not waited for)."""
    blob = json.dumps(_jsonable({str(k): v for k, v in local.items()}), sort_keys=True).encode()
    sizes = allgather_rows(np.array([len(blob)], np.int32), devices).reshape(-1)
    width = int(np.max(sizes))
    buf = np.zeros((width,), np.uint8)
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    got = allgather_rows(buf, devices)
    out: dict[int, Any] = {}
    for p, size in enumerate(sizes):
        for k, v in json.loads(bytes(got[p, : int(size)]).decode()).items():
            out[int(k)] = v
    return out


def replicate(x: Any, mesh) -> Any:
    """Host values (identical on every process) -> arrays replicated over ``mesh``."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def fetch(tree: Any) -> Any:
    """Host numpy copy of (possibly multi-process) arrays: fully replicated / addressable arrays are read locally,
    others are all-gathered (a collective: call it at the same point on every process)."""
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x.addressable_shards[0].data) if not x.is_fully_addressable else np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


_REPLICATORS: dict[Any, Any] = {}


def replicate_fn(sharding):
    """A jitted identity whose output has ``sharding`` (cached per sharding): a sharded array made whole on every
    device, so every process can read it."""
    if sharding not in _REPLICATORS:
        _REPLICATORS[sharding] = jax.jit(lambda t: t, out_shardings=sharding)
    return _REPLICATORS[sharding]


# -- replica digests ------------------------------------------------------------------------------------
def local_replica(x: Any) -> np.ndarray:
    """This process's copy of an array, assembled from its own devices' shards when they cover the whole value
    (data-parallel replicas: each process holds one), else all-gathered (a collective)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    seen = np.zeros(x.shape, bool)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
        seen[shard.index] = True
    return out if seen.all() else fetch(x)


def tree_digest(tree: Any) -> str:
    """SHA-256 over every leaf (shape, dtype, bytes) of this process's replica of ``tree``."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree.flatten(tree)
    h.update(str(treedef).encode())
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.ascontiguousarray(local_replica(leaf))
        h.update(f"{a.shape}{a.dtype.str}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def host_digest(track: Any, extra: Any = None) -> str:
    """SHA-256 of the replicated host state: bank entries, key vectors, op log, extractor buffer, counters."""
    h = hashlib.sha256()
    h.update(json.dumps(_jsonable(extra), sort_keys=True).encode())
    if track is not None:
        mgr = track.mgr
        with mgr.lock.read():
            bank = mgr.bank
            for uid in sorted(bank.entries):
                e = bank.entries[uid]
                h.update(json.dumps(_jsonable(e.__dict__), sort_keys=True, default=str).encode())
                h.update(np.ascontiguousarray(bank.vector(uid), np.float32).tobytes())
            h.update(json.dumps(_jsonable(list(bank.op_log)), sort_keys=True, default=str).encode())
            h.update(json.dumps(_jsonable(sorted(mgr.buffer.samples)), default=str).encode())
            h.update(json.dumps(_jsonable(dict(mgr.counts)), sort_keys=True).encode())
        h.update(f"{track.calls}/{track.version}".encode())
    return h.hexdigest()


def check_replicas(what: str, digest: str) -> None:
    """All-gathers ``digest`` and raises when processes disagree (a no-op with one process)."""
    if not multi():
        return
    got = allgather_objects({jax.process_index(): digest})
    if len(set(got.values())) > 1:
        raise RuntimeError(
            f"{what} diverged across processes: {got}. Every process must run the same control flow on the "
            "same inputs (see comprl_jax/runtime/distributed.py)"
        )
