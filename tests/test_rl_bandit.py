"""Learning test: the actor loss teaches a tiny decoder a seeded text bandit.

Each prompt is ``[subgroup marker, cue]``; the cue names which of N_ARMS answer tokens is rewarded. The policy
samples one answer token from its *full* vocabulary, so chance success is ~1/V at init. Groups of K = 8 rollouts
per prompt are split 4 guided + 4 free (the marker differs), advantages are subgroup-normalised, and one batch
is one optimizer step, exactly the actor path of the trainer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models.config import ModelConfig
from comprl_jax.models.decoder import forward, init_decoder
from comprl_jax.rl import losses
from comprl_jax.rl.advantages import subgroup_advantages
from comprl_jax.rl.train_state import OptimConfig, create_train_state, make_optimizer
from comprl_jax.rl.update import make_logprob_fn, make_update_fn

N_ARMS = 4
ARM0, CUE0, FREE, GUIDED = 0, 4, 8, 9  # token ids: arms 0-3, cues 4-7, subgroup markers
VOCAB, G, K = 16, 8, 8
UPDATES = 50  # success passes 0.9 around update 27-30 with this seed; margin for platform drift


@functools.partial(jax.jit, static_argnums=0)
def sample(logits_fn, params, key):
    """One rollout batch: G cues x K rollouts; returns tokens [G*K, 3], the arm each cue rewards, subgroup."""
    k_cue, k_act = jax.random.split(key)
    arm = jnp.repeat(jax.random.randint(k_cue, (G,), 0, N_ARMS), K)
    subgroup = jnp.tile(jnp.arange(K) % 2, G)
    prompt = jnp.stack([jnp.where(subgroup == 1, GUIDED, FREE), CUE0 + arm], axis=1)
    pos = jnp.broadcast_to(jnp.arange(2), prompt.shape)
    logits = logits_fn(params, prompt, pos, jnp.ones(prompt.shape, bool))[:, -1]
    action = jax.random.categorical(k_act, logits)
    return jnp.concatenate([prompt, action[:, None]], axis=1), arm, subgroup


@pytest.mark.slow
def test_actor_loss_learns_text_bandit():
    cfg = ModelConfig.tiny("qwen3", vocab_size=VOCAB, num_layers=1)
    graphdef, params = init_decoder(cfg, seed=0)
    logits_fn = functools.partial(forward, graphdef)
    tx = make_optimizer(OptimConfig(lr=3e-3))
    state = create_train_state(params, tx)
    update = make_update_fn(logits_fn, losses.ActorLossConfig(), tx, num_micro_batches=2, max_traces=1)
    logprobs = make_logprob_fn(logits_fn)
    b = G * K
    fixed = {
        "positions": np.broadcast_to(np.arange(3, dtype=np.int32), (b, 3)),
        "attn_mask": np.ones((b, 3), bool),
        "loss_mask": np.tile(np.array([0, 0, 1], np.float32), (b, 1)),
    }

    def success(key):
        tokens, arm, subgroup = sample(logits_fn, state.params, key)
        return tokens, subgroup, (tokens[:, 2] == ARM0 + arm).astype(jnp.float32)

    key = jax.random.key(0)
    initial = float(np.mean([success(jax.random.fold_in(key, 10_000 + i))[2].mean() for i in range(4)]))
    assert initial < 0.2, f"untrained policy should be near chance (1/{VOCAB}), got {initial}"
    for step in range(UPDATES):
        tokens, subgroup, reward = success(jax.random.fold_in(key, step))
        adv = subgroup_advantages(reward.reshape(G, K), subgroup.reshape(G, K)).reshape(-1)
        batch = {**fixed, "tokens": tokens, "subgroup": subgroup, "advantages": adv}
        batch["old_logprobs"] = logprobs(state.params, batch)
        state, metrics = update(state, batch)
    final = float(np.mean([success(jax.random.fold_in(key, 20_000 + i))[2].mean() for i in range(4)]))
    assert final >= 0.9, f"success after {UPDATES} updates: {final} (from {initial})"
    assert np.isfinite(float(metrics["entropy"]))
