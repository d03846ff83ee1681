"""Generation engine on the real decoder (random-weight tiny Qwen3): parity with transformers, logprobs,
multi-turn continuation, stops, constraints, compile counts, mesh and threads."""

import re
import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import ModelConfig, forward, init_decoder
from comprl_jax.sampling import FINISH_LENGTH, FINISH_STOP, SamplerService, SamplingParams, find_stop

EOS, PAD = 1, 0
# Byte-level vocabulary: ids 0/1 specials, 2..255 one byte each, then multi-byte tokens up to vocab 300.
MULTI = [
    b"<answer>",
    b"</answer>",
    b"</",
    b"answer",
    b"north",
    b"no",
    b"rth",
    b"south",
    b"so",
    b"uth",
    b"east",
    b"west",
]
VOCAB = [b"", b""] + [bytes([i]) for i in range(2, 256)] + MULTI
VOCAB += [bytes([97 + i % 26, 97 + (i * 7) % 26]) for i in range(300 - len(VOCAB))]
CFG = ModelConfig.tiny("qwen3", vocab_size=len(VOCAB))


@pytest.fixture(scope="module")
def model():
    return init_decoder(CFG, seed=0)


@pytest.fixture(scope="module")
def svc(model):
    return SamplerService(*model, CFG, vocab=VOCAB, stop_token_ids=(EOS,), pad_id=PAD)


