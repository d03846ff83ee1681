"""Sequence packing (issue 30): the packed layout itself, and losses, subgroup statistics, gradients and a full update
step of a packed batch equal to the unpacked (one episode per row) batch, on hand-built ragged episodes."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from comprl_jax.models.config import ModelConfig
from comprl_jax.models.decoder import forward, init_decoder
from comprl_jax.rl import losses
from comprl_jax.rl.train_state import create_train_state
from comprl_jax.rl.update import make_logprob_fn, make_update_fn, split_micro_batches
from comprl_jax.roles import batching, packing
from comprl_jax.roles import role as roles

CFG = ModelConfig.tiny("qwen3", vocab_size=64)
T = 12  # the unpacked rows' length, and the packed rows'
LENGTHS = (3, 7, 2, 5)
MASKS = ([0, 1, 1], [0, 0, 1, 1, 0, 1, 1], [0, 1], [0, 0, 1, 1, 1])
ADVANTAGES = np.array([0.5, -1.0, 1.5, -0.25], np.float32)
SUBGROUP = np.array([0, 1, 1, 0], np.int32)  # two free, two guided
SFT_ROW = np.array([0, 0, 0, 1], np.float32)  # episode 3: a self-distillation row
SAMPLE_WEIGHT = np.array([1.0, 0.5, 0.0, 2.0], np.float32)


def episodes_batch(kind="actor", seed=0):
    """The four ragged episodes in the row layout (``batching.pack``: one per row, right-padded to T)."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, CFG.vocab_size, n).tolist() for n in LENGTHS]
    lps = [(-rng.random(n) * np.array(m)).tolist() for n, m in zip(LENGTHS, MASKS, strict=True)]
    batch = batching.pack(seqs, MASKS, pad_id=0, length=T, logprobs=lps)
    batch.pop("row_valid")
    batch["old_logprobs"] = batch.pop("behaviour_logprobs")
    batch["advantages"] = ADVANTAGES.copy()
    if kind == "actor":
        batch["subgroup"] = SUBGROUP.copy()
        batch["sft_row"] = SFT_ROW.copy()
    else:
        batch["sample_weight"] = SAMPLE_WEIGHT.copy()
    return batch


# ---- the layout -----------------------------------------------------------------------------------------------


def test_layout_is_first_fit_decreasing():
    # longest first: 7 -> row 0; 5 -> row 0 at 7 (fills it); 3 -> row 1; 2 -> row 1 at 3
    assert packing.first_fit_decreasing(LENGTHS, T) == [(1, 0), (0, 0), (1, 3), (0, 7)]
    # ties: the lower index first; an empty episode takes no room
    assert packing.first_fit_decreasing([4, 0, 4, 4], 8) == [(0, 0), None, (0, 4), (1, 0)]
    with pytest.raises(ValueError, match="episode 1 has 9 tokens"):
        packing.first_fit_decreasing([2, 9], 8)

    batch = episodes_batch()
    packed = packing.pack_batch(batch, micro_rows=4)
    assert packed["tokens"].shape == (2, T)  # 4 rows of 12 -> 2 rows of 12 (17 tokens)
    seg = [[1] * 7 + [2] * 5, [1] * 3 + [2] * 2 + [0] * 7]
    np.testing.assert_array_equal(packed["segment_ids"], seg)
    np.testing.assert_array_equal(packed["episode"], [[1] * 7 + [3] * 5, [0] * 3 + [2] * 2 + [0] * 7])
    pos = [list(range(7)) + list(range(5)), [0, 1, 2, 0, 1] + [0] * 7]
    np.testing.assert_array_equal(packed["positions"], pos)
    np.testing.assert_array_equal(packed["attn_mask"], np.asarray(seg) > 0)
    for e, (row, off) in enumerate([(1, 0), (0, 0), (1, 3), (0, 7)]):  # every per-token key moved whole
        n = LENGTHS[e]
        for key in ("tokens", "loss_mask", "old_logprobs"):
            np.testing.assert_array_equal(packed[key][row, off : off + n], batch[key][e, :n], err_msg=key)
    assert np.all(packed["tokens"][1, 5:] == 0) and np.all(packed["loss_mask"][1, 5:] == 0)
    for key in ("advantages", "subgroup", "sft_row"):  # per-row arrays: per episode, unchanged
        np.testing.assert_array_equal(packed["episodes"][key], batch[key])
    assert packing.padding_fraction(batch) == pytest.approx(1 - 17 / 48)
    assert packing.padding_fraction(packed) == pytest.approx(1 - 17 / 24)


