"""Temperature / top-k / top-p / greedy filtering against hand-computed distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.sampling.filters import SamplingParams, filter_logits, select_tokens, top_p_fallback_rows

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


# --- Top-p without sorting the vocabulary (issue 30, point 4): bit-for-bit against the previous filter. ---


def _reference_filter(logits, sp, allowed=None):
    """The filter before the top-p cap (full sort of the vocabulary for top-p without top-k), kept verbatim."""
    x = logits.astype(jnp.float32)
    if allowed is not None:
        x = jnp.where(allowed, x, -jnp.inf)
    if sp.greedy:
        return x
    x = x / sp.temperature
    V = x.shape[-1]
    if 0 < sp.top_k < V:
        top = jax.lax.top_k(x, sp.top_k)[0]
        x = jnp.where(x < top[:, -1:], -jnp.inf, x)
    else:
        top = None
    if sp.top_p < 1.0:
        srt = top if top is not None else -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(srt, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < sp.top_p
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < thresh, -jnp.inf, x)
    return x


_new = jax.jit(filter_logits, static_argnames=("sp", "top_p_cap"))
_ref = jax.jit(_reference_filter, static_argnames=("sp",))
_fallback = jax.jit(top_p_fallback_rows, static_argnames=("sp", "top_p_cap"))

# V = 8, hand-built rows: ties at the top, ties straddling the k-th value and the nucleus edge, a peaked row whose
# nucleus fits in 2 tokens, a flat row (every token needed: the fallback), a row with -inf entries.
SMALL = jnp.asarray(
    [
        [3.0, 3.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0],
        [0.5, 2.0, 2.0, -1.0, 2.0, 0.5, 0.5, -3.0],
        [8.0, 5.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        [1.0, -jnp.inf, 2.0, 2.0, -jnp.inf, 0.0, 1.0, -5.0],
    ],
    jnp.float32,
)
ALLOWED = jnp.asarray(np.arange(8)[None, :] % 3 != 1).repeat(SMALL.shape[0], axis=0).at[:, 0].set(True)
TOP_P = [1.0, 0.99, 0.9, 0.75, 0.6, 0.45, 0.3, 0.05]
TOP_K = [0, 1, 2, 3, 5, 8]


def _bits(a):
    return np.asarray(a).view(np.uint32)


def test_small_vocabulary_enumerated_equals_previous_filter_bit_for_bit():
    # Temperature and the constraint mask come first and are elementwise, so the enumeration folds them into the
    # rows (36 rows: each hand-built row scaled by 1/t, with and without the mask); the last loop passes them through
    # SamplingParams / allowed for real.
    rows = [SMALL / t for t in [1.0, 0.7, 2.5]]
    rows += [jnp.where(ALLOWED, r, -jnp.inf) for r in rows]
    batch = jnp.concatenate(rows)
    fallbacks = 0
    for top_k in [0, 2, 3, 8]:  # 8 = V: top-k off
        for top_p in TOP_P:
            sp = SamplingParams(top_k=top_k, top_p=top_p)
            want = _bits(_ref(batch, sp))
            for cap in [1, 3, 1024] if top_k in (0, 8) else [1024]:  # 1024 > V: the cap is the vocabulary
                np.testing.assert_array_equal(
                    _bits(_new(batch, sp, top_p_cap=cap)), want, err_msg=f"{sp} {cap}"
                )
            fallbacks += int(np.asarray(_fallback(batch, sp, top_p_cap=3)).sum())
            # Every row alone gives the same bits (a row's result does not depend on the batch's cond).
            if top_k == 0:
                for i in range(batch.shape[0]):
                    got = _new(batch[i : i + 1], sp, top_p_cap=3)
                    np.testing.assert_array_equal(_bits(got), want[i : i + 1], err_msg=f"{sp} row {i}")
    assert fallbacks > 0  # the flat rows took the full sort at small caps
    for sp in [
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=2.5, top_k=3, top_p=0.9),
        SamplingParams(greedy=True, top_p=0.5),
    ]:
        for allowed in [None, ALLOWED]:
            want = _bits(_ref(SMALL, sp, allowed))
            for cap in [2, 1024]:
                np.testing.assert_array_equal(_bits(_new(SMALL, sp, allowed, top_p_cap=cap)), want)


def test_small_vocabulary_probabilities_equal_previous_filter():
    for top_k in [0, 3]:
        for top_p in [0.95, 0.7, 0.4]:
            sp = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
            want = np.asarray(jax.nn.softmax(_ref(SMALL, sp), axis=-1))
            for cap in [2, 4, 1024]:
                got = np.asarray(jax.nn.softmax(_new(SMALL, sp, top_p_cap=cap), axis=-1))
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _random_logits(B, V, seed=0):
    """Rows alternating peaked (a trained model: nucleus of tens of tokens) and flat (nucleus past any cap)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    scale = jnp.where(jnp.arange(B)[:, None] % 2 == 0, 4.0, 0.05)
    logits = jax.random.normal(k1, (B, V)) * scale
    boost = jax.random.randint(k2, (B, 20), 0, V)
    return logits.at[jnp.arange(B)[:, None], boost].add(jnp.where(scale > 1, 10.0, 0.0))


