"""Build a ``tokenizer.json`` spec from the tokenizer stored in a GGUF file (SmolLM2, Qwen2/2.5 GGUFs).

GGUF keeps the vocabulary (``tokenizer.ggml.tokens``), token types, BPE merges and the name of the pre-tokenizer
(``tokenizer.ggml.pre``); the split rules themselves live in llama.cpp, so we map the known names to the equivalent
``tokenizers`` pre-tokenizers here. Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported.
"""

from __future__ import annotations

import os
import re
import struct

# llama.cpp pre-tokenizer name -> tokenizers pre_tokenizer (+ normalizer). Qwen2 regex from its tokenizer.json.
_QWEN2_PAT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_PRE = {
    # SmolLM/SmolLM2: llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM isolates every \p{N} first, then applies the GPT-2
    # regex to the rest (as the model's own tokenizer.json: Digits(individual) + ByteLevel). transformers' GGUF
    # tokenizer does not know "smollm" and uses the GPT-2 regex alone, which differs where whitespace meets a
    # number ("  3": ours "ĠĠ" + "3", as in training; transformers "Ġ" + "Ġ" + "3"); see tests/test_gguf.py.
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "gpt-2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    "qwen2": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN2_PAT}, "behavior": "Isolated", "invert": False},
            {**_BYTE_LEVEL, "use_regex": False},
        ],
    },
}
_NORMALIZER = {"qwen2": {"type": "NFC"}}
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


# GGUF metadata value types (gguf spec v2/v3): id -> struct format; 8 = string, 9 = array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def read_gguf_metadata(path: str, prefix: str = "tokenizer.") -> dict:
    """The key/value metadata of a GGUF file whose keys start with ``prefix``; tensors are not touched.

    A small reader of the header (``gguf.GGUFReader`` maps every field of a 100k-token vocabulary into numpy
    objects and takes ~10x longer). Other keys are parsed and dropped.
    """
    with open(path, "rb") as f:
        buf = f.read(16 << 20)  # metadata sits at the start; 16 MiB covers vocabularies of ~1M tokens
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return vals[0]

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(buf):
            raise ValueError(
                f"{path}: truncated or corrupt GGUF metadata (a string runs past byte {len(buf)})"
            )
        out = buf[pos : pos + n].decode("utf-8", errors="surrogateescape")
        pos += n
        return out

    def value(vtype: int):
        if vtype == 8:
            return string()
        if vtype == 9:
            itype, count = take("<I"), take("<Q")
            if itype in _SCALARS and itype != 7:  # fast path for numeric arrays
                nonlocal pos
                fmt = f"<{count}{_SCALARS[itype][1]}"
                out = list(struct.unpack_from(fmt, buf, pos))
                pos += struct.calcsize(fmt)
                return out
            return [value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")
        return take(_SCALARS[vtype])

    try:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {buf[:4]!r})")
        pos = 4
        version = take("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} not supported (need >= 2)")
        take("<Q")  # tensor count
        n_kv = take("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            val = value(take("<I"))
            if key.startswith(prefix):
                meta[key] = val
        return meta
    except struct.error as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF metadata ({e})") from None


def _field(meta: dict, key: str, path: str):
    if key not in meta:
        raise ValueError(f"{path}: GGUF file has no {key!r} (no tokenizer stored?)")
    return meta[key]


def spec_from_gguf(path: str | os.PathLike) -> dict:
    """The tokenizer.json dict for the tokenizer inside a GGUF file.

    Raises:
      FileNotFoundError: no such file. ValueError: naming the unsupported ``tokenizer.ggml.*`` key/value.
    """
    return read_gguf_tokenizer(path)[0]


# ChatML templates that insert a system turn when the conversation has none keep it as a literal
# '<|im_start|>system\n...<|im_end|>' (a real newline, as SmolLM2, or a jinja "\n" escape, as Qwen2.5).
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", re.S)


def default_system_from_template(template: str | None) -> str | None:
    """The system prompt a ChatML ``chat_template`` inserts when a conversation has none (None if it inserts none).

    Only a literal system turn counts (``'<|im_start|>system\n' + messages[0]['content']`` does not).
    """
    if not template:
        return None
    m = _DEFAULT_SYSTEM.search(template)
    if m is None or "'" in m.group(1) or '"' in m.group(1):
        return None
    return m.group(1).replace("\\n", "\n")


def read_gguf_tokenizer(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(tokenizer.json dict, extras)`` of the tokenizer inside a GGUF file.

    ``extras``: ``bos_id`` (``tokenizer.ggml.bos_token_id`` when ``add_bos_token`` is true, else None: the chat
    template then places every special token itself), ``eos_id``, ``chat_template`` (``tokenizer.chat_template``
    or None) and ``default_system`` (the system prompt that template inserts, or None).

    Raises:
      FileNotFoundError: no such file. ValueError: naming the unsupported ``tokenizer.ggml.*`` key/value.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = read_gguf_metadata(path)
    model = _field(reader, "tokenizer.ggml.model", path)
    if model != "gpt2":
        raise ValueError(f"{path}: unsupported tokenizer.ggml.model={model!r} (only byte-level BPE 'gpt2')")
    pre = reader.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre={pre!r} (supported: {sorted(_PRE)})")
    template = reader.get("tokenizer.chat_template")
    extras = {
        "bos_id": reader.get("tokenizer.ggml.bos_token_id")
        if reader.get("tokenizer.ggml.add_bos_token")
        else None,
        "eos_id": reader.get("tokenizer.ggml.eos_token_id"),
        "chat_template": template,
        "default_system": default_system_from_template(template),
    }
    return _spec(reader, pre, path), extras


def _spec(reader: dict, pre: str, path: str) -> dict:
    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    types = _field(reader, "tokenizer.ggml.token_type", path)
    merges = _field(reader, "tokenizer.ggml.merges", path)
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] == _CONTROL,
        }
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": _NORMALIZER.get(pre),
        "pre_tokenizer": _PRE[pre],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
