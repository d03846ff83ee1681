"""Train a small SentencePiece vocabulary from environment text, for tiny CPU models.

Settings chosen for lossless, chat-ready tokenizers:
  * the ChatML tokens are user-defined symbols (always one id, never split or merged);
  * byte fallback on, so any text encodes (unseen characters become ``<0xNN>`` byte pieces);
  * normalization off: identity rule, whitespace runs kept, no dummy prefix -> decode(encode(s)) == s;
  * ``model_type="char"`` gives exactly one token per ASCII character (a character piece, or a single byte piece for
    an ASCII character unseen in training), so grid maps stay aligned row by row.
"""

from __future__ import annotations

import io
import os
import string
from collections.abc import Iterable, Sequence

from comprl_jax.tokenizer.backends import CHATML_TOKENS

MODEL_TYPES = ("bpe", "unigram", "char")


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    model_type: str = "bpe",
    name: str = "spm",
    ensure_chars: str = string.printable,
    seed_sentences: int = 4,
    atomic_symbols: str | Sequence[str] = "",
) -> str:
    """Train a SentencePiece model and write it to ``{out_dir}/{name}.model``.

    Args:
      texts: training strings; newlines and other whitespace inside a string are kept as characters.
      vocab_size: target vocabulary size, including the 256 byte pieces and the 4 meta pieces (unk + 3 ChatML);
        a soft limit (a small corpus may yield fewer pieces). Ignored for ``model_type="char"``, whose vocabulary is
        every character seen.
      out_dir: output folder (created).
      model_type: ``"bpe"`` | ``"unigram"`` | ``"char"``.
      name: file stem.
      ensure_chars: characters that must be pieces of their own (default: printable ASCII); each is added as
        ``seed_sentences`` one-character training lines (no pairs, so no spurious merges).
      seed_sentences: copies of each ``ensure_chars`` character added to the corpus.
      atomic_symbols: characters (a string) or strings (a sequence) that are always a token of their own and never
        part of a merge (SentencePiece user-defined symbols), e.g. the glyphs of a game map plus space and newline:
        a BPE vocabulary then compresses the prose while every map cell stays exactly one token, so grid rows stay
        aligned. Whole words (an env's action names) match longest first: ``northeast`` is one token beside
        ``north`` and ``east``.

    Returns:
      The path of the ``.model`` file.
    """
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    corpus = [t for t in texts if t]
    if not corpus:
        raise ValueError("train_sentencepiece: no non-empty training texts")
    corpus += [c for c in ensure_chars for _ in range(seed_sentences)]
    min_size = 4 + 256 + len(set("".join(corpus)))
    if model_type == "char":
        vocab_size = min_size  # soft limit below; char vocab = every character seen
    elif vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is below the {min_size} pieces this corpus needs (4 meta + 256 bytes + "
            f"{min_size - 260} distinct characters)"
        )
    os.makedirs(out_dir, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        user_defined_symbols=list(CHATML_TOKENS) + [c for c in dict.fromkeys(atomic_symbols) if c],
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        character_coverage=1.0,
        max_sentence_length=1 << 16,
        # ids: 0 <unk>, 1-3 ChatML, then bytes; no BOS/EOS/PAD pieces (ChatML models use <|endoftext|> as pad).
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    path = os.path.join(os.fspath(out_dir), f"{name}.model")
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path
