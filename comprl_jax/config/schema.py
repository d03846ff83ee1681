"""The run config's schema: every key with the paper's default (SPEC §2-6, §9) and the comment that documents it
(``launch/train.py --print_config`` shows these comments beside the values)."""

from __future__ import annotations

import ml_collections


def sampling(temperature: float, top_p: float, top_k: int, max_new_tokens: int) -> ml_collections.ConfigDict:
    """A role's ``sampling`` section (the arguments of ``sampling.SamplingParams``)."""
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
    c.actor.sampling = sampling(0.99, 0.99, 100, 4096)
    c.actor.constrained = False  # device-side action automaton (tiny models)
    # constrained actions may follow <think>[A-Za-z ,:.]{0,N}</think> (the warm actor restates a lesson; 0 = off)
    c.actor.think_chars = 0
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
    # The sampler's KV cache (models/kv_cache.py): "dense" [L, B, S, Hkv, Dh] rows that grow together, or "paged" (a
    # page pool + a page table per row: memory follows the tokens the rows hold, parking a slot engine row copies
    # nothing, a step reads the live window's pages). Same tokens either way; paged decodes 1.4-2x faster on CPU at
    # 1k-16k positions (WORKSPACE "KV caches"). Dense stays the default: on a mesh paged samples the same tokens,
    # but its page pool is replicated over the data axis (every chip holds every row's pages).
    c.actor.kv_cache = "dense"
    # Sequence packing of the update batch (roles.packing): episodes share rows of the batch's bucketed length
    # (segment ids keep them apart in attention), first-fit decreasing, instead of one episode per row padded to
    # the longest. Exact (losses, subgroup statistics and gradients of the unpacked batch; per-sequence terms reduce
    # over each token's episode) and never more rows or memory per micro-batch, so on by default; a mixture-of-experts
    # model with moe_dispatch="capacity" cannot pack (its per-row expert capacity would change which tokens drop).
    c.actor.pack = True
    # Attention kernel of training / scoring forwards (models/attention.py): "auto" = by the platform compiled for
    # (TPU: the Pallas splash kernel, NVIDIA GPU: cuDNN flash attention in bf16, CPU: "xla", the chunked reference);
    # or force "xla" | "cudnn" | "splash" (a kernel that cannot run falls back to "xla" with a logged reason).
    c.actor.attention = "auto"
    # Mixture-of-experts models (the capacity study's Qwen3-30B-A3B): the expert dispatch (models/config.py
    # MOE_DISPATCH). "" = the model's own, "dropless" (exact; gathers a layer's expert weights; does not lower for
    # TPU); "gmm": exact grouped matmuls (the megablox kernel on TPU) with the expert-parallel all-to-all over the
    # fsdp devices, the TPU path; "capacity": GShard slots, tokens past an expert's capacity are dropped. Dense
    # models ignore both keys.
    c.actor.moe_dispatch = ""
    # "gmm" on an expert axis of P devices: a device's tokens go through the exchange in rounds of this many,
    # because its buffers are the static worst case, P x k rows per token of a round (models/moe.py); 0 = one
    # round (a 64k-token sequence on 8 expert shards: ~233 GiB per chip, launch/plan_memory.py).
    c.actor.moe_exchange_tokens = 4096

    c.extractor = ml_collections.ConfigDict()
    c.extractor.model = "Qwen/Qwen3-4B-Thinking-2507"
    c.extractor.lr = 1e-6
    c.extractor.weight_decay = 0.0
    c.extractor.grad_clip = 1.0
    # The CISPO loss (SPEC §3), built as rl.losses.ExtractorLossConfig from c.extractor.loss.
    c.extractor.loss = ml_collections.ConfigDict()
    c.extractor.loss.clip_eps = 0.1  # epsilon of the stop-gradient IS-weight clip clip(rho, 1 - eps, 1 + eps)
    c.extractor.loss.loss_agg = "token_mean"  # or "seq_mean_token_mean"
    # The extractor's training buffer (SPEC §3, Eq. 7), built as experience.BufferConfig(**c.extractor.buffer).
    c.extractor.buffer = ml_collections.ConfigDict()
    c.extractor.buffer.batch_size = 64  # samples per extractor update
    # Eq. 7 delta, in trainer steps (1 = never twice in one step; the released code's)
    c.extractor.buffer.cooldown = 1
    c.extractor.buffer.alpha = 0.5  # Eq. 7 count discount (1 + c_train)^-alpha
    # Eq. 7 recency factor 1 - exp(-(t - t_last)/tau), in trainer steps; 0 = off.
    c.extractor.buffer.recency_tau = 2.0
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
    c.extractor.transcript_chars = 60000  # trajectory text shown to the extractor (the end is kept)
    c.extractor.sampling = sampling(1.0, 0.99, 0, 8192)
    c.extractor.constrained = False
    c.extractor.remat = True
    c.extractor.logits_chunk = 2048
    c.extractor.trainable_layers = 0  # as actor.trainable_layers
    c.extractor.param_dtype = "float32"  # as actor.param_dtype / dtype / rollout_tensor
    c.extractor.dtype = "bfloat16"
    c.extractor.rollout_tensor = 0
    c.extractor.kv_cache = "dense"  # as actor.kv_cache
    c.extractor.pack = True  # as actor.pack
    c.extractor.attention = "auto"  # as actor.attention
    c.extractor.moe_dispatch = ""  # as actor.moe_dispatch ("gmm" for the capacity study on TPU)
    c.extractor.moe_exchange_tokens = 4096  # as actor.moe_exchange_tokens
    c.extractor.train = True  # False: a frozen extractor (Static Online Exp., Offline Exp., and the baseline)

    c.bank = ml_collections.ConfigDict()
    c.bank.capacity = 20000
    c.bank.key = "content"
    c.bank.dedup_threshold = 0.0  # 0 = off
    c.bank.max_entry_chars = 2000  # an entry's text is cut to this
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
