"""Hand-computed checks of Eq. 6, Eq. 7, buffer averaging, FIFO, partitions, merge carry-over, parser, index."""

import math

import numpy as np
import pytest
from test_experience_helpers import DIM, FakeClock, add, answer, hash_embed, mem, update

from comprl_jax.experience import (
    BankConfig,
    BufferConfig,
    ExperienceBank,
    ExperienceManager,
    ExtractorBuffer,
    IndexConfig,
    PartitionIndex,
    RetrievalConfig,
    count_aware_weights,
    diversify,
    eq6_scores,
    format_experience,
    parse_ops,
)
from comprl_jax.experience.merge import next_chunk
from comprl_jax.rl.advantages import extractor_advantages


class ScriptedRng:
    """Stands in for np.random.Generator.random() with fixed draws, and counts them."""

    def __init__(self, draws):
        self.draws, self.n = list(draws), 0

    def random(self):
        self.n += 1
        return self.draws.pop(0)


def test_eq6_scores_by_hand():
    # ranks 1..3; retrievals 0, 3, 1; only the 2nd was retrieved within the window (now - 100 < 300).
    s = eq6_scores([0, 3, 1], [None, 900.0, 500.0], now=1000.0, lam=0.4, window=300.0)
    expected = [-1.0, -2.0 - 0.4 * math.log(4) - 1.0, -3.0 - 0.4 * math.log(2)]
    np.testing.assert_allclose(s, expected, rtol=0, atol=1e-12)


def test_diversify_rerank_and_dropout_paths():
    cfg = RetrievalConfig(k=2, candidates=16, dropout=0.5)
    # Candidate 0 retrieved 10 times, recently: -1 - 0.4*ln(11) - 1 = -2.959; cand 1: -2; cand 2: -3.
    retr, last = [10, 0, 0], [950.0, None, None]
    rng = ScriptedRng([])
    assert diversify(retr, last, 1000.0, cfg, rng) == [1, 0]
    assert rng.n == 0  # top-1 (cand 1) was never retrieved: no draw
    # Now the top-1 itself is recent: -1 - 0.4*ln(2) - 1 = -2.277 still beats cand 1 (-2 - 0.4*ln(6) - 1 = -3.717).
    retr, last = [1, 5, 0], [990.0, 990.0, None]
    s = eq6_scores(retr, last, 1000.0, 0.4, 300.0)
    assert np.argsort(-s).tolist() == [0, 2, 1]
    rng = ScriptedRng([0.3])  # 0.3 < 0.5: top-1 dropped to the end
    assert diversify(retr, last, 1000.0, cfg, rng) == [2, 1] and rng.n == 1
    rng = ScriptedRng([0.7])  # kept
    assert diversify(retr, last, 1000.0, cfg, rng) == [0, 2] and rng.n == 1
    # Outside the window nothing is "recent": -1.277, -2 - 0.4*ln(6) = -2.717, -3 -> [0, 1], and no draw.
    rng = ScriptedRng([])
    assert diversify(retr, [600.0, 600.0, None], 1000.0, cfg, rng) == [0, 1] and rng.n == 0


