"""GGUF import (llama.cpp files, PyPI ``gguf``): llama / qwen2 / qwen3 -> sharded decoder parameters.

A GGUF file holds the config as metadata (``{arch}.block_count``, ``{arch}.embedding_length``, ...) and one tensor
per layer and weight, possibly quantized. We read it with ``gguf.GGUFReader`` (memory-mapped), dequantize every
tensor with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and the other types
gguf-py knows) to float32 on the host, then cast to the param dtype.

Layout facts the loader undoes:
  * GGUF tensors are stored ``ne = [in, out]``, i.e. numpy ``[out, in]`` like HF; our weights are ``[in, out]``.
  * llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of *llama* models from HF's rotate-half
    RoPE layout to interleaved pairs (``convert_hf_to_gguf.py`` ``LlamaModel.permute``); qwen2/qwen3 files are
    stored unpermuted (NEOX RoPE). :func:`unpermute_qk` is the inverse.
  * A file without ``output.weight`` ties the LM head to ``token_embd.weight``.

Parameters are placed through :func:`comprl_jax.models.hf_io.place_params` (the same path as safetensors), one
dequantized stacked parameter in host memory at a time.
"""

from __future__ import annotations

import os

import numpy as np

from comprl_jax.models.config import ModelConfig
from comprl_jax.runtime import sharding

ARCHS = ("llama", "qwen2", "qwen3")
# Our stacked per-layer parameter -> GGUF tensor name inside ``blk.{i}.``.
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}
TOP_NAMES: dict[str, str] = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}
# Stored [out, in] (numpy order) -> transposed into our [in, out].
_TRANSPOSED = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
)
# Metadata keys that change the math in ways this decoder does not implement (MoE, sliding window, ...).
_UNSUPPORTED_KEYS = (
    "expert_count",
    "attention.sliding_window",
    "attention.layer_norm_epsilon",  # LayerNorm instead of RMSNorm
    "attention.clamp_kqv",
    "logit_scale",
)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (rotate-half -> interleaved pairs, per head).

    ``convert_hf_to_gguf.py`` stores ``w.reshape(n_head, 2, Dh // 2, ...).swapaxes(1, 2).reshape(w.shape)``; this
    returns the HF layout. Works on weights ``[n_head * Dh, in]`` and biases ``[n_head * Dh]``.
    """
    out = w.shape[0]
    if out % (2 * n_head):
        raise ValueError(f"cannot unpermute {w.shape[0]} rows into {n_head} heads of an even size")
    dh = out // n_head
    return w.reshape(n_head, dh // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF layout -> GGUF layout); the inverse of :func:`unpermute_qk` (for writers/tests)."""
    dh = w.shape[0] // n_head
    return w.reshape(n_head, 2, dh // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor, path: str = "") -> np.ndarray:
    """A ``GGUFReader`` tensor as float32 numpy in numpy order ``[out, in]`` (= reversed GGUF ``ne``).

    Raises:
      ValueError: naming the tensor and file when gguf-py cannot dequantize its type.
    """
    import gguf

    want = tuple(int(n) for n in reversed(tensor.shape))
    try:
        x = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which gguf.quants.dequantize "
            "cannot dequantize; re-convert the model with a supported type (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q*_K)"
        ) from None
    x = np.asarray(x, np.float32)
    if x.size != int(np.prod(want)):
        raise ValueError(f"{path}: tensor {tensor.name!r} dequantized to {x.shape}, expected {want}")
    return x.reshape(want)


def _fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer.ggml.") and k != "tokenizer.ggml.model":
            continue  # the vocabulary is the tokenizer's business (and slow to unpack)
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001 -- an odd field we never read must not block loading
            continue
    return out


# ``{arch}.rope.scaling.yarn_*`` -> the HF ``rope_scaling`` key (llama.cpp's convert_hf_to_gguf.py writes them from
# these HF keys; ``yarn_attn_factor`` comes from "attention_factor").
_YARN_KEYS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",
}


