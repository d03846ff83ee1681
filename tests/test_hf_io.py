"""HF checkpoint I/O and config validation: round trips, sharded multi-file loads, transformers reading our
files, RoPE scaling tables against transformers, and errors that name the bad file / key."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from comprl_jax.models import ModelConfig
from comprl_jax.models import decoder as D
from comprl_jax.models import layers as L
from comprl_jax.models.config import named_config
from comprl_jax.models.hf_io import INDEX_FILE, load_hf, save_hf
from comprl_jax.runtime import sharding


def _values(params) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in p): np.asarray(v.get_value()) for p, v in flat}


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny("qwen2", tie_word_embeddings=False)
    graphdef, params = D.init_decoder(cfg, seed=1)
    return cfg, params


def test_round_trip_single_and_multi_file_sharded(tiny, tmp_path):
    cfg, params = tiny
    want = _values(params)
    assert save_hf(str(tmp_path / "one"), cfg, params) == ["model.safetensors"]
    cfg1, _, p1 = load_hf(str(tmp_path / "one"))
    assert cfg1 == cfg
    for k, v in _values(p1).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)

    # ~20 KiB shards: several files + an index json; loaded straight onto an fsdp x tensor mesh.
    names = save_hf(str(tmp_path / "multi"), cfg, params, max_shard_bytes=20_000)
    assert len(names) > 3 and os.path.exists(tmp_path / "multi" / INDEX_FILE)
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    _, _, p2 = load_hf(str(tmp_path / "multi"), mesh=mesh)
    flat = jax.tree_util.tree_flatten_with_path(p2, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in flat:
        key = "/".join(str(k.key) for k in path)
        arr = var.get_value()
        assert arr.sharding.spec == sharding.logical_to_spec(var.get_metadata()["out_sharding"], mesh=mesh), (
            key
        )
        np.testing.assert_array_equal(np.asarray(arr), want[key], err_msg=key)
    q = _values(p2)["layers/q_proj"]
    assert q.shape == (2, 64, 64)  # stacked [L, in, out]


def test_overrides_cast_params(tiny, tmp_path):
    cfg, params = tiny
    save_hf(str(tmp_path), cfg, params, dtype="bfloat16")
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    cfg2, _, p = load_hf(str(tmp_path), param_dtype="bfloat16", dtype="bfloat16")
    assert cfg2.dtype == "bfloat16"
    assert all(v.dtype == jax.numpy.bfloat16 for v in _values(p).values())


@pytest.mark.parametrize("arch, tied", [("qwen2", False), ("qwen3", True)])
def test_transformers_loads_our_files(arch, tied, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.tiny(arch, tie_word_embeddings=tied)
    graphdef, params = D.init_decoder(cfg, seed=2)
    save_hf(str(tmp_path), cfg, params, max_shard_bytes=50_000)
    family = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[arch]
    hf = family.from_pretrained(str(tmp_path)).eval()
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tied
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)).astype(np.int32)
    pos = np.broadcast_to(np.arange(7, dtype=np.int32), (2, 7))
    fwd = jax.jit(D.forward, static_argnums=0)
    ours = np.asarray(fwd(graphdef, params, tokens, pos, np.ones((2, 7), bool)))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_missing_shard_names_the_file(tiny, tmp_path):
    cfg, params = tiny
    names = save_hf(str(tmp_path), cfg, params, max_shard_bytes=20_000)
    os.remove(tmp_path / names[1])
    with pytest.raises(FileNotFoundError, match=names[1]):
        load_hf(str(tmp_path))


def test_missing_tensor_and_bad_shape_name_the_tensor(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg, params = tiny
    save_hf(str(tmp_path), cfg, params)
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:5]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape"):
        load_hf(str(tmp_path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(str(tmp_path))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, r"'rope_scaling'.*'dynamic'"),
        ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, r"'rope_scaling'.*'longrope'"),
        ("rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, r"'rope_parameters'.*'su'"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("hidden_act", "gelu", "hidden_act"),
        ("model_type", "gemma", "model_type"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ],
)
def test_unsupported_config_names_the_key(key, value, match):
    d = ModelConfig.tiny("qwen3").to_hf_config()
    d[key] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(d)


def test_unsupported_rope_scaling_in_folder_names_key(tiny, tmp_path):
    cfg, params = tiny
    save_hf(str(tmp_path), cfg, params)
    d = json.load(open(tmp_path / "config.json"))
    d["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    json.dump(d, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_hf(str(tmp_path))


def test_shipped_configs():
    q = named_config("qwen2.5-7b-instruct")
    assert (q.arch, q.hidden_size, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == (
        "qwen2",
        3584,
        28,
        28,
        4,
        128,
    )
    assert q.qkv_bias and not q.qk_norm and not q.tie_word_embeddings and q.rope_theta == 1e6
    q3 = named_config("qwen3-4b")
    assert (q3.arch, q3.hidden_size, q3.num_layers, q3.num_kv_heads, q3.head_dim) == (
        "qwen3",
        2560,
        36,
        8,
        128,
    )
    assert q3.qk_norm and q3.tie_word_embeddings and q3.rope_theta == 5e6
    e = named_config("qwen3-embedding-0.6b")
    assert (e.hidden_size, e.num_layers, e.vocab_size) == (1024, 28, 151669)
    # Known totals (model cards): 7.62 B and 4.02 B parameters.
    assert D.count_params(D.abstract_decoder(q)[1]) == 7_615_616_512
    assert D.count_params(D.abstract_decoder(q3)[1]) == 4_022_468_096


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)  # fmt: skip
def test_rope_scaling_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = {**ModelConfig.tiny("qwen3").to_hf_config(), "max_position_embeddings": 256, "rope_theta": 1e4}
    hf_cfg = transformers.Qwen3Config(**{**d, "rope_parameters": {**scaling, "rope_theta": 1e4}})
    want_inv, want_attn = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf_config({**d, "rope_scaling": scaling})
    assert dict(cfg.rope_scaling)["rope_type"] == scaling["rope_type"]
    inv, attn = L.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=1e-6)
    assert attn == pytest.approx(want_attn, rel=1e-6)


def test_base_model_names_without_prefix_and_unused_tensors(tiny, tmp_path):
    """Qwen3-Embedding ships a bare ``Qwen3Model``: tensor names without "model." and no lm_head."""
    from safetensors.numpy import load_file, save_file

    cfg = ModelConfig.tiny("qwen3", tie_word_embeddings=True)
    _, params = D.init_decoder(cfg, seed=4)
    save_hf(str(tmp_path), cfg, params)
    f = str(tmp_path / "model.safetensors")
    bare = {k.removeprefix("model."): v for k, v in load_file(f).items()}
    bare["rotary_emb.inv_freq"] = np.ones(8, np.float32)  # old checkpoints carry this buffer: ignored
    save_file(bare, f, metadata={"format": "pt"})
    _, _, loaded = load_hf(str(tmp_path))
    want = _values(params)
    for k, v in _values(loaded).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    bare["layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    save_file(bare, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj\.bias"):
        load_hf(str(tmp_path))
