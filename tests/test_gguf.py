"""GGUF import on small hand-written files: dequantization of every supported tensor type, llama.cpp's q/k row
permutation, config from metadata, sharded loading, parity with transformers, and errors that name file / key /
tensor. The real SmolLM2 file is covered in tests/test_smollm.py.

Quantized tensors: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are written with ``gguf.quants.quantize`` (gguf-py can
quantize them). gguf-py cannot quantize Q4_K / Q5_K / Q6_K, so for those we write random but valid blocks (raw
bytes with finite f16 scales) and check ``gguf.quants.dequantize`` against a plain re-implementation of ggml's
``dequantize_row_q{4,5,6}_K`` (ggml-common.h block layouts) written here, then load them through a GGUF file.
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from comprl_jax.models import ModelConfig, gguf_io  # noqa: E402
from comprl_jax.models import decoder as D  # noqa: E402
from comprl_jax.models.gguf_io import (  # noqa: E402
    LAYER_NAMES,
    TOP_NAMES,
    dequantize,
    load_gguf,
    permute_qk,
    read_gguf_config,
    unpermute_qk,
)
from comprl_jax.runtime import sharding  # noqa: E402

Q = gguf.GGMLQuantizationType


def _values(params) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in p): np.asarray(v.get_value()) for p, v in flat}


# ----- q/k permutation ------------------------------------------------------------------------------------------
def test_permutation_hand_values():
    # 2 heads of head_dim 4: HF rows per head are [first half | second half] = [r0 r1 | r2 r3]; llama.cpp
    # interleaves the halves to pairs (r0, r2), (r1, r3).
    hf_rows = np.arange(8)
    assert permute_qk(hf_rows, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_qk(np.array([0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist() == list(range(8))
    # One head of head_dim 6: [a0 a1 a2 | b0 b1 b2] -> a0 b0 a1 b1 a2 b2.
    assert permute_qk(np.arange(6), 1).tolist() == [0, 3, 1, 4, 2, 5]
    # Matrices [out, in]: whole rows move.
    w = np.arange(8 * 3).reshape(8, 3)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 2), 2), w)
    np.testing.assert_array_equal(permute_qk(w, 2)[1], w[2])
    with pytest.raises(ValueError, match="cannot unpermute 6 rows into 2 heads"):
        unpermute_qk(np.zeros((6, 2)), 2)


# ----- dequantization -------------------------------------------------------------------------------------------
def _write_tensors(path, tensors: dict[str, tuple[np.ndarray, object]]) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# type -> max |x - dequant(quant(x))| as a fraction of the block's max |x| (hand-derived from each format:
# Q8_0: step amax/127, error <= step/2 (+ the f16 rounding of the scale); Q4_0: step amax/8, +7/8 clipping of
# the positive end -> <= amax/8; Q4_1: step range/15 with range <= 2 amax -> <= amax/15; F16 / BF16: relative
# rounding 2^-11 / 2^-8 of each element).
QUANT_BOUND = {"F32": 0.0, "F16": 2**-11, "BF16": 2**-8, "Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15}


@pytest.mark.parametrize("name", list(QUANT_BOUND))
def test_quantized_tensor_dequantizes_to_reference(name, tmp_path):
    qtype = Q[name]
    x = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
    data = x if name == "F32" else (x.astype(np.float16) if name == "F16" else gguf.quants.quantize(x, qtype))
    path = _write_tensors(tmp_path / f"{name}.gguf", {"t": (data, qtype)})
    t = gguf.GGUFReader(path).tensors[0]
    assert t.tensor_type == qtype
    got = dequantize(t, path)
    assert got.shape == (6, 64) and got.dtype == np.float32
    np.testing.assert_array_equal(got, gguf.quants.dequantize(data, qtype).astype(np.float32))
    block = 32 if name.startswith("Q") else 1
    amax = np.abs(x).reshape(6, -1, block).max(-1, keepdims=True)
    err = np.abs(got - x).reshape(6, -1, block)
    assert (err <= QUANT_BOUND[name] * amax * (1 + 1e-3)).all(), float((err / amax).max())


def _f16(rng, n, lo, hi):
    return rng.uniform(lo, hi, size=n).astype(np.float16)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml ``get_scale_min_k4``: 6-bit scale and min j (0..7) packed in 12 bytes."""
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def _ref_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin = block[0:2].view(np.float16)[0], block[2:4].view(np.float16)[0]
    scales, qs = block[4:16], block[16:144]
    y = []
    for j in range(4):  # 64 values per step: low nibbles with scale 2j, high nibbles with scale 2j+1
        q = qs[32 * j : 32 * j + 32]
        for k, vals in ((2 * j, q & 0xF), (2 * j + 1, q >> 4)):
            sc, m = _scale_min_k4(k, scales)
            y += [np.float32(d) * sc * int(v) - np.float32(dmin) * m for v in vals]
    return np.array(y, np.float32)


