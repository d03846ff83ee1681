"""The warm models' fixed vocabulary: a BPE ``tokenizer.json`` that ``Tokenizer.from_hf_json`` (the pretrained
loader's) reads, with exact token bytes for constrained decoding.

Pieces may span spaces (a Metaspace pre-tokenizer that does not split), so the fixed instructions of the prompts
(the env's system prompt, the experience header, the distillation instructions) cost a few tokens each and a
prompt is mostly what varies. Byte fallback (``<0x00>``…``<0xFF>``) keeps every text encodable. Some words are
atomic (added tokens, never merged with their neighbours): the env's actions and the 16 family names, so a lesson's
verb and family are one token each wherever they stand, and a name matches a name in one comparison. The ChatML
tokens are the special ones every chat tokenizer here has.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from comprl_jax.tokenizer import CHATML_TOKENS, Tokenizer
from comprl_jax.tokenizer.backends import HFBackend

SPACE = "\u2581"


def bootstrap_tokenizer() -> Tokenizer:
    """A vocabulary of the 256 bytes and the ChatML tokens, no merges: renders the corpus's prompts through the
    rollout's own functions before the real vocabulary exists (its ``decode`` gives their exact text)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    byte_tokens = {f"<0x{b:02X}>": b for b in range(256)}
    vocab = {p: i for i, p in enumerate(CHATML_TOKENS)}
    vocab.update({p: len(CHATML_TOKENS) + b for p, b in byte_tokens.items()})
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tk.decoder = decoders.ByteFallback()  # every byte its own token: text round-trips exactly
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_TOKENS])
    spec = json.loads(tk.to_str())
    return Tokenizer(HFBackend("<bootstrap vocabulary>", spec=spec))


def split_specials(text: str) -> list[str]:
    """``text`` cut at the ChatML tokens (which are not trained on), empty pieces dropped."""
    pieces = [text]
    for t in CHATML_TOKENS:
        pieces = [q for p in pieces for q in p.split(t)]
    return [p for p in pieces if p]


def train_vocab(texts: Iterable[str], vocab_size: int, atomic: Sequence[str], out_dir: str) -> str:
    """Trains the BPE on ``texts`` and writes ``out_dir/tokenizer.json``; returns its path.

    ``atomic``: words that are always one token (added, non-special tokens)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tk = HFTokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=False)
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(SPACE, "never", False)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(atomic) - 256,
        special_tokens=list(CHATML_TOKENS),
        show_progress=False,
        max_token_length=48,
    )
    # the atomic words are cut out of the training text, as the added tokens cut them out of every encoded text
    cut = [q for t in texts for p in split_specials(t) for q in _cut(p, atomic)]
    tk.train_from_iterator(cut, trainer)
    # byte fallback needs the 256 byte pieces in the model's vocabulary (not as added tokens, which are text)
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tk = HFTokenizer.from_str(json.dumps(spec))
    tk.add_tokens([AddedToken(w, normalized=False) for w in atomic])
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tk.save(path)
    return path


def _cut(text: str, words: Sequence[str]) -> list[str]:
    pieces = [text]
    for w in sorted(words, key=len, reverse=True):
        pieces = [q for p in pieces for q in p.split(w)]
    return [p for p in pieces if p]
