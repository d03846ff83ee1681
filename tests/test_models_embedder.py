"""Qwen3-Embedding-style decoder embedder (``embedders.DecoderEmbedder`` on our decoder) against a torch
reference: HF ``Qwen3Model`` final hidden state of the last (``<|endoftext|>``) token, L2-normalised."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from comprl_jax.models.embedders import DecoderEmbedder, Embedder  # noqa: E402
from comprl_jax.models.hf_io import load_hf  # noqa: E402
from comprl_jax.tokenizer import Tokenizer  # noqa: E402

CORPUS = [
    "go north to the stairs",
    "pick up the key, then open the door",
    "a lesson: avoid the river unless you carry a boulder",
    "the room is dark; walk along the wall",
]
TEXTS = ["go north", "open the door with the key", "a", "walk along the dark wall to find the exit", "stairs"]


def test_decoder_embedder_matches_torch_last_token_pooling(tmp_path):
    tok = Tokenizer.train_sentencepiece(CORPUS, 0, tmp_path / "sp", model_type="char")
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim == 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path / "hf")
    _, graphdef, params = load_hf(str(tmp_path / "hf"))
    emb = DecoderEmbedder(graphdef, params, tok, batch_size=4)  # 5 texts -> two padded batches
    assert isinstance(emb, Embedder) and emb.dim == 64
    out = emb.embed(TEXTS)
    assert out.shape == (5, 64) and out.dtype == np.float32

    for i, text in enumerate(TEXTS):
        ids = tok.encode(text) + [tok.pad_id]  # Qwen3-Embedding appends <|endoftext|> (= pad) and pools it
        with torch.no_grad():
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        ref = torch.nn.functional.normalize(h, dim=-1).numpy()
        assert float(out[i] @ ref) >= 0.99999, text
        np.testing.assert_allclose(out[i], ref, atol=1e-5, err_msg=text)
