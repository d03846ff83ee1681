"""Update steps on the real decoder: exact micro-batch accumulation, one compile, donation, sharded == unsharded."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models.config import ModelConfig
from comprl_jax.models.decoder import forward, init_decoder, logits_from_hidden
from comprl_jax.rl import losses
from comprl_jax.rl.train_state import OptimConfig, create_train_state, make_optimizer, train_state_shardings
from comprl_jax.rl.update import (
    BEHAVIOUR,
    BEHAVIOUR_MASK,
    ChunkedHead,
    accumulate_gradients,
    make_logprob_fn,
    make_update_fn,
)
from comprl_jax.runtime import sharding as shd

CFG = ModelConfig.tiny("qwen3", vocab_size=64)


def make_batch(seed, b=16, t=12, kind="actor"):
    """Random multi-turn-like rows: a prompt, then alternating generated / observation spans, right padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    lengths = rng.integers(t // 2, t + 1, b)
    attn = np.arange(t)[None] < lengths[:, None]
    loss_mask = attn & (np.arange(t)[None] >= 3) & (rng.random((b, t)) < 0.7)
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "attn_mask": attn,
        "loss_mask": loss_mask.astype(np.float32),
        "advantages": rng.normal(size=b).astype(np.float32),
    }
    if kind == "actor":
        batch["subgroup"] = (np.arange(b) % 2).astype(np.int32)
    else:
        batch["sample_weight"] = rng.uniform(0, 1, b).astype(np.float32)
    return batch


@functools.lru_cache(maxsize=1)
def model():
    graphdef, params = init_decoder(CFG, seed=0)
    logits_fn = functools.partial(forward, graphdef)
    return logits_fn, params, make_logprob_fn(logits_fn)  # one jitted logprob fn: compiled once per shape


def with_old_logprobs(logits_fn, params, batch, perturb=0.0, seed=0):
    """old logprobs from a forward pass; ``perturb`` shifts them so ratios leave 1 and the clip is exercised."""
    old = np.asarray(model()[2](params, batch))
    noise = np.random.default_rng(seed).normal(scale=perturb, size=old.shape).astype(np.float32)
    return {**batch, "old_logprobs": (old + noise) * batch["loss_mask"]}


