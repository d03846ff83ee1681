"""Token automata for constrained decoding and the stop-string detector (host-side tables, no model)."""

import re

import numpy as np
import pytest

from comprl_jax.sampling.automaton import (
    accepts,
    action_spellings,
    either,
    from_actions,
    from_regex,
    from_strings,
    from_token_sequences,
)
from comprl_jax.sampling.stops import build_stop_automaton, find_stop

EOS = 0
# A small vocabulary: id 0 = EOS (special, b""), id 1 = an unused special, then every printable ASCII byte,
# then multi-byte tokens that cut across the words below in awkward places.
MULTI = [
    "<answer>",
    "</answer>",
    "</",
    "answer",
    "no",
    "rth",
    "north",
    "so",
    "uth",
    "ea",
    "st",
    "we",
    ">\n",
    "h<",
    "th</",
]
VOCAB = [b"", b""] + [bytes([c]) for c in range(32, 127)] + [m.encode() for m in MULTI]
TOK = {b.decode(): i for i, b in enumerate(VOCAB) if b}


def _random_walk(aut, rng, max_steps=200):
    """Uniform random allowed tokens until EOS; returns the ids without the EOS."""
    allowed, nxt = np.asarray(aut.allowed), np.asarray(aut.next_state)
    s, out = 0, []
    for _ in range(max_steps):
        t = int(rng.choice(np.flatnonzero(allowed[s])))
        if t == EOS:
            return out
        out.append(t)
        s = int(nxt[s, t])
    raise AssertionError("walk did not end")


def _text(ids):
    return b"".join(VOCAB[i] for i in ids).decode()


def test_strings_hand_checked():
    aut = from_strings(["north", "nor"], VOCAB, stop_ids=[EOS])
    allowed = np.asarray(aut.allowed)
    # Initial state: exactly the tokens spelling a prefix of "north": n, no, north.
    assert set(np.flatnonzero(allowed[0])) == {TOK["n"], TOK["no"], TOK["north"]}
    assert accepts(aut, [TOK["north"]])
    assert accepts(aut, [TOK["no"], TOK["rth"]])
    assert accepts(aut, [TOK["n"], TOK["o"], TOK["r"]])  # "nor" is allowed too (a prefix of another string)
    assert not accepts(aut, [TOK["no"], TOK["r"], TOK["t"]])  # "nort" is not complete
    assert not accepts(aut, [TOK["so"]])
    # EOS is allowed only where a string is complete: after "nor", not after "no".
    s_no = int(np.asarray(aut.next_state)[0, TOK["no"]])
    s_nor = int(np.asarray(aut.next_state)[s_no, TOK["r"]])
    assert not allowed[s_no, EOS] and allowed[s_nor, EOS]
    assert not allowed[:, 1].any()  # other specials never


def test_no_state_masks_every_token_and_dead_states_pruned():
    # "buzz" cannot be spelled: the vocabulary has no 'z' -> its branch is pruned; "bat" stays.
    vocab = [b if b != b"z" else b"" for b in VOCAB]
    aut = from_strings(["buzz", "bat"], vocab, stop_ids=[EOS])
    allowed = np.asarray(aut.allowed)
    assert allowed.any(axis=1).all()
    s_b = int(np.asarray(aut.next_state)[0, TOK["b"]])
    assert set(np.flatnonzero(allowed[s_b])) == {TOK["a"]}  # 'u' would lead to a dead state
    with pytest.raises(ValueError, match="no allowed string can be spelled"):
        from_strings(["zz"], vocab, stop_ids=[EOS])
    with pytest.raises(ValueError, match="non-empty"):
        from_strings(["ok", ""], vocab, stop_ids=[EOS])


ACTIONS = ["north", "south", "east", "west"]
ANSWER_RE = r"<answer>(north|south|east|west)</answer>"


@pytest.mark.parametrize("build", ["strings", "regex"])
def test_random_walks_always_match(build):
    if build == "strings":
        aut = from_strings([f"<answer>{a}</answer>" for a in ACTIONS], VOCAB, stop_ids=[EOS])
    else:
        aut = from_regex(ANSWER_RE, VOCAB, stop_ids=[EOS])
    assert np.asarray(aut.allowed).any(axis=1).all()
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        ids = _random_walk(aut, rng)
        assert re.fullmatch(ANSWER_RE, _text(ids)), _text(ids)
        seen.add(_text(ids))
    assert seen == {f"<answer>{a}</answer>" for a in ACTIONS}


