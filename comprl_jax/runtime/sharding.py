"""Device meshes, logical-axis rules and host->device placement.

Parameters carry *logical* axis names (``nnx.Param(..., out_sharding=("embed", "mlp"))``); a rule table maps
each logical name to a mesh axis (or a tuple of mesh axes, or None = replicated). The same model code thus runs
unsharded on one CPU, fsdp x tensor on a pod, or data x fsdp on 8 fake CPU devices in tests.

Mesh axes: ``data`` (batch only), ``fsdp`` (batch *and* parameter shards, ZeRO-3 style), ``tensor`` (Megatron
style: heads / MLP hidden / vocab). Mixture-of-experts weights carry an ``expert`` axis, mapped to ``fsdp``:
expert parallelism reuses the fsdp devices (each holds ``E / fsdp`` whole experts instead of a slice of every
expert), so no mesh axis or config key is added and a dense model's layout is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis / axes / None. Order matters only for readability; each name appears once.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("expert", "fsdp"),  # MoE expert weights [E, ...]: expert parallelism over the fsdp devices
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("q_heads_dim", "tensor"),  # fused [heads * head_dim] projections
    ("kv_heads_dim", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("length", None),
    ("cache_length", None),
)


def resolve_axes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fills one ``-1`` entry so that the product equals ``num_devices``.

    Args:
      axes: mesh axis name -> size (``-1`` = fill). Unknown names raise.
      num_devices: devices the mesh spans.
    """
    axes = dict(axes)
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(
            f"mesh axes {sorted(unknown)} are unknown; use a subset of {MESH_AXES} (config key mesh.*)"
        )
    for name in MESH_AXES:
        axes.setdefault(name, 1)
    fill = [k for k, v in axes.items() if v == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {fill} (config key mesh.*)")
    fixed = math.prod(v for v in axes.values() if v != -1)
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"cannot fill mesh axis {fill[0]!r}: {num_devices} devices not divisible by {fixed}"
            )
        axes[fill[0]] = num_devices // fixed
    if math.prod(axes.values()) != num_devices:
        raise ValueError(f"mesh {axes} spans {math.prod(axes.values())} devices but {num_devices} are given")
    return {k: axes[k] for k in MESH_AXES}