def _ref_q5_k(block: np.ndarray) -> np.ndarray:
    d, dmin = block[0:2].view(np.float16)[0], block[2:4].view(np.float16)[0]
    scales, qh, qs = block[4:16], block[16:48], block[48:176]
    y = []
    for j in range(4):
        q = qs[32 * j : 32 * j + 32]
        for k, vals, bit in ((2 * j, q & 0xF, 2 * j), (2 * j + 1, q >> 4, 2 * j + 1)):
            sc, m = _scale_min_k4(k, scales)
            high = ((qh >> bit) & 1).astype(int) * 16
            y += [
                np.float32(d) * sc * (int(v) + int(h)) - np.float32(dmin) * m
                for v, h in zip(vals, high, strict=True)
            ]
    return np.array(y, np.float32)


def _ref_q6_k(block: np.ndarray) -> np.ndarray:
    ql, qh, sc = block[0:128], block[128:192], block[192:208].view(np.int8)
    d = np.float32(block[208:210].view(np.float16)[0])
    y = np.zeros(256, np.float32)
    for n in range(2):  # two halves of 128 values
        l_, h_, s_ = ql[64 * n :], qh[32 * n :], sc[8 * n :]
        for i in range(32):
            is_ = i // 16
            q1 = int((l_[i] & 0xF) | (((h_[i] >> 0) & 3) << 4)) - 32
            q2 = int((l_[i + 32] & 0xF) | (((h_[i] >> 2) & 3) << 4)) - 32
            q3 = int((l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4)) - 32
            q4 = int((l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4)) - 32
            base = 128 * n + i
            y[base] = d * np.float32(s_[is_]) * q1
            y[base + 32] = d * np.float32(s_[is_ + 2]) * q2
            y[base + 64] = d * np.float32(s_[is_ + 4]) * q3
            y[base + 96] = d * np.float32(s_[is_ + 6]) * q4
    return y


