"""The sampler's own copy of a role's weights, laid out for decoding (issue 27 item 3).

Training keeps float32 master weights sharded FSDP style: every device holds ``1 / fsdp`` of every matrix, and a
forward pass all-gathers each layer's full weights. That is right for a 32k-token update (the gather is
amortised over the micro-batch), and wrong for decoding, where it would happen on every generated token (~30 GB
per device per token for the 7B actor in float32). As Tunix (``rl_cluster`` reshards to the rollout mesh), MaxText
and vLLM do, the sampler holds a second copy in the compute dtype on a **decode mesh** over the same devices:
``(data = n / t, fsdp = 1, tensor = t)``. The weights are split over ``tensor`` only (heads, MLP width, vocab:
Megatron style, so a decode step needs all-reduces of activations, never a weight all-gather) and replicated over
``data``; the rows and the KV cache split over ``data`` (and the cache's KV heads over ``tensor``).

``t`` (config key ``{role}.rollout_tensor``, 0 = auto) is the fewest devices, among the divisors of the device
count that also divide the model's KV heads, whose share of the copy stays under :data:`COPY_FRACTION` of a
device's memory; ``t = 1`` (a full replica per device, no collective at all while decoding) wherever it fits.
The copy is refreshed from the training state after every update (:meth:`RolloutLayout.refresh`: one jitted
cast + reshard), timed as the metric ``{role}/rollout_refresh_s``.

Without a mesh (one device) the copy is the training parameters cast to the compute dtype; when that is the
parameter dtype (the float32 CPU scales) no copy is made at all.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from comprl_jax.runtime import sharding as shd

# Largest share of one device's memory the sampler's copy may take when rollout_tensor is chosen automatically
# (the rest: the training state's FSDP shard, the KV cache of a wave of rows, the update's activations).
COPY_FRACTION = 0.25


def device_memory_bytes(device) -> int | None:
    """Memory of one device (``bytes_limit`` of its memory stats), or None where unknown (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 -- backends without memory stats raise or return None
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def copy_bytes(abstract_params, dtype: str) -> int:
    """Bytes of one full copy of the parameters in ``dtype`` (floating leaves; others as stored)."""
    total = 0
    for x in jax.tree.leaves(abstract_params):
        dt = jnp.dtype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        total += math.prod(x.shape) * dt.itemsize
    return total


def choose_tensor(num_devices: int, kv_heads: int, copy: int, device_bytes: int | None) -> int:
    """Tensor split of the decode copy: the smallest divisor ``t`` of ``num_devices`` (and of ``kv_heads``, so the
    KV cache splits evenly) with ``copy / t <= COPY_FRACTION x device_bytes``; 1 when the memory is unknown.

    Raises:
      ValueError: no such split exists (names the sizes and the key to set).
    """
    if device_bytes is None:
        return 1
    options = [t for t in range(1, num_devices + 1) if num_devices % t == 0 and kv_heads % t == 0]
    for t in options:
        if copy / t <= COPY_FRACTION * device_bytes:
            return t
    raise ValueError(
        f"the sampler's weight copy ({copy / 2**30:.1f} GiB) does not fit {COPY_FRACTION:.0%} of a device's "
        f"{device_bytes / 2**30:.1f} GiB at any tensor split of {num_devices} devices dividing {kv_heads} KV "
        "heads; set {role}.rollout_tensor explicitly, or use more devices"
    )


def decode_mesh(train_mesh: Mesh, tensor: int) -> Mesh:
    """``(data = n / tensor, fsdp = 1, tensor)`` over the training mesh's devices in the same order (so one jit
    may read the training layout and write this one: a reshard, no host round trip)."""
    devices = np.asarray(train_mesh.devices).reshape(-1)
    n = devices.size
    if tensor < 1 or n % tensor:
        raise ValueError(f"rollout tensor split {tensor} must divide the role's {n} devices")
    return Mesh(
        devices.reshape(n // tensor, 1, tensor),
        shd.MESH_AXES,
        axis_types=(AxisType.Auto,) * len(shd.MESH_AXES),
    )


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """Where and how the sampler's weights live.

    Attributes:
      mesh: the decode mesh (None: one device). shardings: the parameters' shardings on it (None without a mesh).
      dtype: the copy's floating dtype (the role's compute dtype). tensor: the tensor split (1 without a mesh).
      same: the copy *is* the training parameters (no mesh, and dtype == the parameter dtype).
    """

    mesh: Mesh | None
    shardings: Any
    dtype: str
    tensor: int
    same: bool

    def refresh(self, params):
        """The sampler's copy of ``params`` (the training state's): cast to :attr:`dtype` and laid out on
        :attr:`mesh`, one jitted call (asynchronous: returns before the device finishes)."""
        if self.same:
            return params
        return _refresh_fn(self.dtype, self.shardings)(params)


_REFRESH: dict[Any, Any] = {}


def _refresh_fn(dtype: str, shardings):
    """One jitted cast + reshard per (dtype, target layout)."""
    key = dtype, jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings))
    if key not in _REFRESH:
        dt = jnp.dtype(dtype)

        def cast(params):
            return jax.tree.map(
                lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
            )

        _REFRESH[key] = jax.jit(cast, out_shardings=shardings)
    return _REFRESH[key]


def rollout_layout(
    params, model_cfg, train_mesh: Mesh | None, tensor: int = 0, device_bytes=None
) -> RolloutLayout:
    """The decode layout of a role (see the module docstring).

    Args:
      params: the training parameters (an ``nnx.State``; arrays or abstract). model_cfg: the model's
        ``ModelConfig`` (its ``dtype`` is the copy's). train_mesh: the role's mesh (None: one device).
      tensor: ``{role}.rollout_tensor`` (0 = chosen by memory). device_bytes: one device's memory (default: from
        the device's memory stats; None on CPU, where the copy is replicated).
    """
    dtype = model_cfg.dtype
    if train_mesh is None:
        same = all(
            x.dtype == jnp.dtype(dtype) or not jnp.issubdtype(x.dtype, jnp.floating)
            for x in jax.tree.leaves(params)
        )
        return RolloutLayout(None, None, dtype, 1, same)
    n = train_mesh.devices.size
    if not tensor:
        if device_bytes is None:
            device_bytes = device_memory_bytes(train_mesh.devices.flat[0])
        tensor = choose_tensor(n, model_cfg.num_kv_heads, copy_bytes(params, dtype), device_bytes)
    mesh = decode_mesh(train_mesh, tensor)
    return RolloutLayout(mesh, shd.state_shardings(params, mesh), dtype, tensor, False)


class RefreshTimer:
    """Seconds the device spent on one refresh: from the update's outputs being ready (``updated``: e.g. its
    metrics, which are never donated, unlike the state) to the copy being ready, measured by a watcher thread (a
    wait, not a dispatch), so the caller's async dispatch is kept. ``no_copy``: the layout samples from the state
    itself (0 s)."""

    def __init__(self, updated, copy, *, no_copy: bool = False):
        self._seconds: float | None = None

        def watch():
            jax.block_until_ready(updated)
            if no_copy:  # the sampler reads the state itself; the next update may donate it under our feet
                self._seconds = 0.0
                return
            t0 = time.perf_counter()
            jax.block_until_ready(copy)
            self._seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=watch, name="rollout-refresh-watch", daemon=True)
        self._thread.start()

    def seconds(self) -> float:
        """Waits for the refresh and returns its device seconds."""
        self._thread.join()
        return float(self._seconds if self._seconds is not None else float("nan"))
