"""Decoder unit tests: hand-computed RMSNorm / RoPE values, the KV-cache contract of ``extend`` (chunked,
ragged, idle rows, padding never written), padding invariance of ``forward``, dtypes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import ModelConfig, extend, init_cache, init_decoder
from comprl_jax.models import decoder as D
from comprl_jax.models import layers as L

# Jitted once per shape: eager op-by-op dispatch of the scanned decoder is far slower on a busy CPU.
forward = jax.jit(D.forward, static_argnums=0, static_argnames=("return_hidden", "remat"))


def test_rms_norm_hand_computed():
    # rms([3, 4]) = sqrt((9 + 16) / 2) = 3.5355339; weights [1, 2] -> [3 / 3.5355, 2 * 4 / 3.5355].
    out = L.rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(np.asarray(out), [[0.8485281, 2.2627417]], rtol=1e-6)


def test_rope_hand_computed():
    cfg = ModelConfig.tiny("llama", head_dim=4, num_heads=2, num_kv_heads=1, rope_theta=100.0)
    inv, attn = L.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-7)  # 1 / 100 ** ([0, 2] / 4)
    assert attn == 1.0
    cos, sin = L.rope_cos_sin(cfg, jnp.array([[2]]))
    x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    y = np.asarray(L.apply_rope(x, cos, sin)).ravel()
    # rotate-half: pairs (x0, x2) by angle 2*1, (x1, x3) by angle 2*0.1.
    c0, s0, c1, s1 = math.cos(2), math.sin(2), math.cos(0.2), math.sin(0.2)
    np.testing.assert_allclose(
        y, [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1], rtol=1e-6
    )
    lin = ModelConfig.tiny(
        "llama", head_dim=4, rope_theta=100.0, rope_scaling=(("factor", 4.0), ("rope_type", "linear"))
    )
    np.testing.assert_allclose(L.rope_inv_freq(lin)[0], [0.25, 0.025], rtol=1e-6)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny("qwen3")
    graphdef, params = init_decoder(cfg, seed=0)
    return cfg, graphdef, params


def test_chunked_ragged_extend_equals_forward(model):
    cfg, graphdef, params = model
    rng = np.random.default_rng(1)
    full = rng.integers(0, cfg.vocab_size, (3, 12)).astype(np.int32)
    ref = np.asarray(
        forward(graphdef, params, full, np.broadcast_to(np.arange(12), (3, 12)), np.ones((3, 12), bool))
    )
    ext = jax.jit(extend, static_argnums=0)
    cache = init_cache(cfg, 3, 16)
    # Chunk 1: rows take 5, 0 (idle) and 7 tokens; chunk 2 the rest (7, 12, 5), padded to width 12.
    first = np.array([5, 0, 7], np.int32)
    chunk1 = np.zeros((3, 7), np.int32)
    for b, n in enumerate(first):
        chunk1[b, :n] = full[b, :n]
    lg1, cache = ext(graphdef, params, cache, chunk1, first)
    assert np.asarray(cache.lengths).tolist() == [5, 0, 7]
    # Slots past each row's length were never written (padding columns are dropped, not stored).
    k, v = np.asarray(cache.k), np.asarray(cache.v)  # the slot is k's last axis and v's fourth
    assert not k[:, 0, ..., 5:].any() and not k[:, 1].any() and not k[:, 2, ..., 7:].any()
    assert not v[:, 0, :, 5:].any() and not v[:, 1].any() and not v[:, 2, :, 7:].any()
    assert k[:, 0, ..., :5].any() and v[:, 2, :, :7].any()
    rest = 12 - first
    chunk2 = np.zeros((3, 12), np.int32)
    for b, n in enumerate(first):
        chunk2[b, : rest[b]] = full[b, n:]
    lg2, cache = ext(graphdef, params, cache, chunk2, rest)
    assert np.asarray(cache.lengths).tolist() == [12, 12, 12]
    for b, n in enumerate(first):
        np.testing.assert_allclose(np.asarray(lg1)[b, :n], ref[b, :n], atol=1e-5)
        np.testing.assert_allclose(np.asarray(lg2)[b, : rest[b]], ref[b, n:], atol=1e-5)
    assert np.isfinite(np.asarray(lg1)).all()  # idle row: meaningless but finite logits


def test_forward_left_padding_with_positions(model):
    cfg, graphdef, params = model
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, 6).astype(np.int32)
    right = forward(
        graphdef, params, np.pad(toks, (0, 3))[None], np.arange(9)[None], (np.arange(9) < 6)[None]
    )
    pos = np.maximum(np.arange(9) - 3, 0)[None]
    # Padding ids may be anything, even -1 (clipped, never NaN): valid rows are unaffected.
    left = forward(
        graphdef, params, np.pad(toks, (3, 0), constant_values=-1)[None], pos, (np.arange(9) >= 3)[None]
    )
    np.testing.assert_allclose(np.asarray(left)[0, 3:], np.asarray(right)[0, :6], atol=1e-5)


def test_dtypes_and_hidden():
    cfg = ModelConfig.tiny("qwen2", param_dtype="bfloat16", dtype="bfloat16")
    graphdef, params = init_decoder(cfg, seed=0)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    toks, pos, mask = np.zeros((2, 4), np.int32), np.broadcast_to(np.arange(4), (2, 4)), np.ones((2, 4), bool)
    logits = forward(graphdef, params, toks, pos, mask)
    hidden = forward(graphdef, params, toks, pos, mask, return_hidden=True)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 4, cfg.vocab_size)
    assert hidden.dtype == jnp.float32 and hidden.shape == (2, 4, cfg.hidden_size)
    cache = init_cache(cfg, 2, 8)
    assert cache.k.dtype == jnp.bfloat16 and cache.k.shape == (2, 2, 2, 16, 8)  # [L, B, Hkv, Dh, S]
    assert cache.v.dtype == jnp.bfloat16 and cache.v.shape == (2, 2, 2, 8, 16)  # [L, B, Hkv, S, Dh]


def test_remat_same_gradients(model):
    cfg, graphdef, params = model
    toks = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    pos, mask = np.broadcast_to(np.arange(6), (2, 6)), np.ones((2, 6), bool)

    def loss(p, remat):
        return forward(graphdef, p, toks, pos, mask, remat=remat).mean()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g0 = grad(params, False)
    g1 = grad(params, True)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_both_dense_cache_layouts_extend_alike():
    """The CPU layout (``keys_last``: k [L, B, Hkv, Dh, S], v [L, B, Hkv, S, Dh]) and the accelerator layout
    ([L, B, S, Hkv, Dh]) give the same logits through a ragged prefill and three decode steps, and the same cache
    contents position by position."""
    cfg = ModelConfig.tiny("qwen3", vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64,
                           num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    graphdef, params = init_decoder(cfg, seed=3)
    ext = jax.jit(extend, static_argnums=0)
    toks = np.random.default_rng(0).integers(1, 64, (3, 9)).astype(np.int32)
    n = np.array([9, 4, 6], np.int32)
    out = {}
    for keys_last in (False, True):
        cache = init_cache(cfg, 3, 16, keys_last=keys_last)
        assert cache.keys_last is keys_last and cache.capacity == 16
        logits = [ext(graphdef, params, cache, toks, n)]
        cache = logits[0][1]
        for step in range(3):
            lg, cache = ext(graphdef, params, cache, toks[:, step : step + 1], np.ones(3, np.int32))
            logits.append((lg, cache))
        k, v = np.asarray(cache.k), np.asarray(cache.v)
        if keys_last:  # back to [L, B, S, Hkv, Dh]
            k, v = k.transpose(0, 1, 4, 2, 3), v.transpose(0, 1, 3, 2, 4)
        out[keys_last] = ([np.asarray(lg) for lg, _ in logits], k, v, np.asarray(cache.lengths))
    for a, b in zip(out[False][0], out[True][0], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for i in (1, 2):
        np.testing.assert_array_equal(out[False][i], out[True][i])  # the same keys and values, slot by slot
    assert out[True][3].tolist() == [12, 7, 9]