def target_platform() -> str:
    """The platform the computation is built for: the ambient mesh's devices (an AOT compile for a TPU topology
    runs on a CPU host with a TPU mesh), else the default backend. ``"tpu"``, ``"gpu"``, ``"cpu"``, ..."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        dev = getattr(mesh, "abstract_device", None)
        if dev is not None and getattr(dev, "platform", None):
            return _canonical(dev.platform)
    try:  # a concrete mesh set outside jit (jax.set_mesh) without a usable abstract device
        from jax._src import mesh as mesh_lib

        concrete = mesh_lib.get_concrete_mesh()
        if concrete is not None and not concrete.empty:
            return _canonical(concrete.devices.flat[0].platform)
    except (ImportError, AttributeError):
        pass
    return _canonical(jax.default_backend())


def _canonical(platform: str) -> str:
    return "gpu" if platform in ("cuda", "gpu") else platform


def make_mesh(axes: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ``(data, fsdp, tensor)``; all axes Explicit-free (Auto) so jit propagates shardings.

    Args:
      axes: e.g. ``{"data": -1}`` (default) or ``{"fsdp": 4, "tensor": 2}``.
      devices: defaults to ``jax.devices()``.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_axes(axes or {"data": -1}, len(devices))
    shape = tuple(sizes[k] for k in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(
    names: Sequence[str | None] | None, rules=DEFAULT_RULES, mesh: Mesh | None = None
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec. A mesh axis is used at most once (later dims that would reuse
    it are replicated); mesh axes of size 1 are dropped so specs stay readable.

    Raises:
      KeyError: a logical name has no rule.
    """
    if names is None:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(
                f"logical axis {name!r} has no sharding rule; add it to the rules (known: {sorted(table)})"
            )
        target = table[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(t for t in targets if t not in used and (mesh is None or mesh.shape.get(t, 1) > 1))
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def expert_parallel_spec(mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """Layout of a dispatched MoE buffer ``[B, E, ...]`` for expert-parallel compute: experts over the mesh axes
    of ``expert``, rows over the remaining ``batch`` axes. Moving a batch-sharded buffer to this layout is the
    all-to-all of expert parallelism (GSPMD inserts it). ``mesh`` may be abstract."""
    table = dict(rules)

    def axes(name):
        target = table.get(name)
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        return tuple(a for a in targets if mesh.shape.get(a, 1) > 1)

    ep = axes("expert")
    rows = tuple(a for a in axes("batch") if a not in ep)

    def entry(t):
        return None if not t else t[0] if len(t) == 1 else t

    return PartitionSpec(entry(rows), entry(ep))


def named_sharding(mesh: Mesh, names: Sequence[str | None] | None, rules=DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, mesh))


def _var_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    return var.get_metadata().get("out_sharding")


def state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings for an (abstract) ``nnx.State``: the same tree, each Variable's value replaced by the
    NamedSharding its ``out_sharding`` logical names resolve to. Variables without names are replicated."""

    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(named_sharding(mesh, _var_names(x), rules))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_specs(state: Any, rules=DEFAULT_RULES, mesh: Mesh | None = None) -> Any:
    """Like :func:`state_shardings` but PartitionSpecs (no mesh needed)."""

    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(logical_to_spec(_var_names(x), rules, mesh))
        return PartitionSpec()

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def own_sharding_rules():
    """Context in which NNX modules are built (and merged) without NNX's eager sharding.

    Parameters carry logical axis names (``out_sharding=`` metadata) that *we* resolve with :data:`DEFAULT_RULES`;
    eager sharding would instead demand a mesh context whenever a module is built, even unsharded on one CPU.
    Every place that constructs such a module enters this context (a scoped switch, not a process-wide one set at
    import); ``nnx.merge`` does not run constructors and needs none.
    """
    return nnx.use_eager_sharding(False)


def create_sharded(module_factory, mesh: Mesh, rules=DEFAULT_RULES):
    """Builds an NNX module with every parameter created already sharded, inside one jitted init.

    Args:
      module_factory: ``() -> nnx.Module`` (closing over its config and an ``nnx.Rngs``).
    Returns:
      ``(graphdef, state)`` with ``state`` leaves laid out as the rules say. No unsharded copy is ever made on
      one device: the init runs under ``jax.jit(out_shardings=...)``.
    """
    with own_sharding_rules():  # we resolve the logical names: the same module code with and without a mesh
        graphdef, abs_state = nnx.split(nnx.eval_shape(module_factory))
        shardings = state_shardings(abs_state, mesh, rules)
        state = jax.jit(lambda: nnx.split(module_factory())[1], out_shardings=shardings)()
    return graphdef, state


def abstract_module(module_factory):
    """``(graphdef, abstract_state)`` of a module without allocating (``jax.eval_shape``)."""
    with own_sharding_rules():
        return nnx.split(nnx.eval_shape(module_factory))


class MeshFn:
    """A jitted function that always traces, lowers and runs under its mesh (``jax.set_mesh``).

    The model pins activations to the ambient mesh's batch axes (``decoder.constrain_batch``) and MoE buffers to
    the expert layout; with no ambient mesh those constraints are no-ops and GSPMD lays activations out from the
    parameters alone: on 8 fake devices the FSDP update of a 7B-wide model then carried the whole batch on every
    device, split along the embedding, and planned 30.5 GiB of temporaries per device instead of 7.0 (issue 27).
    So every device function of a role is wrapped here, inside the library, not left to its caller.

    ``fn(*args)`` calls, ``fn.lower(*args)`` lowers (AOT, e.g. ``launch/compile_check.py``), ``fn.jitted`` is the
    plain ``jax.jit`` object; other attributes are the jitted function's.
    """

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def under_mesh(jitted, mesh: Mesh | None):
    """``jitted`` wrapped to run under ``mesh`` (:class:`MeshFn`); unchanged without a mesh."""
    return jitted if mesh is None else MeshFn(jitted, mesh)


def constrain(x: jax.Array, mesh: Mesh | None, names: Sequence[str | None], rules=DEFAULT_RULES) -> jax.Array:
    """``with_sharding_constraint`` by logical names; a no-op without a mesh (single-device code paths)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, names, rules))


def put_batch(batch: Any, mesh: Mesh, names: Sequence[str | None] = ("batch",), rules=DEFAULT_RULES) -> Any:
    """The one host->device transfer of a batch: numpy leaves ``[B, ...]`` -> arrays sharded over the batch axes.

    ``batch`` is the *global* batch (every process of a multi-process run holds the same host values, see
    ``comprl_jax/runtime/distributed.py``). Multi-process: each process hands over only the rows its own devices hold
    (:func:`process_rows`) through ``jax.make_array_from_process_local_data``.
    """
    sharding = named_sharding(mesh, names, rules)

    def one(x):
        x = np.asarray(x)
        if jax.process_count() > 1:
            rows = process_rows(sharding, x.shape)
            local = x if rows is None else x[rows]
            return jax.make_array_from_process_local_data(sharding, local, x.shape)
        return jax.device_put(x, sharding)

    return jax.tree.map(one, batch)


def process_rows(sharding: NamedSharding, shape: Sequence[int]) -> slice | None:
    """The contiguous block of leading-axis rows this process's devices hold under ``sharding``; None when that
    is the whole axis (replicated rows) or not one block (the full array is then passed; JAX takes its parts)."""
    n = shape[0]
    blocks = set()
    for ix in sharding.addressable_devices_indices_map(tuple(shape)).values():
        lo, hi, _ = (ix[0] if ix else slice(None)).indices(n)
        blocks.add((lo, hi))
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    covered = lo
    for a, b in sorted(blocks):
        if a > covered:
            return None
        covered = max(covered, b)
    return None if (lo, hi) == (0, n) or covered != hi else slice(lo, hi)
