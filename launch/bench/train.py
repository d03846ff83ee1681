"""Actor-update throughput and MFU against a matmul peak measured in the same run.

COMMAND: .venv/bin/python launch/bench/train.py            # CPU default: d_model 512, 8 layers, seq 512, fp32
         .venv/bin/python launch/bench/train.py --preset qwen3-1.7b --batch 8 --seq 2048   # GPU, bf16

Prints one JSON line per measured function:
  {"bench": "train", "fn": "actor_update", "tokens_s", "step_s", "model_tflops", "peak_tflops", "mfu", ...}
  {"bench": "train", "fn": "old_logprobs", ...}        (the forward-only pass that precedes each update)

``model_tflops`` is the achieved model FLOP rate (TFLOP/s): PaLM-style model FLOPs per token
(6·N_matmul + 12·L·H·Dh·T for forward + backward, 2·N_matmul + 4·L·H·Dh·T for forward only; N_matmul counts every
weight matrix including the LM head, not the embedding gather) times tokens per second. ``peak_tflops`` is the
best rate of a square matmul in the run's compute dtype, timed in the same process just before; ``mfu`` is their
ratio, so a busy shared machine lowers both sides alike. ``mfu_cpu_time`` is the same ratio on process CPU
seconds (robust to other processes taking cores).

Sequence packing (issue 30), ``--packing``: an actor update on episodes of log-normal lengths (the paper's median
2k / cap 32k scaled down: median 128, cap 2048; one episode at the cap, the issue's case), one episode per row
padded to the bucket of the longest (today's ``batching.pack``) against the same episodes packed first-fit
decreasing into rows of that length (``roles.packing``), same update function (micro-batches of ``--micro-rows``
rows). One line: ``{"bench": "packing", "padding_fraction_unpacked", "padding_fraction_packed", "step_s_unpacked",
"step_s_packed", "speedup", "len_median", "len_sigma", "len_max", ...}``.

COMMAND: .venv/bin/python launch/bench/train.py --packing            # tiny preset, 32 episodes, 8 rows/micro-batch

Measured 2026-12-05, same box (load ~6), --packing: 32 episodes, 6,669 tokens (mean 208): unpacked 32 rows x 2048,
padding 0.898, 26.4 s/step; packed 4 rows x 2048, padding 0.186, 2.57 s/step: speedup 10.3 (7.0 on CPU seconds).

Measured 2026-11-30 on the 2-core AMD EPYC dev box (shared, load ~5), default command:
  actor_update  131 tokens/s, 0.028 model TFLOP/s vs 0.0595 peak -> mfu 0.47 (cpu-time 0.46), compile 46 s
  old_logprobs  311 tokens/s -> mfu 0.37 (cpu-time 0.68)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from comprl_jax.models.config import ModelConfig  # noqa: E402
from comprl_jax.models.decoder import forward, init_decoder  # noqa: E402
from comprl_jax.rl import losses  # noqa: E402
from comprl_jax.rl.train_state import OptimConfig, create_train_state, make_optimizer  # noqa: E402
from comprl_jax.rl.update import make_logprob_fn, make_update_fn  # noqa: E402
from comprl_jax.roles import batching, packing  # noqa: E402

PRESETS = {
    # smoke-test size (tests/test_rl_bench.py)
    "tiny": dict(
        arch="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
    ),
    # the CPU shape; vocab of a small SentencePiece model
    "cpu-d512": dict(
        arch="qwen3",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        qk_norm=True,
    ),
    # Qwen3-1.7B shapes (HF config.json of Qwen/Qwen3-1.7B)
    "qwen3-1.7b": dict(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        param_dtype="float32",  # fp32 master weights (a 1e-6 step is lost in bf16), bf16 compute
        dtype="bfloat16",
    ),
}


def matmul_params(cfg: ModelConfig) -> int:
    d, f, qd, kvd = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    )
    per_layer = d * qd + 2 * d * kvd + qd * d + 3 * d * f
    return cfg.num_layers * per_layer + d * cfg.vocab_size  # LM head (tied or not, it is a matmul)


def model_flops_per_token(cfg: ModelConfig, seq: int, backward: bool) -> float:
    attn = cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
    return (6 * matmul_params(cfg) + 12 * attn) if backward else (2 * matmul_params(cfg) + 4 * attn)


def matmul_peak_tflops(dtype, n: int, reps: int = 5) -> tuple[float, float]:
    """Best-of-``reps`` rate of an ``[n, n] @ [n, n]`` matmul: (TFLOP per wall second, per CPU second)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
    f(a, b).block_until_ready()
    wall, cpu = timed(lambda: f(a, b).block_until_ready(), reps, best=True)
    return 2 * n**3 / wall / 1e12, 2 * n**3 / cpu / 1e12


