"""Temperature / top-k / top-p / greedy filtering against hand-computed distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.sampling.filters import SamplingParams, filter_logits, select_tokens

# p = [0.5, 0.3, 0.15, 0.05]
LOGITS = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))


def _probs(sp, allowed=None):
    return np.asarray(jax.nn.softmax(filter_logits(LOGITS, sp, allowed), axis=-1))[0]


def test_top_k_top_p_temperature_by_hand():
    # top-k 3: [0.5, 0.3, 0.15] / 0.95
    np.testing.assert_allclose(
        _probs(SamplingParams(top_k=3)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6
    )
    # top-p 0.7: mass before token i = [0, 0.5, 0.8, 0.95] -> keep the first two: [0.625, 0.375]
    np.testing.assert_allclose(_probs(SamplingParams(top_p=0.7)), [0.625, 0.375, 0, 0], atol=1e-6)
    # top-p 0.81: mass before the third token (0.8) is below it -> three kept.
    np.testing.assert_allclose(
        _probs(SamplingParams(top_p=0.81)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6
    )
    # temperature 0.5 squares the probabilities: p^2 / sum(p^2), sum = 0.25 + 0.09 + 0.0225 + 0.0025 = 0.365
    np.testing.assert_allclose(
        _probs(SamplingParams(temperature=0.5)), np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365, atol=1e-6
    )
    # top-k then top-p (inside the top-k): top-k 2 then top-p 0.5 keeps only the first.
    np.testing.assert_allclose(_probs(SamplingParams(top_k=2, top_p=0.5)), [1, 0, 0, 0], atol=1e-6)
    # constraint mask removes token 0 first: renormalised over the rest.
    allowed = jnp.asarray([[False, True, True, True]])
    np.testing.assert_allclose(_probs(SamplingParams(), allowed), [0, 0.6, 0.3, 0.1], atol=1e-6)


def test_sampling_frequencies_and_unmodified_logprobs():
    sp = SamplingParams(top_p=0.7)
    keys = jax.random.split(jax.random.key(0), 4000)
    toks, lps = jax.vmap(lambda k: select_tokens(LOGITS, k, sp))(keys)
    freq = np.bincount(np.asarray(toks)[:, 0], minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)
    # logprobs are under the raw distribution, not the truncated one
    np.testing.assert_allclose(
        np.asarray(lps)[:, 0], np.log([0.5, 0.3, 0.15, 0.05])[np.asarray(toks)[:, 0]], atol=1e-6
    )
    tok, lp = select_tokens(
        LOGITS, jax.random.key(1), SamplingParams(greedy=True), jnp.asarray([[0, 0, 1, 1]], bool)
    )
    assert int(tok[0]) == 2 and abs(float(lp[0]) - np.log(0.15)) < 1e-6


def test_invalid_params_name_the_field():
    for kw, field in [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
