"""Tokenizer backends: one small interface over HF ``tokenizer.json`` and SentencePiece ``.model`` files.

A backend knows how to encode plain text (special-token strings in the text map to their single ids), which ids are
special, and the exact bytes every id contributes to decoded text. The latter is the contract the sampler relies on
to build stop-string and regex automata, so it is computed from the vocabulary itself, never by decoding ids one at
a time (which loses partial UTF-8 sequences and leading spaces).
"""

from __future__ import annotations

import functools
import json
import os
import re

# ChatML control tokens every chat tokenizer here must have as single ids.
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"  # "▁", SentencePiece's visible space


@functools.lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` table: printable stand-in character -> raw byte.

    Byte-level BPE (GPT-2, Qwen, SmolLM2) maps every byte to a printable unicode character before merging, so a token
    string like ``"Ġworld"`` stands for the bytes ``b" world"``.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def sp_piece_bytes(piece: str) -> bytes:
    """Bytes of a SentencePiece-style piece: ``<0xNN>`` byte pieces are that byte, ``▁`` is a space."""
    m = _BYTE_PIECE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode("utf-8")


class HFBackend:
    """A Hugging Face ``tokenizer.json`` (PyPI ``tokenizers``), byte-level BPE or SentencePiece-style (Metaspace).

    Args:
      path: the ``tokenizer.json`` file (or, with ``spec``, just a name for error messages).
      spec: an already-parsed tokenizer.json dict (e.g. built from a GGUF file).
    """

    def __init__(self, path: str | os.PathLike, spec: dict | None = None):
        import tokenizers  # local: keeps ``import comprl_jax`` light

        self.path = os.fspath(path)
        if spec is None:
            if not os.path.isfile(self.path):
                raise FileNotFoundError(f"tokenizer file not found: {self.path}")
            with open(self.path, encoding="utf-8") as f:
                spec = json.load(f)
        self._tk = tokenizers.Tokenizer.from_str(json.dumps(spec))
        # We add no BOS/EOS implicitly: chat templates place every special token themselves.
        self._tk.no_truncation()
        self._tk.no_padding()
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        self.special_ids = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        added_text = {t["id"]: t["content"] for t in spec.get("added_tokens", []) if not t.get("special")}
        self.kind = _hf_kind(spec, self.path)
        self.token_bytes_table = self._bytes_table(added_text)

    def _bytes_table(self, added_text: dict[int, str]) -> list[bytes]:
        specials = set(self.special_ids.values())
        table = []
        dec = gpt2_byte_decoder()
        for i in range(self.vocab_size):
            tok = self._tk.id_to_token(i)
            if tok is None or i in specials:
                table.append(b"")
            elif i in added_text:  # added (non-special) tokens are stored as plain text, not byte-mapped
                table.append(added_text[i].encode("utf-8"))
            elif self.kind == "byte_level":
                try:
                    table.append(bytes(dec[c] for c in tok))
                except KeyError as e:
                    raise ValueError(
                        f"{self.path}: token {i} {tok!r} has a character outside the byte alphabet"
                    ) from e
            else:
                table.append(sp_piece_bytes(tok))
        return table

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; added/special-token strings in it map to their single ids."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def id_to_piece(self, i: int) -> str:
        return self._tk.id_to_token(i)


def _hf_kind(spec: dict, path: str) -> str:
    """Which byte mapping a tokenizer.json uses: ``"byte_level"`` (GPT-2 alphabet) or ``"metaspace"`` (▁, <0xNN>)."""

    def types(node) -> list[str]:
        if not node:
            return []
        out = [node.get("type", "")]
        for key in ("pretokenizers", "decoders"):
            for sub in node.get(key) or []:
                out += types(sub)
        return out

    found = types(spec.get("pre_tokenizer")) + types(spec.get("decoder"))
    if "ByteLevel" in found:
        return "byte_level"
    if "Metaspace" in found or "ByteFallback" in found or (spec.get("model") or {}).get("byte_fallback"):
        return "metaspace"
    raise ValueError(
        f"{path}: unsupported tokenizer.json (pre_tokenizer/decoder types {found}); need ByteLevel or Metaspace/"
        "ByteFallback so token bytes are exact"
    )


class SPBackend:
    """A SentencePiece model.

    Args:
      model_path: the ``.model`` file.
      add_dummy_prefix: override of the model's dummy-prefix rule. Default False: chat templates encode text
        segment by segment, and a prefix ``▁`` on every segment would change the ids (our trained models have it off).
    """

    def __init__(self, model_path: str | os.PathLike, add_dummy_prefix: bool = False):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        self.path = os.fspath(model_path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"SentencePiece model not found: {self.path}")
        proto = pb.ModelProto()
        with open(self.path, "rb") as f:
            proto.ParseFromString(f.read())
        proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
        self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.vocab_size = self._sp.get_piece_size()
        pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        # Control/unknown pieces (<s>, </s>, <pad>, <unk>) and the ChatML symbols are special: they contribute no text.
        self.special_ids = {
            p: i
            for i, p in enumerate(pieces)
            if self._sp.is_control(i) or self._sp.is_unknown(i) or p in CHATML_TOKENS
        }
        self.kind = "sentencepiece"
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        specials = set(self.special_ids.values())
        self.token_bytes_table = [
            b"" if i in specials else (bytes([int(p[3:5], 16)]) if self._sp.is_byte(i) else sp_piece_bytes(p))
            for i, p in enumerate(pieces)
        ]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; user-defined symbols (the ChatML tokens) in it map to their single ids."""
        return self._sp.encode(text)

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)