def make_batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Full-length rows: a 64-token prompt, then generated tokens (loss_mask 1); half guided, half free."""
    rng = np.random.default_rng(seed)
    loss_mask = np.ones((batch, seq), np.float32)
    loss_mask[:, : min(64, seq // 4)] = 0
    return {
        "tokens": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
        "attn_mask": np.ones((batch, seq), bool),
        "loss_mask": loss_mask,
        "advantages": rng.normal(size=batch).astype(np.float32),
        "subgroup": (np.arange(batch) % 2).astype(np.int32),
    }


def timed(fn, steps: int, best: bool = False) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of ``fn()`` (which must block): the median, or the best.

    CPU seconds (all threads) make a contention-robust second figure on a shared machine: a core lent to another
    process slows the wall clock but not this process's CPU time.
    """
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    pick = np.min if best else np.median
    return float(pick(wall)), float(pick(cpu))


def lognormal_episodes(cfg: ModelConfig, n: int, median: int, sigma: float, cap: int, seed: int = 0):
    """``n`` episodes of log-normal lengths (``median``, ``sigma``; clipped to [8, cap]; episode 0 at the cap): a
    prompt of a quarter of the tokens (at most 64, out of the loss), then generated tokens; half guided."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), 8, cap).astype(int)
    lengths[0] = cap
    seqs = [rng.integers(1, cfg.vocab_size, k).tolist() for k in lengths]
    masks = [[0] * min(64, k // 4) + [1] * (k - min(64, k // 4)) for k in lengths]
    batch = batching.pack(seqs, masks, pad_id=0)
    batch.pop("row_valid")
    batch["advantages"] = rng.normal(size=n).astype(np.float32)
    batch["subgroup"] = (np.arange(n) % 2).astype(np.int32)
    return batch, lengths


def packing_bench(args) -> None:
    """The ``--packing`` line (module docstring)."""
    cfg = ModelConfig(**PRESETS[args.preset], max_position_embeddings=max(args.len_max, 2048))
    batch, lengths = lognormal_episodes(cfg, args.episodes, args.len_median, args.len_sigma, args.len_max)
    packed = packing.pack_batch(batch, micro_rows=args.micro_rows)
    graphdef, params = init_decoder(cfg, seed=0)
    logits_fn = functools.partial(forward, graphdef, remat=args.remat)
    tx = make_optimizer(OptimConfig(lr=1e-6))
    loss_cfg = losses.ActorLossConfig(compute_entropy=not args.no_entropy)
    # one update function for both layouts: micro-batches of micro_rows rows, their number taken from the batch
    update = make_update_fn(logits_fn, loss_cfg, tx, micro_rows=args.micro_rows)
    out = {}
    for name, b in (("unpacked", batch), ("packed", packed)):
        box = {"state": create_train_state(jax.tree.map(jnp.copy, params), tx)}
        dev = jax.device_put(b)

        def step(dev=dev, box=box):
            box["state"], m = update(box["state"], dev)
            jax.block_until_ready(m)
            return m

        t0 = time.perf_counter()
        m = step()  # compile + first run
        out[f"compile_s_{name}"] = round(time.perf_counter() - t0, 1)
        out[f"step_s_{name}"], out[f"cpu_s_{name}"] = (round(x, 4) for x in timed(step, args.steps))
        out[f"rows_{name}"], out[f"row_len_{name}"] = (int(x) for x in b["tokens"].shape)
        out[f"padding_fraction_{name}"] = round(packing.padding_fraction(b), 4)
        out[f"pg_loss_{name}"] = float(m["pg_loss"])
    print(
        json.dumps(
            {
                "bench": "packing",
                "preset": args.preset,
                "platform": jax.devices()[0].platform,
                "episodes": args.episodes,
                "micro_rows": args.micro_rows,
                "len_median": args.len_median,
                "len_sigma": args.len_sigma,
                "len_max": args.len_max,
                "tokens": int(lengths.sum()),
                "len_mean": round(float(lengths.mean()), 1),
                "padding_fraction_unpacked": out.pop("padding_fraction_unpacked"),
                "padding_fraction_packed": out.pop("padding_fraction_packed"),
                "step_s_unpacked": out["step_s_unpacked"],
                "step_s_packed": out["step_s_packed"],
                "speedup": round(out.pop("step_s_unpacked") / out.pop("step_s_packed"), 2),
                # on process CPU seconds: robust to other processes taking cores (see timed)
                "speedup_cpu_time": round(out["cpu_s_unpacked"] / out["cpu_s_packed"], 2),
                **out,
            }
        ),
        flush=True,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-d512", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=1, help="micro-batches per update")
    p.add_argument("--steps", type=int, default=3, help="timed updates (after one compile call)")
    p.add_argument("--peak-n", type=int, default=0, help="matmul size for the peak (0: 2048 CPU, 8192 GPU)")
    p.add_argument("--remat", action="store_true", help="rematerialise layers in the backward pass")
    p.add_argument("--no-entropy", action="store_true", help="skip the entropy metric")
    p.add_argument(
        "--packing", action="store_true", help="the sequence-packing line instead (default preset tiny)"
    )
    p.add_argument("--episodes", type=int, default=32, help="--packing: episodes of the batch")
    p.add_argument("--micro-rows", type=int, default=8, help="--packing: rows per micro-batch")
    p.add_argument("--len-median", type=int, default=128, help="--packing: median episode length")
    p.add_argument("--len-sigma", type=float, default=1.0, help="--packing: log-normal sigma of the lengths")
    p.add_argument("--len-max", type=int, default=2048, help="--packing: length cap (one episode has it)")
    args = p.parse_args(argv)
    if args.packing:
        if "--preset" not in (argv if argv is not None else sys.argv):
            args.preset = "tiny"
        packing_bench(args)
        return

    cfg = ModelConfig(**PRESETS[args.preset], max_position_embeddings=max(args.seq, 2048))
    dtype = jnp.dtype(cfg.dtype)
    platform = jax.devices()[0].platform
    peak_n = args.peak_n or (2048 if platform == "cpu" else 8192)
    peak, peak_cpu = matmul_peak_tflops(dtype, peak_n)

    graphdef, params = init_decoder(cfg, seed=0)
    logits_fn = functools.partial(forward, graphdef, remat=args.remat)
    tx = make_optimizer(OptimConfig(lr=1e-6))
    state = create_train_state(params, tx)
    del params
    loss_cfg = losses.ActorLossConfig(compute_entropy=not args.no_entropy)
    update = make_update_fn(logits_fn, loss_cfg, tx, num_micro_batches=args.micro, max_traces=1)
    logprobs = make_logprob_fn(logits_fn, num_micro_batches=args.micro)
    batch = jax.device_put(make_batch(cfg, args.batch, args.seq))
    tokens = args.batch * args.seq

    old = logprobs(state.params, batch).block_until_ready()  # compile
    t_lp = timed(lambda: logprobs(state.params, batch).block_until_ready(), args.steps)
    batch["old_logprobs"] = old

    box = {"state": state}

    def step():
        box["state"], m = update(box["state"], batch)
        jax.block_until_ready(m)

    t0 = time.perf_counter()
    step()  # compile + first run
    compile_s = time.perf_counter() - t0
    t_up = timed(step, args.steps)
    # Measured again after the model runs; the higher figure is kept (the machine may have been busier before).
    peak2, peak_cpu2 = matmul_peak_tflops(dtype, peak_n)
    peak, peak_cpu = max(peak, peak2), max(peak_cpu, peak_cpu2)

    common = {
        "preset": args.preset,
        "platform": platform,
        "dtype": cfg.dtype,
        "d_model": cfg.hidden_size,
        "layers": cfg.num_layers,
        "vocab": cfg.vocab_size,
        "seq": args.seq,
        "batch": args.batch,
        "micro": args.micro,
        "peak_tflops": round(peak, 4),
        "peak_n": peak_n,
    }
    for fn, (sec, cpu), bwd, extra in (
        ("actor_update", t_up, True, {"compile_s": round(compile_s, 1)}),
        ("old_logprobs", t_lp, False, {}),
    ):
        flops = model_flops_per_token(cfg, args.seq, bwd) * tokens
        achieved = flops / sec / 1e12
        print(
            json.dumps(
                {
                    "bench": "train",
                    "fn": fn,
                    "tokens_s": round(tokens / sec, 1),
                    "step_s": round(sec, 4),
                    "model_tflops": round(achieved, 4),
                    **common,
                    "mfu": round(achieved / peak, 4),
                    "mfu_cpu_time": round(flops / cpu / 1e12 / peak_cpu, 4),
                    **extra,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
