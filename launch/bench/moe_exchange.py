"""The gmm dispatch's expert exchange through the TPU compiler: per-chip temporaries against expert shards and rounds.

The expert-parallel ``gmm`` path (``models/moe.py``) sends each device's assignments to the devices holding their
experts through static worst-case buffers (``P x k`` rows per token for ``P`` expert shards). This compiles a tiny
qwen3_moe forward + grad for a v5p:2x2x1 slice (libtpu AOT on this CPU; no TPU needed) with one sequence per chip
and reads ``memory_analysis().temp_size_in_bytes``: the growth with ``P`` is the exchange, and
``ModelConfig.moe_exchange_tokens`` (rounds, each rematerialised) should take it away.

COMMAND: PYTHONPATH=.libtpu .venv/bin/python launch/bench/moe_exchange.py [--tokens=4096] [--rounds=0,1024]
Prints one JSON line per (rounds, expert shards): {"bench": "moe_exchange", "topology", "expert_shards",
"tokens_per_chip", "rounds", "temp_mib", ...}.

Measured 2026-12-05 (this box, libtpu 0.0.42; hidden 128, 8 experts, top-2, width 128, 2 layers, no remat):
4,096 tokens per chip, one round: 187.8 MiB at P = 1, 402.1 at P = 4 (+214 MiB: 4.6 KB per exchanged row and
layer; launch/plan_memory.py counts 5.1); rounds of 1,024: 187.8 and 190.2. 1,024 tokens, one round: 53.0 / 70.5
/ 110.3 MiB at P = 1 / 2 / 4.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402


def compile_tiny_moe(devices, mesh_axes: dict, batch: int, tokens: int, *, moe_width: int = 128, rounds=None):
    """AOT-compiles a tiny qwen3_moe forward + grad with the gmm dispatch on ``devices`` (a mesh of ``mesh_axes``;
    fsdp is the expert axis) for ``batch`` rows of ``tokens``, rows over the batch axes. ``moe_width``: each
    expert's width (the kernel tiles by 128); ``rounds``: ``moe_exchange_tokens`` (None: the model's default).
    Shared with ``tests/test_moe_gmm.py``'s compile check."""
    from comprl_jax.models import ModelConfig
    from comprl_jax.models import decoder as D
    from comprl_jax.runtime import sharding

    mesh = sharding.make_mesh(dict(mesh_axes), devices=devices[: math.prod(mesh_axes.values())])
    extra = {} if rounds is None else {"moe_exchange_tokens": rounds}
    cfg = ModelConfig.tiny(
        "qwen3_moe", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, moe_intermediate_size=moe_width,
        intermediate_size=256, moe_dispatch="gmm", dtype="bfloat16", **extra,
    )  # fmt: skip
    gd, abstract = D.abstract_decoder(cfg)
    shardings = sharding.state_shardings(abstract, mesh)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    row = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh=mesh))
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=row)
    mask = jax.ShapeDtypeStruct((batch, tokens), jnp.bool_, sharding=row)

    def loss(params, ids, mask):
        positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
        logits = D.forward(gd, params, ids, positions, mask)
        return jnp.sum(jnp.where(mask[..., None], logits.astype(jnp.float32), 0.0))

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss)).lower(params, ids, mask).compile()


def temp_mib(devices, shards: int, tokens: int, rounds: int) -> float:
    """Per-chip temporaries (MiB) with one sequence of ``tokens`` per chip over ``shards`` expert shards."""
    compiled = compile_tiny_moe(devices, {"fsdp": shards, "tensor": 1}, shards, tokens, rounds=rounds)
    return round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per chip")
    ap.add_argument("--rounds", default="0,1024", help="moe_exchange_tokens values (0 = one round)")
    ap.add_argument("--shards", default="1,4", help="expert shards (fsdp devices)")
    args = ap.parse_args(argv)
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(args.topology, platform="tpu").devices)
    for rounds in (int(r) for r in args.rounds.split(",")):
        for shards in (int(p) for p in args.shards.split(",")):
            line = {
                "bench": "moe_exchange",
                "topology": args.topology,
                "expert_shards": shards,
                "tokens_per_chip": args.tokens,
                "rounds": rounds,
                "temp_mib": temp_mib(devices, shards, args.tokens, rounds),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
