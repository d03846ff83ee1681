"""Query-chunked attention (long inputs) equals the dense computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import layers as L


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_equals_dense(causal):
    t, c = 64, 16
    old = L.QUERY_CHUNK
    L.QUERY_CHUNK = c
    try:
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (2, t, 4, 8))
        k = jax.random.normal(kk, (2, t, 2, 8))
        v = jax.random.normal(kv, (2, t, 2, 8))
        idx = jnp.arange(t)
        valid = jnp.arange(t)[None] < jnp.array([[t], [40]])
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