def _k_blocks(name: str, n: int, rng) -> np.ndarray:
    """n random valid blocks of a K-quant type as uint8 ``[n, bytes]`` (finite f16 scales)."""
    size = gguf.GGML_QUANT_SIZES[Q[name]][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if name == "Q6_K":
        b[:, 208:210] = _f16(rng, n, 0.001, 0.01).view(np.uint8).reshape(n, 2)
    else:
        b[:, 0:2] = _f16(rng, n, 0.001, 0.01).view(np.uint8).reshape(n, 2)
        b[:, 2:4] = _f16(rng, n, 0.001, 0.01).view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.parametrize("name,ref", [("Q4_K", _ref_q4_k), ("Q5_K", _ref_q5_k), ("Q6_K", _ref_q6_k)])
def test_k_quants_match_ggml_reference(name, ref, tmp_path):
    rng = np.random.default_rng({"Q4_K": 1, "Q5_K": 2, "Q6_K": 3}[name])
    rows, blocks_per_row = 3, 2  # a [3, 512] tensor
    raw = _k_blocks(name, rows * blocks_per_row, rng)
    want = np.stack([ref(blk) for blk in raw]).reshape(rows, 256 * blocks_per_row)
    data = raw.reshape(rows, -1)
    np.testing.assert_allclose(gguf.quants.dequantize(data, Q[name]), want, rtol=1e-6, atol=1e-7)
    path = _write_tensors(tmp_path / f"{name}.gguf", {"t": (data, Q[name])})
    t = gguf.GGUFReader(path).tensors[0]
    assert t.tensor_type == Q[name] and tuple(t.shape) == (512, 3)
    np.testing.assert_allclose(dequantize(t, path), want, rtol=1e-6, atol=1e-7)


# ----- whole models ---------------------------------------------------------------------------------------------
def write_model_gguf(
    path, cfg: ModelConfig, params, qtypes: dict[str, str] | None = None, extra_kv: dict | None = None
) -> str:
    """Writes our decoder params as a llama.cpp-style GGUF (``[out, in]`` tensors, llama q/k permuted).

    ``qtypes``: our parameter name -> GGUF type name for some tensors (default F32). ``cfg.rope_scaling`` is
    written as llama.cpp's ``convert_hf_to_gguf.py`` writes a HF ``rope_scaling`` (YaRN's beta_fast, beta_slow and
    attention_factor as ``yarn_*`` keys); ``extra_kv``: more float32 keys (``{arch}`` filled in).
    """
    qtypes = qtypes or {}
    a = cfg.arch
    w = gguf.GGUFWriter(str(path), a)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    scaling = cfg.rope_scaling_dict
    if scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        for hf_key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
            ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
        ):
            if scaling.get(hf_key) is not None:
                add(scaling[hf_key])
    for key, value in (extra_kv or {}).items():
        w.add_float32(key.format(arch=a), value)
    vals = _values(params)

    def put(name: str, ours: str, x: np.ndarray):
        if ours in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
            x = x.T
        if a == "llama" and ours in ("q_proj", "k_proj"):
            x = permute_qk(x, cfg.num_heads if ours == "q_proj" else cfg.num_kv_heads)
        x = np.ascontiguousarray(x, np.float32)
        qt = Q[qtypes.get(ours, "F32")]
        data = x if qt == Q.F32 else (x.astype(np.float16) if qt == Q.F16 else gguf.quants.quantize(x, qt))
        w.add_tensor(name, data, raw_dtype=qt)

    for key, x in vals.items():
        parts = key.split("/")
        if parts[0] == "layers":
            for i in range(cfg.num_layers):
                put(f"blk.{i}.{LAYER_NAMES[parts[1]]}", parts[1], x[i])
        else:
            put(TOP_NAMES[parts[0]], parts[0], x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_round_trip_exact_and_sharded(arch, tied, tmp_path):
    cfg = ModelConfig.tiny(
        arch, tie_word_embeddings=tied, rope_theta=100000.0, rms_norm_eps=2.0**-17
    )  # f32-exact (GGUF stores f32)
    _, params = D.init_decoder(cfg, seed=3)
    path = write_model_gguf(tmp_path / "m.gguf", cfg, params)
    assert read_gguf_config(path) == cfg
    want = _values(params)
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    got_cfg, _, got = load_gguf(path, mesh=mesh)
    assert got_cfg == cfg
    flat = jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    assert sorted("/".join(str(k.key) for k in p) for p, _ in flat) == sorted(want)
    for p, var in flat:
        key = "/".join(str(k.key) for k in p)
        arr = var.get_value()
        spec = sharding.logical_to_spec(var.get_metadata()["out_sharding"], mesh=mesh)
        assert arr.sharding.spec == spec, key
        np.testing.assert_array_equal(np.asarray(arr), want[key], err_msg=key)


def test_quantized_layers_load_as_their_dequantization(tmp_path):
    cfg = ModelConfig.tiny("llama", tie_word_embeddings=True)
    _, params = D.init_decoder(cfg, seed=4)
    qt = {"q_proj": "Q8_0", "k_proj": "Q4_0", "gate_proj": "Q4_1", "embed": "F16"}
    path = write_model_gguf(tmp_path / "q.gguf", cfg, params, qt)
    _, _, got = load_gguf(path, param_dtype="bfloat16")
    got, want = _values(got), _values(params)
    assert got["layers/q_proj"].dtype == jax.numpy.bfloat16
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for ours, n_head in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
        for i in range(cfg.num_layers):
            t = reader[f"blk.{i}.{LAYER_NAMES[ours]}"]
            ref = unpermute_qk(gguf.quants.dequantize(t.data, t.tensor_type), n_head).T
            np.testing.assert_array_equal(got[f"layers/{ours}"][i], ref.astype(jax.numpy.bfloat16))
            # ... and close to the original weights (Q4_0: step amax / 8 of 32-blocks of normal(0.02) weights).
            assert (
                np.abs(got[f"layers/{ours}"][i].astype(np.float32) - want[f"layers/{ours}"][i]).max() < 0.02
            )


def test_llama_file_matches_transformers_model(tmp_path, monkeypatch):
    """A llama.cpp-layout file (q/k permuted) from a random HF Llama loads to the HF model's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from comprl_jax.models.hf_io import load_hf

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=2.0**-20,
        tie_word_embeddings=True, rope_theta=10000.0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim == 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path / "hf")
    cfg, _, params = load_hf(str(tmp_path / "hf"))
    path = write_model_gguf(tmp_path / "l.gguf", cfg, params)
    gcfg, graphdef, gparams = load_gguf(path)
    assert gcfg == cfg
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 11)).astype(np.int32)
    pos = np.broadcast_to(np.arange(11, dtype=np.int32), (2, 11))
    ours = np.asarray(
        jax.jit(D.forward, static_argnums=0)(graphdef, gparams, tokens, pos, np.ones_like(tokens))
    )
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-4
    # The same file loaded without undoing llama.cpp's permutation is a different model: the undo is what matches.
    monkeypatch.setattr(gguf_io, "unpermute_qk", lambda w, n_head: w)
    _, graphdef, raw = load_gguf(path)
    wrong = np.asarray(jax.jit(D.forward, static_argnums=0)(graphdef, raw, tokens, pos, np.ones_like(tokens)))
    assert np.abs(wrong - ref).max() > 0.1


def test_yarn_file_matches_the_safetensors_model(tmp_path, monkeypatch):
    """A Qwen2 with YaRN (beta_fast, beta_slow, attention_factor set) saved by transformers, loaded from its
    safetensors, written as llama.cpp's converter would, and loaded from the GGUF: same config, and the GGUF model's
    logits match transformers' over 96 positions (3x the original 32-token context)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from comprl_jax.models.hf_io import load_hf

    torch.manual_seed(1)
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 8.0,
        "beta_slow": 2.0,
        "attention_factor": 0.75,
        "rope_theta": 10000.0,
    }  # fmt: skip  (values exact in float32, as GGUF stores them)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=2.0**-20, tie_word_embeddings=False,
        rope_parameters=yarn,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim == 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path / "hf")
    cfg, _, params = load_hf(str(tmp_path / "hf"))
    assert {k: v for k, v in cfg.rope_scaling_dict.items() if k in yarn} == {
        k: v for k, v in yarn.items() if k != "rope_theta"
    }
    path = write_model_gguf(tmp_path / "yarn.gguf", cfg, params)
    fields = gguf.GGUFReader(path).fields
    assert fields["qwen2.rope.scaling.yarn_beta_fast"].contents() == 8.0
    assert fields["qwen2.rope.scaling.yarn_attn_factor"].contents() == 0.75
    gcfg, graphdef, gparams = load_gguf(path)
    assert gcfg == cfg
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 96)).astype(np.int32)
    pos = np.broadcast_to(np.arange(96, dtype=np.int32), (2, 96))
    forward = jax.jit(D.forward, static_argnums=0)
    ours = np.asarray(forward(graphdef, gparams, tokens, pos, np.ones_like(tokens)))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-4
    # Reading only type / factor / original context (as before) is another model: HF's default betas (32, 1) and
    # attention factor (0.1 ln 4 + 1 = 1.139).
    monkeypatch.setattr(gguf_io, "_YARN_KEYS", {})
    _, graphdef, gparams = load_gguf(path)
    dropped = np.asarray(forward(graphdef, gparams, tokens, pos, np.ones_like(tokens)))
    assert np.abs(dropped - ref).max() > 0.5