def test_row_count_buckets():
    # up to micro_rows: powers of two times the devices; past it, a power of two of micro-batches, capped
    assert [packing.bucket_rows(n, 8, 64) for n in (0, 1, 2, 3, 5, 8)] == [1, 1, 2, 4, 8, 8]
    assert [packing.bucket_rows(n, 8, 64, row_multiple=2) for n in (1, 3)] == [2, 4]
    assert [packing.bucket_rows(n, 8, 64) for n in (9, 17, 33, 64)] == [16, 32, 64, 64]
    assert packing.bucket_rows(40, 8, 48) == 48  # never more micro-batches than the row layout's 6
    assert packing.bucket_rows(5, 6, 48, row_multiple=2) == 6  # capped at micro_rows
    lay = packing.plan(LENGTHS, T, micro_rows=1)
    assert (lay.rows, lay.used, lay.length) == (2, 2, T)


def test_pack_batch_refuses_what_it_cannot_pack_exactly():
    batch = episodes_batch()
    bad = dict(batch, loss_mask=batch["loss_mask"].copy())
    bad["loss_mask"][2, 0] = 1  # no prediction for a first token: packed, it would see the previous episode
    with pytest.raises(ValueError, match=r"episodes \[2\] have their first token in loss_mask"):
        packing.pack_batch(bad)
    right = dict(batch, attn_mask=batch["attn_mask"][:, ::-1].copy())
    with pytest.raises(ValueError, match="left-aligned"):
        packing.pack_batch(right)


# ---- losses, subgroup statistics and gradients: packed == unpacked --------------------------------------------


ACTOR_CFGS = [
    losses.ActorLossConfig(ratio=r, loss_agg=a, subgroup_mean=s, sft_coef=c)
    for r in losses.RATIOS
    for a in losses.LOSS_AGGS
    for s in (True, False)
    for c in (0.0, 0.3)
]
EXTRACTOR_CFGS = [losses.ExtractorLossConfig(loss_agg=a) for a in losses.LOSS_AGGS]


def _loss_and_grad(cfg, logp, batch, num_micro=1):
    """Loss, metric pairs and d loss / d logp, the full-batch weights first, then summed over micro-batches
    (strided rows; a packed batch's per-episode arrays go whole to each), as the update step does."""
    loss_fn, weights_fn = losses.loss_functions(cfg)
    full = {**batch, **weights_fn(batch, cfg), "logp": logp}
    episodes = full.pop(losses.EPISODES, None)
    micro = jax.tree.map(lambda x: split_micro_batches(jnp.asarray(x), num_micro), full)
    total, pairs, grads = 0.0, None, []
    for i in range(num_micro):
        mb = jax.tree.map(lambda x, i=i: x[i], micro)
        if episodes is not None:
            mb[losses.EPISODES] = episodes
        lp = mb.pop("logp")
        (li, pi), gi = jax.value_and_grad(lambda p, b=mb: loss_fn(p, None, b, cfg), has_aux=True)(lp)
        total += li
        grads.append(gi)
        pairs = pi if pairs is None else losses.accumulate_pairs(pairs, pi)
    grad = jnp.stack(grads).swapaxes(0, 1).reshape(logp.shape)  # merge the strided micro-batches
    return total, losses.finalize_metrics(pairs), np.asarray(grad)