@pytest.mark.parametrize(
    "kind, cfg",
    [
        ("actor", losses.ActorLossConfig()),
        # the other actor variants share this code path; their formulas are hand-checked in test_rl_math.py
        ("extractor", losses.ExtractorLossConfig()),
    ],
)
def test_micro_batch_accumulation_is_exact(kind, cfg):
    logits_fn, params, _ = model()
    batch = with_old_logprobs(logits_fn, params, make_batch(1, kind=kind), perturb=0.3)
    grad = jax.jit(lambda p, b, m: accumulate_gradients(logits_fn, cfg, p, b, m), static_argnums=2)
    g1, m1 = grad(params, batch, 1)
    g4, m4 = grad(params, batch, 4)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g1)) > 1e-3  # a real, non-zero gradient
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    f1, f4 = losses.finalize_metrics(m1), losses.finalize_metrics(m4)
    for k in f1:
        np.testing.assert_allclose(f1[k], f4[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert 0.0 < float(f1["clipfrac"]) < 1.0


def test_logprobs_micro_batched_equal_full():
    logits_fn, params, _ = model()
    batch = make_batch(2)
    full = make_logprob_fn(logits_fn)(params, batch)
    micro = make_logprob_fn(logits_fn, num_micro_batches=4)(params, batch)
    np.testing.assert_allclose(full, micro, atol=1e-6)
    assert np.all(np.asarray(full)[batch["loss_mask"] == 0] == 0)


def chunked(chunk):
    """The trainer's scorer for a role with ``logits_chunk=chunk`` and remat on."""
    from comprl_jax.roles.role import scorer as _scorer

    scorer = _scorer(model()[0].args[0], True, chunk)
    assert isinstance(scorer, ChunkedHead) and scorer.chunk == chunk
    return scorer


@pytest.mark.parametrize("chunk", [4, 5, 64])  # divides T=12, pads T to 15, one chunk longer than T
def test_chunked_head_equals_full_logits(chunk):
    logits_fn, params, _ = model()
    cfg = losses.ActorLossConfig(compute_entropy=True)
    batch = with_old_logprobs(logits_fn, params, make_batch(3), perturb=0.3)
    grad = jax.jit(lambda f, p, b: accumulate_gradients(f, cfg, p, b, 2), static_argnums=0)
    g_full, m_full = grad(logits_fn, params, batch)
    g_chunk, m_chunk = grad(chunked(chunk), params, batch)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    f_full, f_chunk = losses.finalize_metrics(m_full), losses.finalize_metrics(m_chunk)
    for k in f_full:  # includes the entropy, computed chunk by chunk
        np.testing.assert_allclose(f_full[k], f_chunk[k], rtol=1e-5, atol=1e-7, err_msg=k)
    lp_full = make_logprob_fn(logits_fn, num_micro_batches=2)(params, batch)
    lp_chunk = make_logprob_fn(chunked(chunk), num_micro_batches=2)(params, batch)
    np.testing.assert_allclose(lp_full, lp_chunk, atol=1e-6)


def test_chunked_head_never_holds_full_logits():
    """XLA's own buffer plan: how the gradient's temporaries grow with the vocabulary. The plain path holds
    [B, T, V] float32 logits (and their cotangent); the chunked one only [B, C, V] at a time."""
    b, t = 2, 512

    def temp_bytes(vocab, chunk):
        graphdef, params = init_decoder(ModelConfig.tiny("qwen3", vocab_size=vocab), seed=0)
        f = functools.partial(forward, graphdef, remat=True)
        if chunk:
            hidden = functools.partial(forward, graphdef, return_hidden=True, remat=True)
            f = ChunkedHead(hidden, functools.partial(logits_from_hidden, graphdef), chunk)
        batch = {
            "tokens": jnp.zeros((b, t), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
            "attn_mask": jnp.ones((b, t), bool),
            "loss_mask": jnp.ones((b, t), jnp.float32),
            "old_logprobs": jnp.zeros((b, t), jnp.float32),
            "advantages": jnp.ones((b,), jnp.float32),
            "subgroup": jnp.zeros((b,), jnp.int32),
        }
        fn = jax.jit(lambda p, bt: accumulate_gradients(f, losses.ActorLossConfig(), p, bt))
        return fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    dv = 4096  # extra vocabulary entries
    full = temp_bytes(2 * dv, 0) - temp_bytes(dv, 0)
    chunked = temp_bytes(2 * dv, 32) - temp_bytes(dv, 32)
    assert full >= b * t * dv * 4, (full, chunked)  # at least one [B, T, dV] float32 buffer
    assert chunked < full / 4, (full, chunked)


def test_update_compiles_once_and_donates():
    logits_fn, params, _ = model()
    tx = make_optimizer(OptimConfig(lr=1e-3))
    state = create_train_state(jax.tree.map(jnp.copy, params), tx)
    update = make_update_fn(logits_fn, losses.ActorLossConfig(), tx, num_micro_batches=2, max_traces=1)
    for i in range(5):
        batch = with_old_logprobs(logits_fn, state.params, make_batch(10 + i), perturb=0.1, seed=i)
        old_leaves = jax.tree.leaves(state)
        state, metrics = update(state, batch)
        assert all(x.is_deleted() for x in old_leaves), "donated state buffers must be freed"
    assert int(state.step) == 5
    assert update._cache_size() == 1
    assert np.isfinite(float(metrics["pg_loss"])) and float(metrics["grad_norm"]) > 0
    chex.clear_trace_counter()


@pytest.mark.slow
def test_sharded_update_equals_unsharded():
    logits_fn, params, _ = model()
    tx = make_optimizer(OptimConfig(lr=1e-3))
    cfg = losses.ActorLossConfig()
    batch = with_old_logprobs(logits_fn, params, make_batch(3), perturb=0.2)

    plain = create_train_state(jax.tree.map(jnp.copy, params), tx)
    plain, m_plain = make_update_fn(logits_fn, cfg, tx, num_micro_batches=2)(plain, batch)

    mesh = shd.make_mesh({"data": 2, "fsdp": 4})
    _, sharded_params = init_decoder(CFG, seed=0, mesh=mesh)
    assert any(
        len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
        for x in jax.tree.leaves(sharded_params)
    ), "fsdp should actually shard some parameter"
    state = create_train_state(sharded_params, tx, mesh)
    shardings = train_state_shardings(state, mesh)
    sharded_batch = shd.put_batch(batch, mesh)
    old = make_logprob_fn(logits_fn, num_micro_batches=2, mesh=mesh, param_shardings=shardings.params)(
        state.params, sharded_batch
    )
    np.testing.assert_allclose(old, model()[2](params, batch), atol=1e-5, rtol=0)
    update = make_update_fn(logits_fn, cfg, tx, num_micro_batches=2, mesh=mesh, state_shardings=shardings)
    with jax.set_mesh(mesh):
        state, m_sharded = update(state, sharded_batch)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for k in m_plain:
        np.testing.assert_allclose(m_plain[k], m_sharded[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # the state keeps its layout: the same shardings come back out.
    for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(state), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)


def test_bad_inputs_raise_clear_errors():
    logits_fn, params, _ = model()
    tx = make_optimizer(OptimConfig(lr=1e-3))
    with pytest.raises(ValueError, match="state_shardings"):
        make_update_fn(logits_fn, losses.ActorLossConfig(), tx, mesh=shd.make_mesh())
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        accumulate_gradients(
            logits_fn,
            losses.ActorLossConfig(),
            params,
            with_old_logprobs(logits_fn, params, make_batch(4)),
            3,
        )
    with pytest.raises(TypeError, match="no loss registered for dict"):
        accumulate_gradients(logits_fn, {"clip_eps": 0.2}, params, make_batch(4), 1)


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize(
    "arch, tied, chunk", [("qwen3", False, 0), ("qwen3", True, 5), ("qwen3_moe", False, 0)]
)
def test_frozen_layers_train_only_the_top_layers(arch, tied, chunk):
    """``trainable_layers`` (partial fine-tuning): the same log-probs; no gradient into the embedding, the frozen
    layers or the head; the trained layers' and final norm's gradients equal the full model's; an AdamW step
    leaves every frozen weight bit-identical; and the backward pass of the frozen layers is not built."""
    from comprl_jax.roles.role import scorer

    cfg = ModelConfig.tiny(arch, vocab_size=64, num_layers=3, tie_word_embeddings=tied)  # MoE: every layer
    graphdef, params = init_decoder(cfg, seed=1)
    full, part = scorer(graphdef, True, chunk, 0), scorer(graphdef, True, chunk, 2)  # layers 0, 1 frozen
    lp_full = make_logprob_fn(full)(params, make_batch(4))
    lp_part = make_logprob_fn(part)(params, make_batch(4))
    np.testing.assert_allclose(lp_full, lp_part, atol=1e-6, rtol=0)  # two scans instead of one: float order
    batch = {**make_batch(4), "old_logprobs": np.asarray(lp_full)}
    loss_cfg = losses.ActorLossConfig()
    grad = jax.jit(lambda f, p, b: accumulate_gradients(f, loss_cfg, p, b, 2)[0], static_argnums=0)
    g_full, g_part = _leaves(grad(full, params, batch)), _leaves(grad(part, params, batch))
    trained_somewhere = 0
    for k, g in g_part.items():
        if k.startswith("['layers']"):
            assert not np.any(g[:2]), k
            np.testing.assert_allclose(g[2:], g_full[k][2:], rtol=1e-5, atol=1e-7, err_msg=k)
            trained_somewhere += int(np.abs(g[2:]).max() > 1e-4)
        elif k.startswith("['final_norm']"):
            np.testing.assert_allclose(g, g_full[k], rtol=1e-5, atol=1e-7)
            assert np.abs(g).max() > 1e-4
        else:  # embed, lm_head
            assert not np.any(g), k
            assert np.abs(g_full[k]).max() > 1e-4, k  # the full model does train them
    assert trained_somewhere >= 8

    tx = make_optimizer(OptimConfig(lr=1e-2))
    update = make_update_fn(part, loss_cfg, tx, num_micro_batches=2)
    before = _leaves(params)
    state, _ = update(create_train_state(jax.tree.map(jnp.copy, params), tx), batch)
    after = _leaves(state.params)
    for k, x in before.items():
        y = after[k]
        if k.startswith("['layers']"):
            np.testing.assert_array_equal(y[:2], x[:2], err_msg=k)
            assert not np.array_equal(y[2:], x[2:]), k
        elif k.startswith("['final_norm']"):
            assert not np.array_equal(y, x)
        else:  # embed, lm_head
            np.testing.assert_array_equal(y, x, err_msg=k)

    # The backward pass of frozen layers is never built: matmuls executed by the gradient computation (scan
    # bodies counted once per iteration) drop with every frozen layer (3 layers: 108, 81, 55 measured).
    counts = [
        _matmuls(
            jax.make_jaxpr(lambda p, f=scorer(graphdef, True, chunk, k): grad(f, p, batch))(params).jaxpr
        )
        for k in (0, 1, 2)
    ]
    assert counts[0] > counts[1] > counts[2], counts


def _matmuls(jaxpr) -> int:
    """``dot_general`` calls a jaxpr executes, scan bodies times their length."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == "dot_general"
        times = e.params.get("length", 1) if e.primitive.name == "scan" else 1
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += times * _matmuls(inner)
    return n


def test_one_step_batch_takes_pi_old_from_its_own_forward_pass():
    """Without ``old_logprobs`` (one optimizer step on fresh samples, ``roles.dispatch_update``) the update uses its
    own forward pass as pi_old: the same gradient and loss as with a separate pi_old pass, rho = 1 exactly, and
    ``logprob_mismatch`` against the sampler's log-probs when the batch carries them."""
    logits_fn, params, logprob_fn = model()
    cfg = losses.ActorLossConfig()
    batch = make_batch(5)
    old = np.asarray(logprob_fn(params, batch))
    noise = (
        np.random.default_rng(0).normal(scale=0.01, size=old.shape).astype(np.float32) * batch["loss_mask"]
    )
    sampler_side = {BEHAVIOUR: old + noise, BEHAVIOUR_MASK: batch["loss_mask"]}
    grad = jax.jit(lambda b: accumulate_gradients(logits_fn, cfg, params, b, 2))
    g_explicit, _ = grad({**batch, "old_logprobs": old})
    g_own, _ = grad({**batch, **sampler_side})
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_own)) > 1e-3
    for a, b in zip(jax.tree.leaves(g_explicit), jax.tree.leaves(g_own), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    tx = make_optimizer(OptimConfig(lr=1e-2))
    update = make_update_fn(logits_fn, cfg, tx, num_micro_batches=2)
    fresh = functools.partial(create_train_state, tx=tx)
    _, m_explicit = update(fresh(jax.tree.map(jnp.copy, params)), {**batch, "old_logprobs": old})
    _, m_own = update(fresh(jax.tree.map(jnp.copy, params)), {**batch, **sampler_side})
    assert float(m_own["ratio"]) == 1.0 and float(m_own["clipfrac"]) == 0.0
    np.testing.assert_allclose(m_own["pg_loss"], m_explicit["pg_loss"], rtol=1e-5, atol=1e-7)
    expected = np.sum(np.abs(noise)) / np.sum(batch["loss_mask"])  # mean |trainer - sampler| over the mask
    np.testing.assert_allclose(m_own["logprob_mismatch"], expected, rtol=1e-3)
    assert "logprob_mismatch" not in m_explicit
