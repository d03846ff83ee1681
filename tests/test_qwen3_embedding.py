"""The paper's embedder (issue 13.7): ``retrieval.embedder`` naming a Qwen3-Embedding Hugging Face folder loads it
(last-token pooling on ``<|endoftext|>``, the query instruction on queries only, L2-normalised), placed like every
other model, equal to transformers' ``Qwen3Model`` on a random-init model of that architecture; a missing folder
fails naming the config key and what to do."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from comprl_jax.models.embedders import QWEN3_QUERY_INSTRUCTION, embedder_from_config  # noqa: E402

TEXTS = ["go north to the stairs", "pick up the key, then open the door", "a", "walk along the dark wall"]
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _hf_folder(path):
    """A random-init Qwen3 model + a byte-level BPE tokenizer.json trained here (Qwen3-Embedding's layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = TEXTS * 20 + [f"Instruct: {QWEN3_QUERY_INSTRUCTION}\nQuery:"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus, trainer)
    assert tk.get_vocab_size() <= 384  # the model's (tensor-divisible) embedding is at least as large
    path.mkdir()
    tk.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim == 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    return model, tk


def _reference(model, tk, texts, instruction=None):
    eos = tk.token_to_id("<|endoftext|>")
    out = []
    for t in texts:
        if instruction is not None:
            t = f"Instruct: {instruction}\nQuery:{t}"
        ids = tk.encode(t).ids + [eos]
        with torch.no_grad():
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        out.append(torch.nn.functional.normalize(h, dim=-1).numpy())
    return np.stack(out)


def test_qwen3_embedding_folder_from_config_matches_transformers(tmp_path):
    model, tk = _hf_folder(tmp_path / "qwen3-embedding")
    emb = embedder_from_config(str(tmp_path / "qwen3-embedding"))
    assert emb.dim == 64
    docs, queries = emb.embed(TEXTS), emb.embed_query(TEXTS)
    np.testing.assert_allclose(docs, _reference(model, tk, TEXTS), atol=1e-4)
    np.testing.assert_allclose(queries, _reference(model, tk, TEXTS, QWEN3_QUERY_INSTRUCTION), atol=1e-4)
    assert np.abs(docs - queries).max() > 1e-2  # the instruction is really applied to queries only
    np.testing.assert_allclose(np.linalg.norm(queries, axis=1), 1.0, atol=1e-5)


def test_qwen3_embedding_placed_on_a_mesh_like_other_models(tmp_path):
    import jax

    from comprl_jax.runtime import sharding as shd

    _hf_folder(tmp_path / "q")
    one = embedder_from_config(str(tmp_path / "q")).embed_query(TEXTS)
    mesh = shd.make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, jax.devices()[:8])
    sharded = embedder_from_config(str(tmp_path / "q"), mesh=mesh)
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded._params)}
    assert any("fsdp" in s for s in specs)  # parameters laid out by the rule table, not replicated
    np.testing.assert_allclose(sharded.embed_query(TEXTS), one, atol=1e-5)


def test_paper_default_without_a_local_folder_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config key retrieval\.embedder.*huggingface-cli download"):
        embedder_from_config("Qwen/Qwen3-Embedding-0.6B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"config key retrieval\.embedder: .*empty has no config\.json"
    ):
        embedder_from_config(str(tmp_path / "empty"))