@pytest.mark.parametrize("top_p", [0.9, 0.5])
def test_random_rows_above_the_cap_equal_previous_filter(top_p):
    B, V, cap = 6, 3000, 256
    logits = _random_logits(B, V)
    allowed = jax.random.bernoulli(jax.random.key(3), 0.8, (B, V)).at[:, 0].set(True)
    for al in [None, allowed]:
        for temperature in [1.0, 0.6]:
            sp = SamplingParams(temperature=temperature, top_p=top_p)
            want = _bits(_ref(logits, sp, al))
            np.testing.assert_array_equal(_bits(_new(logits, sp, al, top_p_cap=cap)), want)
            fb = np.asarray(_fallback(logits, sp, al, top_p_cap=cap))
            np.testing.assert_array_equal(fb, np.arange(B) % 2 == 1)  # flat rows only
            # A row's result does not depend on the batch: the peaked rows alone skip the sort, same bits.
            peaked = logits[::2]
            pal = None if al is None else al[::2]
            assert not np.asarray(_fallback(peaked, sp, pal, top_p_cap=cap)).any()
            np.testing.assert_array_equal(_bits(_new(peaked, sp, pal, top_p_cap=cap)), want[::2])


def test_peaked_batch_takes_the_cheap_branch_at_the_default_cap():
    B, V = 4, 20_000  # above TOP_P_CAP
    logits = _random_logits(2 * B, V, seed=1)[::2]  # peaked rows only
    sp = SamplingParams(top_p=0.95)
    assert not np.asarray(_fallback(logits, sp)).any()  # the cond's predicate is False: no sort
    np.testing.assert_array_equal(_bits(_new(logits, sp)), _bits(_ref(logits, sp)))
    flat = jnp.zeros((1, V), jnp.float32)
    assert np.asarray(_fallback(flat, sp)).all()
    np.testing.assert_array_equal(_bits(_new(flat, sp)), _bits(_ref(flat, sp)))
    # Without top-p, with top-k on, or greedy: never a fallback.
    for sp in [SamplingParams(), SamplingParams(top_k=50, top_p=0.5), SamplingParams(greedy=True, top_p=0.5)]:
        assert not np.asarray(_fallback(flat, sp)).any()


def test_first_max_is_argmax():
    """Greedy's index (filters.first_max) equals jnp.argmax: the first of tied maxima, a row of -inf, a row's first
    NaN, a maximum in the last column; and on random rows of the sampler's shapes."""
    from comprl_jax.sampling.filters import first_max

    inf, nan = float("inf"), float("nan")
    x = jnp.array(
        [
            [0.5, 2.0, -1.0, 2.0],  # tie: the first
            [-inf, -inf, -inf, -inf],  # everything filtered: 0
            [1.0, nan, 3.0, nan],  # the first NaN, as argmax
            [-3.0, -2.0, -1.0, 7.0],
            [inf, 1.0, inf, 0.0],
        ]
    )
    np.testing.assert_array_equal(first_max(x), [1, 0, 1, 3, 0])
    np.testing.assert_array_equal(first_max(x), jnp.argmax(x, axis=-1))
    r = jax.random.normal(jax.random.key(0), (3, 16, 2048))
    r = r.at[:, :, 100].set(r.max()).at[:, :, 7].set(r.max())  # ties in every row
    assert first_max(r).dtype == jnp.int32
    np.testing.assert_array_equal(first_max(r), jnp.argmax(r, axis=-1))
    np.testing.assert_array_equal(first_max(r), 7)