def test_eq7_weights_and_advantages_by_hand():
    # Count factor alone (tau = 0, the released code), an update in trainer step t = 10: never trained -> 1;
    # c=3, last 5 -> 4^-0.5 = 0.5; c=1, last 10 -> cooldown (10-10 < 1) -> 0; c=8, last 9 -> 9^-0.5 = 1/3.
    w = count_aware_weights([0, 3, 1, 8], [None, 5, 10, 9], step=10, cooldown=1, alpha=0.5)
    np.testing.assert_allclose(w, [1.0, 0.5, 0.0, 1 / 3], rtol=1e-6)
    # Count and recency (the paper; tau = 2 steps): x (1 - exp(-(t - t_last) / 2)) for trained entries:
    # c=3 rested 5 -> 0.5 (1 - e^-2.5); c=8 rested 1 -> (1/3)(1 - e^-0.5); never trained stays 1.
    w = count_aware_weights([0, 3, 1, 8], [None, 5, 10, 9], step=10, cooldown=1, alpha=0.5, recency_tau=2.0)
    hand = [1.0, 0.5 * (1 - math.exp(-2.5)), 0.0, (1 - math.exp(-0.5)) / 3]
    np.testing.assert_allclose(w, hand, rtol=1e-6)
    # The cooldown counts trainer steps: delta = 3 silences a sample trained 2 steps ago.
    w = count_aware_weights([1, 1], [8, 7], step=10, cooldown=3, alpha=0.5, recency_tau=2.0)
    np.testing.assert_allclose(w, [0.0, 2**-0.5 * (1 - math.exp(-1.5))], rtol=1e-6)
    buf = ExtractorBuffer(BufferConfig(batch_size=4))  # default: tau = 2
    rewards = [1.0, -1.0, 1.0, 0.0]  # mean 0.25 -> centred [0.75, -1.25, 0.75, -0.25]
    for i, (r, c, t) in enumerate(zip(rewards, [0, 3, 1, 8], [None, 5, 10, 9], strict=True)):
        buf.add_reward(f"entry:{i}", r, "p", "r", c, t)
    b = buf.pop_batch(step=10)
    adv = np.asarray(extractor_advantages(b.rewards)) * b.weights  # what the loss applies
    np.testing.assert_allclose(adv, [0.75, -1.25 * hand[1], 0.0, -0.25 * hand[3]], rtol=1e-6)
    assert ExtractorBuffer.trained_keys(b) == ["entry:0", "entry:1", "entry:3"]


def test_shared_sample_reward_averaging_and_fifo_pop():
    buf = ExtractorBuffer(BufferConfig(batch_size=3))
    assert not buf.add_reward("entry:7", 1.0)  # unknown key, no prompt: nothing recorded
    buf.add_reward("entry:0", 1.0, "p0", "r0")
    buf.add_reward("entry:1", -1.0, "p1", "r1")
    buf.add_reward("entry:0", -1.0)
    buf.add_reward("entry:0", 1.0)  # entry 0 used by 3 trajectories: (1 - 1 + 1)/3
    assert len(buf) == 2 and buf.pop_batch(0) is None
    buf.add_reward("entry:2", 1.0, "p2", "r2")
    buf.add_reward("entry:3", 1.0, "p3", "r3")
    b = buf.pop_batch(0)
    assert b.keys == ["entry:0", "entry:1", "entry:2"] and list(buf.samples) == ["entry:3"]
    np.testing.assert_allclose(b.rewards, [1 / 3, -1.0, 1.0], rtol=1e-6)


def _mgr(**kw):
    bank_cfg = kw.pop("bank_cfg", BankConfig(index=IndexConfig(scann_min_size=10**9)))
    return ExperienceManager(
        hash_embed,
        DIM,
        kw.pop("extractor_fn", None),
        bank_cfg=bank_cfg,
        clock=kw.pop("clock", FakeClock()),
        **kw,
    )


def test_manager_outcomes_cooldown_and_mark_trained():
    m = _mgr(buffer_cfg=BufferConfig(batch_size=2))
    # One distillation call writes two entries: one sample (call 0), not two.
    m.apply_output("t", answer(add(mem("a", "go east")), add(mem("b", "go west"))), [], step=0, prompt="P")
    m.apply_output("t", answer(add(mem("c", "go north"))), [], step=0, prompt="Q")  # call 1: entry 2
    assert [e.call for e in m.bank.entries.values()] == [0, 0, 1]
    m.record_outcome([0, 0], True)  # duplicate uid in one trajectory counts once
    m.record_outcome([0, 1], False)  # two entries of one call in one trajectory: once
    m.record_outcome([1], True)
    m.record_outcome([2], False)
    assert list(m.buffer.samples) == ["call:0", "call:1"]
    b = m.pop_extractor_batch(step=3)
    np.testing.assert_allclose(b.rewards, [1 / 3, -1.0])  # call 0: (+1 - 1 + 1) / 3
    np.testing.assert_allclose(extractor_advantages(b.rewards), [2 / 3, -2 / 3], rtol=1e-6)
    m.mark_trained(b, step=3)  # every entry of a trained call advances
    assert [(e.train_count, e.last_trained) for e in m.bank.entries.values()] == [(1, 3)] * 3
    m.record_outcome([0], True)
    m.record_outcome([2], False)
    b = m.pop_extractor_batch(step=3)  # again in trainer step 3: cooldown (3 - 3 < 1) -> weights 0
    np.testing.assert_allclose(b.weights, [0.0, 0.0])
    m.mark_trained(b, step=3)  # w = 0: nothing advances
    assert m.bank.entries[0].train_count == 1
    m.record_outcome([1], True)
    m.record_outcome([2], False)
    b = m.pop_extractor_batch(step=4)  # trained once, rested 1 step: 2^-0.5 (1 - e^-1/2)
    np.testing.assert_allclose(b.weights, [2**-0.5 * (1 - math.exp(-0.5))] * 2, rtol=1e-6)
    m.check_invariants()