def test_yarn_keys_that_change_the_math_are_refused(tmp_path):
    cfg = ModelConfig.tiny(  # float32-exact values: GGUF stores float32
        "qwen3",
        tie_word_embeddings=True,
        rope_scaling=(("factor", 2.0), ("rope_type", "yarn")),
        rms_norm_eps=2.0**-17,
    )
    _, params = D.init_decoder(cfg, seed=6)
    ok = {"{arch}.rope.scaling.yarn_ext_factor": 1.0, "{arch}.rope.scaling.yarn_log_multiplier": 0.0}
    assert read_gguf_config(write_model_gguf(tmp_path / "ok.gguf", cfg, params, extra_kv=ok)) == cfg
    for key, value in (("yarn_ext_factor", 0.5), ("yarn_log_multiplier", 0.1)):
        path = write_model_gguf(
            tmp_path / f"{key}.gguf", cfg, params, extra_kv={f"{{arch}}.rope.scaling.{key}": value}
        )
        with pytest.raises(
            ValueError, match=rf"{key}\.gguf: GGUF metadata key 'qwen3\.rope\.scaling\.{key}' = {value}"
        ):
            read_gguf_config(path)
    linear = ModelConfig.tiny(
        "qwen3", tie_word_embeddings=True, rope_scaling=(("factor", 2.0), ("rope_type", "linear"))
    )
    path = write_model_gguf(
        tmp_path / "lin.gguf", linear, params, extra_kv={"{arch}.rope.scaling.yarn_beta_fast": 8.0}
    )
    with pytest.raises(ValueError, match=r"yarn_beta_fast'\] are set but rope\.scaling\.type is 'linear'"):
        read_gguf_config(path)


