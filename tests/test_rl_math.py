"""Hand-computed values for every RL formula (SPEC §2, §3, §7)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.rl import advantages as adv_lib
from comprl_jax.rl import losses
from comprl_jax.rl.update import merge_micro_batches, split_micro_batches

EPS = 1e-6


# ---- subgroup advantages (Eq. 5) -------------------------------------------------------------------------------

# Two tasks, K = 8: columns 0-3 guided (1), 4-7 free (0), except task 1 interleaves the subgroups.
REWARDS = np.array([[1, 0, 0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0, 0, 1]], np.float32)
SUBGROUP = np.array([[1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0, 1, 0]], np.int32)


def test_subgroup_advantages_mean_std():
    got = np.asarray(adv_lib.subgroup_advantages(REWARDS, SUBGROUP, "mean_std", eps=EPS))
    # task 0 guided [1,0,0,0]: mean 1/4, unbiased var (9/16 + 3/16) / 3 = 1/4, std 1/2 -> [3/2, -1/2, -1/2, -1/2].
    # task 0 free [1,1,1,1]: zero variance -> exactly 0.
    s = 0.5 + EPS
    np.testing.assert_allclose(got[0], [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0], rtol=1e-6)
    assert np.all(got[0, 4:] == 0.0)
    # task 1 guided (cols 0,2,4,6) [0,0,1,0]: mean 1/4 -> [-1/2, -1/2, 3/2, -1/2];
    # free (cols 1,3,5,7) [1,1,0,1]: mean 3/4, std 1/2 -> [1/2, 1/2, -3/2, 1/2].
    np.testing.assert_allclose(
        got[1], np.array([-0.25, 0.25, -0.25, 0.25, 0.75, -0.75, -0.25, 0.25]) / s, rtol=1e-6
    )


def test_subgroup_advantages_mean_mode():
    got = np.asarray(adv_lib.subgroup_advantages(REWARDS, SUBGROUP, "mean"))
    np.testing.assert_allclose(got[0], [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(got[1], [-0.25, 0.25, -0.25, 0.25, 0.75, -0.75, -0.25, 0.25], atol=1e-7)


def test_whole_group_is_grpo_with_one_subgroup_and_differs_from_subgroup_norm():
    whole = np.asarray(adv_lib.whole_group_advantages(REWARDS[:1], "mean"))
    # mean over all 8 = 5/8: a failed guided rollout gets -5/8, a successful free one +3/8.
    np.testing.assert_allclose(
        whole[0], [3 / 8, -5 / 8, -5 / 8, -5 / 8, 3 / 8, 3 / 8, 3 / 8, 3 / 8], atol=1e-7
    )
    one = np.asarray(
        adv_lib.subgroup_advantages(REWARDS[:1], np.zeros((1, 8), np.int32), "mean_std", eps=EPS)
    )
    # unbiased std of [1,0,0,0,1,1,1,1] = sqrt(15/56).
    np.testing.assert_allclose(one[0], (REWARDS[0] - 5 / 8) / (math.sqrt(15 / 56) + EPS), rtol=1e-6)


def test_advantage_mode_is_validated():
    with pytest.raises(ValueError, match="adv_norm"):
        adv_lib.subgroup_advantages(REWARDS, SUBGROUP, "std")


def test_extractor_advantages_count_weights_and_actor_critic():
    np.testing.assert_allclose(
        adv_lib.extractor_advantages([1.0, -1.0, 0.0, 1.0]), [0.75, -1.25, -0.25, 0.75]
    )
    # Eq. 7, δ = 1, α = 0.5: never trained -> 1; trained 3 times -> 1/2; trained last step (Δt = 0) -> 0.
    w = adv_lib.count_aware_weight([0, 3, 3], [10, 5, 0], alpha=0.5, cooldown=1)
    np.testing.assert_allclose(w, [1.0, 0.5, 0.0])
    # the actor-critic reward s + r(m): test_method_fidelity.py::test_actor_critic_decisions_and_the_s_plus_r_reward


def test_self_distillation_select():
    # free mean of task 0 is 1 -> no guided rollout beats it; task 1 free mean 3/4 -> only guided successes (col 4).
    sel = np.asarray(adv_lib.self_distillation_select(REWARDS, SUBGROUP))
    assert not sel[0].any()
    assert sel[1].tolist() == [False, False, False, False, True, False, False, False]


# ---- PPO-clip surrogate ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "adv, ratio, loss, clipped, dloss_dratio",
    [
        (1.0, 0.5, -0.5, 0, -1.0),  # below 1-ε, A > 0: the unclipped term is the min, gradient flows
        (1.0, 1.1, -1.1, 0, -1.0),
        (1.0, 1.5, -1.2, 1, 0.0),  # above 1+ε, A > 0: clipped at 1.2, no gradient
        (-1.0, 0.5, 0.8, 1, 0.0),  # below 1-ε, A < 0: clipped at 0.8, no gradient
        (-1.0, 1.1, 1.1, 0, 1.0),
        (-1.0, 1.5, 1.5, 0, 1.0),  # above 1+ε, A < 0: unclipped (pessimistic) term, gradient flows
    ],
)
def test_ppo_clip_surrogate(adv, ratio, loss, clipped, dloss_dratio):
    f = lambda r: losses.ppo_clip_token_loss(r, jnp.float32(adv), 0.2)  # noqa: E731
    got_loss, got_clipped = f(jnp.float32(ratio))
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    assert float(got_clipped) == clipped
    np.testing.assert_allclose(jax.grad(lambda r: f(r)[0])(jnp.float32(ratio)), dloss_dratio, atol=1e-7)


# ---- aggregations ------------------------------------------------------------------------------------------------

MASK = np.array([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]], np.float32)
TOK_LOSS = np.array([[9, 1, 2, 9], [9, 3, 4, 5], [9, 10, 9, 9]], np.float32)  # 9 = masked out
SUB = np.array([0, 0, 1], np.int32)


@pytest.mark.parametrize(
    "agg, subgroup_mean, expected",
    [
        ("token_mean", False, 25 / 6),  # (1+2+3+4+5+10) / 6
        ("seq_mean_token_mean", False, (1.5 + 4 + 10) / 3),
        ("token_mean", True, (15 / 5 + 10) / 2),  # ½ (free token mean + guided token mean)
        ("seq_mean_token_mean", True, ((1.5 + 4) / 2 + 10) / 2),
    ],
)
def test_aggregations(agg, subgroup_mean, expected):
    w = losses.aggregation_weights(MASK, SUB, agg, subgroup_mean)
    np.testing.assert_allclose(jnp.sum(w * TOK_LOSS), expected, rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(w), 1.0, rtol=1e-6)


def test_subgroup_mean_with_one_subgroup_equals_plain():
    sub0 = np.zeros(3, np.int32)
    for agg in losses.LOSS_AGGS:
        np.testing.assert_allclose(
            losses.aggregation_weights(MASK, sub0, agg, True),
            losses.aggregation_weights(MASK, sub0, agg, False),
        )


def _actor_batch(logp_minus_old, adv, mask, subgroup):
    mask = np.asarray(mask, np.float32)
    b, t = mask.shape
    return {
        "loss_mask": jnp.asarray(mask, jnp.float32),
        "old_logprobs": jnp.zeros((b, t), jnp.float32),
        "advantages": jnp.asarray(adv, jnp.float32),
        "subgroup": jnp.asarray(subgroup, jnp.int32),
    }, jnp.asarray(logp_minus_old, jnp.float32)


def test_actor_loss_token_ratio_end_to_end():
    # row 0 (free, A=+1): ρ = [e^0.05, e^0.5]; row 1 (guided, A=-1): ρ = [e^-0.5].
    batch, logp = _actor_batch([[0, 0.05, 0.5], [0, -0.5, 0]], [1.0, -1.0], [[0, 1, 1], [0, 1, 0]], [0, 1])
    cfg = losses.ActorLossConfig(compute_entropy=False)
    loss, pairs = losses.actor_loss(logp, None, batch, cfg)
    free = (-math.exp(0.05) - 1.2) / 2  # second token clipped at 1.2
    guided = 0.8  # -min(-e^-0.5, -0.8) = 0.8
    np.testing.assert_allclose(loss, (free + guided) / 2, rtol=1e-6)
    m = losses.finalize_metrics(pairs)
    np.testing.assert_allclose([m["clipfrac_free"], m["clipfrac_guided"], m["clipfrac"]], [0.5, 1.0, 2 / 3])
    np.testing.assert_allclose(
        [m["adv_mean_free"], m["adv_std_free"], m["adv_mean_guided"]], [1.0, 0.0, -1.0]
    )
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    np.testing.assert_allclose(m["approx_kl"], (k3(0.05) + k3(0.5) + k3(-0.5)) / 3, rtol=1e-5)


def test_actor_loss_sequence_ratio():
    # log ρ = [0.1, 0.3] -> sequence ratio e^0.2 = 1.2214 > 1.2: clipped for A > 0, applied to both tokens.
    batch, logp = _actor_batch([[0, 0.1, 0.3]], [1.0], [[0, 1, 1]], [0])
    loss, pairs = losses.actor_loss(logp, None, batch, losses.ActorLossConfig(ratio="sequence"))
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    assert float(losses.finalize_metrics(pairs)["clipfrac"]) == 1.0
    # just inside: log ρ = [0.1, 0.2] -> e^0.15; gradient w.r.t. each token's logp = -e^0.15 / 2 / 2.
    batch, logp = _actor_batch([[0, 0.1, 0.2]], [1.0], [[0, 1, 1]], [0])
    g = jax.grad(lambda lp: losses.actor_loss(lp, None, batch, losses.ActorLossConfig(ratio="sequence"))[0])(
        logp
    )
    np.testing.assert_allclose(g, [[0, -math.exp(0.15) / 2, -math.exp(0.15) / 2]], rtol=1e-6)


def test_actor_sft_term_is_token_mean_over_sft_rows_only():
    batch, logp = _actor_batch([[0, 0.0, 0.0], [0, 0, 0]], [1.0, 0.0], [[0, 1, 1], [0, 1, 1]], [1, 1])
    logp = logp + jnp.array([[0, -1.0, -2.0], [0, -3.0, -5.0]])  # old = new logp: ratio 1
    batch["old_logprobs"] = logp * batch["loss_mask"]
    batch["sft_row"] = jnp.array([0.0, 1.0])
    loss, pairs = losses.actor_loss(logp, None, batch, losses.ActorLossConfig(sft_coef=0.5))
    # PPO on row 0 only: -(1·A) = -1; SFT NLL on row 1 = (3 + 5) / 2 = 4, times 0.5.
    np.testing.assert_allclose(loss, -1.0 + 0.5 * 4.0, rtol=1e-6)
    np.testing.assert_allclose(losses.finalize_metrics(pairs)["sft_nll"], 4.0, rtol=1e-6)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="actor.loss_agg"):
        losses.ActorLossConfig(loss_agg="sum")
    with pytest.raises(ValueError, match="actor.ratio"):
        losses.ActorLossConfig(ratio="seq")
    with pytest.raises(ValueError, match="extractor.clip_eps"):
        losses.ExtractorLossConfig(clip_eps=1.5)


def test_run_config_loss_sub_dicts_build_the_loss_dataclasses():
    """``c.actor.loss`` / ``c.extractor.loss`` are the loss configs' fields, checked once by the dataclass."""
    from comprl_jax import config as config_lib

    c = config_lib.build("tiny", "t")
    assert losses.loss_config(c, "actor", sft_coef=0.3) == losses.ActorLossConfig(
        clip_eps=0.2, ratio="token", loss_agg="token_mean", subgroup_mean=True, sft_coef=0.3
    )
    assert losses.loss_config(c, "extractor") == losses.ExtractorLossConfig(clip_eps=0.1)
    with c.unlocked():
        c.extractor.loss.loss_agg = "sum"
        with pytest.raises(ValueError, match=r"^config key extractor.loss.loss_agg: must be one of"):
            config_lib.validate(c)
        c.extractor.loss.loss_agg = "token_mean"
        c.actor.loss.eps = 0.1
        with pytest.raises(ValueError, match=r"config key actor.loss.eps: unknown"):
            config_lib.validate(c)


