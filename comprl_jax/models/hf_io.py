"""Hugging Face checkpoint I/O: ``config.json`` + ``*.safetensors`` <-> sharded decoder parameters.

Loading never materialises a full unsharded copy on one device: the abstract sharded state is built first
(``jax.eval_shape``), then every parameter is assembled with ``jax.make_array_from_callback``, whose callback
reads only the requested slice from the memory-mapped safetensors file (``safe_open(...).get_slice``). Our
weights are ``[in, out]`` and stacked over layers; HF stores one ``[out, in]`` tensor per layer, so a device's
slice is read layer by layer and transposed.

Qwen3-MoE: expert weights are stacked ``[L_moe, E, ...]`` on our side and stored one tensor per layer and expert
(``layers.{i}.mlp.experts.{j}.gate_proj.weight``, the layout of the released checkpoints, which ``transformers``
5 also writes and reads); a device holding experts ``E / fsdp`` reads only its experts' tensors. Dense-MLP
weights of a model that mixes dense and MoE layers are stacked over the dense layers only.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from comprl_jax.models.config import ModelConfig
from comprl_jax.models.decoder import abstract_decoder
from comprl_jax.runtime import sharding

INDEX_FILE = "model.safetensors.index.json"
# Our stacked per-layer parameter -> (HF tensor name inside ``layers.{i}.``, stored transposed?).
LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
# Stacked MoE parameter -> (HF tensor name inside ``layers.{i}.``, ``{j}`` = expert id, transposed?).
MOE_NAMES: dict[str, tuple[str, bool]] = {
    "router": ("mlp.gate.weight", True),
    "expert_gate": ("mlp.experts.{j}.gate_proj.weight", True),
    "expert_up": ("mlp.experts.{j}.up_proj.weight", True),
    "expert_down": ("mlp.experts.{j}.down_proj.weight", True),
}
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# Top-level parameter -> (HF name without the "model." prefix, transposed?). lm_head never has the prefix.
TOP_NAMES: dict[str, tuple[str, bool]] = {
    "embed": ("embed_tokens.weight", False),
    "final_norm": ("norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# Checkpoint tensors that carry no parameters of ours (old RoPE buffers).
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def _path_str(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _weight_map(folder: str) -> dict[str, str]:
    """HF tensor name -> absolute file path; every referenced file must exist."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        files = {n: os.path.join(folder, fn) for n, fn in wmap.items()}
        for fn in sorted(set(files.values())):
            if not os.path.exists(fn):
                raise FileNotFoundError(f"safetensors shard {fn} listed in {index} is missing")
        return files
    shards = sorted(fn for fn in os.listdir(folder) if fn.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors file (and no {INDEX_FILE}) in {folder}")
    files = {}
    for fn in shards:
        with safe_open(os.path.join(folder, fn), framework="numpy") as f:
            files.update(dict.fromkeys(f.keys(), os.path.join(folder, fn)))
    return files


def _hf_names(cfg: ModelConfig, path: tuple[str, ...], prefix: str) -> tuple[np.ndarray, bool]:
    """HF tensor names for one of our parameters and whether they are stored transposed.

    Returns a numpy object array shaped like our parameter's stacked axes: ``()`` for a top-level parameter,
    ``[L]`` for a per-layer one (``[L_dense]`` / ``[L_moe]`` for the dense / MoE MLP of a mixed model),
    ``[L_moe, E]`` for expert weights.
    """
    if path[0] == "layers":
        if path[1] in MOE_NAMES:
            name, tr = MOE_NAMES[path[1]]
            ids = cfg.moe_layers
            if "{j}" in name:
                names = [
                    [f"{prefix}layers.{i}.{name.format(j=j)}" for j in range(cfg.num_experts)] for i in ids
                ]
                return np.array(names, dtype=object).reshape(len(ids), cfg.num_experts), tr
        else:
            name, tr = LAYER_NAMES[path[1]]
            ids = cfg.dense_layers if path[1] in _DENSE_MLP else range(cfg.num_layers)
        return np.array([f"{prefix}layers.{i}.{name}" for i in ids], dtype=object), tr
    name, tr = TOP_NAMES[path[0]]
    return np.array(name if path[0] == "lm_head" else prefix + name, dtype=object), tr


def _norm_index(idx: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)) for s, n in zip(idx, shape, strict=True))