def test_fifo_eviction_and_partition_isolation():
    m = _mgr(bank_cfg=BankConfig(capacity=3, index=IndexConfig(scann_min_size=10**9)))
    for i, t in enumerate(["a", "b", "a", "b", "a"]):
        m.apply_output(t, answer(add(mem(f"lesson {i}", f"word{i} shared"))), [], step=i)
    assert list(m.bank.entries) == [2, 3, 4]
    assert m.bank.counts["removed_fifo"] == 2
    assert [e.task_id for e in m.bank.entries.values()] == ["a", "b", "a"]
    res = m.search_sync(["word3 shared"] * 2, ["a", "b"])
    assert set(res[0].uids) <= {2, 4} and res[1].uids == [3]
    r = m.search_sync(["x"], ["missing-task"])[0]
    assert r.uids == [] and r.block.endswith("[No experience found]")
    m.check_invariants()


def test_experience_block_format():
    block = format_experience([mem("Stairs", "Head for >."), "raw text"])
    lines = block.split("\n")
    assert "may be partly wrong" in lines[0] and "over-fit" in lines[0]
    assert lines[1:] == ["1. Stairs: Head for >.", "2. raw text"]


def test_parser_counts_reasons_and_never_half_applies():
    good = mem("t", "c")
    text = answer(
        add(good),
        update([1, 9], good),
        update([2], "no tags"),
        {"function_name": "delete"},
        update([2, 2], good),
        {"function_name": "return"},
        add("<title>x</title><content>" + "y" * 50 + "</content>"),
        update([1], good),
        update([1], good),
        5,
    )
    r = parse_ops(text, num_previous=3, max_chars=40)
    assert [(o.function, o.targets) for o in r.ops] == [("add", ()), ("update", (0,))]
    assert dict(r.rejected) == {
        "target_out_of_range": 1,
        "bad_format": 1,
        "unknown_function": 1,
        "duplicate_target": 2,
        "oversized": 1,
        "not_an_object": 1,
    }
    assert r.num_returns == 1 and r.num_items == 10
    assert parse_ops("<answer>[oops</answer>", 1, 99).rejected == {"unparsable": 1}
    assert parse_ops('<answer>{"a": 1}</answer>', 1, 99).rejected == {"not_a_list": 1}
    assert parse_ops("reasoning only", 1, 99).rejected == {"unparsable": 1}
    # Thinking models get "<think>" from the template: only the closing tag appears.
    assert (
        len(
            parse_ops(
                "because...</think>\n<answer>[" + '{"function_name": "return"}' + "]</answer>", 0, 9
            ).ops
        )
        == 0
    )


def test_update_replaces_targets_with_one_entry_and_stale_targets_are_rejected():
    m = _mgr()
    m.apply_output(
        "t", answer(add(mem("a", "one")), add(mem("b", "two")), add(mem("c", "three"))), [], step=0
    )
    res = m.apply_output("t", answer(update([1, 3], mem("ac", "one and three"))), [0, 1, 2], step=1)
    assert res.added == [3] and res.removed == [0, 2] and list(m.bank.entries) == [1, 3]
    res = m.apply_output("t", answer(update([1], mem("x", "y")), add(mem("z", "w"))), [0], step=2)
    assert res.rejected == {"stale_target": 1} and res.added == [4]
    m.check_invariants()


