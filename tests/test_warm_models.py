"""Warm-start models (issue 49): the supervised loss by hand, a trained folder read back by the pretrained loader
with the same logits, the shipped folders, and (slow) the shipped actor following an oracle lesson by play."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import decoder as dec
from comprl_jax.models import zoo
from comprl_jax.warm import corpus as C
from comprl_jax.warm import sft
from comprl_jax.warm import vocab as V

CLEAR_JAX_CACHES_EACH_TEST = True


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A vocabulary and a seconds-long model trained on a few actor examples."""
    out = str(tmp_path_factory.mktemp("warm"))
    boot = V.bootstrap_tokenizer()
    exs = C.examples("actor", 0, 200)
    path = V.train_vocab([boot.decode(sum(a.ids(boot), [])) for a in exs], 1024, C.atomic_words(), out)
    from comprl_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_json(path)
    rows = [a.ids(tok) for a in exs]
    model = sft.model_config(tok.vocab_size, hidden=32, layers=2, heads=4, kv_heads=2, ff=64)
    graphdef, params = sft.train(
        sft.SFTConfig(steps=3, batch=8, warmup=1), model, rows, tok.pad_id, log=lambda r: None
    )
    return {
        "out": out,
        "tok": tok,
        "rows": rows,
        "model": model,
        "graphdef": graphdef,
        "params": params,
        "path": path,
    }


def test_the_supervised_loss_is_the_answer_tokens_cross_entropy_by_hand(small):
    tok, rows = small["tok"], small["rows"][:3]
    graphdef, params = small["graphdef"], small["params"]
    arrays = sft.pack(rows, tok.pad_id, 6)
    loss, acc = sft.loss_fn(graphdef, params, *arrays)
    tokens, valid = arrays[0], arrays[1]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = np.asarray(dec.forward(graphdef, params, tokens, positions, valid), np.float64)
    nll, hits, n = 0.0, 0, 0
    for b, (p, a) in enumerate(rows):
        for j, want in enumerate(a[:6]):
            row = logits[b, len(p) - 1 + j]  # the position before an answer token predicts it
            nll -= row[want] - (row.max() + math.log(np.exp(row - row.max()).sum()))
            hits += int(row.argmax() == want)
            n += 1
    assert float(loss) == pytest.approx(nll / n, rel=1e-5)
    assert float(acc) == pytest.approx(hits / n)
    # the prompt's next-token term adds lm_weight x its mean cross-entropy
    with_lm, _ = sft.loss_fn(graphdef, params, *arrays, lm_weight=0.5)
    lm, m = 0.0, 0
    for b, (p, a) in enumerate(rows):
        ids = list(p) + list(a)
        for t in range(len(ids) - 1):
            row = logits[b, t]
            lm -= row[ids[t + 1]] - (row.max() + math.log(np.exp(row - row.max()).sum()))
            m += 1
    assert float(with_lm) == pytest.approx(nll / n + 0.5 * lm / m, rel=1e-5)


def test_a_weighted_answer_token_counts_its_weight_times_by_hand(small):
    """actor_tune's rows carry one weight per answer token: the loss is the weighted mean of the tokens' NLL."""
    tok, rows = small["tok"], small["rows"][:3]
    graphdef, params = small["graphdef"], small["params"]
    weighted = [(p, a, [1.0] * len(a)) for p, a in rows]
    weighted[1][2][2] = 8.0  # the third answer token of the second row
    arrays = sft.pack(weighted, tok.pad_id, 6)
    assert arrays[4][1].tolist() == [1, 1, 8, 1, 1, 1][: len(rows[1][1])] + [0] * (6 - len(rows[1][1]))
    # unweighted rows pack as weight 1 (the 2-tuples of the supervised run)
    np.testing.assert_array_equal(sft.pack(rows, tok.pad_id, 6)[4][0], arrays[4][0])
    loss, _ = sft.loss_fn(graphdef, params, *arrays)
    tokens, valid = arrays[0], arrays[1]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = np.asarray(dec.forward(graphdef, params, tokens, positions, valid), np.float64)
    num = den = 0.0
    for b, (p, a, w) in enumerate(weighted):
        for j, want in enumerate(a[:6]):
            row = logits[b, len(p) - 1 + j]
            num -= w[j] * (row[want] - (row.max() + math.log(np.exp(row - row.max()).sum())))
            den += w[j]
    assert float(loss) == pytest.approx(num / den, rel=1e-5)


