"""The paged KV cache (issue 30 point 2; ``models/kv_cache.py``, ``sampling/pages.py``): page allocation and the
cache's write / gather by hand, ``extend`` through scattered pages equal to the uncached forward, and the sampler on
a paged cache giving the same greedy tokens and log-probabilities as on the dense one and as the uncached model
(tiny and small Qwen3 here; SmolLM2 in tests/test_smollm.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import ModelConfig, forward, init_decoder
from comprl_jax.models import decoder as D
from comprl_jax.models import kv_cache as KV
from comprl_jax.sampling import SamplerService, SamplingParams
from comprl_jax.sampling.pages import PageTable


def test_page_table_by_hand():
    """Rows get ceil(need / page) pages from the free list (lowest first), keep them across turns, give them
    back on release; a short pool is reported and grown; the table marks missing pages with the pool size."""
    pt = PageTable(rows=3, max_len=64, page_size=16, num_pages=4)
    pt.reserve({0: 20, 2: 5})  # row 0: 2 pages, row 2: 1
    assert pt.owned == [[0, 1], [], [2]] and pt.used == 3
    assert pt.missing({1: 33}) == 2  # 3 pages wanted, 1 free
    with pytest.raises(ValueError, match="short of 2 pages"):
        pt.reserve({1: 33})
    pt.grow_to(8)
    pt.reserve({1: 33, 0: 32})  # row 0 already has its 2 pages
    assert pt.owned == [[0, 1], [3, 4, 5], [2]]
    np.testing.assert_array_equal(pt.table(), [[0, 1, 8, 8], [3, 4, 5, 8], [2, 8, 8, 8]])
    pt.release(1)
    assert pt.free == [3, 4, 5, 6, 7] and pt.used == 3
    with pytest.raises(ValueError, match="max_len=64"):
        pt.reserve({2: 65})
    with pytest.raises(ValueError, match="multiple of page_size"):
        PageTable(1, 60, 16, 1)


def test_paged_write_and_context_by_hand():
    """Position s of row b lands in page pages[b, s // 4] at offset s % 4 (pool [L, Hkv, P, page, Dh]); a row
    without a page there drops the write; context() gathers the row's pages back in position order."""
    cfg = ModelConfig.tiny("qwen3", num_layers=2, num_kv_heads=1, head_dim=2)
    cache = KV.init_paged_cache(cfg, batch=2, max_len=8, num_pages=3, page_size=4)
    cache = cache.replace(pages=jnp.array([[2, 0], [1, 3]], jnp.int32), lengths=jnp.array([3, 0], jnp.int32))
    # 3 new positions per row, value = 100 * layer + 10 * row + column (keys), negated (values)
    val = 100 * np.arange(2)[:, None, None] + 10 * np.arange(2)[None, :, None] + np.arange(3)[None, None, :]
    k_new = jnp.asarray(np.broadcast_to(val[..., None, None], (2, 2, 3, 1, 2)), jnp.float32)
    out = KV.write(cache, k_new, -k_new, jnp.array([3, 2], jnp.int32))
    np.testing.assert_array_equal(out.lengths, [6, 2])
    k = np.asarray(out.k)[:, 0, :, :, 0]  # [L, P, page]
    # row 0, positions 3, 4, 5 -> page 2 offset 3, page 0 offsets 0 and 1
    assert k[1, 2, 3] == 100 and k[1, 0, 0] == 101 and k[1, 0, 1] == 102
    # row 1 (2 new), positions 0, 1 -> page 1 offsets 0, 1; its third column is padding: nowhere
    assert k[0, 1, 0] == 10 and k[0, 1, 1] == 11 and (k[0, 1, 2:] == 0).all()
    assert np.asarray(out.v)[1, 0, 0, 0, 0] == -101
    kc, vc, valid, specs = KV.context(out, jnp.int32(1))
    assert specs == ("bksd", "bksd") and kc.shape == (2, 1, 8, 2)  # [B, Hkv, S, Dh]
    np.testing.assert_array_equal(np.asarray(kc)[0, 0, 3:6, 0], [100, 101, 102])
    np.testing.assert_array_equal(np.asarray(kc)[1, 0, :2, 0], [110, 111])
    np.testing.assert_array_equal(np.asarray(vc)[1, 0, :2, 1], [-110, -111])
    assert (np.asarray(kc)[1, 0, 4:] == 0).all()  # its second column has page 3, never written
    np.testing.assert_array_equal(np.asarray(valid), [[1] * 6 + [0] * 2, [1, 1] + [0] * 6])
    # past the page table (capacity 8): dropped, never wrapped into another page
    full = out.replace(lengths=jnp.array([7, 2], jnp.int32))
    again = KV.write(full, k_new, k_new, jnp.array([3, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(again.k)[1, 0, 0, 3, 0], 100)  # position 7 = page 0 offset 3
    assert np.asarray(again.k)[1, 0, 1:].sum() == np.asarray(out.k)[1, 0, 1:].sum()  # nothing else changed


@pytest.mark.parametrize("keys_last", [False, True])
def test_dense_write_by_hand(keys_last):
    """Column t < num_new[b] of row b lands at slot lengths[b] + t of every layer; padding columns and slots past
    the cache are dropped, the rest of the cache is untouched. Both dense layouts: the accelerators' [L, B, S,
    Hkv, Dh] (its scatter batches over layers and rows) and the CPU's keys_last."""
    cfg = ModelConfig.tiny("qwen3", num_layers=2, num_kv_heads=2, head_dim=2)
    cache = KV.init_cache(cfg, batch=3, max_len=6, dtype=jnp.float32, keys_last=keys_last)
    cache = cache.replace(lengths=jnp.array([1, 4, 0], jnp.int32))
    # value = 1000 * layer + 100 * row + 10 * column + KV head (+ 0.5 in the second Dh entry); values negated
    L, B, T, H = 2, 3, 3, 2
    val = (
        1000 * np.arange(L)[:, None, None, None]
        + 100 * np.arange(B)[None, :, None, None]
        + 10 * np.arange(T)[None, None, :, None]
        + np.arange(H)[None, None, None, :]
    )
    k_new = np.stack([val, val + 0.5], axis=-1).astype(np.float32)  # [L, B, T, Hkv, Dh]
    out = KV.write(cache, jnp.asarray(k_new), jnp.asarray(-k_new), jnp.array([2, 3, 0], jnp.int32))
    np.testing.assert_array_equal(out.lengths, [3, 7, 0])
    k, v = np.asarray(out.k), np.asarray(out.v)
    if keys_last:  # back to [L, B, S, Hkv, Dh]
        k, v = k.transpose(0, 1, 4, 2, 3), v.transpose(0, 1, 3, 2, 4)
    want = np.zeros((L, B, 6, H, 2), np.float32)
    want[:, 0, 1:3] = k_new[:, 0, :2]  # row 0: 2 new at slots 1, 2; its third column is padding
    want[:, 1, 4:6] = k_new[:, 1, :2]  # row 1: slots 4, 5; its third new column (slot 6) is past the cache
    np.testing.assert_array_equal(k, want)  # row 2 (no new tokens) untouched
    np.testing.assert_array_equal(v, -want)


def test_dense_turn_round_trip_by_hand():
    """A CPU turn on a paged cache runs on a dense copy of its pages (PagedKVCache.dense_turn): that copy holds
    each layer's context() in the dense CPU layout, and writing a turn into it and back (end_dense_turn) leaves the
    pool exactly as writing the turn into the pages. A forced decode kernel keeps the turn on the pages."""
    from comprl_jax.models import paged_kernels as PK

    cfg = ModelConfig.tiny("qwen3", num_layers=2, head_dim=128)
    rng = np.random.default_rng(3)
    B, PS, W, NP = 3, 4, 3, 10
    cache = KV.init_paged_cache(cfg, B, W * PS, num_pages=NP, page_size=PS)
    pages = np.full((B, W), NP, np.int32)  # row 2 has no third page
    pages.flat[:8] = rng.permutation(NP)[:8]
    cache = cache.replace(pages=jnp.asarray(pages))

    def turn():  # [L, B, 5, Hkv, Dh] keys and values of a 5-column turn
        shape = (cfg.num_layers, B, 5, cfg.num_kv_heads, cfg.head_dim)
        return jnp.asarray(rng.normal(size=shape), jnp.float32), jnp.asarray(
            rng.normal(size=shape), jnp.float32
        )

    k0, v0 = turn()
    cache = KV.write(cache, k0, v0, jnp.array([5, 2, 4], jnp.int32))
    dense = cache.dense_turn()
    assert isinstance(dense, KV.KVCache) and dense.keys_last and dense.capacity == W * PS
    np.testing.assert_array_equal(dense.lengths, [5, 2, 4])
    for layer in range(cfg.num_layers):
        kc, vc, _, specs = KV.context(cache, jnp.int32(layer))
        assert specs == ("bksd", "bksd")
        np.testing.assert_array_equal(dense.v[layer], vc)
        np.testing.assert_array_equal(dense.k[layer], jnp.swapaxes(kc, 2, 3))
    k1, v1 = turn()
    n1 = jnp.array([5, 3, 5], jnp.int32)  # row 2 runs past its 8 positions with pages: dropped either way
    want = KV.write(cache, k1, v1, n1)
    got = cache.end_dense_turn(KV.write(dense, k1, v1, n1))
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_array_equal(got.k, want.k)
    np.testing.assert_array_equal(got.v, want.v)
    np.testing.assert_array_equal(got.pages, cache.pages)
    with PK.forced("tpu", interpret=True):
        assert (
            cache.replace(k=cache.k.astype(jnp.bfloat16)).dense_turn() is None
        )  # the kernel reads the pages


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_extend_through_the_cache_equals_the_forward(kind):
    """Prefill 30 tokens then 10 single-token decode steps, pages scattered over the pool in a random order:
    logits equal the uncached forward's at every position."""
    cfg = ModelConfig.tiny("qwen3")
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(0)
    B, T = 3, 40
    toks = rng.integers(1, cfg.vocab_size, (B, T)).astype(np.int32)
    want = forward(graphdef, params, toks, np.broadcast_to(np.arange(T), (B, T)), np.ones((B, T), bool))
    if kind == "dense":
        cache = D.init_cache(cfg, B, 64)
    else:
        cache = D.init_paged_cache(cfg, B, 64, num_pages=12, page_size=16)
        cache = cache.replace(pages=jnp.asarray(rng.permutation(12).reshape(3, 4), jnp.int32))
    logits, cache = D.extend(graphdef, params, cache, toks[:, :30], jnp.full((B,), 30))
    np.testing.assert_allclose(logits, want[:, :30], atol=2e-6, rtol=0)
    for t in range(30, T):
        logits, cache = D.extend(graphdef, params, cache, toks[:, t : t + 1], jnp.ones((B,), jnp.int32))
        np.testing.assert_allclose(logits[:, 0], want[:, t], atol=2e-6, rtol=0)
    np.testing.assert_array_equal(cache.lengths, [T] * B)


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_fresh_prefill_equals_attending_to_the_empty_cache(kind):
    """``extend(..., fresh=True)`` on an empty cache (the new tokens attend among themselves, the forward's causal
    bands: 1,024 columns are two 512-query chunks) gives the logits and the cache of the context path (which
    attends to the cache's whole empty window as well), and both equal the uncached forward; ragged rows of
    1,000, 37 and 1 tokens."""
    cfg = ModelConfig.tiny("qwen3", vocab_size=512)
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(3)
    B, T, S = 3, 1024, 1088
    n = np.array([1000, 37, 1], np.int32)
    toks = np.zeros((B, T), np.int32)
    for b in range(B):
        toks[b, : n[b]] = rng.integers(1, cfg.vocab_size, n[b])
    want = forward(
        graphdef, params, toks, np.broadcast_to(np.arange(T), (B, T)), np.arange(T)[None] < n[:, None]
    )

    def empty():
        if kind == "dense":
            return D.init_cache(cfg, B, S)
        cache = D.init_paged_cache(cfg, B, S, num_pages=3 * 17, page_size=64)
        return cache.replace(pages=jnp.asarray(rng.permutation(3 * 17).reshape(3, 17), jnp.int32))

    ext = jax.jit(D.extend, static_argnums=0, static_argnames="fresh")
    cache = empty()
    got = {fresh: ext(graphdef, params, cache, toks, jnp.asarray(n), fresh=fresh) for fresh in (False, True)}
    for b in range(B):
        np.testing.assert_allclose(got[True][0][b, : n[b]], want[b, : n[b]], atol=2e-6, rtol=0)
        np.testing.assert_allclose(got[True][0][b, : n[b]], got[False][0][b, : n[b]], atol=2e-6, rtol=0)
    np.testing.assert_array_equal(got[True][1].lengths, n)
    for name in ("k", "v"):
        np.testing.assert_allclose(
            getattr(got[True][1], name), getattr(got[False][1], name), atol=2e-6, rtol=0
        )
    # A decode step on the fresh prefill's cache reads what it wrote: the next position's logits are the forward's.
    nxt = rng.integers(1, cfg.vocab_size, (B, 1)).astype(np.int32)
    lg, _ = ext(graphdef, params, got[True][1], nxt, jnp.ones((B,), jnp.int32))
    seq = np.zeros((B, T + 1), np.int32)
    for b in range(B):
        seq[b, : n[b]], seq[b, n[b]] = toks[b, : n[b]], nxt[b, 0]
    ref = forward(
        graphdef, params, seq, np.broadcast_to(np.arange(T + 1), (B, T + 1)), np.ones((B, T + 1), bool)
    )
    np.testing.assert_allclose(lg[:, 0], np.asarray(ref)[np.arange(B), n], atol=2e-6, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_generate_prefills_fresh_and_samples_what_the_context_path_samples(kind):
    """``SamplerService.generate`` (a fresh prefill, in 2 row groups here) samples the tokens, and the
    log-probabilities, of the same turn run on a new cache through the context path (``run(fresh=False)``)."""
    cfg = ModelConfig.tiny("qwen3", vocab_size=512)
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, cfg.vocab_size, k).tolist() for k in (300, 5, 120, 64)]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0)
    traced = []  # the `fresh` of every trace of the sampler's turn

    def wrap(fn):
        def traced_fn(*args, **kw):
            traced.append(kw["fresh"])
            return fn(*args, **kw)

        return traced_fn

    svc = SamplerService(
        graphdef,
        params,
        cfg,
        stop_token_ids=(),
        pad_id=0,
        kv_cache=kind,
        page_size=16,
        prefill_tokens=1100,
        wrap=wrap,
    )
    assert svc.prefill_groups(4, 512) == 2
    key = jax.random.key(7)
    fresh = svc.generate(prompts, key, sp)
    cache = svc.new_cache(svc.batch_bucket(4), 512 + 16)
    ctx = svc.run(cache, prompts, [16] * 4, key, sp).to_numpy(4)
    assert traced == [True, False]
    np.testing.assert_array_equal(fresh.tokens, ctx.tokens)
    np.testing.assert_allclose(fresh.logprobs, ctx.logprobs, atol=1e-5, rtol=0)


MODELS = {
    "tiny": dict(vocab_size=512),
    "small": dict(
        vocab_size=2048,
        num_layers=8,
        hidden_size=1024,
        intermediate_size=3072,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_paged_equals_dense_and_the_uncached_model(name):
    """Ragged prompts, 24 greedy tokens: the paged sampler's tokens equal the dense sampler's, their
    log-probabilities agree, and both are what the uncached forward over prompt + reply gives (argmax at every
    position, log_softmax of the chosen token)."""
    cfg = ModelConfig.tiny("qwen3", **MODELS[name])
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (5, 37, 70, 18)]
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    out = {}
    for kind in ("dense", "paged"):
        svc = SamplerService(graphdef, params, cfg, stop_token_ids=(), pad_id=0, kv_cache=kind, page_size=16)
        out[kind] = svc.generate(prompts, jax.random.key(0), sp)
    np.testing.assert_array_equal(out["paged"].tokens, out["dense"].tokens)
    np.testing.assert_allclose(out["paged"].logprobs, out["dense"].logprobs, atol=1e-5, rtol=0)
    for b, p in enumerate(prompts):
        seq = np.asarray(p + out["paged"].tokens[b].tolist(), np.int32)[None]
        n = seq.shape[1]
        logp = jax.nn.log_softmax(
            forward(graphdef, params, seq, np.arange(n)[None], np.ones((1, n), bool))[0]
        )
        at = np.arange(len(p) - 1, n - 1)  # the positions whose next token was sampled
        np.testing.assert_array_equal(np.argmax(logp[at], -1), out["paged"].tokens[b])
        got = np.take_along_axis(np.asarray(logp[at]), out["paged"].tokens[b][:, None], 1)[:, 0]
        np.testing.assert_allclose(out["paged"].logprobs[b], got, atol=1e-4, rtol=0)


def test_conversation_pages_follow_the_tokens_and_sample_the_same():
    """A 6-turn sampled conversation (temperature 1, rows sitting turns out, different reply limits): the paged
    conversation gives the dense one's tokens and log-probabilities, its page table addresses max_len from the
    start, and its pool holds exactly the pages the rows' reservations need (it doubled once to get them)."""
    cfg = ModelConfig.tiny("qwen3")
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(0)
    B = 5
    turns = [
        [
            rng.integers(5, 256, rng.integers(3, 120)).tolist() if rng.random() > 0.2 else None
            for _ in range(B)
        ]
        for _ in range(6)
    ]
    limits = [10, 40, 25, 40, 5]
    sp = SamplingParams(max_new_tokens=40, temperature=1.0)
    res, convs = {}, {}
    for kind in ("dense", "paged"):
        svc = SamplerService(
            graphdef, params, cfg, stop_token_ids=(3,), pad_id=0, kv_cache=kind, page_size=16
        )
        conv = svc.conversation(B, 1190)
        res[kind] = [conv.turn(t, jax.random.key(i), sp, max_new=limits) for i, t in enumerate(turns)]
        convs[kind] = conv
    for a, b in zip(res["dense"], res["paged"], strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    conv = convs["paged"]
    assert conv.cache_len == 1200  # max_len in whole pages
    pt = conv.pages
    # each row holds ceil(its largest reservation / 16) pages; nothing else is taken from the pool
    assert pt.used == sum(len(p) for p in pt.owned)
    for b in range(B):
        assert len(pt.owned[b]) * 16 >= len(conv.ids[b]) - 1
    assert pt.num_pages == 2 * (8 * 256 // 16)  # 8 rows (5 bucketed) x 256 positions to start, doubled once
