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
        idx = jnp.arange(t)
        valid = jnp.arange(t)[None] < jnp.array([[t], [40]])  # row 1: right padding
        allowed = (idx[None, :, None] >= idx[None, None, :]) & valid[:, None, :]

        def f(fn, q):
            return (fn(q, k, v, allowed) ** 2).sum()

        dense = L._attention_dense(q, k, v, allowed)
        chunked = L.attention(q, k, v, allowed, causal=causal)
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(dense), atol=1e-5, rtol=1e-5)
        g_dense = jax.grad(lambda q: f(L._attention_dense, q))(q)
        g_chunk = jax.grad(lambda q: f(lambda *a: L.attention(*a, causal=causal), q))(q)
        np.testing.assert_allclose(np.asarray(g_chunk), np.asarray(g_dense), atol=1e-4, rtol=1e-4)
    finally:
        L.QUERY_CHUNK = old


def test_causal_attention_memory_grows_linearly_with_length():
    """XLA's buffer plan for the attention gradient: doubling T at most ~doubles the temporaries (one chunk's
    scores at a time), where holding every chunk's scores would quadruple them."""

    def temp_bytes(t):
        q = jnp.zeros((1, t, 8, 32))
        k = v = jnp.zeros((1, t, 2, 32))
        allowed = jnp.tril(jnp.ones((t, t), bool))[None]
        f = jax.grad(lambda q, k, v: L.attention(q, k, v, allowed, causal=True).sum(), argnums=(0, 1, 2))
        return jax.jit(f).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(4096), temp_bytes(8192)
    full_scores = 8 * 8192 * 8192 * 4
    assert large < 2.5 * small, (small, large)
    assert large < full_scores / 2, (large, full_scores)
