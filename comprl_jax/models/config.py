"""Decoder configuration: one frozen dataclass for the Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama family.

``ModelConfig`` is hashable so it can be a static argument of ``jax.jit``. ``from_hf_config`` reads a Hugging Face
``config.json`` dict (both the transformers-4 spelling ``rope_theta`` + ``rope_scaling`` and the transformers-5
``rope_parameters``) and refuses anything this decoder would silently get wrong, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")
# Token dispatch of the mixture-of-experts layers (``models.moe``): "dropless" is exact (every token reaches its
# top-k experts); "capacity" gives each expert a fixed number of slots per batch row (GShard style, expert
# parallel under a mesh) and drops assignments past it; "gmm" is exact too: tokens sorted by expert over the whole
# local batch, the expert matmuls through the megablox grouped matmul on TPU (``jax.lax.ragged_dot`` elsewhere), and
# under a mesh with an expert axis an all-to-all token exchange in ``shard_map``; "gmm_interpret" is "gmm" with the
# Pallas kernel in interpret mode on any platform (CPU tests of the TPU kernel).
MOE_DISPATCH = ("dropless", "capacity", "gmm", "gmm_interpret")
MOE_EXCHANGE_TOKENS = 4096  # default rounds of the gmm exchange (ModelConfig.moe_exchange_tokens)
# RoPE scaling types implemented in ``layers.rope_inv_freq`` ("default" = none).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")
# Attention kernel of the full-sequence forward (``models.attention``): "auto" picks by the platform compiled for
# (TPU: splash, GPU: cudnn in bf16/f16, else xla); "xla" is the portable reference.
ATTENTION = ("auto", "xla", "cudnn", "splash")

# Keys of HF configs that do not change the math of this decoder (bookkeeping, generation defaults, training-only
# options). Anything outside this set and the keys read below is rejected, so a new architectural knob is never
# silently dropped.
_IGNORED_KEYS = frozenset(
    {
        "architectures",
        "attention_dropout",  # we never use attention dropout (RL fine-tuning of pretrained models)
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "transformers_version",
        "use_cache",
        "torch_dtype",  # storage dtype of the checkpoint; compute/param dtypes come from ModelConfig
        "dtype",
        "max_window_layers",  # only meaningful with use_sliding_window=true, which we reject
        "sliding_window",
        "_name_or_path",
        "is_llama_config",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tokenizer_class",
        "model_name",
        "name_or_path",
        "transformers.js_config",
        "output_router_logits",  # HF training switch: whether forward returns router logits / adds the aux loss
    }
)


# The shipped real configs (presets/*.json beside this module, package data).
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "presets")
ALIASES = {
    "qwen3-4b": "qwen3-4b-thinking-2507",
    "qwen2.5-7b": "qwen2.5-7b-instruct",
    "qwen3-30b-a3b": "qwen3-30b-a3b-instruct-2507",
}


def hf_config_dict(name_or_path: str) -> dict:
    """The ``config.json`` dict of a shipped model (``comprl_jax/models/presets/<name>.json``), a json file, or a HF folder."""
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    elif not os.path.exists(path):
        path = os.path.join(CONFIG_DIR, ALIASES.get(name_or_path, name_or_path) + ".json")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))
        raise FileNotFoundError(f"model config {name_or_path!r} is neither a file/folder nor one of {known}")
    with open(path) as f:
        return json.load(f)


def named_config(name_or_path: str, **overrides) -> ModelConfig:
    """``ModelConfig`` of a shipped model name (e.g. "qwen2.5-7b-instruct"), a config.json path or a HF folder."""
    return ModelConfig.from_hf_config(hf_config_dict(name_or_path), **overrides)


def _rope_from_hf(d: dict) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling items) from either HF spelling; validates the scaling type."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    key = "rope_parameters" if params is not None else "rope_scaling"
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"config key 'rope_parameters' must be a dict, got {params!r}")
        if "full_attention" in params or "sliding_attention" in params:
            raise ValueError("config key 'rope_parameters': per-layer-type RoPE parameters are not supported")
        params = dict(params)
        theta = params.pop("rope_theta", theta)
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    theta = 10000.0 if theta is None else float(theta)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ValueError(f"config key {key!r} must be a dict or null, got {scaling!r}")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", scaling.pop("type", None))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config key {key!r} has unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}"
        )
    scaling.pop("rope_theta", None)
    if "factor" not in scaling:
        raise ValueError(f"config key {key!r} ({kind}) needs a 'factor'")
    items = tuple(sorted({**scaling, "rope_type": kind}.items()))
    return theta, items


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder. Frozen and hashable (a static jit argument).

    Attributes:
      arch: "qwen2" (qkv bias) | "qwen3" (per-head q/k RMSNorm) | "llama" (neither) | "qwen3_moe" (Qwen3
        attention; the MLP of the layers in :attr:`moe_layers` is a mixture of experts).
      rope_scaling: ``None`` or a tuple of sorted ``(key, value)`` items including ``("rope_type", kind)``.
      param_dtype: dtype parameters are stored in; ``dtype``: matmul compute dtype (attention softmax, norms and
        logits are always float32).
      num_experts, num_experts_per_tok, moe_intermediate_size: experts per MoE layer, experts each token is routed
        to (top-k), and each expert's SwiGLU width. ``num_experts = 0``: no MoE layer (every dense model).
      norm_topk_prob: renormalise the top-k router probabilities to sum to 1 (Qwen3-30B-A3B: true).
      decoder_sparse_step, mlp_only_layers: layer ``i`` is MoE iff ``i not in mlp_only_layers`` and
        ``(i + 1) % decoder_sparse_step == 0`` (HF's rule); the others keep the dense SwiGLU of
        ``intermediate_size``.
      router_aux_loss_coef: the checkpoint's load-balancing coefficient (kept for round trips; the RL update has
        its own switch, off by default).
      moe_dispatch: "dropless" (exact), "capacity" (``capacity_factor`` x the even share of slots per expert
        and batch row; assignments past it are dropped), or "gmm" / "gmm_interpret" (exact: grouped matmul, the
        megablox kernel on TPU, expert-parallel all-to-all under a mesh; see :data:`MOE_DISPATCH`). Not part of
        the checkpoint: a run-time choice.
      moe_exchange_tokens: "gmm" with an expert axis of ``P`` devices: a device's tokens go through the
        all-to-all in rounds of at most this many (each round rematerialised in the backward), because the
        exchange buffer is the static worst case, ``P x k`` rows per token of a round: over a 64k-token
        sequence and 8 expert shards that alone is ~250 GB (Qwen3-30B-A3B); 0 = one round. Run-time, exact.
      attention: the full-sequence forward's attention backend, one of :data:`ATTENTION` (``models.attention``).
        Not part of the checkpoint: a run-time choice (never written to config.json).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    dtype: str = "float32"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    moe_dispatch: str = "dropless"
    capacity_factor: float = 1.25
    moe_exchange_tokens: int = MOE_EXCHANGE_TOKENS
    attention: str = "auto"

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"model arch {self.arch!r} is not supported; use one of {ARCHS}")
        # a list from json would make the config unhashable (it is a static jit argument)
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        self._check_moe()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        for key in ("param_dtype", "dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"ModelConfig.{key}={getattr(self, key)!r}; use one of {DTYPES}")
        if self.attention not in ATTENTION:
            raise ValueError(f"ModelConfig.attention={self.attention!r}; use one of {ATTENTION}")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type")
            if kind not in ROPE_TYPES or kind == "default":
                raise ValueError(f"rope_scaling type {kind!r} is not supported; use one of {ROPE_TYPES[1:]}")

    def _check_moe(self):
        if self.arch != "qwen3_moe":
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} needs arch 'qwen3_moe', got {self.arch!r}")
            return
        if self.num_experts < 0:
            raise ValueError(f"config key 'num_experts' must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"config key 'num_experts_per_tok' must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size < 1:
                raise ValueError(
                    f"config key 'moe_intermediate_size' must be >= 1, got {self.moe_intermediate_size}"
                )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"config key 'decoder_sparse_step' must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"config key 'mlp_only_layers' has layer ids {bad} outside [0, {self.num_layers})"
            )
        if self.moe_dispatch not in MOE_DISPATCH:
            raise ValueError(f"ModelConfig.moe_dispatch={self.moe_dispatch!r}; use one of {MOE_DISPATCH}")
        if not self.capacity_factor > 0:
            raise ValueError(f"ModelConfig.capacity_factor must be > 0, got {self.capacity_factor}")
        if self.moe_exchange_tokens < 0:
            raise ValueError(f"ModelConfig.moe_exchange_tokens must be >= 0, got {self.moe_exchange_tokens}")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has a mixture-of-experts MLP (HF ``Qwen3MoeDecoderLayer``'s rule)."""
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Ids of the layers with an MoE MLP (their expert weights are stacked in this order)."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Ids of the layers with the dense SwiGLU MLP (all of them for a dense model)."""
        return tuple(i for i in range(self.num_layers) if not self.is_moe_layer(i))

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, d: dict, **overrides) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dict.

        Args:
          d: the parsed json.
          **overrides: ModelConfig fields to set afterwards (e.g. ``param_dtype="bfloat16"``).
        Raises:
          ValueError: naming the key, for an unknown key or an unsupported value.
        """
        d = dict(d)
        arch = d.get("model_type")
        if arch not in ARCHS:
            raise ValueError(f"config key 'model_type' is {arch!r}; supported: {ARCHS}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"config key 'hidden_act' is {d['hidden_act']!r}; only 'silu' (SwiGLU) is supported"
            )
        if d.get("use_sliding_window", False):
            raise ValueError(
                "config key 'use_sliding_window' is true; sliding-window attention is not supported"
            )
        if any(t != "full_attention" for t in d.get("layer_types") or ()):
            raise ValueError(f"config key 'layer_types' must be all 'full_attention', got {d['layer_types']}")
        if d.get("attention_bias", False) and arch != "qwen2":
            # Llama/Qwen3 attention_bias also adds an o_proj bias, which this decoder does not have.
            raise ValueError(f"config key 'attention_bias' is true for {arch}; not supported")
        if d.get("mlp_bias", False):
            raise ValueError("config key 'mlp_bias' is true; not supported")
        if d.get("pretraining_tp", 1) != 1:
            raise ValueError(f"config key 'pretraining_tp' is {d['pretraining_tp']}; only 1 is supported")
        if d.get("rope_interleaved", False):
            raise ValueError(
                "config key 'rope_interleaved' is true; only the rotate-half RoPE layout is supported"
            )
        if d.get("quantization_config") is not None:
            raise ValueError(
                "config key 'quantization_config' is set; quantized checkpoints are not supported"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in d:
                raise ValueError(f"config key {key!r} is missing")
        read = {
            "model_type", "hidden_act", "use_sliding_window", "layer_types", "attention_bias", "mlp_bias",
            "pretraining_tp", "rope_interleaved", "quantization_config", "vocab_size", "hidden_size",
            "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
            "max_position_embeddings",
        }  # fmt: skip
        if arch == "qwen3_moe":
            read |= set(_MOE_KEYS)
        unknown = sorted(set(d) - read - _IGNORED_KEYS)
        if unknown:
            raise ValueError(
                f"config keys {unknown} are not supported by comprl_jax.models (unknown to this decoder)"
            )
        theta, scaling = _rope_from_hf(d)
        heads = int(d["num_attention_heads"])
        fields = dict(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            # transformers defaults: Qwen2/Qwen3 untied, Llama untied.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        )
        if arch == "qwen3_moe":
            fields.update(_moe_from_hf(d))
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict:
        """A ``config.json`` dict that ``transformers`` (4.x legacy keys, also read by 5.x) loads."""
        arch_name = {
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
        }
        d = {
            "architectures": [arch_name[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.param_dtype,
        }
        if self.arch != "qwen2":
            d["attention_bias"] = False
        if self.arch == "qwen3_moe":
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                use_sliding_window=False,
            )
        return d

    @classmethod
    def tiny(cls, arch: str = "qwen3", **overrides) -> ModelConfig:
        """A 2-layer, d_model 64 config of the given family for CPU tests (GQA 4 query / 2 kv heads).

        ``"qwen3_moe"``: 8 experts of width 64, top-2, renormalised: 2 x 64 = 128 active MLP units per token, the
        dense tiny model's ``intermediate_size``.
        """
        fields = dict(
            arch=arch,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position_embeddings=2048,
        )
        if arch == "qwen3_moe":
            fields.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
        fields.update(overrides)
        return cls(**fields)


# HF ``Qwen3MoeConfig`` keys this decoder reads (``num_local_experts`` is transformers 5's spelling of
# ``num_experts``; both are accepted).
_MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
)


def _moe_from_hf(d: dict) -> dict:
    """ModelConfig fields of a ``qwen3_moe`` config.json (HF defaults where a key is absent)."""
    if "num_experts" in d and "num_local_experts" in d and d["num_experts"] != d["num_local_experts"]:
        raise ValueError(
            f"config keys 'num_experts'={d['num_experts']} and 'num_local_experts'={d['num_local_experts']} disagree"
        )
    experts = d.get("num_experts", d.get("num_local_experts", 128))
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
    )
