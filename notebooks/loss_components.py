# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Loss components of Complementary RL
#
# The pieces of `comprl_jax.rl` on synthetic numbers, each with the check that makes its point:
#
# 1. **Subgroup vs whole-group advantage normalisation** (paper Fig. 3c): mixing guided and free rollouts in one
#    baseline biases both subgroups; normalising inside each subgroup does not.
# 2. **PPO clipping per subgroup**: the clipped surrogate and the clip fraction of each subgroup.
# 3. **CISPO weights** (the extractor): a clipped, stop-gradient IS weight that never zeroes the gradient.
# 4. **Eq. 7 count-aware reweighting** of extractor samples.
# 5. **Eq. 6 diversification scores** for retrieval.
#
# Executed by `tests/test_notebooks.py`; paired with `loss_components.ipynb` by jupytext.

# %%
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from comprl_jax.experience.retrieval import eq6_scores  # noqa: E402
from comprl_jax.rl import advantages as adv_lib  # noqa: E402
from comprl_jax.rl import losses  # noqa: E402

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Subgroup vs whole-group normalisation (Fig. 3c)
#
# Simulate many groups of K = 8 rollouts of one task: 4 guided ones succeed with probability 0.7 (the
# experience helps), 4 free ones with probability 0.3. With **one** baseline for the whole group, the mean
# advantage of the guided subgroup is positive and that of the free subgroup negative *whatever the free
# policy did*: a free success is credited less than a guided one, and the gradient mostly says "be more like
# the guided context", not "do what worked". Normalising inside each subgroup gives each its own zero-mean
# signal: successes are rewarded relative to rollouts that had the same information.

