r"""Per-device memory plan for a model on a mesh: parameters, AdamW state, gradients and a KV cache.

Nothing is allocated: the parameter tree comes from ``jax.eval_shape`` and each array's per-device shard shape
from the logical-axis rules (``comprl_jax.sharding.DEFAULT_RULES``) on an abstract mesh, so a TPU v5p-64 plan
runs on a laptop. Convention: AdamW keeps mu and nu in float32 (8 bytes per parameter) whatever the parameter
dtype; gradients are in the parameter dtype; activations and XLA temporaries are NOT counted.

COMMAND:
  .venv/bin/python launch/plan_memory.py --config=qwen2.5-7b-instruct --mesh=fsdp=8 --batch=8 --seq_len=4096
  # prints one JSON line, then a table; optimizer state per device = 7,617,949,696 bytes (7.09 GiB)
  .venv/bin/python launch/plan_memory.py --config=qwen3-4b --mesh=data=2,fsdp=4 \
      --extractor_config=qwen3-4b --extractor_mesh=fsdp=8      # disjoint actor / extractor meshes
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from comprl_jax import sharding
from comprl_jax.models.config import named_config
from comprl_jax.models.decoder import CACHE_AXES, abstract_decoder

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "qwen2.5-7b-instruct", "shipped model name, config.json path or HF folder")
flags.DEFINE_string("mesh", "fsdp=8", "mesh axes, e.g. 'fsdp=8' or 'data=2,fsdp=4,tensor=2'")
flags.DEFINE_integer("batch", 8, "KV cache rows (global)")
flags.DEFINE_integer("seq_len", 4096, "KV cache length")
flags.DEFINE_string("param_dtype", "float32", "parameter (master weight) dtype")
flags.DEFINE_string("cache_dtype", "bfloat16", "KV cache dtype")
flags.DEFINE_string("extractor_config", None, "optional second model on its own (disjoint) mesh")
flags.DEFINE_string("extractor_mesh", "fsdp=8", "mesh axes of the extractor")

GIB = 1024**3


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1} (unknown axis names raise, naming them)."""
    axes = {}
    for part in filter(None, spec.split(",")):
        name, _, size = part.partition("=")
        if not size.strip().isdigit():
            raise ValueError(f"--mesh entry {part!r} must look like name=size")
        axes[name.strip()] = int(size)
    return sharding.resolve_axes(axes, math.prod(axes.values()))


def shard_bytes(shape, dtype, names, mesh: AbstractMesh, rules=sharding.DEFAULT_RULES) -> int:
    """Bytes one device holds of an array laid out by logical ``names`` (uneven dims round up, as XLA pads)."""
    spec = sharding.logical_to_spec(names, rules, mesh)
    n = 1
    for i, size in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= -(-size // math.prod(mesh.shape[a] for a in axes))
    return n * jnp.dtype(dtype).itemsize


def plan(
    config: str, mesh_axes: dict[str, int], batch: int, seq_len: int, param_dtype: str, cache_dtype: str
) -> dict:
    """Per-device bytes of params / AdamW (mu+nu fp32) / grads / KV cache for ``config`` on ``mesh_axes``."""
    cfg = named_config(config, param_dtype=param_dtype)
    mesh = AbstractMesh(
        tuple(mesh_axes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3
    )
    _, abstract = abstract_decoder(cfg)  # jax.eval_shape: no allocation
    variables = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    total = replicated = param_b = opt_b = 0
    for v in variables:
        names = v.get_metadata().get("out_sharding")
        total += v.size
        if sharding.logical_to_spec(names, mesh=mesh) == jax.sharding.PartitionSpec():
            replicated += v.size
        param_b += shard_bytes(v.shape, v.dtype, names, mesh)
        opt_b += 2 * shard_bytes(v.shape, jnp.float32, names, mesh)  # mu + nu, float32 by convention
    cache_shape = (cfg.num_layers, batch, seq_len, cfg.num_kv_heads, cfg.head_dim)
    cache_b = 2 * shard_bytes(cache_shape, cache_dtype, CACHE_AXES, mesh)  # k and v
    per_device = {"params": param_b, "adamw_state": opt_b, "grads": param_b, "kv_cache": cache_b}
    per_device["total"] = sum(per_device.values())
    return {
        "config": config,
        "arch": cfg.arch,
        "mesh": mesh_axes,
        "devices": mesh.size,
        "param_count": total,
        "replicated_param_count": replicated,
        "param_dtype": param_dtype,
        "adamw_state_dtype": "float32 (mu + nu, 8 bytes/param)",
        "grad_dtype": param_dtype,
        "kv_cache": {"batch": batch, "seq_len": seq_len, "dtype": cache_dtype},
        "bytes_per_device": per_device,
        "note": "activations and XLA temporaries not included",
    }


def table(rows: list[dict]) -> str:
    cols = ["params", "adamw_state", "grads", "kv_cache", "total"]  # adamw_state: mu + nu in float32
    head = f"{'model':<24} {'mesh':<22} " + " ".join(f"{c + ' GiB':>15}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
        vals = " ".join(f"{r['bytes_per_device'][c] / GIB:>15.3f}" for c in cols)
        lines.append(f"{r['config']:<24} {mesh:<22} {vals}")
    return "\n".join(lines)


def main(argv):
    del argv
    rows = [
        plan(
            FLAGS.config,
            parse_mesh(FLAGS.mesh),
            FLAGS.batch,
            FLAGS.seq_len,
            FLAGS.param_dtype,
            FLAGS.cache_dtype,
        )
    ]
    out = dict(rows[0])
    if FLAGS.extractor_config:
        ext = plan(
            FLAGS.extractor_config,
            parse_mesh(FLAGS.extractor_mesh),
            FLAGS.batch,
            FLAGS.seq_len,
            FLAGS.param_dtype,
            FLAGS.cache_dtype,
        )
        rows.append(ext)
        out["extractor"] = ext
        out["total_devices_disjoint"] = rows[0]["devices"] + ext["devices"]
    print(json.dumps(out))
    print(table(rows))
    print("per device; AdamW mu+nu in float32; grads in param dtype; activations excluded", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
