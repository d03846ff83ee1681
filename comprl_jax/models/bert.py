"""A BERT encoder (all-MiniLM-L6-v2 and friends) in Flax NNX, loaded from a Hugging Face folder.

Post-LayerNorm BERT: embeddings (word + absolute position + token type) -> LayerNorm, then per layer
``x = LN(x + Attn(x)); x = LN(x + FFN_gelu(x))``. Layer parameters are stacked ``[L, ...]`` and run by one
``lax.scan`` (same layout idea as the decoder). Weights are stored ``[in, out]``; HF stores Linear weights
``[out, in]`` and :func:`load_bert` transposes them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_hf_config(cls, d: dict, source: str = "config.json") -> BertConfig:
        """Validate and convert a HF BERT ``config.json`` dict; unsupported values raise naming the key."""
        checks = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
        for key, want in checks.items():
            if d.get(key, want) != want:
                raise ValueError(f"{source}: unsupported {key}={d[key]!r} (supported: {want!r})")
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=d["num_attention_heads"],
                intermediate_size=d["intermediate_size"],
                max_position_embeddings=d["max_position_embeddings"],
                type_vocab_size=d.get("type_vocab_size", 2),
                layer_norm_eps=d.get("layer_norm_eps", 1e-12),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


# Our parameter name -> (HF name template, is a Linear weight to transpose). "{i}" = layer index.
_EMBED_NAMES = {
    "word_emb": "embeddings.word_embeddings.weight",
    "pos_emb": "embeddings.position_embeddings.weight",
    "type_emb": "embeddings.token_type_embeddings.weight",
    "emb_ln_scale": "embeddings.LayerNorm.weight",
    "emb_ln_bias": "embeddings.LayerNorm.bias",
}
_LAYER_NAMES = {
    "wq": ("attention.self.query.weight", True),
    "bq": ("attention.self.query.bias", False),
    "wk": ("attention.self.key.weight", True),
    "bk": ("attention.self.key.bias", False),
    "wv": ("attention.self.value.weight", True),
    "bv": ("attention.self.value.bias", False),
    "wo": ("attention.output.dense.weight", True),
    "bo": ("attention.output.dense.bias", False),
    "ln1_scale": ("attention.output.LayerNorm.weight", False),
    "ln1_bias": ("attention.output.LayerNorm.bias", False),
    "w_in": ("intermediate.dense.weight", True),
    "b_in": ("intermediate.dense.bias", False),
    "w_out": ("output.dense.weight", True),
    "b_out": ("output.dense.bias", False),
    "ln2_scale": ("output.LayerNorm.weight", False),
    "ln2_bias": ("output.LayerNorm.bias", False),
}


class BertEncoder(nnx.Module):
    """BERT encoder built from arrays (see :func:`load_bert`).

    Args:
      cfg: the config.
      arrays: our names (``_EMBED_NAMES`` keys, and ``_LAYER_NAMES`` keys stacked ``[L, ...]``) -> arrays.
    """

    def __init__(self, cfg: BertConfig, arrays: dict[str, np.ndarray]):
        self.cfg = cfg
        for name in (*_EMBED_NAMES, *_LAYER_NAMES):
            setattr(self, name, nnx.Param(jnp.asarray(arrays[name], jnp.float32)))

    def __call__(self, ids: jax.Array, type_ids: jax.Array, mask: jax.Array) -> jax.Array:
        """Encode a right-padded batch.

        Args:
          ids: ``[B, T]`` int32 word-piece ids. type_ids: ``[B, T]`` int32 segment ids. mask: ``[B, T]`` bool valid.
        Returns:
          Last hidden state ``[B, T, D]`` float32 (rows of padding are meaningless).
        """
        cfg = self.cfg
        b, t = ids.shape
        h, dh = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        x = jnp.take(self.word_emb[...], ids, axis=0) + self.pos_emb[...][:t][None]
        x = x + jnp.take(self.type_emb[...], type_ids, axis=0)
        x = _layer_norm(x, self.emb_ln_scale[...], self.emb_ln_bias[...], cfg.layer_norm_eps)
        # Keys that are padding get -inf-like scores; every row has >= 1 valid key ([CLS]).
        bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]

        def layer(x, p):
            q = (x @ p["wq"] + p["bq"]).reshape(b, t, h, dh)
            k = (x @ p["wk"] + p["bk"]).reshape(b, t, h, dh)
            v = (x @ p["wv"] + p["bv"]).reshape(b, t, h, dh)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh) + bias
            attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, -1)
            x = _layer_norm(x + attn @ p["wo"] + p["bo"], p["ln1_scale"], p["ln1_bias"], cfg.layer_norm_eps)
            ff = jax.nn.gelu(x @ p["w_in"] + p["b_in"], approximate=False) @ p["w_out"] + p["b_out"]
            return _layer_norm(x + ff, p["ln2_scale"], p["ln2_bias"], cfg.layer_norm_eps), None

        x, _ = jax.lax.scan(layer, x, {k: getattr(self, k)[...] for k in _LAYER_NAMES})
        return x


def load_bert(folder: str | os.PathLike) -> tuple[BertConfig, BertEncoder]:
    """Load ``config.json`` + ``model.safetensors`` (never a pickle) from a HF BERT folder.

    Returns:
      ``(cfg, module)``. Raises FileNotFoundError / ValueError naming the missing file or tensor.
    """
    from safetensors import safe_open

    folder = os.fspath(folder)
    cfg_path, st_path = os.path.join(folder, "config.json"), os.path.join(folder, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} is missing (BERT folder needs config.json and model.safetensors)")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = BertConfig.from_hf_config(json.load(f), source=cfg_path)
    with safe_open(st_path, framework="numpy") as f:
        names = set(f.keys())
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in names else ""

        def get(name: str) -> np.ndarray:
            if prefix + name not in names:
                raise ValueError(f"{st_path}: missing tensor {prefix + name!r}")
            return f.get_tensor(prefix + name).astype(np.float32)

        arrays = {ours: get(hf) for ours, hf in _EMBED_NAMES.items()}
        for ours, (hf, transpose) in _LAYER_NAMES.items():
            per_layer = [get(f"encoder.layer.{i}.{hf}") for i in range(cfg.num_layers)]
            arrays[ours] = np.stack([w.T if transpose else w for w in per_layer])
    return cfg, BertEncoder(cfg, arrays)
