"""Memory of the sampler's prefill: logits only where a token is drawn (``extend(..., logits_at=)``), so the
compiled decode's buffers do not grow with input length x vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.models import ModelConfig, extend, init_cache, init_decoder


def test_extend_logits_at_equals_full_logits():
    cfg = ModelConfig.tiny("qwen3")
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (3, 9)).astype(np.int32)
    num_new = np.array([9, 4, 0], np.int32)  # a full row, a ragged row, an idle row
    ext = jax.jit(extend, static_argnums=0)
    full, c_full = ext(graphdef, params, init_cache(cfg, 3, 16), toks, num_new)
    at = np.array([8, 3, 0], np.int32)
    part, c_part = ext(graphdef, params, init_cache(cfg, 3, 16), toks, num_new, jnp.asarray(at))
    assert part.shape == (3, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(part), np.asarray(full)[np.arange(3), at], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c_part.k), np.asarray(c_full.k))
    assert np.asarray(c_part.lengths).tolist() == [9, 4, 0]