def test_regex_json_like_and_errors():
    aut = from_regex(r'\{"op": "(add|return)", "n": [0-9]{1,2}\}', VOCAB, stop_ids=[EOS])
    rng = np.random.default_rng(1)
    for _ in range(100):
        assert re.fullmatch(r'\{"op": "(add|return)", "n": [0-9]{1,2}\}', _text(_random_walk(aut, rng)))
    with pytest.raises(ValueError, match="stop token"):
        from_regex("a", VOCAB, stop_ids=[])
    with pytest.raises(ValueError, match=r"cannot compile '\(unclosed'"):
        from_regex("(unclosed", VOCAB, stop_ids=[EOS])


def _first_stop_token(ids, stops):
    """Reference: index of the first token after which the decoded prefix contains a stop string."""
    for i in range(len(ids)):
        if find_stop(b"".join(VOCAB[t] for t in ids[: i + 1]), stops) >= 0:
            return i
    return -1


def _detect(sa, ids):
    nxt, hit = np.asarray(sa.next_state), np.asarray(sa.hit)
    q = 0
    for i, t in enumerate(ids):
        if hit[q, t]:
            return i
        q = int(nxt[q, t])
    return -1


def test_stop_automaton_hand_checked():
    stops = ["</answer>", "ab"]
    sa = build_stop_automaton(stops, VOCAB)
    ids = [TOK["<answer>"], TOK["north"], TOK["</"], TOK["answer"], TOK[">"], TOK["x"]]
    assert _detect(sa, ids) == 4  # spans three tokens
    assert (
        _detect(sa, [TOK["x"], TOK["th</"], TOK["answer"], TOK[">\n"]]) == 3
    )  # starts inside a token, ends inside
    assert _detect(sa, [TOK["a"], TOK["b"]]) == 1
    assert _detect(sa, [TOK["<answer>"], TOK["a"], TOK["a"], TOK["h<"]]) == -1
    assert _detect(sa, [TOK["</answer>"]]) == 0
    assert _detect(sa, [EOS, TOK["a"], 1, TOK["b"]]) == 3  # specials contribute no bytes


def test_stop_automaton_matches_reference_on_random_sequences():
    stops = ["</answer>", "ansa", "rthr", "st"]
    sa = build_stop_automaton(stops, VOCAB)
    rng = np.random.default_rng(0)
    pool = [TOK[c] for c in "<>/answerthx"] + [TOK[m] for m in MULTI]
    found = 0
    for _ in range(400):
        ids = [int(t) for t in rng.choice(pool, size=12)]
        ref = _first_stop_token(ids, stops)
        assert _detect(sa, ids) == ref, (_text(ids), ref)
        found += ref >= 0
    assert found > 50  # the sample exercises matches, not just misses


def test_action_spellings_split_compounds_only():
    acts = ["north", "east", "south", "west", "northeast", "southwest", "pick up", "wait", "waitwest"]
    sp = action_spellings(acts)
    assert list(sp) == acts
    assert sp["north"] == ("north",) and sp["pick up"] == ("pick up",) and sp["wait"] == ("wait",)
    assert sp["northeast"] == ("northeast", "north-east", "north east")
    assert sp["southwest"] == ("southwest", "south-west", "south west")
    assert sp["waitwest"] == ("waitwest", "wait-west", "wait west")  # any join of two actions, by rule
    assert action_spellings(["up", "down"]) == {"up": ("up",), "down": ("down",)}


def test_from_actions_accepts_every_spelling_and_nothing_else():
    aut = from_actions(["north", "east", "northeast"], VOCAB, stop_ids=[EOS])
    texts = {"<answer>north</answer>", "<answer>east</answer>"}
    texts |= {f"<answer>{s}</answer>" for s in ("northeast", "north-east", "north east")}
    pattern = "|".join(re.escape(t) for t in texts)
    assert np.asarray(aut.allowed).any(axis=1).all()
    rng = np.random.default_rng(2)
    seen = set()
    for _ in range(1000):
        text = _text(_random_walk(aut, rng))
        assert re.fullmatch(pattern, text), text
        seen.add(text)
    assert seen == texts
    # The split spelling through any tokenization, e.g. "no" "rth" "-" "ea" "st"; other separators are not allowed.
    assert accepts(
        aut, [TOK["<answer>"], TOK["no"], TOK["rth"], TOK["-"], TOK["ea"], TOK["st"], TOK["</answer>"]]
    )
    assert not accepts(aut, [TOK["<answer>"], TOK["north"], TOK["_"], TOK["ea"], TOK["st"], TOK["</answer>"]])


