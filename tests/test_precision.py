"""Precision (issue 27 item 2): per-role parameter / compute dtypes, bfloat16 compute with float32 master weights,
float32 logits, log-probs and losses; the CPU scales stay float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax import config as config_lib
from comprl_jax.config.run import RunConfig
from comprl_jax.models import ModelConfig, decoder
from comprl_jax.rl.losses import token_logprobs

CFG = ModelConfig.tiny("qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4)


def _logprobs(cfg, params, toks):
    graphdef, _ = decoder.abstract_decoder(cfg)
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits = jax.jit(lambda p: decoder.forward(graphdef, p, toks, pos, jnp.ones((b, t), bool)))(params)
    lp, _ = token_logprobs(logits, toks)
    return logits, lp


def test_bfloat16_logprobs_stay_near_float32():
    """Same float32 master weights (HF init), compute in bfloat16 vs float32, 4 rows x 64 random tokens through 4
    layers. Measured 2026-12-03: max |dlogp| 0.0057 nats, mean 0.0015 (bfloat16 keeps 8 significant bits:
    relative rounding 2^-9 per op). Bound: max 0.02, mean 0.005 nats. The gap must also be above 1e-4: the
    compute dtype took effect (a float32 run would give 0)."""
    _, params = decoder.init_decoder(CFG, seed=0)
    toks = jax.random.randint(jax.random.key(1), (4, 64), 0, CFG.vocab_size)
    logits32, lp32 = _logprobs(CFG, params, toks)
    logits16, lp16 = _logprobs(dataclasses.replace(CFG, dtype="bfloat16"), params, toks)
    assert logits16.dtype == lp16.dtype == jnp.float32  # logits and log-probs stay float32
    gap = np.abs(np.asarray(lp32) - np.asarray(lp16))[:, 1:]
    assert gap.max() <= 0.02 and gap.mean() <= 0.005, (gap.max(), gap.mean())
    assert gap.mean() > 1e-4, gap.mean()


def test_bfloat16_update_keeps_float32_master_weights_and_moments():
    """One optimizer step with bfloat16 compute: parameters, Adam moments and gradients stay float32."""
    from comprl_jax.rl import OptimConfig, create_train_state, make_optimizer, make_update_fn
    from comprl_jax.rl.losses import ActorLossConfig
    from comprl_jax.roles.role import scorer

    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    graphdef, params = decoder.init_decoder(cfg, seed=0)
    tx = make_optimizer(OptimConfig(lr=1e-3))
    state = create_train_state(params, tx)
    b, t = 4, 32
    batch = {
        "tokens": jax.random.randint(jax.random.key(2), (b, t), 0, cfg.vocab_size),
        "positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
        "attn_mask": jnp.ones((b, t), bool),
        "loss_mask": jnp.ones((b, t), jnp.float32).at[:, :8].set(0),
        "advantages": jnp.array([1.0, -1.0, 0.5, -0.5]),
        "subgroup": jnp.array([0, 0, 1, 1], jnp.int32),
    }
    new, metrics = make_update_fn(scorer(graphdef, False, 0), ActorLossConfig(), tx)(state, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.opt_state) if jnp.ndim(x) > 0)
    assert metrics["pg_loss"].dtype == jnp.float32 and float(metrics["grad_norm"]) > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from comprl_jax.models.zoo import tiny_tokenizer

    c = config_lib.build("tiny", "t")
    corpus = ["Observation: go north east south west"] * 10
    return tiny_tokenizer(corpus, str(tmp_path_factory.mktemp("tok"))), c


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bfloat16", 0.05)])
def test_logprob_mismatch_of_bfloat16_sampling_against_the_bfloat16_trainer(tiny, dtype, bound):
    """A role built as the trainer builds it (``{role}.dtype``): the sampler decodes from its own copy of the
    weights in the compute dtype, the update recomputes the sampled tokens' log-probs, and ``logprob_mismatch``
    reports |sampler - trainer|. Float32: < 1e-5 (same weights, two code paths). bfloat16: both sides round the
    same bfloat16 weights and each token row's matmuls alike; only the float32 softmax over a growing cache vs the
    full sequence differs. Measured 2026-12-03: 1.5e-7 nats (this random-init model's logits are ~0.05, so a
    rounding of relative size 2^-9 is small in absolute terms); bound 0.05 nats, the size of the bf16-vs-f32 gap
    that would show the two sides computing in different precisions on a model with unit-scale logits."""
    from comprl_jax.models.zoo import load_model
    from comprl_jax.rl import ActorLossConfig
    from comprl_jax.roles import batching
    from comprl_jax.roles import role as roles
    from comprl_jax.sampling import SamplingParams

    tok, c = tiny
    section = dataclasses.replace(RunConfig.of(c).actor, micro_batch=1, dtype=dtype)
    model = load_model("tiny", role="actor", tokenizer=tok, seed=3, dtype=dtype)
    assert model.cfg.dtype == dtype and model.cfg.param_dtype == "float32"
    role = roles.build_role(model, "actor", section, ActorLossConfig(), rows=4)
    assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(role.sampler.params))
    prompts = [tok.encode(f"Observation: go {d}") for d in ("north", "south", "east", "west")]
    res = role.sampler.generate(prompts, jax.random.key(1), SamplingParams(max_new_tokens=12))
    seqs, masks, lps = [], [], []
    for b, p in enumerate(prompts):
        n = int(res.lengths[b])
        seqs.append(p + res.tokens[b, :n].tolist())
        masks.append([0] * len(p) + [1] * n)
        lps.append([0.0] * len(p) + res.logprobs[b, :n].tolist())
    batch = batching.pack(seqs, masks, tok.pad_id, logprobs=lps)
    batch.pop("row_valid")
    batch["advantages"] = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    batch["subgroup"] = np.zeros(4, np.int32)
    batch["behaviour_mask"] = batch["loss_mask"]
    batch[roles.SAMPLED_BY] = role.version  # one optimizer step on this sampler's own samples
    m = jax.device_get(roles.dispatch_update(role, batch))
    assert m["logprob_mismatch"] < bound, m["logprob_mismatch"]
    assert role.refresh_seconds() >= 0.0  # the sampler got a fresh copy after the update, timed
    assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(role.sampler.params))


def test_config_precision_per_scale():
    """Paper scale: bfloat16 compute, float32 master weights, for both roles; the CPU scales stay float32; a run
    directory written before these keys existed resumes float32 (what it ran)."""
    paper = config_lib.load_file("configs/minihack_room.py")
    for role in ("actor", "extractor"):
        assert (paper[role].param_dtype, paper[role].dtype) == ("float32", "bfloat16")
    for scale in ("tiny", "cpu", "smollm"):
        c = config_lib.load_file(f"configs/minihack_room.py:{scale}")
        assert (c.actor.dtype, c.extractor.dtype) == ("float32", "float32")
    old = paper.to_dict()
    for role in ("actor", "extractor"):
        for key in ("param_dtype", "dtype", "rollout_tensor"):
            del old[role][key]
    up = config_lib.upgrade_saved(old)
    assert up["actor"]["dtype"] == up["extractor"]["dtype"] == "float32"
    bad = config_lib.load_file("configs/minihack_room.py:tiny")
    with bad.unlocked():
        bad.actor.dtype = "float8"
    with pytest.raises(ValueError, match="actor.dtype"):
        config_lib.validate(bad)