def _prompts(n, seed=0, lo=1, hi=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, len(VOCAB), size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_greedy_matches_transformers(model, tmp_path, svc):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from comprl_jax.models import save_hf

    save_hf(str(tmp_path), CFG, model[1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompts = _prompts(8, seed=1)
    res = svc.generate(prompts, jax.random.key(0), SamplingParams(max_new_tokens=16, greedy=True))
    for b, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=PAD
            )
        ref = out[0, len(p) :].tolist()
        assert res.tokens[b, : res.lengths[b]].tolist() == ref, f"row {b}"


def test_logprobs_equal_forward_pass(model, svc):
    prompts = _prompts(4, seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=40, top_p=0.9)
    res = svc.generate(prompts, jax.random.key(1), sp, max_new=[12, 5, 9, 12])
    assert res.lengths.tolist() == [12, 5, 9, 12] and (res.finish_reason == FINISH_LENGTH).all()
    # One forward over the right-padded [prompt + sampled] rows (padding is masked out and never attended).
    seqs = [p + res.tokens[b, : res.lengths[b]].tolist() for b, p in enumerate(prompts)]
    width = max(map(len, seqs))
    toks = np.array([s + [PAD] * (width - len(s)) for s in seqs], np.int32)
    mask = np.arange(width)[None] < np.array([len(s) for s in seqs])[:, None]
    logits = forward(
        *model, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(width), toks.shape), jnp.asarray(mask)
    )
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for b, p in enumerate(prompts):
        n = int(res.lengths[b])
        ref = logp[b, len(p) - 1 + np.arange(n), res.tokens[b, :n]]
        np.testing.assert_allclose(res.logprobs[b, :n], ref, atol=1e-5, rtol=0)
        assert (res.logprobs[b, n:] == 0).all() and (res.tokens[b, n:] == PAD).all()


@pytest.mark.parametrize("max_len", [128, 1024])  # 1024: turns run on a 256-slot window of the cache
def test_three_turns_incremental_equal_reprefill(svc, max_len):
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    conv = svc.conversation(batch=3, max_len=max_len)
    turns = [_prompts(3, seed=10 + t, lo=2, hi=9) for t in range(3)]
    turns[1][2] = None  # row 2 sits out turn 2
    for t, obs in enumerate(turns):
        res = conv.turn(obs, jax.random.key(t), sp, max_new=[8, 4, 6])
        for b in range(3):
            if obs[b] is None:
                assert res.lengths[b] == 0
                continue
            ids, mask = conv.tokens(b)
            n = int(res.lengths[b])
            context = ids[: len(ids) - n]  # everything before this turn's reply
            ref = svc.generate([context], jax.random.key(t), sp, max_new=[8, 4, 6][b])
            assert res.tokens[b, :n].tolist() == ref.tokens[0, : ref.lengths[0]].tolist(), (t, b)
            assert mask[len(ids) - n :] == [1] * n and ids[len(ids) - n :] == res.tokens[b, :n].tolist()
            assert conv.logprobs(b)[len(ids) - n :] == res.logprobs[b, :n].tolist()
    # The cache holds every id but each row's last sampled token (fed at the start of the next turn).
    lengths = np.asarray(conv.cache.lengths)[:3]
    assert lengths.tolist() == [len(conv.tokens(b)[0]) - 1 for b in range(3)]
    assert sum(conv.tokens(0)[1]) == 8 + 8 + 8


def test_conversation_cache_grows_with_the_context_and_changes_nothing(svc):
    """The KV cache starts at 256 slots and doubles when a turn needs more (issue 19: a 32-row SmolLM2 cache sized
    to max_context 8,192 was 12 GB): the same tokens and logprobs as a cache allocated at max_len up front."""
    from comprl_jax.sampling import Conversation

    class Preallocated(Conversation):
        MIN_CACHE = 1 << 30  # min(max_len, this) = max_len: the whole cache up front (the old behaviour)

    sp = SamplingParams(max_new_tokens=8, temperature=0.8)
    turns = [_prompts(2, seed=40 + t, lo=140, hi=160) for t in range(5)]
    turns[3][1] = None  # an idle row keeps its cache through a growth
    grown, full = svc.conversation(batch=2, max_len=1024), Preallocated(svc, batch=2, max_len=1024)
    assert (grown.cache_len, full.cache_len) == (256, 1024)
    lens = []
    for t, obs in enumerate(turns):
        a = grown.turn(obs, jax.random.key(t), sp)
        b = full.turn(obs, jax.random.key(t), sp)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        lens.append(grown.cache_len)
    assert lens == [256, 512, 512, 1024, 1024] and full.cache_len == 1024
    for r in range(2):
        assert grown.tokens(r) == full.tokens(r) and grown.logprobs(r) == full.logprobs(r)
    assert np.asarray(grown.cache.lengths).tolist() == np.asarray(full.cache.lengths).tolist()
    with pytest.raises(ValueError, match="exceeds the conversation's max_len=1024"):
        grown.turn([[5] * 300, None], jax.random.key(9), sp)


def test_stops_first_occurrence_and_finish_reasons(svc):
    prompts = _prompts(6, seed=3)
    sp = SamplingParams(max_new_tokens=32, temperature=1.0)
    key = jax.random.key(7)
    full = svc.generate(prompts, key, sp)  # same key, no stops: the stopped runs are prefixes of this one
    text = [b"".join(VOCAB[t] for t in full.tokens[b]) for b in range(6)]
    # Stop strings cut out of the rows' own text so that they occur: spanning tokens, starting mid-token.
    stops = sorted({text[0][5:9], text[1][10:13], text[2][3:5]})
    stop_tok = int(full.tokens[3, 6])
    svc2 = SamplerService(
        svc.graphdef, svc.params, CFG, vocab=VOCAB, stop_token_ids=(EOS, stop_tok), pad_id=PAD
    )
    res = svc2.generate(prompts, key, sp, stop_strings=stops)
    for b in range(6):
        ids = full.tokens[b].tolist()
        ends = [i for i in range(32) if ids[i] in (EOS, stop_tok) or find_stop(text_upto(ids, i), stops) >= 0]
        n = ends[0] + 1 if ends else 32
        assert res.lengths[b] == n, b
        assert res.tokens[b, :n].tolist() == ids[:n]
        assert res.finish_reason[b] == (FINISH_STOP if ends else FINISH_LENGTH)
    assert res.finish_reason[:3].tolist() == [FINISH_STOP] * 3
    assert int(res.steps) == int(res.lengths.max())  # no steps past the longest row


def text_upto(ids, i):
    return b"".join(VOCAB[t] for t in ids[: i + 1])


def test_constraint_1000_samples_match_regex(svc):
    pattern = r"<answer>(north|south|east|west)</answer>"
    aut = svc.regex_constraint(pattern)
    assert np.asarray(aut.allowed).any(axis=1).all()  # no state masks every token
    prompts = _prompts(1000, seed=4, lo=1, hi=6)
    res = svc.generate(
        prompts, jax.random.key(3), SamplingParams(max_new_tokens=32, temperature=1.0), constraint=aut
    )
    assert (res.finish_reason == FINISH_STOP).all()
    assert int(res.steps) == int(res.lengths.max()) < 32  # the loop ended with the longest row, not at N
    seen = set()
    for b in range(1000):
        ids = res.tokens[b, : res.lengths[b]].tolist()
        assert ids[-1] == EOS
        txt = b"".join(VOCAB[t] for t in ids[:-1]).decode()
        assert re.fullmatch(pattern, txt), txt
        seen.add(txt)
    assert len(seen) == 4


def test_one_compile_per_bucket(model):
    chex.clear_trace_counter()
    svc = SamplerService(
        *model, CFG, stop_token_ids=(EOS,), pad_id=PAD, wrap=lambda f: chex.assert_max_traces(f, n=2)
    )
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    for i, (b, lo, hi) in enumerate([(3, 1, 9), (4, 5, 16), (3, 2, 4), (4, 1, 12)]):  # batch 4, length 16
        svc.generate(_prompts(b, seed=i, lo=lo, hi=hi), jax.random.key(i), sp)
    svc.generate(_prompts(7, seed=9, lo=1, hi=16), jax.random.key(0), sp)  # batch bucket 8: second trace
    svc.generate(_prompts(5, seed=8, lo=1, hi=16), jax.random.key(0), sp)
    with pytest.raises(AssertionError):  # a third bucket would be a third trace
        svc.generate(_prompts(9, seed=7, lo=1, hi=16), jax.random.key(0), sp)


@pytest.mark.slow
def test_mesh_matches_single_device_and_threads(model, svc):
    from comprl_jax.runtime import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    gd, params = init_decoder(CFG, seed=0, mesh=mesh)
    msvc = SamplerService(gd, params, CFG, stop_token_ids=(EOS,), pad_id=PAD, mesh=mesh)
    cache = msvc.new_cache(msvc.batch_bucket(6), 32)
    assert cache.k.shape[1] == 8  # batch bucket is a multiple of data * fsdp = 4
    assert cache.k.sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"), "tensor")
    assert cache.v.sharding.spec == cache.k.sharding.spec  # [L, B, Hkv, ...]: rows and KV heads split alike
    assert cache.lengths.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    prompts = _prompts(6, seed=5)
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    ref = svc.generate(prompts, jax.random.key(0), sp)
    # Two threads drive two services at once (as the actor and the extractor do); results are unchanged.
    out = {}

    def work(name, s):
        out[name] = s.generate(prompts, jax.random.key(0), sp)

    threads = [threading.Thread(target=work, args=(n, s)) for n, s in (("mesh", msvc), ("plain", svc))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("mesh", "plain"):
        np.testing.assert_array_equal(out[name].tokens, ref.tokens, err_msg=name)


def test_errors_name_the_row_or_field(svc):
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    conv = svc.conversation(batch=2, max_len=16)
    with pytest.raises(ValueError, match="row 1: context 18 tokens exceeds the conversation's max_len=16"):
        conv.turn([[5, 6], list(range(2, 12))], jax.random.key(0), sp)
    with pytest.raises(ValueError, match="row 0: a turn needs at least one input token"):
        conv.turn([[], None], jax.random.key(0), sp)
    with pytest.raises(ValueError, match="turn got 3 rows"):
        conv.turn([[5], [5], [5]], jax.random.key(0), sp)
    with pytest.raises(ValueError, match="max_new 9 exceeds SamplingParams.max_new_tokens=8"):
        svc.generate([[5]], jax.random.key(0), sp, max_new=9)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        svc.generate([[5], []], jax.random.key(0), sp)
    plain = SamplerService(svc.graphdef, svc.params, CFG, stop_token_ids=(EOS,))
    with pytest.raises(ValueError, match="needs vocab="):
        plain.regex_constraint("a")