def test_token_sequences_allow_one_path_each():
    """Exactly the given token paths: "north" as the one token, not as n + o + r + t + h or no + rth; the
    first token offers each sequence's own first token once, so a model with no preference picks among the
    sequences' first tokens uniformly."""
    seqs = [[TOK["<answer>"], TOK["north"], TOK["</answer>"]], [TOK["<answer>"], TOK["so"], TOK["uth"], TOK["</answer>"]],
            [TOK["<answer>"], TOK["ea"], TOK["st"], TOK["</answer>"]]]  # fmt: skip
    aut = from_token_sequences(seqs, len(VOCAB), stop_ids=[EOS])
    allowed, nxt = np.asarray(aut.allowed), np.asarray(aut.next_state)
    assert set(np.flatnonzero(allowed[0])) == {TOK["<answer>"]}
    s1 = int(nxt[0, TOK["<answer>"]])
    assert set(np.flatnonzero(allowed[s1])) == {TOK["north"], TOK["so"], TOK["ea"]}
    for q in seqs:
        assert accepts(aut, q)
    assert not accepts(
        aut, [TOK["<answer>"], TOK["no"], TOK["rth"], TOK["</answer>"]]
    )  # another tokenization
    assert not accepts(aut, seqs[0][:2])  # incomplete
    assert not allowed[s1, EOS] and allowed[int(nxt[nxt[s1, TOK["north"]], TOK["</answer>"]]), EOS]
    rng = np.random.default_rng(0)
    assert {tuple(_random_walk(aut, rng)) for _ in range(100)} == {tuple(q) for q in seqs}
    with pytest.raises(ValueError, match="non-empty"):
        from_token_sequences([[1], []], len(VOCAB), stop_ids=[EOS])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        from_token_sequences([[len(VOCAB)]], len(VOCAB), stop_ids=[EOS])


def test_either_accepts_the_union_and_shares_common_prefixes():
    """Canonical action paths or the search & ask tag (a regex, any tokenization): both start with '<', so the
    product must follow both until they part."""
    acts = from_token_sequences(
        [[TOK["<answer>"], TOK["north"], TOK["</answer>"]]], len(VOCAB), stop_ids=[EOS]
    )
    ask = from_regex(r"<ask>[a-z]{1,3}</ask>", VOCAB, stop_ids=[EOS])
    both = either(acts, ask)
    assert accepts(both, [TOK["<answer>"], TOK["north"], TOK["</answer>"]])
    assert not accepts(both, [TOK["<answer>"], TOK["no"], TOK["rth"], TOK["</answer>"]])  # still one path
    tag = [TOK[c] for c in "<ask>"] + [TOK["n"], TOK["o"]] + [TOK["</"]] + [TOK[c] for c in "ask>"]
    assert accepts(both, tag)
    assert not accepts(both, [TOK[c] for c in "<ask></ask>"])
    allowed = np.asarray(both.allowed)
    assert set(np.flatnonzero(allowed[0])) == {TOK["<answer>"], TOK["<"]}  # "<" can start only the tag here
    assert allowed.any(axis=1).all()
    rng = np.random.default_rng(1)
    for _ in range(200):
        text = _text(_random_walk(both, rng))
        assert text == "<answer>north</answer>" or re.fullmatch(r"<ask>[a-z]{1,3}</ask>", text), text
    # A token both allow moves both: "<" + "answer>" style prefixes shared by two canonical paths.
    shared = either(
        acts, from_token_sequences([[TOK["<answer>"], TOK["so"], TOK["</answer>"]]], len(VOCAB), [EOS])
    )
    s1 = int(np.asarray(shared.next_state)[0, TOK["<answer>"]])
    assert set(np.flatnonzero(np.asarray(shared.allowed)[s1])) == {TOK["north"], TOK["so"]}