# ----- errors ---------------------------------------------------------------------------------------------------
def test_errors_name_file_key_and_tensor(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"GGUF file not found: .*nope\.gguf"):
        load_gguf(tmp_path / "nope.gguf")
    cfg = ModelConfig.tiny("qwen3", tie_word_embeddings=True)
    _, params = D.init_decoder(cfg, seed=5)
    path = write_model_gguf(tmp_path / "ok.gguf", cfg, params)

    def rewrite(name, arch="qwen3", drop=(), extra_kv=None):
        r = gguf.GGUFReader(path)
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        for k, f in r.fields.items():
            if k.startswith("qwen3.") and not k.startswith("GGUF."):
                key = arch + k[len("qwen3") :]
                v = f.contents()
                if isinstance(v, int):
                    w.add_uint32(key, v)
                elif isinstance(v, float):
                    w.add_float32(key, v)
        for k, v in (extra_kv or {}).items():
            w.add_uint32(k, v)
        for t in r.tensors:
            if t.name not in drop:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(tmp_path / name)

    with pytest.raises(ValueError, match=r"gemma\.gguf: general\.architecture='gemma' is not supported"):
        load_gguf(rewrite("gemma.gguf", arch="gemma"))
    with pytest.raises(ValueError, match=r"noq\.gguf: tensor 'blk\.1\.attn_q\.weight' is missing"):
        load_gguf(rewrite("noq.gguf", drop=("blk.1.attn_q.weight",)))
    with pytest.raises(ValueError, match=r"moe\.gguf: GGUF metadata key 'qwen3\.expert_count' is set"):
        load_gguf(rewrite("moe.gguf", extra_kv={"qwen3.expert_count": 8}))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match=r"bad\.gguf: not a readable GGUF file"):
        load_gguf(bad)
