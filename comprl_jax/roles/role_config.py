"""Config sections ``actor`` and ``extractor`` as dataclasses (``runtime.fields.from_section`` builds them): a key
of the section is a field here, and its value is checked here, once.

Nested sections: ``sampling`` (:class:`~comprl_jax.sampling.SamplingParams`), ``loss``
(:class:`~comprl_jax.rl.losses.ActorLossConfig` / :class:`~comprl_jax.rl.losses.ExtractorLossConfig`) and the
extractor's ``buffer`` (:class:`~comprl_jax.experience.buffer.BufferConfig`). The comments beside the keys in
``comprl_jax/config/schema.py`` document them (``launch/train.py --print_config`` prints them).
"""

from __future__ import annotations

import dataclasses

from comprl_jax.experience.buffer import BufferConfig
from comprl_jax.models.config import ATTENTION, MOE_DISPATCH, MOE_EXCHANGE_TOKENS
from comprl_jax.rl.advantages import ADV_NORMS
from comprl_jax.rl.losses import ActorLossConfig, ExtractorLossConfig
from comprl_jax.rl.train_state import OptimConfig
from comprl_jax.runtime.fields import check
from comprl_jax.sampling import SamplingParams

DTYPES = ("float32", "bfloat16")  # param_dtype and dtype (models.config.DTYPES allows these)
DISTILL_FROM = ("all", "guided")
DISTILL_OVERLAPS = ("auto", "rollout", "update")


@dataclasses.dataclass(frozen=True)
class RoleConfig:
    """What both roles share: the model, its optimizer, micro-batching, precision, decoding and memory."""

    model: str = "tiny"
    train: bool = True
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch: int = 8
    sampling: SamplingParams = SamplingParams()
    constrained: bool = False
    remat: bool = True
    logits_chunk: int = 2048
    trainable_layers: int = 0
    param_dtype: str = "float32"
    dtype: str = "bfloat16"
    rollout_tensor: int = 0
    kv_cache: str = "dense"  # the sampler's KV cache (sampling.service.KV_CACHES)
    pack: bool = True  # sequence packing of the update batches (roles.packing)
    attention: str = "auto"
    moe_dispatch: str = ""  # "" = the model's own (models.config.MOE_DISPATCH)
    moe_exchange_tokens: int = MOE_EXCHANGE_TOKENS

    def __post_init__(self):
        check(self.lr > 0, "lr", "must be positive", self.lr)
        check(self.micro_batch >= 1, "micro_batch", "must be >= 1", self.micro_batch)
        check(
            self.trainable_layers >= 0,
            "trainable_layers",
            "must be >= 0 (0 = every layer trains)",
            self.trainable_layers,
        )
        check(
            not self.trainable_layers or self.weight_decay == 0,
            "weight_decay",
            f"must be 0 with {{section}}.trainable_layers={self.trainable_layers} (decay would change the frozen weights)",
            self.weight_decay,
        )
        for key in ("param_dtype", "dtype"):
            check(getattr(self, key) in DTYPES, key, f"must be one of {DTYPES}", getattr(self, key))
        check(
            self.rollout_tensor >= 0,
            "rollout_tensor",
            "must be >= 0 (0 = chosen by memory)",
            self.rollout_tensor,
        )
        check(self.kv_cache in ("dense", "paged"), "kv_cache", "must be 'dense' or 'paged'", self.kv_cache)
        check(self.attention in ATTENTION, "attention", f"must be one of {ATTENTION}", self.attention)
        check(
            self.moe_dispatch in ("", *MOE_DISPATCH),
            "moe_dispatch",
            f"must be '' (the model's own) or one of {MOE_DISPATCH}",
            self.moe_dispatch,
        )
        check(
            self.moe_exchange_tokens >= 0,
            "moe_exchange_tokens",
            "must be >= 0 (0 = one round)",
            self.moe_exchange_tokens,
        )
        check(self.logits_chunk >= 0, "logits_chunk", "must be >= 0 (0 = full logits)", self.logits_chunk)

    @property
    def optim(self) -> OptimConfig:
        """The optimizer's settings (AdamW moments at their defaults)."""
        return OptimConfig(lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip)


@dataclasses.dataclass(frozen=True)
class ActorConfig(RoleConfig):
    """Config section ``actor``: the policy (SPEC §2, §7)."""

    adv_norm: str = "mean_std"
    adv_eps: float = 1e-6
    loss: ActorLossConfig = ActorLossConfig()
    warmup_steps: int = 0
    updates_per_batch: int = 1
    self_distill_coef: float = 0.0
    actor_critic: bool = False
    # With constrained decoding of a fixed action set: the reply may open with <think>...</think> of at most this
    # many lowercase characters (0 = the answer alone). The warm actor restates the lesson that applies there.
    think_chars: int = 0

    def __post_init__(self):
        super().__post_init__()
        check(self.think_chars >= 0, "think_chars", "must be >= 0 (0 = no think)", self.think_chars)
        check(self.adv_norm in ADV_NORMS, "adv_norm", f"must be one of {ADV_NORMS}", self.adv_norm)
        check(self.updates_per_batch >= 1, "updates_per_batch", "must be >= 1", self.updates_per_batch)
        check(
            self.self_distill_coef >= 0, "self_distill_coef", "must be >= 0 (0 = off)", self.self_distill_coef
        )


@dataclasses.dataclass(frozen=True)
class ExtractorConfig(RoleConfig):
    """Config section ``extractor``: the experience extractor (SPEC §3-4)."""

    loss: ExtractorLossConfig = ExtractorLossConfig()
    buffer: BufferConfig = BufferConfig()
    distill_from: str = "all"
    distill_overlap: str = "auto"
    max_context: int = 65536
    rows_per_call: int = 0
    transcript_chars: int = 60000

    def __post_init__(self):
        super().__post_init__()
        check(
            self.distill_from in DISTILL_FROM,
            "distill_from",
            f"must be one of {DISTILL_FROM}",
            self.distill_from,
        )
        check(
            self.distill_overlap in DISTILL_OVERLAPS,
            "distill_overlap",
            f"must be one of {DISTILL_OVERLAPS}",
            self.distill_overlap,
        )
        check(
            self.rows_per_call >= 0,
            "rows_per_call",
            "must be >= 0 (0 = all rows at once)",
            self.rows_per_call,
        )