def test_merge_sliding_chunks_with_carry_over():
    calls = []

    def extractor(prompts):
        out = []
        for p in prompts:
            calls.append(p)
            n = len(calls)
            out.append(answer(add(mem(f"M{n}", f"merged chunk {n}"))) if n != 3 else "garbage")
        return out

    m = _mgr(extractor_fn=extractor)
    for i in range(9):
        m.apply_output("t", answer(add(mem(f"e{i}", f"lesson {i}"))), [], step=0)
    stats = m.merge(step=5)
    # chunk 1 = e0..e4 -> M1 (uid 9); chunk 2 = M1 + e5..e8 -> M2 (uid 10); no originals left.
    assert stats == {"chunks": 2, "merged": 2, "removed": 10, "added": 2}
    assert "M1: merged chunk 1" not in calls[0] and "[1] <title>M1</title>" in calls[1]
    assert [(e.uid, e.text, e.kind) for e in m.bank.entries.values()] == [
        (10, mem("M2", "merged chunk 2"), "merge")
    ]
    assert m.bank.entries[10].prompt == calls[1]
    # Third call returns garbage: the chunk is kept as it is.
    for i in range(2):
        m.apply_output("t", answer(add(mem(f"f{i}", f"new {i}"))), [], step=6)
    stats = m.merge(step=10)
    assert stats["kept"] == 1 and len(m.bank.entries) == 3
    assert next_chunk([7, 8], list(range(10)), 3, 5) == ([7, 8, 3, 4, 5], 6)
    m.check_invariants()


def test_one_extractor_call_is_one_sample_for_merges_and_old_stores():
    """SPEC §3: a merge call that writes two entries is one buffer sample; its reward is the mean over every
    trajectory guided by either entry (once per trajectory); training marks both. A store saved before call ids
    (entries without ``call``) keeps one sample per entry."""
    m = _mgr(
        extractor_fn=lambda ps: [answer(add(mem("M", "east")), add(mem("N", "west"))) for _ in ps],
        buffer_cfg=BufferConfig(batch_size=1),
    )
    for i in range(2):
        m.apply_output("t", answer(add(mem(f"e{i}", f"lesson {i}"))), [], step=0, prompt=f"P{i}")
    m.merge(step=1)
    merged = list(m.bank.entries.values())
    assert [(e.uid, e.call, e.kind) for e in merged] == [(2, 2, "merge"), (3, 2, "merge")]
    m.record_outcome([2, 3], True)  # one trajectory guided by both: +1 once
    m.record_outcome([3], False)
    assert list(m.buffer.samples) == ["call:2"] and m.buffer.samples["call:2"].reward == 0.0
    b = m.pop_extractor_batch(step=1)
    m.mark_trained(b, step=1)
    assert [(e.train_count, e.last_trained) for e in m.bank.entries.values()] == [(1, 1), (1, 1)]
    state = m.bank.state_dict()
    for d in state["entries"]:
        d.pop("call")  # a store from before call ids
    state.pop("next_call")
    old = ExperienceBank(DIM, m.bank.cfg)
    old.load_state_dict(state)
    assert [ExperienceBank.sample_key(e) for e in old.entries.values()] == ["entry:2", "entry:3"]
    assert old.next_call == 0 and old.new_call() == 0
    m.check_invariants()


def test_dedup_pass_keeps_the_oldest_of_near_duplicates_per_partition():
    m = _mgr()
    for task, text in [
        ("a", "go east"),
        ("a", "go west"),
        ("a", "go east"),
        ("b", "go east"),
        ("a", "go west"),
    ]:
        m.apply_output(task, answer(add(mem("t", text))), [], step=0)
    assert m.dedup(0.999) == 2  # uids 2 and 4 repeat 0 and 1; task b's copy is in its own partition
    assert list(m.bank.entries) == [0, 1, 3] and m.counts["dedup_removed"] == 2
    assert m.bank.op_log[-1]["reason"] == "dedup"
    assert m.dedup(0.999) == 0
    m.check_invariants()


