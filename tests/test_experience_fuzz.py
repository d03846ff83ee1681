"""Hypothesis fuzzing: the op parser on arbitrary text and on near-valid JSON, and random op sequences on the bank.

10,000 cases in total: 5,000 free text + 2,000 tag soup + 1,500 structured op lists (parser), 1,500 op sequences.
"""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_experience_helpers import DIM, FakeClock, hash_embed, mem

from comprl_jax.experience import BankConfig, ExperienceManager, IndexConfig, RetrievalConfig, parse_ops

FAST = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)

_fragments = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "[",
        "]",
        "{",
        "}",
        '"',
        ",",
        ":",
        '"function_name"',
        '"add"',
        '"update"',
        '"return"',
        '"parameters"',
        '"new_memory"',
        '"target_idx"',
        "<title>",
        "</title>",
        "<content>",
        "</content>",
        "1",
        "-3",
        "null",
    ]
)


@pytest.mark.slow
@settings(max_examples=5000, **FAST)
@given(st.text(max_size=120))
def test_parser_never_raises_on_text(text):
    r = parse_ops(text, 3, 100)
    assert len(r.ops) + r.num_returns + sum(r.rejected.values()) == r.num_items or r.num_items == 0


@pytest.mark.slow
@settings(max_examples=2000, **FAST)
@given(st.lists(st.one_of(_fragments, st.text(max_size=4)), max_size=24))
def test_parser_never_raises_on_tag_soup(parts):
    r = parse_ops("".join(parts), 2, 50)
    assert len(r.ops) + r.num_returns + sum(r.rejected.values()) == r.num_items or r.num_items == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
_memory = st.one_of(st.builds(mem, st.text(min_size=1, max_size=10), st.text(min_size=1, max_size=30)), _json)
_op = st.one_of(
    st.fixed_dictionaries(
        {
            "function_name": st.sampled_from(["add", "update", "return", "del", 3]),
            "parameters": st.fixed_dictionaries(
                {},
                optional={
                    "new_memory": _memory,
                    "target_idx": st.one_of(st.lists(st.integers(-1, 6), max_size=4), _json),
                },
            ),
        }
    ),
    _json,
)


@pytest.mark.slow
@settings(max_examples=1500, **FAST)
@given(st.lists(_op, max_size=6), st.integers(0, 5))
def test_parser_structured_ops_are_valid_or_counted(ops, num_previous):
    r = parse_ops("<answer>" + json.dumps(ops) + "</answer>", num_previous, 40)
    assert len(r.ops) + r.num_returns + sum(r.rejected.values()) == len(ops)
    seen = set()
    for op in r.ops:
        assert op.function in ("add", "update") and len(op.new_memory) <= 40
        assert all(0 <= t < num_previous for t in op.targets) and not seen & set(op.targets)
        seen |= set(op.targets)


# -- random op sequences on a live manager ------------------------------------------------------------
_words = st.sampled_from(["key", "door", "stairs", "east", "box", "lava", "shop", "red"])
_action = st.one_of(
    st.tuples(
        st.just("ops"),
        st.sampled_from("ab"),
        st.lists(
            st.one_of(
                st.builds(
                    lambda w: {"function_name": "add", "parameters": {"new_memory": mem(w, w + " tip")}},
                    _words,
                ),
                st.builds(
                    lambda i, w: {
                        "function_name": "update",
                        "parameters": {"target_idx": i, "new_memory": mem(w, w)},
                    },
                    st.lists(st.integers(0, 4), max_size=3),
                    _words,
                ),
                st.just({"function_name": "return"}),
                _json,
            ),
            max_size=4,
        ),
    ),
    st.tuples(st.just("search"), st.sampled_from("abc"), _words),
    st.tuples(st.just("outcome"), st.lists(st.integers(0, 30), max_size=3), st.booleans()),
    st.tuples(st.just("merge")),
    st.tuples(st.just("tick"), st.floats(0, 400)),
    st.tuples(st.just("train"), st.integers(0, 3)),
)


def _merger(prompts):
    return [
        (
            '<answer>[{"function_name": "add", "parameters": {"new_memory": "<title>m</title><content>'
            f'{len(p) % 7}</content>"}}}}]</answer>'
        )
        if len(p) % 3
        else "junk"
        for p in prompts
    ]


@pytest.mark.slow
@settings(max_examples=1500, **FAST)
@given(st.lists(_action, max_size=8), st.sampled_from([0.0, 0.95]))
def test_random_op_sequences_keep_invariants(actions, dedup):
    clock = FakeClock()
    m = ExperienceManager(
        hash_embed,
        DIM,
        _merger,
        clock=clock,
        bank_cfg=BankConfig(
            capacity=6, dedup_threshold=dedup, max_entry_chars=60, index=IndexConfig(scann_min_size=10**9)
        ),
        retrieval_cfg=RetrievalConfig(k=2, candidates=4),
    )
    from comprl_jax.experience import BufferConfig

    m.buffer.cfg = BufferConfig(batch_size=2)
    for a in actions:
        if a[0] == "ops":
            shown = m.bank.partition(a[1])[:3]
            m.apply_output(a[1], "<answer>" + json.dumps(a[2]) + "</answer>", shown, step=0, prompt="p")
        elif a[0] == "search":
            r = m.search_sync([a[2]], [a[1]])[0]
            assert len(r.uids) <= 2 and all(m.bank.entries[u].task_id == a[1] for u in r.uids)
        elif a[0] == "outcome":
            m.record_outcome(a[1], a[2])
        elif a[0] == "merge":
            m.merge(step=1)
        elif a[0] == "tick":
            clock.t += a[1]
        else:
            b = m.pop_extractor_batch(a[1])
            if b is not None:
                assert abs(float(np.sum(b.rewards - b.rewards.mean()))) < 1e-5
                m.mark_trained(b, a[1])
        m.check_invariants()
    total = sum(e.retrievals for e in m.bank.entries.values())
    assert total <= m.counts["searches"] * 2