def test_an_older_runs_config_json_is_upgraded_to_the_loss_sub_dicts():
    from comprl_jax import config as config_lib

    old = {"actor": {"lr": 1e-3, "clip_eps": 0.3, "ratio": "sequence"}, "extractor": {"cispo_eps": 0.2}}
    new = config_lib.upgrade_saved(old)
    # runs from before partial fine-tuning trained every layer; before issue 27 they computed in float32 and
    # sampled from the training layout; before issue 28's producer-consumer distillation they applied a step's
    # lessons within the step; before issue 30 they trained one episode per row (no packing), sampled on the dense
    # KV cache, and "auto" attention picks what they ran; before the MoE dispatch keys they used the model's own
    f32 = {"trainable_layers": 0, "param_dtype": "float32", "dtype": "float32", "rollout_tensor": 0}
    f32 |= {"pack": False, "attention": "auto", "kv_cache": "dense"}
    f32 |= {"moe_dispatch": "", "moe_exchange_tokens": 4096}
    assert new == {
        # before issue 49 the actor answered without a think
        "actor": {"lr": 1e-3, "loss": {"clip_eps": 0.3, "ratio": "sequence"}, **f32, "think_chars": 0},
        "extractor": {"loss": {"clip_eps": 0.2}, **f32, "distill_overlap": "update"},
    }
    assert old["actor"]["clip_eps"] == 0.3  # a copy
    current = config_lib.build("tiny", "t").to_dict()
    assert config_lib.upgrade_saved(current) == current
    with_frozen = config_lib.build("tiny", "t")
    with_frozen.actor.trainable_layers = 1
    assert config_lib.upgrade_saved(with_frozen.to_dict())["actor"]["trainable_layers"] == 1


