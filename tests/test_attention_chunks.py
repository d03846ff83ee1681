"""Query-chunked attention (long inputs) equals the dense computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import layers as L


@pytest.mark.parametrize(
    "causal, t", [(False, 64), (True, 64), (True, 96), (True, 80)]
)  # causal: 4 chunks in 4 bands, 6 in 3, 5 in 1
def test_chunked_equals_dense(causal, t):
    c = 16
    old = L.QUERY_CHUNK
    L.QUERY_CHUNK = c
    try:
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (2, t, 4, 8))
        k = jax.random.normal(kk, (2, t, 2, 8))
        v = jax.random.normal(kv, (2, t, 2, 8))
        q_pos = jnp.broadcast_to(jnp.arange(t), (2, t))
        valid = jnp.arange(t)[None] < jnp.array([[t], [40]])  # row 1: right padding

        def f(fn, q):
            return (fn(q, k, v, q_pos, valid) ** 2).sum()

        dense = L._attention_dense(q, k, v, q_pos, valid)
        chunked = L.attention(q, k, v, q_pos, valid, causal=causal)
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(dense), atol=1e-5, rtol=1e-5)
        g_dense = jax.grad(lambda q: f(L._attention_dense, q))(q)
        g_chunk = jax.grad(lambda q: f(lambda *a: L.attention(*a, causal=causal), q))(q)
        np.testing.assert_allclose(np.asarray(g_chunk), np.asarray(g_dense), atol=1e-4, rtol=1e-4)
    finally:
        L.QUERY_CHUNK = old


def _numpy_attention(q, k, v, vis):
    """Grouped-query softmax attention in float64 numpy, one (row, head) at a time: the hand reference."""
    b, t, h, dh = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, t, h, dh))
    for r in range(b):
        for j in range(h):
            s = q[r, :, j] @ k[r, :, j // g].T / np.sqrt(dh)  # [T, S]
            s = np.where(vis[r], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[r, :, j] = (p / p.sum(-1, keepdims=True)) @ v[r, :, j // g]
    return out.reshape(b, t, h * dh)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_dense_attention_of_each_layout_equals_numpy(platform, monkeypatch):
    """``_attention_dense`` builds its matmuls per platform (CPU: G * T rows of each dot; elsewhere the
    ``[B, T, Hkv, G, Dh]`` form, which the TPU compiler holds in fewer temporaries). Each equals a float64 numpy
    softmax over each query's visible keys (GQA 4 / 2 heads, left padding in row 0, queries after 3 context keys)."""
    t, s = 6, 9
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (2, t, 4, 8))
    k = jax.random.normal(kk, (2, s, 2, 8))
    v = jax.random.normal(kv, (2, s, 2, 8))
    q_pos = jnp.broadcast_to(jnp.arange(s - t, s), (2, t))  # the last t of s keys: a prefill onto context
    valid = jnp.arange(s)[None] >= jnp.array([[2], [0]])  # row 0: 2 left-padding keys
    vis = np.asarray(L.visible(q_pos, valid))
    monkeypatch.setattr(L.sharding, "target_platform", lambda: platform)
    # a fresh function: a jit of L._attention_dense itself would reuse the other case's trace
    out = jax.jit(lambda *a: L._attention_dense(*a))(q, k, v, q_pos, valid)
    want = _numpy_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), vis)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6, rtol=1e-6)


def test_causal_attention_memory_grows_linearly_with_length():
    """XLA's buffer plan for the attention gradient: doubling T at most ~doubles the temporaries (one chunk's
    scores at a time), where holding every chunk's scores would quadruple them."""

    def temp_bytes(t):
        q = jnp.zeros((1, t, 8, 32))
        k = v = jnp.zeros((1, t, 2, 32))
        q_pos, valid = jnp.arange(t)[None], jnp.ones((1, t), bool)
        f = jax.grad(lambda q, k, v: L.attention(q, k, v, q_pos, valid, causal=True).sum(), argnums=(0, 1, 2))
        return jax.jit(f).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(4096), temp_bytes(8192)
    full_scores = 8 * 8192 * 8192 * 4
    assert large < 2.5 * small, (small, large)
    assert large < full_scores / 2, (large, full_scores)


def test_visible_is_the_causal_mask_of_valid_keys():
    """layers.visible by hand: row 0 full, row 1 with keys 3.. padding; a cache-extend row at slots 5-6."""
    q_pos = jnp.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    k_valid = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    got = np.asarray(L.visible(q_pos, k_valid))
    np.testing.assert_array_equal(got[0], np.tril(np.ones((5, 5), bool)))
    want1 = np.tril(np.ones((5, 5), bool))
    want1[:, 3:] = False
    np.testing.assert_array_equal(got[1], want1)
    # a decode step at slot 5 of a cache with 6 filled slots out of 8: sees slots 0-5
    step = np.asarray(L.visible(jnp.array([[5]]), jnp.arange(8)[None] < 6))
    np.testing.assert_array_equal(step, [[[1, 1, 1, 1, 1, 1, 0, 0]]])


def test_no_quadratic_mask_in_the_forward_pass():
    """The decoder's forward carries no [B, T, T] mask (issue 27 item 4): at T = 4,096 with 512-query chunks,
    no buffer of the compiled forward + backward has a T x T shape (before: ``pred[2,4096,4096]`` carried
    through the layer scan), and the temporaries stay within a few of one chunk's score buffers."""
    from comprl_jax.models import decoder
    from comprl_jax.models.config import ModelConfig

    cfg = ModelConfig.tiny("qwen3", num_layers=2, max_position_embeddings=8192)
    graphdef, params = decoder.abstract_decoder(cfg)
    b, t = 2, 4096
    tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
    mask = jax.ShapeDtypeStruct((b, t), jnp.bool_)

    def loss(p, tokens, mask):
        h = decoder.forward(graphdef, p, tokens, tokens, mask, return_hidden=True, remat=True)
        return h.sum()

    compiled = jax.jit(jax.grad(loss)).lower(params, tok, mask).compile()
    text = compiled.as_text()
    assert f"{t},{t}]" not in text, "a [.., T, T] buffer is in the compiled forward/backward"
    temp = compiled.memory_analysis().temp_size_in_bytes
    chunk_scores = b * cfg.num_heads * L.QUERY_CHUNK * t * 4  # one chunk's float32 scores
    # one chunk's backward holds its scores, probabilities, their gradients and softmax intermediates: a few
    # chunk-score buffers, never anything that grows with T x T
    assert temp < 8 * chunk_scores, (temp, chunk_scores)
