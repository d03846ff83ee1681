"""MoE layer forward + backward against a dense SwiGLU MLP with the same active parameters, same run.

COMMAND: .venv/bin/python launch/bench/moe.py        # CPU default: 4 x 512 tokens, d_model 256, 16 experts, top-2

Prints one JSON line:
  {"bench": "moe", "fn": "mlp_fwd_bwd", "dense_ms", "dropless_ms", "capacity_ms", "gmm_ms", "dropless_ratio",
   "capacity_ratio", "gmm_ratio", ...}

The dense MLP has width ``top_k x expert_width``: per token it does the same matmul FLOPs as the MoE layer's
active experts, so a ratio above 1 is the price of routing and dispatch (router, top-k, sorts, gathers,
scatter-adds, the capacity path's padded slots) plus whatever the grouped matmul costs on this backend. On CPU
``jax.lax.ragged_dot`` (the dropless path) has no grouped kernel: XLA computes it as a masked dense product over
every expert, E times the active FLOPs, so its CPU ratio is an upper bound (TPU and GPU lower it to a grouped
GEMM). The capacity path uses plain einsums over ``capacity_factor x tokens x k`` slots on every backend. The
``gmm`` dispatch (one sort over the whole batch, 2-D grouped matmuls: the megablox Pallas kernel on TPU) runs
``jax.lax.ragged_dot`` off TPU, so on CPU it pays the same masked dense product as dropless; its kernel in Pallas
interpret mode (``gmm_interpret``, what the CPU parity tests run) is a test vehicle, far too slow to time here.
Timings are medians of interleaved repeats (a busy shared machine slows all three alike).

Measured 2026-12-01 on the 2-core dev box (shared, busy, load ~5), default command (2,048 tokens, fp32):
  dense 108.8 ms, dropless 1714.9 ms (ratio 15.8), capacity 251.8 ms (ratio 2.3); WORKSPACE.md "Mixture of experts".
Measured 2026-12-05, same box (load ~6), with the gmm line (issue 30): dense 83.2 ms, dropless 1646.6 ms (19.8),
capacity 208.4 ms (2.5), gmm 1381.6 ms (16.6).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from comprl_jax.models import layers as L  # noqa: E402
from comprl_jax.models import moe  # noqa: E402
from comprl_jax.models.config import ModelConfig  # noqa: E402


def _timed(fn, args, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--expert_width", type=int, default=128)
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)

    cfg = ModelConfig.tiny(
        "qwen3_moe",
        hidden_size=a.d_model,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.expert_width,
        dtype=a.dtype,
        capacity_factor=a.capacity_factor,
    )
    dt = jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    moe_p = {n: jnp.asarray(rng.normal(0, 0.05, s), dt) for n, s in moe.param_shapes(cfg).items()}
    f = a.top_k * a.expert_width  # dense width with the active experts' matmul FLOPs
    dense_p = {
        "gate": jnp.asarray(rng.normal(0, 0.05, (a.d_model, f)), dt),
        "up": jnp.asarray(rng.normal(0, 0.05, (a.d_model, f)), dt),
        "down": jnp.asarray(rng.normal(0, 0.05, (f, a.d_model)), dt),
    }
    x = jnp.asarray(rng.normal(size=(a.batch, a.seq, a.d_model)), dt)
    valid = jnp.ones((a.batch, a.seq), bool)

    def dense_loss(p, x):
        return jnp.sum(L.swiglu(x, p["gate"], p["up"], p["down"]).astype(jnp.float32) ** 2)

    def moe_loss(c, p, x):
        return jnp.sum(moe.moe_mlp(c, p, x, valid)[0].astype(jnp.float32) ** 2)

    fns = {
        "dense": (jax.jit(jax.grad(dense_loss, argnums=(0, 1))), (dense_p, x)),
        "dropless": (jax.jit(jax.grad(lambda p, x: moe_loss(cfg, p, x), argnums=(0, 1))), (moe_p, x)),
        "gmm": (
            jax.jit(
                jax.grad(
                    lambda p, x: moe_loss(dataclasses.replace(cfg, moe_dispatch="gmm"), p, x),
                    argnums=(0, 1),
                )
            ),
            (moe_p, x),
        ),
        "capacity": (
            jax.jit(
                jax.grad(
                    lambda p, x: moe_loss(dataclasses.replace(cfg, moe_dispatch="capacity"), p, x),
                    argnums=(0, 1),
                )
            ),
            (moe_p, x),
        ),
    }
    compile_s = {}
    for name, (fn, args) in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))  # compile + first run
        compile_s[name] = round(time.perf_counter() - t0, 2)
    times = {name: [] for name in fns}
    for _ in range(a.repeats):  # interleaved: a load spike hits every variant
        for name, (fn, args) in fns.items():
            times[name] += _timed(fn, args, 1)
    ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    tokens = a.batch * a.seq
    print(
        json.dumps(
            {
                "bench": "moe",
                "fn": "mlp_fwd_bwd",
                "backend": jax.default_backend(),
                "dtype": a.dtype,
                "tokens": tokens,
                "d_model": a.d_model,
                "experts": a.experts,
                "top_k": a.top_k,
                "expert_width": a.expert_width,
                "dense_width": f,
                "capacity_factor": a.capacity_factor,
                "capacity_slots_per_expert_row": moe.capacity(cfg, a.seq),
                "dense_ms": round(ms["dense"], 2),
                "dropless_ms": round(ms["dropless"], 2),
                "capacity_ms": round(ms["capacity"], 2),
                "gmm_ms": round(ms["gmm"], 2),
                "dropless_ratio": round(ms["dropless"] / ms["dense"], 2),
                "capacity_ratio": round(ms["capacity"] / ms["dense"], 2),
                "gmm_ratio": round(ms["gmm"] / ms["dense"], 2),
                "dense_tokens_s": round(tokens / ms["dense"] * 1e3),
                "compile_s": compile_s,
                "repeats": a.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