def test_partition_index_scann_matches_exact_and_masks_deletions():
    rng = np.random.default_rng(0)
    cent = rng.standard_normal((8, DIM)).astype(np.float32)
    x = cent[rng.integers(0, 8, 600)] + 0.3 * rng.standard_normal((600, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cfg = IndexConfig(scann_min_size=400, background=False, rebuild_fraction=0.5, leaves_to_search_frac=1.0)
    ix = PartitionIndex(DIM, cfg)
    for i in range(500):
        ix.add(i, x[i])
    assert ix.built is not None and len(ix.built.uids) == 400
    for i in range(500, 600):
        ix.add(i, x[i])  # 100 new rows > 0.5 * 400? no -> served as exact suffix
    for i in range(0, 100, 3):
        ix.remove(i)
    assert ix.num_builds == 1
    q = x[:16]
    got_u, got_s = ix.search(q, 10)
    alive = np.array([i for i in range(600) if i >= 100 or i % 3], np.int64)
    s = q @ x[alive].T
    exp = alive[np.argsort(-s, axis=1, kind="stable")[:, :10]]
    assert (got_u == exp).mean() > 0.97  # ScaNN is approximate (all leaves searched here)
    assert not np.isin(got_u, np.arange(0, 100, 3)).any()
    with pytest.raises(ValueError, match="increasing order"):
        ix.add(5, x[0])


def test_op_log_replay_rebuilds_identical_bank_and_dedup():
    m = _mgr(
        bank_cfg=BankConfig(capacity=4, dedup_threshold=0.99, index=IndexConfig(scann_min_size=10**9)),
        extractor_fn=lambda ps: [answer(add(mem("m", f"merged {len(p)}"))) for p in ps],
    )
    res = m.apply_output("a", answer(add(mem("a", "east")), add(mem("a", "east"))), [], step=0)
    assert res.added == [0] and res.rejected == {"duplicate": 1}  # duplicates inside one op list too
    res = m.apply_output("a", answer(add(mem("a", "east"))), [], step=0)
    assert res.rejected == {"duplicate": 1}  # identical text -> cosine 1.0 >= 0.99 with a live entry
    for i in range(5):
        m.apply_output("ab"[i % 2], answer(add(mem(f"t{i}", f"word{i}"))), [], step=i)
    m.search_sync(["word1", "word2"], ["b", "a"])
    m.merge(step=5)
    key = ExperienceBank.sample_key(next(reversed(m.bank.entries.values())))
    m.mark_trained(type("B", (), {"keys": [key], "weights": np.ones(1)})(), 7)
    assert key.startswith("call:") and next(reversed(m.bank.entries.values())).last_trained == 7
    fresh = ExperienceBank(DIM, m.bank.cfg)
    fresh.replay(m.bank.op_log, hash_embed)
    assert fresh.next_call == m.bank.next_call
    assert [vars(e) for e in fresh.entries.values()] == [vars(e) for e in m.bank.entries.values()]
    assert fresh.op_log == m.bank.op_log
    for u in m.bank.entries:
        np.testing.assert_array_equal(fresh.vector(u), m.bank.vector(u))
    fresh.check_invariants()


def test_configs_from_dict_validates_keys():
    from comprl_jax.experience import configs_from_dict

    kw = configs_from_dict(
        {
            "bank": {"capacity": 7, "index": {"scann_min_size": 9}},
            "retrieval": {"k": 2},
            "manager": {"query_batch": 4},
        }
    )
    assert kw["bank_cfg"].capacity == 7 and kw["bank_cfg"].index.scann_min_size == 9
    assert kw["retrieval_cfg"].k == 2 and kw["cfg"].query_batch == 4
    with pytest.raises(ValueError, match=r"bank\.index\.leaves"):
        configs_from_dict({"bank": {"index": {"leaves": 3}}})
    with pytest.raises(ValueError, match=r"retrieval\.lambda"):
        configs_from_dict({"retrieval": {"lambda": 0.4}})
    with pytest.raises(ValueError, match=r"config key bank\.key: must be one of"):
        configs_from_dict({"bank": {"key": "title"}})


def test_blank_experience_keeps_the_token_length_and_drops_the_content():
    """Control arm (method blank_exp): header + "[No experience found]" + filler, at least as many tokens as the
    real block and at most one more; no word of the retrieved entries survives."""
    from comprl_jax.experience.retrieval import BLANK_FILLER, NO_EXPERIENCE, blank_experience

    def count(text):  # a whitespace tokenizer: every word and every filler dot is one token
        return len(text.split())

    real = format_experience(["<title>go east</title><content>the stairs are east of the door</content>"] * 3)
    blank = blank_experience(real, count)
    assert blank.startswith(format_experience([])) and NO_EXPERIENCE in blank
    assert count(real) <= count(blank) <= count(real) + 1
    assert "stairs" not in blank and blank.endswith(BLANK_FILLER.strip())
    assert blank_experience(format_experience([]), count) == format_experience([])  # nothing to pad