# %%
G, K = 4000, 8
sub = np.tile(np.repeat([1, 0], K // 2), (G, 1))  # 4 guided then 4 free
p_success = np.where(sub == 1, 0.7, 0.3)
rewards = (rng.random((G, K)) < p_success).astype(np.float32)

whole = np.asarray(adv_lib.whole_group_advantages(rewards, "mean_std"))
subgrp = np.asarray(adv_lib.subgroup_advantages(rewards, sub, "mean_std"))

rows = []
for name, a in (("whole-group", whole), ("subgroup", subgrp)):
    for c, cname in ((1, "guided"), (0, "free")):
        sel = sub == c
        rows.append((name, cname, a[sel].mean(), a[sel & (rewards == 1)].mean()))
        print(f"{name:12s} {cname:7s} mean adv {a[sel].mean():+.3f}   adv of a success {a[sel & (rewards == 1)].mean():+.3f}")

# The point, as checks: whole-group normalisation biases the subgroup means; subgroup normalisation centres them.
assert whole[sub == 1].mean() > 0.3 and whole[sub == 0].mean() < -0.3
assert abs(subgrp[sub == 1].mean()) < 0.02 and abs(subgrp[sub == 0].mean()) < 0.02

fig, ax = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
for axis, (name, a) in zip(ax, (("whole-group", whole), ("subgroup", subgrp)), strict=True):
    axis.hist([a[sub == 1], a[sub == 0]], bins=21, label=["guided", "free"])
    axis.axvline(0, color="k", lw=0.5)
    axis.set_title(f"{name} normalisation")
    axis.set_xlabel("advantage")
ax[0].legend()
plt.tight_layout()

# %% [markdown]
# ## 2. PPO clipping per subgroup
#
# The per-token loss is `-min(ρA, clip(ρ, 1-ε, 1+ε)A)`. For A > 0 the objective stops rewarding ρ beyond 1 + ε;
# for A < 0 it stops below 1 - ε. Clip fractions are reported **per subgroup** as (numerator, denominator) pairs:
# guided rollouts, sampled with the experience in context, drift differently from free ones.

# %%
eps = 0.2
ratio = jnp.linspace(0.4, 1.6, 121)
fig, ax = plt.subplots(1, 2, figsize=(9, 3))
for axis, a in zip(ax, (1.0, -1.0), strict=True):
    loss, clipped = losses.ppo_clip_token_loss(ratio, jnp.float32(a), eps)
    grad = jax.vmap(jax.grad(lambda r, a=a: losses.ppo_clip_token_loss(r, jnp.float32(a), eps)[0]))(ratio)
    axis.plot(ratio, -loss, label="surrogate (objective)")
    axis.plot(ratio, -grad, label="d objective / d ρ")
    axis.axvspan(1 - eps, 1 + eps, alpha=0.1)
    axis.set_title(f"A = {a:+.0f}")
    axis.set_xlabel("ρ")
ax[0].legend()
plt.tight_layout()

# Synthetic batch: guided rows drifted more (log-ratio std 0.3) than free rows (0.05).
B, T = 16, 32
subgroup = np.arange(B) % 2
log_ratio = rng.normal(size=(B, T)) * np.where(subgroup[:, None] == 1, 0.3, 0.05)
batch = {
    "loss_mask": np.ones((B, T), np.float32),
    "old_logprobs": np.zeros((B, T), np.float32),
    "advantages": rng.choice([-1.0, 1.0], B).astype(np.float32),
    "subgroup": subgroup.astype(np.int32),
}
_, pairs = losses.actor_loss(jnp.asarray(log_ratio, jnp.float32), None, batch, losses.ActorLossConfig())
m = losses.finalize_metrics(pairs)
print({k: round(float(m[k]), 3) for k in ("clipfrac_guided", "clipfrac_free", "clipfrac", "approx_kl")})
assert m["clipfrac_guided"] > m["clipfrac_free"]

# %% [markdown]
# ## 3. CISPO weights (extractor)
#
# CISPO multiplies each token's log-likelihood gradient by `sg(clip(ρ, 1-ε, 1+ε))` with ε = 0.1. The weight is
# bounded, but unlike PPO-clip the gradient is never zero: rare tokens that moved a lot (often the important
# "reasoning fork" tokens of a long extractor response) still get a learning signal.

# %%
rho = np.linspace(0.5, 1.5, 101)
old = np.zeros((1, rho.size + 1), np.float32)
logp = np.concatenate([[0.0], np.log(rho)]).astype(np.float32)[None]
xb = {"loss_mask": np.concatenate([[0.0], np.ones(rho.size)])[None].astype(np.float32), "old_logprobs": old,
      "advantages": np.array([1.0], np.float32), "sample_weight": np.array([1.0], np.float32)}
cfg = losses.ExtractorLossConfig(compute_entropy=False)
g_cispo = -np.asarray(jax.grad(lambda lp: losses.extractor_loss(lp, None, xb, cfg)[0])(jnp.asarray(logp)))[0, 1:]
g_cispo = g_cispo * rho.size  # undo the token mean: the per-token coefficient on ∇ log π
ppo_coef = np.where(rho > 1.2, 0.0, rho)  # PPO-clip (A > 0): ρ·∇log π inside, 0 once clipped
np.testing.assert_allclose(g_cispo, np.clip(rho, 0.9, 1.1), rtol=1e-5)
plt.figure(figsize=(4.5, 3))
plt.plot(rho, g_cispo, label="CISPO, ε=0.1")
plt.plot(rho, ppo_coef, "--", label="PPO-clip, ε=0.2")
plt.xlabel("ρ")
plt.ylabel("coefficient on ∇ log π (A = 1)")
plt.legend()
plt.tight_layout()

# %% [markdown]
# ## 4. Eq. 7 count-aware reweighting
#
# An entry that keeps being retrieved keeps producing extractor samples; `w = (1 + c_train)^(-α)` damps
# entries already trained on many times, and `w = 0` during the cooldown δ right after training.

# %%
counts = np.arange(0, 21)
plt.figure(figsize=(4.5, 3))
for alpha in (0.25, 0.5, 1.0):
    w = np.asarray(adv_lib.count_aware_weight(counts, np.full(counts.shape, 10), alpha=alpha, cooldown=1))
    plt.plot(counts, w, marker=".", label=f"α = {alpha}")
plt.xlabel("times trained c_train")
plt.ylabel("weight w")
plt.legend()
plt.tight_layout()
w_default = np.asarray(adv_lib.count_aware_weight([0, 3, 8, 3], [9, 9, 9, 0], alpha=0.5, cooldown=1))
print("weights (c=0, 3, 8, and c=3 in cooldown):", w_default)
np.testing.assert_allclose(w_default, [1.0, 0.5, 1 / 3, 0.0], rtol=1e-6)

# Batch-mean advantages, then weights: a cooled-down sample contributes nothing; the mean still counts it.
r = np.array([1.0, -1.0, 1.0, 0.0])
print("advantages:", np.asarray(adv_lib.extractor_advantages(r)) * w_default)

# %% [markdown]
# ## 5. Eq. 6 diversification scores
#
# `s(m) = -rank(m) - λ·log(1 + retrievals(m)) - 1[retrieved within the window]`, λ = 0.4, window 300 s: a very
# popular or just-used top hit yields to the next candidate, so one entry does not monopolise the bank.

# %%
retrievals = [50, 0, 3, 0]
last = [990.0, None, 400.0, None]  # clock seconds; now = 1000 -> candidate 1 was used 10 s ago
s = eq6_scores(retrievals, last, now=1000.0, lam=0.4, window=300.0)
order = np.argsort(-s, kind="stable")
for i in range(len(s)):
    print(f"rank {i + 1}: retrievals {retrievals[i]:3d}  recent {last[i] is not None and 1000 - last[i] < 300}"
          f"  score {s[i]:+.3f}")
print("re-ranked:", (order + 1).tolist())
np.testing.assert_allclose(s, [-1 - 0.4 * np.log(51) - 1, -2, -3 - 0.4 * np.log(4), -4])
assert order[0] == 1  # the overused, just-retrieved top hit drops below the fresh second candidate