@pytest.mark.parametrize("cfg", ACTOR_CFGS + EXTRACTOR_CFGS, ids=repr)
def test_packed_loss_metrics_and_gradients_equal_unpacked(cfg):
    kind = "actor" if isinstance(cfg, losses.ActorLossConfig) else "extractor"
    batch = episodes_batch(kind)
    rng = np.random.default_rng(1)
    batch["logp"] = (batch["old_logprobs"] + rng.normal(scale=0.3, size=(4, T)) * batch["loss_mask"]).astype(
        np.float32
    )  # rho != 1: the clips act
    packed = packing.pack_batch(batch, micro_rows=1)
    logp, logp_packed = batch.pop("logp"), packed.pop("logp")
    loss, metrics, grad = _loss_and_grad(cfg, jnp.asarray(logp), batch)
    for num_micro in (1, 2):  # the two packed rows as one micro-batch, and as two
        loss_p, metrics_p, grad_p = _loss_and_grad(cfg, jnp.asarray(logp_packed), packed, num_micro)
        np.testing.assert_allclose(loss_p, loss, rtol=1e-6, atol=1e-7)
        assert metrics_p.keys() == metrics.keys()
        for k in metrics:  # incl. the subgroup statistics: adv_mean/std_free/guided, tokens_*, clipfrac_*
            np.testing.assert_allclose(metrics_p[k], metrics[k], rtol=1e-6, atol=1e-7, err_msg=k)
        # d loss / d logp of each token, packed back into the packed layout's places
        want = packing.pack_batch({**batch, "g": grad}, micro_rows=1)["g"]
        np.testing.assert_allclose(grad_p, want, rtol=1e-6, atol=1e-7)
    assert np.abs(grad).max() > 1e-3
    if kind == "actor":
        assert float(metrics["adv_mean_guided"]) == pytest.approx((-1.0 + 1.5) / 2)
    if getattr(cfg, "ratio", "token") == "token":
        assert 0 < float(metrics["clipfrac"]) < 1


def test_packed_token_weights_equal_unpacked():
    """The per-sequence normalisation (lengths, cells) over the full batch: same weight on each token."""
    batch = episodes_batch()
    packed = packing.pack_batch(batch, micro_rows=2)
    for cfg in ACTOR_CFGS:
        w = losses.actor_token_weights(batch, cfg)
        w_p = losses.actor_token_weights(packed, cfg)
        for k in w:
            want = packing.pack_batch({**batch, "w": np.asarray(w[k])}, micro_rows=2)["w"]
            np.testing.assert_allclose(w_p[k], want, rtol=1e-7, atol=0, err_msg=f"{cfg} {k}")


# ---- the model: segment ids in the forward, micro-batching, one full update -----------------------------------


@functools.lru_cache(maxsize=1)
def model():
    graphdef, params = init_decoder(CFG, seed=0)
    return functools.partial(forward, graphdef), params


MODEL_CFGS = [losses.ActorLossConfig(), losses.ExtractorLossConfig()]  # the other variants: loss level, above