def test_the_loss_config_type_selects_the_loss_functions():
    assert losses.loss_functions(losses.ActorLossConfig()) == (losses.actor_loss, losses.actor_token_weights)
    assert losses.loss_functions(losses.ExtractorLossConfig())[0] is losses.extractor_loss

    @dataclasses.dataclass(frozen=True)
    class MyLoss:
        compute_entropy: bool = False

    with pytest.raises(TypeError, match="no loss registered for MyLoss"):
        losses.loss_functions(MyLoss())
    mine = (lambda logp, ent, batch, cfg: (0.0, {}), lambda batch, cfg: {})
    losses.register_loss(MyLoss, *mine)
    try:
        assert losses.loss_functions(MyLoss()) == mine
    finally:
        del losses.LOSSES[MyLoss]


# ---- CISPO -------------------------------------------------------------------------------------------------------


def test_cispo_gradient_direction_and_clip():
    # one row, 3 generated tokens with ρ = 1.5, 0.5, 1.05; ε = 0.1 -> stop-gradient weights 1.1, 0.9, 1.05.
    old = jnp.array([[0.0, -1.0, -1.0, -1.0]])
    logp = old + jnp.array([[0.0, math.log(1.5), math.log(0.5), math.log(1.05)]])
    batch = {
        "loss_mask": jnp.array([[0.0, 1, 1, 1]]),
        "old_logprobs": old,
        "advantages": jnp.array([2.0]),
        "sample_weight": jnp.array([0.5]),  # Eq. 7 weight: effective advantage 1.0
    }
    cfg = losses.ExtractorLossConfig(compute_entropy=False)
    loss, pairs = losses.extractor_loss(logp, None, batch, cfg)
    w = np.array([1.1, 0.9, 1.05])
    np.testing.assert_allclose(loss, -(w * np.asarray(logp[0, 1:])).sum() / 3, rtol=1e-6)
    g = jax.grad(lambda lp: losses.extractor_loss(lp, None, batch, cfg)[0])(logp)
    # ∂L/∂log π = -clip(ρ)·A/N: negative for A > 0 (descent raises log π), nonzero even where ρ was clipped.
    np.testing.assert_allclose(g[0], np.concatenate([[0.0], -w * 1.0 / 3]), rtol=1e-6)
    m = losses.finalize_metrics(pairs)
    np.testing.assert_allclose(m["clipfrac"], 2 / 3)
    np.testing.assert_allclose(m["is_weight"], w.mean(), rtol=1e-6)
    # negative advantage flips the direction.
    batch["advantages"] = jnp.array([-2.0])
    g = jax.grad(lambda lp: losses.extractor_loss(lp, None, batch, cfg)[0])(logp)
    assert np.all(np.asarray(g[0, 1:]) > 0)


