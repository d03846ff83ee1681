"""Experience store of Complementary RL (SPEC §3-5): bank, index, retrieval, extractor ops, merge, manager."""

from comprl_jax.experience.bank import BankConfig, Entry, ExperienceBank, RWLock
from comprl_jax.experience.buffer import BufferConfig, ExtractorBatch, ExtractorBuffer, count_aware_weights
from comprl_jax.experience.index import IndexConfig, PartitionIndex
from comprl_jax.experience.manager import (
    DistillRequest,
    ExperienceManager,
    ManagerConfig,
    Retrieval,
    configs_from_dict,
)
from comprl_jax.experience.ops import Op, distill_prompt, merge_prompt, parse_ops, refine_prompt
from comprl_jax.experience.retrieval import RetrievalConfig, diversify, eq6_scores, format_experience

__all__ = [
    "BankConfig",
    "BufferConfig",
    "DistillRequest",
    "Entry",
    "ExperienceBank",
    "ExperienceManager",
    "ExtractorBatch",
    "ExtractorBuffer",
    "IndexConfig",
    "ManagerConfig",
    "Op",
    "PartitionIndex",
    "RWLock",
    "Retrieval",
    "RetrievalConfig",
    "configs_from_dict",
    "count_aware_weights",
    "distill_prompt",
    "diversify",
    "eq6_scores",
    "format_experience",
    "merge_prompt",
    "parse_ops",
    "refine_prompt",
]