def test_the_decision_index_is_the_token_after_the_name_and_the_balanced_set_is_balanced(small):
    tok = small["tok"]
    exs = C.examples("actor", 3, 400)
    for a in exs:
        _, target = a.ids(tok)
        k = a.decision_index(tok, target)
        assert target[k - len(tok.encode(a.family)) : k] == tok.encode(a.family)
        # an entry about the own family: the think goes on with the entry (its title's colon); else it closes
        assert tok.decode(target[k:]).startswith(":" if a.think != a.family else "</think>")
    with pytest.raises(ValueError, match="family's name"):
        exs[0].decision_index(tok, tok.encode("<think>nothing</think>"))
    picked = C.balanced_for_decision(exs, np.random.default_rng(0))
    own = sum(1 for a in picked if a.entries and a.think != a.family)
    absent = sum(1 for a in picked if a.entries and a.think == a.family)
    rest = sum(1 for a in picked if not a.entries)
    n = min(
        sum(1 for a in exs if a.entries and a.think != a.family),
        sum(1 for a in exs if a.entries and a.think == a.family),
    )
    assert (own, absent, rest) == (n, n, n // 2) and n > 20
    assert len(set(map(id, picked))) == len(picked)  # each example at most once


def test_a_trained_folder_loads_through_the_pretrained_loader_with_the_same_logits(small, tmp_path):
    folder = str(tmp_path / "actor")
    sft.save_folder(folder, small["model"], small["params"], small["path"], dtype="float32")
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json"]
    got = zoo.load_model(folder, role="actor", tokenizer=None, seed=0)
    assert got.cfg.vocab_size == small["model"].vocab_size and got.tokenizer.kind == "metaspace"
    prompt = small["rows"][0][0]
    assert got.tokenizer.encode(small["tok"].decode(prompt)) == small["tok"].encode(
        small["tok"].decode(prompt)
    )
    tokens = jnp.asarray([prompt])
    positions = jnp.arange(len(prompt))[None]
    valid = jnp.ones_like(tokens, bool)
    a = dec.forward(small["graphdef"], small["params"], tokens, positions, valid)
    b = dec.forward(got.graphdef, got.params, tokens, positions, valid)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_shipped_folders_load_and_are_small():
    total = 0
    for name, sub in zoo.WARM_MODELS.items():
        folder = zoo.warm_path(name)
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        m = zoo.load_model(name, role="actor", tokenizer=None, seed=0)
        assert m.tokenizer.kind == "metaspace" and m.cfg.arch == "qwen3"
        for w in C.atomic_words():  # the shared vocabulary keeps each action and family one token
            assert len(m.tokenizer.encode(w)) == 1, (sub, w)
    assert total <= 20 * 2**20, total


def test_a_missing_warm_folder_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(zoo, "WARM_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make warm-start"):
        zoo.load_model("warm_actor", role="actor", tokenizer=None, seed=0)


@pytest.mark.slow
def test_the_warm_actor_follows_an_oracle_lesson_far_above_chance(tmp_path):
    """By play through the trainer's own rollout (held-out instances, the run's constrained decoding and
    temperature): with its own family's true lesson among 0-2 others, the actor plays the lesson's action far
    more often than chance (1/8): z >= 4 over 48 episodes."""
    import importlib.util

    from comprl_jax.warm import skills

    spec = importlib.util.spec_from_file_location("bench_warm_start", "launch/bench/warm_start.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tr = bench.trainer_for(0, str(tmp_path))
    try:
        trials = [t for t in skills.actor_trials(0, 48, np.random.default_rng(7)) if t.condition == "follow"]
        got = skills.play_actor(tr, trials, jax.random.key(0))
    finally:
        tr.close()
    follow = np.mean([r["played"] == r["named"] for r in got])
    z = (follow - 1 / 8) / math.sqrt((1 / 8) * (7 / 8) / len(got))
    assert len(got) == 48 and z >= 4, (follow, z)


def test_the_decision_probe_reports_every_block_size_and_place(tmp_path):
    """launch/bench/warm_decision.py on the shipped actor, 60 prompts a split: each figure a probability with the
    count behind it, the counts of a split's block sizes adding up to its prompts, the by-place and by-likeness
    breakdowns adding up to their block size's own count."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_warm_decision", "launch/bench/warm_decision.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = bench.measure("warm_actor", 60, 7)
    assert got["bench"] == "warm_decision"
    for split in ("train", "held_out"):
        sizes = [
            k
            for k in got
            if k.startswith(split) and k.endswith("_count") and "_at" not in k and "_near" not in k
        ]
        assert sum(got[k] for k in sizes) == 60, sizes
        for n in (2, 3):
            own = got.get(f"{split}_own_n{n}_count", 0)
            assert sum(got.get(f"{split}_own_n{n}_at{j}_count", 0) for j in range(n)) == own
            assert sum(got.get(f"{split}_own_n{n}_near{j}_count", 0) for j in (0, 1)) == own
        probs = [v for k, v in got.items() if k.startswith(split) and not k.endswith("_count")]
        assert probs and all(0.0 <= p <= 1.0 for p in probs)
