"""Extractor capacity (paper: Qwen3-30B-A3B-Instruct-2507 as the extractor instead of Qwen3-4B, +5% average) on
the 3-task mixture.

What runs now:
* Paper scale: the extractor is `Qwen/Qwen3-30B-A3B-Instruct-2507`, a Qwen3-MoE (48 layers, 128 experts, top-8,
  30.5 B parameters, 3.3 B active) run by comprl_jax's MoE decoder (`comprl_jax/models/moe.py`; expert weights
  sharded over the fsdp devices). No hub is reachable from the code: download the HF folder and pass it, e.g.
    python launch/train.py --config=configs/extractor_capacity.py --workdir=runs/cap \
        --config.actor.model=/models/Qwen2.5-7B-Instruct \
        --config.extractor.model=/models/Qwen3-30B-A3B-Instruct-2507
  Without a folder the model load fails with a message naming `extractor.model` and saying how to pass one.
  Memory plan (v5p-64, 8xH100/H200): WORKSPACE.md, "Mixture of experts"; `launch/plan_memory.py --paper=v5p-64
  --study=capacity`. On TPU add `--config.extractor.moe_dispatch=gmm` (the model's own "dropless" dispatch does not
  lower there; gmm's expert exchange goes in rounds of `extractor.moe_exchange_tokens`, and the plan with
  `--moe_dispatch=gmm` fits a v5p-64).
* `:tiny` (this CPU): the actor is the tiny dense model, the extractor a random-init tiny MoE (`tiny_moe`: 2 layers,
  8 experts, top-2, the same 128 active MLP units per token) over the run's own SentencePiece vocabulary, so the
  extractor's distillation sampling and its CISPO update run through the MoE layer:
    python launch/train.py --config=configs/extractor_capacity.py:tiny --workdir=runs/cap_tiny
  -> one progress line per step; metrics.jsonl rows carry `extractor/*` once the extractor buffer fills.
  Compare with the dense tiny extractor: add `--config.extractor.model=tiny`.
"""

from comprl_jax.config import (
    TASKS3,
    apply_method,
    apply_scale,
    apply_tasks,
    base_config,
    finalize,
    parse_variant,
)

PAPER_EXTRACTOR = "Qwen/Qwen3-30B-A3B-Instruct-2507"
TINY_EXTRACTOR = "tiny_moe"


def get_config(arg: str | None = None):
    # build()'s steps, with the extractor chosen after the scale: apply_scale sets both roles to "tiny".
    scale, method, _ = parse_variant(arg)
    c = base_config()
    c.experiment = "extractor_capacity"
    apply_tasks(c, TASKS3)  # Table 1's mixture: only the extractor differs from multitask3
    c.extractor.model = PAPER_EXTRACTOR
    apply_scale(c, scale)
    if scale == "tiny":
        c.extractor.model = TINY_EXTRACTOR
    if method is not None:
        apply_method(c, method)
    return finalize(c)