def test_token_logprobs_match_log_softmax():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 7)
    logp, ent = losses.token_logprobs(logits, tokens, compute_entropy=True)
    ref = jax.nn.log_softmax(logits, -1)
    want = np.take_along_axis(np.asarray(ref[:, :-1]), np.asarray(tokens[:, 1:, None]), -1)[..., 0]
    np.testing.assert_allclose(logp[:, 1:], want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(logp[:, 0]) == 0)
    np.testing.assert_allclose(ent[:, 1:], -(jnp.exp(ref) * ref).sum(-1)[:, :-1], rtol=1e-5)


# ---- exact micro-batching at the loss level (every variant; the model-level check is in test_rl_update.py) ---------


@pytest.mark.parametrize("ratio", losses.RATIOS)
@pytest.mark.parametrize("agg", losses.LOSS_AGGS)
@pytest.mark.parametrize("subgroup_mean, sft_coef", [(True, 0.0), (False, 0.0), (True, 0.3)])
def test_loss_split_into_micro_batches_is_exact(ratio, agg, subgroup_mean, sft_coef):
    rng = np.random.default_rng(0)
    b, t, m = 8, 6, 4
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    mask[:, 0] = 0
    mask[5] = 0  # an empty row
    batch = {
        "loss_mask": mask,
        "old_logprobs": (-rng.random((b, t)) * mask).astype(np.float32),
        "advantages": rng.normal(size=b).astype(np.float32),
        "subgroup": np.array([0, 0, 0, 0, 0, 1, 1, 0], np.int32),  # uneven subgroups
        "sft_row": np.array([0, 0, 1, 0, 0, 0, 0, 1], np.float32),
    }
    logp = jnp.asarray(-rng.random((b, t)), jnp.float32)
    cfg = losses.ActorLossConfig(ratio=ratio, loss_agg=agg, subgroup_mean=subgroup_mean, sft_coef=sft_coef)
    full = {**batch, **losses.actor_token_weights(batch, cfg)}

    def loss_of(lp, bt):
        return losses.actor_loss(lp, None, bt, cfg)

    (l_full, p_full), g_full = jax.value_and_grad(loss_of, has_aux=True)(logp, full)
    micro = jax.tree.map(lambda x: split_micro_batches(jnp.asarray(x), m), {**full, "logp": logp})
    l_sum, g_parts, p_sum = 0.0, [], None
    for i in range(m):
        mb = jax.tree.map(lambda x, i=i: x[i], micro)
        (li, pi), gi = jax.value_and_grad(loss_of, has_aux=True)(mb.pop("logp"), mb)
        l_sum += li
        g_parts.append(gi)
        p_sum = pi if p_sum is None else losses.accumulate_pairs(p_sum, pi)
    np.testing.assert_allclose(l_sum, l_full, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(merge_micro_batches(jnp.stack(g_parts)), g_full, atol=1e-7)
    f_full, f_sum = losses.finalize_metrics(p_full), losses.finalize_metrics(p_sum)
    for k in f_full:
        np.testing.assert_allclose(f_sum[k], f_full[k], rtol=1e-5, atol=1e-7, err_msg=k)