@pytest.mark.parametrize("cfg", MODEL_CFGS, ids=repr)
def test_packed_update_equals_unpacked(cfg):
    logits_fn, params = model()
    kind = "actor" if isinstance(cfg, losses.ActorLossConfig) else "extractor"
    batch = episodes_batch(kind, seed=2)
    del batch["old_logprobs"]
    # pi_old of the unpacked and the packed rows (segment ids reach the model): the same numbers, in their places
    old = np.asarray(make_logprob_fn(logits_fn, micro_rows=2)(params, batch))
    packed = packing.pack_batch(batch, micro_rows=1)
    old_p = np.asarray(make_logprob_fn(logits_fn, micro_rows=1)(params, packed))
    want = packing.pack_batch({**batch, "lp": old}, micro_rows=1)["lp"]
    np.testing.assert_allclose(old_p, want, rtol=0, atol=1e-6)
    noise = np.random.default_rng(3).normal(scale=0.3, size=old.shape).astype(np.float32)
    batch["old_logprobs"] = (old + noise) * batch["loss_mask"]  # rho != 1
    packed = packing.pack_batch(batch, micro_rows=1)

    # One optimizer step as roles.build_role builds it (micro-batches of micro_rows = 1 row, their number counted
    # per batch: 4 unpacked, 2 packed). The optimizer is plain SGD at lr 1, so the new parameters differ exactly by
    # the gradients' difference (AdamW's first step, lr * g / (|g| + eps), would amplify the float32 rounding of an
    # entry whose gradient is near eps by orders of magnitude, whatever the batch layout).
    update = make_update_fn(logits_fn, cfg, optax.sgd(1.0), micro_rows=1)
    new, m = update(create_train_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0)), batch)
    new_p, m_p = update(create_train_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0)), packed)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new.params, params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # a real gradient
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(new_p.params), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    assert m_p.keys() == m.keys()
    for k in m:  # losses, clip fractions, KL, entropy, subgroup statistics, grad_norm
        np.testing.assert_allclose(m_p[k], m[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_packed_update_on_a_mesh_equals_unpacked_on_one_device():
    """The packed actor update sharded over data 2 x fsdp 2 x tensor 2 of the 8 fake devices (segment ids and
    per-segment positions split over the batch axes with the rows) gives the unpacked one-device step's parameters
    and metrics."""
    from comprl_jax.rl.train_state import train_state_shardings
    from comprl_jax.runtime import sharding as shd

    cfg = losses.ActorLossConfig()
    logits_fn, params = model()
    batch = episodes_batch("actor", seed=2)
    old = np.asarray(make_logprob_fn(logits_fn, micro_rows=2)(params, batch))
    noise = np.random.default_rng(3).normal(scale=0.3, size=old.shape).astype(np.float32)
    batch["old_logprobs"] = (old + noise) * batch["loss_mask"]
    want, m = make_update_fn(logits_fn, cfg, optax.sgd(1.0), micro_rows=2)(
        create_train_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0)), batch
    )

    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, sharded = init_decoder(CFG, seed=0, mesh=mesh)
    state = create_train_state(sharded, optax.sgd(1.0), mesh)
    shardings = train_state_shardings(state, mesh)
    # one micro-batch of 4 rows (2 hold episodes): a row per batch device, as the role packs (row_multiple)
    packed = packing.pack_batch(batch, micro_rows=4, row_multiple=4)
    assert packed["segment_ids"].shape[0] == 4
    update = make_update_fn(
        logits_fn, cfg, optax.sgd(1.0), micro_rows=4, mesh=mesh, state_shardings=shardings
    )
    with jax.set_mesh(mesh):
        got, m_p = update(state, shd.put_batch(packed, mesh))
    for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    for k in m:
        np.testing.assert_allclose(m_p[k], m[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_role_pack_step_makes_the_behaviour_flag_per_token():
    """``roles.pack_step`` (what dispatch_update does per optimizer step): the extractor's per-row flag of rows
    whose pi_old is the behaviour logprobs becomes a per-token flag, which ``_with_behaviour`` applies."""
    batch = episodes_batch("extractor")
    batch[roles.USE_BEHAVIOUR] = np.array([True, False, True, False])
    role = types.SimpleNamespace(
        micro_rows=2,
        row_multiple=1,
        rows=4,
        model=types.SimpleNamespace(tokenizer=types.SimpleNamespace(pad_id=0)),
    )
    packed = roles.pack_step(role, batch)
    assert roles.USE_BEHAVIOUR not in packed["episodes"]
    use = packed[roles.USE_BEHAVIOUR]
    np.testing.assert_array_equal(use, np.isin(packed["episode"], [0, 2]) & (packed["segment_ids"] > 0))
    fresh = np.full(use.shape, -9.0, np.float32)
    old, _, _ = roles._with_behaviour(fresh, packed["old_logprobs"], packed["loss_mask"], use)
    np.testing.assert_array_equal(np.asarray(old), np.where(use, packed["old_logprobs"], -9.0))


def test_a_mini_batch_of_empty_rows_packs_to_padding():
    """Every episode of a strided mini-batch can be empty (a padding row of the batch): nothing is placed, the
    packed rows are padding, and the episode arrays pass through (an index dtype bug once raised here)."""
    b, t = 4, 8
    batch = {
        "tokens": np.zeros((b, t), np.int32),
        "attn_mask": np.zeros((b, t), bool),
        "loss_mask": np.zeros((b, t), bool),
        "advantages": np.arange(b, dtype=np.float32),
    }
    out = packing.pack_batch(batch, pad_id=7)
    assert out["tokens"].shape[1] == t and (out["tokens"] == 7).all()
    assert not out["attn_mask"].any() and not out["loss_mask"].any() and (out["segment_ids"] == 0).all()
    assert out["episodes"]["advantages"].tolist() == [0.0, 1.0, 2.0, 3.0]