def _rope_scaling(meta: dict, a: str, path: str) -> tuple | None:
    """``ModelConfig.rope_scaling`` items from the ``{arch}.rope.scaling.*`` keys; keys that would change the rotary
    embedding in a way HF's YaRN (``layers.rope_inv_freq``) does not model are rejected, never dropped."""
    kind = meta.get(a + "rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"{path}: {a}rope.scaling.type={kind!r} is not supported (none, linear, yarn)")
    # A rotary attention factor outside YaRN (llama.cpp reads it for a few architectures): not modelled here.
    attn = float(meta.get(a + "rope.scaling.attn_factor", 1.0))
    if attn != 1.0:
        raise ValueError(
            f"{path}: GGUF metadata key {a + 'rope.scaling.attn_factor'!r} = {attn} is not supported"
        )
    if kind == "none":
        return None
    if a + "rope.scaling.factor" not in meta:
        raise ValueError(f"{path}: GGUF metadata key {a + 'rope.scaling.factor'!r} is missing")
    items: dict = {"rope_type": kind, "factor": float(meta[a + "rope.scaling.factor"])}
    if a + "rope.scaling.original_context_length" in meta:
        items["original_max_position_embeddings"] = int(meta[a + "rope.scaling.original_context_length"])
    present = sorted(k for k in meta if k.startswith(a + "rope.scaling.yarn_"))
    if kind != "yarn" and present:
        raise ValueError(f"{path}: GGUF metadata keys {present} are set but rope.scaling.type is {kind!r}")
    for gguf_key, hf_key in _YARN_KEYS.items():
        if a + "rope.scaling." + gguf_key in meta:
            items[hf_key] = float(meta[a + "rope.scaling." + gguf_key])
    # The extrapolation mix (llama.cpp's ext_factor; HF's YaRN has none, i.e. 1) and the log multiplier of the
    # attention factor (DeepSeek's mscale_all_dim; 0 = off, llama.cpp's default) change the math: refuse them.
    ext = meta.get(a + "rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:
        raise ValueError(
            f"{path}: GGUF metadata key {a + 'rope.scaling.yarn_ext_factor'!r} = {float(ext)} is not supported (only "
            "1, HF's YaRN); load the model's HF folder instead"
        )
    log_mul = meta.get(a + "rope.scaling.yarn_log_multiplier")
    if log_mul is not None and float(log_mul) != 0.0:
        raise ValueError(
            f"{path}: GGUF metadata key {a + 'rope.scaling.yarn_log_multiplier'!r} = {float(log_mul)} is not "
            "supported (a log-scaled YaRN attention factor); load the model's HF folder instead"
        )
    return tuple(sorted(items.items()))


def config_from_gguf(meta: dict, tensor_names: set[str], path: str = "", **overrides) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (``general.architecture`` and its ``{arch}.*`` keys).

    Args:
      meta: metadata key -> value. tensor_names: the file's tensor names (the head is tied when there is no
        ``output.weight``; qwen2 needs q/k/v biases).
      **overrides: ModelConfig fields (``param_dtype``, ``dtype``, ...).
    Raises:
      ValueError: naming the file and the missing / unsupported key.
    """

    def need(key):
        if key not in meta:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
        return meta[key]

    arch = need("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; supported: {ARCHS}")
    a = arch + "."
    for k in _UNSUPPORTED_KEYS:
        if a + k in meta:
            raise ValueError(f"{path}: GGUF metadata key {a + k!r} is set; this decoder does not support it")
    heads = int(need(a + "attention.head_count"))
    hidden = int(need(a + "embedding_length"))
    head_dim = int(meta.get(a + "attention.key_length", hidden // heads))
    if int(meta.get(a + "attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: {a}attention.value_length differs from key_length; not supported")
    rot = meta.get(a + "rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(
            f"{path}: {a}rope.dimension_count={rot} != head_dim {head_dim} (partial RoPE unsupported)"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: tensor 'rope_freqs.weight' (llama3-style frequency factors) is not supported; load the "
            "HF folder instead (its config.json rope_scaling is)"
        )
    scaling = _rope_scaling(meta, a, path)
    if "token_embd.weight" not in tensor_names:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = need(
        a + "vocab_size"
    )  # read_gguf_config / load_gguf fill it from token_embd when a file lacks it
    if arch == "qwen2" and "blk.0.attn_q.bias" not in tensor_names:
        raise ValueError(f"{path}: qwen2 file without 'blk.0.attn_q.bias' (qwen2 has q/k/v biases)")
    fields = dict(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need(a + "feed_forward_length")),
        num_layers=int(need(a + "block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(a + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(meta.get(a + "context_length", 32768)),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def read_gguf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file (no tensor is dequantized)."""
    import gguf

    path = os.fspath(path)
    reader = _open(path, gguf)
    return _config(reader, path, overrides)


def _open(path: str, gguf):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except ValueError as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def _config(reader, path: str, overrides: dict) -> ModelConfig:
    tensors = {t.name: t for t in reader.tensors}
    meta = _fields(reader)
    if meta.get("general.architecture") in ARCHS and meta["general.architecture"] + ".vocab_size" not in meta:
        # Older files: the vocabulary size is the embedding's row count (numpy [vocab, d]).
        meta[meta["general.architecture"] + ".vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    return config_from_gguf(meta, set(tensors), path, **overrides)


def _gguf_names(cfg: ModelConfig, path: tuple[str, ...]) -> list[str]:
    if path[0] == "layers":
        return [f"blk.{i}.{LAYER_NAMES[path[1]]}" for i in range(cfg.num_layers)]
    return [TOP_NAMES[path[0]]]


def load_gguf(path: str | os.PathLike, mesh=None, rules=sharding.DEFAULT_RULES, **overrides):
    """Loads a llama / qwen2 / qwen3 GGUF file straight into (sharded) decoder parameters.

    Args:
      path: the ``.gguf`` file.
      mesh: parameters are laid out by ``rules`` on it; ``None`` = one device.
      **overrides: ModelConfig fields, e.g. ``param_dtype="bfloat16"``.
    Returns:
      ``(cfg, graphdef, params)``.
    Raises:
      FileNotFoundError: no such file. ValueError: naming the file and the bad key / tensor / type.
    """
    import gguf

    from comprl_jax.models.hf_io import place_params

    path = os.fspath(path)
    reader = _open(path, gguf)
    cfg = _config(reader, path, overrides)
    tensors = {t.name: t for t in reader.tensors}
    used: set[str] = set()

    def host(name: str, our: str) -> np.ndarray:
        """One tensor dequantized, unpermuted and in our [in, out] layout (float32)."""
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} is missing (needed for {our})")
        x = dequantize(tensors[name], path)
        if cfg.arch == "llama" and our in ("q_proj", "q_bias"):
            x = unpermute_qk(x, cfg.num_heads)
        elif cfg.arch == "llama" and our in ("k_proj", "k_bias"):
            x = unpermute_qk(x, cfg.num_kv_heads)
        return x.T if our in _TRANSPOSED else x

    def reader_fn(ppath, shape, dtype):
        names = _gguf_names(cfg, ppath)
        used.update(names)
        our = ppath[-1]
        per = shape[1:] if ppath[0] == "layers" else shape
        for n in names:
            if n not in tensors:
                raise ValueError(f"{path}: tensor {n!r} is missing (needed for {'/'.join(ppath)})")
            got = tuple(int(s) for s in reversed(tensors[n].shape))
            got = tuple(reversed(got)) if our in _TRANSPOSED else got
            if got != tuple(per):
                raise ValueError(
                    f"{path}: tensor {n!r} has shape {got} in our layout, the metadata implies {per}"
                )
        full: list[np.ndarray] = []  # dequantized once per parameter, shared by all of its device shards

        def read(idx):
            if not full:
                xs = [host(n, our) for n in names]
                full.append((np.stack(xs) if ppath[0] == "layers" else xs[0]).astype(dtype))
            return np.ascontiguousarray(full[0][idx])

        return read

    graphdef, params = place_params(cfg, reader_fn, mesh, rules)
    extra = sorted(set(tensors) - used - ({"token_embd.weight"} if cfg.tie_word_embeddings else set()))
    if extra:
        raise ValueError(f"{path}: tensors {extra[:5]} (of {len(extra)}) are not used by this decoder")
    return cfg, graphdef, params