def place_params(cfg: ModelConfig, reader, mesh=None, rules=sharding.DEFAULT_RULES):
    """Builds the decoder's parameters straight into their (sharded) device layout from host reads.

    The abstract state is built first (``jax.eval_shape``); every parameter is then assembled with
    ``jax.make_array_from_callback``, so each device only receives its own slice and no full unsharded copy is
    ever put on one device. Shared by the safetensors (:func:`load_hf`) and GGUF (``gguf_io.load_gguf``) loaders.

    Args:
      cfg: the decoder config.
      reader: ``reader(path, shape, dtype) -> read``, called once per parameter with its path (e.g.
        ``("layers", "q_proj")``, ``("embed",)``), global shape and dtype; ``read(idx)`` gets a tuple of
        normalised slices (one per axis) and returns that block as a numpy array of ``dtype``.
      mesh: parameters are laid out by ``rules`` on it; ``None`` = one device.
    Returns:
      ``(graphdef, params)``.
    """
    graphdef, abstract = abstract_decoder(cfg)
    if mesh is not None:
        shardings = sharding.state_shardings(abstract, mesh, rules)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(
            lambda v: v.replace(one), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )

    def load_one(path, var, shard):
        shape = tuple(var.shape)
        read = reader(_path_str(path), shape, var.dtype)
        arr = jax.make_array_from_callback(
            shape, shard.get_value(), lambda idx: read(_norm_index(idx, shape))
        )
        return var.replace(arr)

    params = jax.tree_util.tree_map_with_path(
        load_one, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return graphdef, params


def load_hf(folder: str, mesh=None, rules=sharding.DEFAULT_RULES, **overrides):
    """Loads a HF model folder straight into (sharded) decoder parameters.

    Args:
      folder: holds ``config.json`` and one ``*.safetensors`` file or several with ``model.safetensors.index.json``.
      mesh: parameters are laid out by ``rules`` on it; ``None`` = one device.
      **overrides: ModelConfig fields, e.g. ``param_dtype="bfloat16"``, ``dtype="bfloat16"``.
    Returns:
      ``(cfg, graphdef, params)``.
    Raises:
      FileNotFoundError: naming a missing config or shard file. ValueError/KeyError: naming a bad key or tensor.
    """
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path} is missing")
    with open(cfg_path) as f:
        cfg = ModelConfig.from_hf_config(json.load(f), **overrides)
    files = _weight_map(folder)
    prefix = "model." if "model.embed_tokens.weight" in files else ""
    used: set[str] = set()

    with contextlib.ExitStack() as stack:
        handles: dict[str, object] = {}

        def tensor(name: str):
            if name not in files:
                raise KeyError(f"tensor {name!r} is missing from the checkpoint in {folder}")
            fn = files[name]
            if fn not in handles:
                handles[fn] = stack.enter_context(safe_open(fn, framework="numpy"))
            return handles[fn].get_slice(name)

        def reader(path, shape, dtype):
            names, tr = _hf_names(cfg, path, prefix)
            used.update(names.flat)
            lead = names.ndim  # stacked axes (layers, experts) ahead of the stored tensor's own axes
            per = shape[lead:]
            want = tuple(reversed(per)) if tr else tuple(per)
            for n in names.flat:
                got = tuple(tensor(n).get_shape())
                if got != want:
                    raise ValueError(f"tensor {n!r} has shape {got}, config.json implies {want}")

            def read(idx):
                block = names[
                    idx[:lead] + (Ellipsis,)
                ]  # this device's (layer, expert) tensors, an array even at 0-d
                inner = idx[lead:]
                hf_idx = tuple(reversed(inner)) if tr else inner
                out = None
                for ix in np.ndindex(block.shape):
                    x = tensor(block[ix])[hf_idx]
                    x = x.T if tr else x
                    if out is None:
                        out = np.empty(block.shape + x.shape, dtype)
                    out[ix] = x
                return np.ascontiguousarray(out)

            return read

        graphdef, params = place_params(cfg, reader, mesh, rules)
    extra = sorted(
        n
        for n in set(files) - used
        if not n.endswith(_SKIP_SUFFIXES) and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    if extra:
        raise ValueError(
            f"checkpoint tensors {extra[:5]} (of {len(extra)}) in {folder} are not used by this decoder"
        )
    return cfg, graphdef, params


def _host(x) -> np.ndarray:
    if not x.is_fully_addressable:  # multi-process: gather the global value (every process gets it)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _hf_tensors(cfg: ModelConfig, params, dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy tensor) pairs in a stable order, one parameter in host memory at a time."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in flat:
        path = _path_str(path)
        names, tr = _hf_names(cfg, path, "model.")
        x = _host(var.get_value() if isinstance(var, nnx.Variable) else var)
        x = x.astype(dtype) if dtype is not None else x
        for ix in np.ndindex(names.shape):
            yield names[ix], np.ascontiguousarray(x[ix].T if tr else x[ix])


def save_hf(folder: str, cfg: ModelConfig, params, dtype=None, max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes ``config.json`` + safetensors that ``transformers`` ``from_pretrained`` loads; past
    ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors`` with an index json.

    Only one shard's tensors are held in host memory at a time (a 7B model does not fit twice).

    Args:
      params: the decoder's ``nnx.State`` (sharded or not). dtype: storage dtype (default: as stored).
    Returns:
      the safetensors file names written (process 0; others gather and return ``[]``).
    """
    os.makedirs(folder, exist_ok=True)
    write = jax.process_index() == 0
    np_dtype = None if dtype is None else np.dtype(jax.numpy.dtype(dtype))
    tmp_names: list[str] = []
    wmap: dict[str, int] = {}
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        tmp = os.path.join(folder, f".shard-{len(tmp_names):05d}.safetensors.tmp")
        if write:
            save_file(shard, tmp, metadata={"format": "pt"})
        tmp_names.append(tmp)

    for name, x in _hf_tensors(cfg, params, np_dtype):
        if shard and size + x.nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = x
        wmap[name] = len(tmp_names)
        size += x.nbytes
        total += x.nbytes
    flush()
    if not write:
        return []
    n = len(tmp_names)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for tmp, fn in zip(tmp_names, names, strict=True):
        os.replace(tmp, os.path.join(folder, fn))
    if n > 1:
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump(
                {"metadata": {"total_size": total}, "weight_map": {t: names[i] for t, i in wmap.items()}}, f
            )
    hf = cfg.to_hf_config()
    hf["torch_dtype"] = str(np_dtype) if np_dtype is not None else cfg.param_dtype
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return names
