r"""Per-device memory plan for a model on a mesh: parameters, AdamW state, gradients and a KV cache.

Nothing is allocated: the parameter tree comes from ``jax.eval_shape`` and each array's per-device shard shape
from the logical-axis rules (``comprl_jax.runtime.sharding.DEFAULT_RULES``) on an abstract mesh, so a TPU v5p-64 plan
runs on a laptop. Convention: AdamW keeps mu and nu in float32 (8 bytes per parameter) whatever the parameter
dtype; gradients are in the parameter dtype; activations and XLA temporaries are NOT counted.

The paper's setting (``--paper=v5p-64`` / ``--paper=8xh100``, SPEC §9: Qwen2.5-7B actor at 32k, Qwen3-4B extractor
at 64k, Qwen3-Embedding-0.6B, rollout 128 x 8) adds activations: per-layer remat, the chunked output head
(``rl.update.ChunkedHead``), and how many rollout / distillation rows fit next to the rest (see
:func:`paper_plan`); WORKSPACE.md holds the figures. ``--study=capacity`` plans the paper's extractor-capacity
study instead: the extractor is Qwen3-30B-A3B-Instruct-2507 (a mixture of experts: expert weights sharded over
fsdp, the MoE layer's dispatch buffers in the activations; see :func:`update_activation_bytes`).

COMMAND:
  .venv/bin/python launch/plan_memory.py --paper=v5p-64     # one JSON line per placement, then a table
  .venv/bin/python launch/plan_memory.py --paper=8xh100
  .venv/bin/python launch/plan_memory.py --paper=v5p-64 --study=capacity   # Qwen3-30B-A3B extractor (also 8xh200)
  .venv/bin/python launch/plan_memory.py --paper=v5p-64 --study=capacity --moe_dispatch=gmm   # its TPU dispatch
  .venv/bin/python launch/plan_memory.py --config=qwen3-30b-a3b --mesh=fsdp=8   # experts over the 8 fsdp devices
  .venv/bin/python launch/plan_memory.py --config=qwen2.5-7b-instruct --mesh=fsdp=8 --batch=8 --seq_len=4096
  # prints one JSON line, then a table; optimizer state per device = 7,617,949,696 bytes (7.09 GiB)
  .venv/bin/python launch/plan_memory.py --config=qwen3-4b --mesh=data=2,fsdp=4 \
      --extractor_config=qwen3-4b --extractor_mesh=fsdp=8      # disjoint actor / extractor meshes
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from comprl_jax.models.config import named_config
from comprl_jax.models.decoder import CACHE_AXES, abstract_decoder
from comprl_jax.runtime import sharding

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "qwen2.5-7b-instruct", "shipped model name, config.json path or HF folder")
flags.DEFINE_string("mesh", "fsdp=8", "mesh axes, e.g. 'fsdp=8' or 'data=2,fsdp=4,tensor=2'")
flags.DEFINE_integer("batch", 8, "KV cache rows (global)")
flags.DEFINE_integer("seq_len", 4096, "KV cache length")
flags.DEFINE_string("param_dtype", "float32", "parameter (master weight) dtype")
flags.DEFINE_string("cache_dtype", "bfloat16", "KV cache dtype")
flags.DEFINE_string("extractor_config", None, "optional second model on its own (disjoint) mesh")
flags.DEFINE_string("extractor_mesh", "fsdp=8", "mesh axes of the extractor")
flags.DEFINE_enum(
    "paper",
    None,
    ["v5p-64", "8xh100", "8xh200", "16xh100", "16xh200"],
    "plan the paper's full setting on this hardware",
)
flags.DEFINE_enum(
    "study",
    "main",
    ["main", "capacity"],
    "--paper: the main setting or the extractor-capacity study (MoE extractor)",
)
flags.DEFINE_integer("logits_chunk", 2048, "--paper: positions per output-head chunk (0 = full logits)")
flags.DEFINE_string(
    "moe_dispatch",
    "",
    "--study=capacity: the extractor's MoE dispatch ('' = the model's dropless; gmm = the TPU path)",
)

GIB = 1024**3


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1} (unknown axis names raise, naming them)."""
    axes = {}
    for part in filter(None, spec.split(",")):
        name, _, size = part.partition("=")
        if not size.strip().isdigit():
            raise ValueError(f"--mesh entry {part!r} must look like name=size")
        axes[name.strip()] = int(size)
    return sharding.resolve_axes(axes, math.prod(axes.values()))


def shard_bytes(shape, dtype, names, mesh: AbstractMesh, rules=sharding.DEFAULT_RULES) -> int:
    """Bytes one device holds of an array laid out by logical ``names`` (uneven dims round up, as XLA pads)."""
    spec = sharding.logical_to_spec(names, rules, mesh)
    n = 1
    for i, size in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= -(-size // math.prod(mesh.shape[a] for a in axes))
    return n * jnp.dtype(dtype).itemsize


@functools.lru_cache(maxsize=16)
def _abstract_params(cfg):
    """The abstract parameter tree of ``cfg`` (cached: the paper plans ask for the same models many times)."""
    return abstract_decoder(cfg)[1]


def plan(
    config: str, mesh_axes: dict[str, int], batch: int, seq_len: int, param_dtype: str, cache_dtype: str
) -> dict:
    """Per-device bytes of params / AdamW (mu+nu fp32) / grads / KV cache for ``config`` on ``mesh_axes``."""
    cfg = named_config(config, param_dtype=param_dtype)
    mesh = AbstractMesh(
        tuple(mesh_axes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3
    )
    abstract = _abstract_params(cfg)  # jax.eval_shape: no allocation
    variables = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    total = replicated = param_b = opt_b = 0
    for v in variables:
        names = v.get_metadata().get("out_sharding")
        total += v.size
        if sharding.logical_to_spec(names, mesh=mesh) == jax.sharding.PartitionSpec():
            replicated += v.size
        param_b += shard_bytes(v.shape, v.dtype, names, mesh)
        opt_b += 2 * shard_bytes(v.shape, jnp.float32, names, mesh)  # mu + nu, float32 by convention
    cache_shape = (cfg.num_layers, batch, seq_len, cfg.num_kv_heads, cfg.head_dim)
    cache_b = 2 * shard_bytes(cache_shape, cache_dtype, CACHE_AXES, mesh)  # k and v
    per_device = {"params": param_b, "adamw_state": opt_b, "grads": param_b, "kv_cache": cache_b}
    per_device["total"] = sum(per_device.values())
    return {
        "config": config,
        "arch": cfg.arch,
        "mesh": mesh_axes,
        "devices": mesh.size,
        "param_count": total,
        "replicated_param_count": replicated,
        "param_dtype": param_dtype,
        "adamw_state_dtype": "float32 (mu + nu, 8 bytes/param)",
        "grad_dtype": param_dtype,
        "kv_cache": {"batch": batch, "seq_len": seq_len, "dtype": cache_dtype},
        "bytes_per_device": per_device,
        "note": "activations and XLA temporaries not included",
    }


def table(rows: list[dict]) -> str:
    cols = ["params", "adamw_state", "grads", "kv_cache", "total"]  # adamw_state: mu + nu in float32
    head = f"{'model':<24} {'mesh':<22} " + " ".join(f"{c + ' GiB':>15}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
        vals = " ".join(f"{r['bytes_per_device'][c] / GIB:>15.3f}" for c in cols)
        lines.append(f"{r['config']:<24} {mesh:<22} {vals}")
    return "\n".join(lines)


# --- the paper's setting ---------------------------------------------------------------------------------------

# One JAX device per chip. v5p: 2 TensorCores per chip act as one device (megacore); v5p-64 = 64 cores = 32 chips
# on 8 hosts, 95 GiB HBM each (cloud.google.com/tpu/docs/v5p). H100 SXM 80 GB: 81,559 MiB as nvidia-smi reports;
# H200 SXM 141 GB: 143,771 MiB as nvidia-smi reports (not measured here).
HARDWARE = {
    "v5p-64": {"devices": 32, "hosts": 8, "hbm_bytes": 95 * GIB},
    "8xh100": {"devices": 8, "hosts": 1, "hbm_bytes": 81_559 * 1024**2},
    "8xh200": {"devices": 8, "hosts": 1, "hbm_bytes": 143_771 * 1024**2},
    "16xh100": {"devices": 16, "hosts": 2, "hbm_bytes": 81_559 * 1024**2},  # two 8xH100 nodes
    "16xh200": {"devices": 16, "hosts": 2, "hbm_bytes": 143_771 * 1024**2},  # two 8xH200 nodes
}
USABLE = 0.90  # of HBM: XLA's own reserve, fragmentation and the temporaries this plan does not itemise
PAPER = {  # SPEC §9
    "actor": "qwen2.5-7b-instruct",
    "extractor": "qwen3-4b-thinking-2507",
    "embedder": "qwen3-embedding-0.6b",
    "actor_seq": 32_768,
    "extractor_seq": 65_536,
    "rollout_rows": 128 * 8,  # tasks x group size: trajectories per step
    "distill_rows": 128 * 8,  # extractor.distill_from = "all": one distillation per trajectory
    "extractor_buffer": 64,
}
# The extractor of each study (the capacity study swaps the 4B extractor for the MoE, everything else equal).
STUDY_EXTRACTOR = {"main": PAPER["extractor"], "capacity": "qwen3-30b-a3b-instruct-2507"}


def state_bytes(cfg, mesh_axes: dict[str, int], micro_batches: int) -> dict[str, int]:
    """Per-device bytes of a trained model's resident state: float32 master params, AdamW mu + nu, the float32
    gradient accumulator, and (when accumulating over micro-batches) one micro-batch's gradients."""
    p = plan(cfg, mesh_axes, 1, 1, "float32", "bfloat16")["bytes_per_device"]
    grads = p["grads"] * (2 if micro_batches > 1 else 1)
    return {"params": p["params"], "adamw_state": p["adamw_state"], "grads": grads}


def kv_bytes_per_row(cfg, seq: int, tensor: int) -> int:
    """bf16 K and V of one sequence of ``seq`` tokens on one device (kv heads split over ``tensor``)."""
    return 2 * cfg.num_layers * seq * -(-cfg.num_kv_heads // tensor) * cfg.head_dim * 2


def update_activation_bytes(
    cfg, rows: int, seq: int, tensor: int, logits_chunk: int, compute_bytes: int = 2, expert_shards: int = 1
) -> dict[str, int]:
    """Per-device activation bytes of one micro-batch's forward + backward (``rows`` sequences on this device).

    Matches the update path: bf16 compute (``compute_bytes``), per-layer remat (the scan saves each layer's input), one layer
    recomputed at a time, query-chunked float32 attention (``layers.QUERY_CHUNK``, ``CAUSAL_BANDS``), and the chunked output head
    whose logits, exp and cotangent are float32 (3 buffers of ``rows x chunk x V``; XLA's CPU plan of the plain
    head shows the same 3x growth with V, tests/test_rl_update.py).

    Mixture-of-experts layers (``models.moe``) replace the dense MLP's ``3 x F`` per token by, per (token,
    choice) assignment (``k`` per token; ``capacity_factor`` x that many slots with the capacity dispatch): the
    dispatched input and the expert output (``D`` each), gate/up/activation (``3 x F_moe``), the gathered
    per-choice output (``D``), plus float32 router logits and probabilities (``2 x E`` per token); values and
    cotangents. The dropless dispatch also gathers one layer's expert weights and their gradient (compute
    dtype; FSDP style). The ``gmm`` dispatch on an expert axis of ``expert_shards`` = P devices exchanges each
    round of ``cfg.moe_exchange_tokens`` tokens through static worst-case buffers of ``P x k`` rows per token
    (``models.moe``): send, receive, the receive sorted by expert, the expert output and its way back (``D``
    each, 5 + the two local ones) and gate/up/activation (``3 x F_moe``), values and cotangents, one round at
    a time (``expert_exchange``; the TPU compiler, tiny MoE on v5p, 4,096 tokens per device: +214 MiB temporaries
    from P = 1 to 4 in one round, 4.6 KB per exchanged row against 5.1 KB here; +2.4 MiB in rounds of 1,024).
    ``layer_working_set`` is the larger of the dense and the MoE layer.
    """
    from comprl_jax.models.layers import CAUSAL_BANDS, QUERY_CHUNK

    cd = compute_bytes
    h, hkv, dh, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    t_h, t_kv, t_f = -(-h // tensor), -(-hkv // tensor), -(-f // tensor)
    tokens = rows * seq
    residual = cfg.num_layers * tokens * d * cd
    # one layer: q, k, v (+ RoPE'd copies), attention output, gate/up/act, two norm outputs; values + cotangents
    attn_and_norms = 2 * (t_h + 2 * t_kv) * dh + t_h * dh + 2 * d
    layer = tokens * (attn_and_norms + 3 * t_f) * cd * 2 if cfg.dense_layers else 0
    out = {}
    if cfg.moe_layers:
        k, e, t_fm = cfg.num_experts_per_tok, cfg.num_experts, -(-cfg.moe_intermediate_size // tensor)
        exact = cfg.moe_dispatch != "capacity"  # dropless and gmm route every assignment (k slots per token)
        slots = k if exact else cfg.capacity_factor * k
        if cfg.moe_dispatch.startswith("gmm"):
            # the sorted assignments through the grouped matmuls: all local tokens at once without an expert
            # axis; with one, P x k rows per token of one exchange round (the rounds are rematerialised)
            p = expert_shards
            chunk = min(tokens, cfg.moe_exchange_tokens or tokens) if p > 1 else tokens
            width = 7 * d + 3 * t_fm if p > 1 else 3 * d + 3 * t_fm
            out["expert_exchange"] = 2 * p * k * chunk * width * cd
            moe_layer = int(tokens * ((attn_and_norms + k * d) * cd + 2 * e * 4) * 2)
        else:
            moe_layer = int(
                tokens * ((attn_and_norms + slots * (2 * d + 3 * t_fm) + k * d) * cd + 2 * e * 4) * 2
            )
        layer = max(layer, moe_layer)
        if cfg.moe_dispatch == "dropless":
            out["expert_weights_gathered"] = 2 * 3 * e * d * t_fm * cd
    # scores, probs and their cotangent for one query chunk per causal band (XLA overlaps the unrolled bands;
    # band i sees (i + 1) / bands of the keys): layers.attention with CAUSAL_BANDS
    n = seq // QUERY_CHUNK if seq > QUERY_CHUNK and seq % QUERY_CHUNK == 0 else 1
    bands = max(d for d in range(1, min(CAUSAL_BANDS, n) + 1) if n % d == 0)
    attention = rows * t_h * min(QUERY_CHUNK, seq) * seq * 4 * 3 * (bands + 1) // (2 * bands) * bands
    chunk = logits_chunk if 0 < logits_chunk < seq else seq
    head = (
        3 * rows * chunk * -(-cfg.vocab_size // tensor) * 4 + 2 * tokens * d * 4
    )  # + float32 hidden, cotangent
    return {
        "residual_stream": residual,
        "layer_working_set": layer,
        "attention_chunk": attention,
        "head": head,
        **out,
    }


ROLLOUT_TENSORS = (1, 2, 4, 8)  # the sampler's tensor splits a paper plan tries ({role}.rollout_tensor)


def rollout_tensors(cfg, devices: int) -> list[int]:
    """Splits of :data:`ROLLOUT_TENSORS` dividing the role's devices and the model's KV heads (as the layout's)."""
    return [t for t in ROLLOUT_TENSORS if devices % t == 0 and cfg.num_kv_heads % t == 0]


@functools.lru_cache(maxsize=64)  # paper plans ask for the same copies once per update split they try
def sampler_copy_bytes(config: str, devices: int, tensor: int) -> int:
    """Per-device bytes of the sampler's bf16 weight copy on its ``(data = devices / tensor, 1, tensor)`` decode
    mesh (``sampling/layout.py``: the logical rules on that mesh)."""
    mesh = {"data": devices // tensor, "fsdp": 1, "tensor": tensor}
    return plan(config, mesh, 1, 1, "bfloat16", "bfloat16")["bytes_per_device"]["params"]


def paper_plan(
    hardware: str,
    placement: str,
    logits_chunk: int = 2048,
    actor_tensor: int = 1,
    extractor_tensor: int = 1,
    study: str = "main",
    moe_dispatch: str = "",
) -> dict:
    """Whether the paper's setting fits per device on ``hardware``, for one placement and tensor split.

    Phases (trainer.py): rollout, then the actor update while the extractor distils this step's trajectories,
    then the extractor update. Co-located, all models share every device and the overlapping pairs add up
    (rollout || extractor update, actor update || distillation); disjoint, each model has half the devices.
    Meshes are ``fsdp x tensor``; one sequence per fsdp group per micro-batch. Rollout and distillation caches
    are static (full context per row), so the plan reports how many rows fit at once (globally) and how many
    waves a step's 1,024 trajectories then need. ``study="capacity"``: the extractor is the MoE of the paper's
    capacity study (:data:`STUDY_EXTRACTOR`), its experts spread over the extractor's fsdp devices. Each
    sampler's bf16 weight copy (its rollout layout, ``rollout_tensor``: chosen here for the fewest waves) is
    resident in every phase.
    """
    hw = HARDWARE[hardware]
    n = hw["devices"]
    usable = int(hw["hbm_bytes"] * USABLE)
    extractor = STUDY_EXTRACTOR[study]
    actor_cfg, ext_cfg = named_config(PAPER["actor"]), named_config(extractor)
    if moe_dispatch and ext_cfg.num_experts:  # extractor.moe_dispatch ("gmm": the TPU path, models/moe.py)
        ext_cfg = dataclasses.replace(ext_cfg, moe_dispatch=moe_dispatch)
    actor_n = ext_n = n if placement == "colocated" else n // 2
    t_a, t_e = actor_tensor, extractor_tensor
    for name, t, m in (("actor", t_a, actor_n), ("extractor", t_e, ext_n)):
        if m % t:
            raise ValueError(f"{name} tensor={t} does not divide its {m} devices")
    actor_mesh = {"data": 1, "fsdp": actor_n // t_a, "tensor": t_a}
    ext_mesh = {"data": 1, "fsdp": ext_n // t_e, "tensor": t_e}
    actor_mb = -(-PAPER["rollout_rows"] // actor_mesh["fsdp"])  # micro-batches of one sequence per fsdp group
    ext_mb = -(-PAPER["extractor_buffer"] // ext_mesh["fsdp"])
    a_state = state_bytes(PAPER["actor"], actor_mesh, actor_mb)
    e_state = state_bytes(extractor, ext_mesh, ext_mb)
    emb = plan(PAPER["embedder"], ext_mesh, 1, 1, "bfloat16", "bfloat16")["bytes_per_device"]["params"]
    a_act = update_activation_bytes(actor_cfg, 1, PAPER["actor_seq"], t_a, logits_chunk)
    e_act = update_activation_bytes(
        ext_cfg, 1, PAPER["extractor_seq"], t_e, logits_chunk, expert_shards=ext_mesh["fsdp"]
    )  # experts over the fsdp devices (runtime/sharding.py)
    a_res, e_res = sum(a_state.values()), sum(e_state.values()) + emb
    a_up, e_up = sum(a_act.values()), sum(e_act.values())
    # Each sampler keeps its own bf16 copy on a (data = n / t, 1, t) decode mesh (sampling/layout.py), resident
    # through every phase; rows split over the data groups, each row's cache over its t devices. The split of
    # each role is the one with the fewest rollout + distillation waves (ties: the smaller split; when no update
    # peak fits, the smallest peak).
    best = None
    for rt_a in rollout_tensors(actor_cfg, actor_n):
        for rt_e in rollout_tensors(ext_cfg, ext_n):
            c_a = sampler_copy_bytes(PAPER["actor"], actor_n, rt_a)
            c_e = sampler_copy_bytes(extractor, ext_n, rt_e)
            if placement == "colocated":
                resident = a_res + e_res + c_a + c_e
                peak = resident + max(a_up, e_up)
                free_rollout = usable - resident - e_up  # rollout || extractor update
                free_distill = usable - resident - a_up  # actor update || distillation
            else:
                peak = max(a_res + c_a + a_up, e_res + c_e + e_up)
                free_rollout, free_distill = usable - a_res - c_a, usable - e_res - c_e
            # one row's cache on each of its devices
            a_row = kv_bytes_per_row(actor_cfg, PAPER["actor_seq"], rt_a)
            e_row = kv_bytes_per_row(ext_cfg, PAPER["extractor_seq"], rt_e)
            rollout = max(int(free_rollout // a_row), 0) * (actor_n // rt_a)
            distill = max(int(free_distill // e_row), 0) * (ext_n // rt_e)
            waves = -(-PAPER["rollout_rows"] // rollout) if rollout else math.inf
            waves += -(-PAPER["distill_rows"] // distill) if distill else math.inf
            key = (max(peak - usable, 0), waves, rt_a * rt_e)  # a peak that fits first, then fewest waves
            if best is None or key < best[0]:
                best = (key, rt_a, rt_e, c_a, c_e, peak, a_row, e_row, rollout, distill)
    _, rt_a, rt_e, c_a, c_e, peak_update, a_row, e_row, rollout_rows, distill_rows = best
    fits = peak_update <= usable and rollout_rows >= 1 and distill_rows >= 1

    def gib(x):
        return round(x / GIB, 2)

    return {
        "bench": "plan_memory",
        "study": study,
        "extractor": extractor,
        "hardware": hardware,
        "placement": placement,
        "mesh": {"actor": actor_mesh, "extractor": ext_mesh},
        "hbm_gib": gib(hw["hbm_bytes"]),
        "usable_gib": gib(usable),
        "logits_chunk": logits_chunk,
        "state_gib": {
            "actor": {k: gib(v) for k, v in a_state.items()},
            "extractor": {k: gib(v) for k, v in e_state.items()},
            "embedder": gib(emb),
        },
        "update_activations_gib": {
            "actor": {k: gib(v) for k, v in a_act.items()},
            "extractor": {k: gib(v) for k, v in e_act.items()},
        },
        "rollout_tensor": {"actor": rt_a, "extractor": rt_e},
        "sampler_copy_gib": {"actor": gib(c_a), "extractor": gib(c_e)},
        "kv_gib_per_row_per_device": {"actor_32k": gib(a_row), "extractor_64k": gib(e_row)},
        "peak_update_gib": gib(peak_update),
        "rollout_rows_at_once": rollout_rows,
        "rollout_waves": -(-PAPER["rollout_rows"] // rollout_rows) if rollout_rows else None,
        "distill_rows_at_once": distill_rows,
        "distill_waves": -(-PAPER["distill_rows"] // distill_rows) if distill_rows else None,
        "micro_batches": {"actor": actor_mb, "extractor": ext_mb},
        "fits": bool(fits),
    }


def best_paper_plan(
    hardware: str, placement: str, logits_chunk: int = 2048, study: str = "main", moe_dispatch: str = ""
) -> dict:
    """The fitting plan with the least tensor parallelism (fewest waves on ties); the last tried if none fits."""
    n = HARDWARE[hardware]["devices"] // (1 if placement == "colocated" else 2)
    tried = [
        paper_plan(hardware, placement, logits_chunk, ta, te, study, moe_dispatch)
        for ta in (1, 2, 4)
        for te in (1, 2, 4, 8)
        if n % ta == 0 and n % te == 0
    ]
    fitting = [p for p in tried if p["fits"]]
    if not fitting:
        return tried[-1]
    return min(
        fitting,
        key=lambda p: (
            p["mesh"]["actor"]["tensor"] * p["mesh"]["extractor"]["tensor"],
            p["rollout_waves"] + p["distill_waves"],
        ),
    )


def paper_table(rows: list[dict]) -> str:
    head = (
        f"{'hardware':<8} {'placement':<10} {'actor mesh':<13} {'extr. mesh':<13} {'usable':>7} {'peak upd':>9} "
        f"{'rollout rows':>13} {'waves':>6} {'distill rows':>13} {'waves':>6} fits"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        am, em = (f"fsdp={r['mesh'][k]['fsdp']},tp={r['mesh'][k]['tensor']}" for k in ("actor", "extractor"))
        lines.append(
            f"{r['hardware']:<8} {r['placement']:<10} {am:<13} "
            f"{em:<13} {r['usable_gib']:>7.1f} {r['peak_update_gib']:>9.1f} "
            f"{r['rollout_rows_at_once']:>13} {r['rollout_waves'] or '-':>6} "
            f"{r['distill_rows_at_once']:>13} {r['distill_waves'] or '-':>6} {r['fits']}"
        )
    return (
        "\n".join(lines)
        + "\n(GiB per device; rows = sequences at full context at once; waves per step's 1,024; extractor "
        + (rows[0]["extractor"] if rows else "-")
        + ")"
    )


def main(argv):
    del argv
    if FLAGS.paper:
        rows = [
            paper_plan(FLAGS.paper, p, FLAGS.logits_chunk, study=FLAGS.study, moe_dispatch=FLAGS.moe_dispatch)
            for p in ("colocated", "disjoint")
        ] + [  # pure fsdp above, then the least tensor split that fits
            best_paper_plan(FLAGS.paper, p, FLAGS.logits_chunk, FLAGS.study, FLAGS.moe_dispatch)
            for p in ("colocated", "disjoint")
        ]
        for r in rows:
            print(json.dumps(r))
        print(paper_table(rows))
        return
    rows = [
        plan(
            FLAGS.config,
            parse_mesh(FLAGS.mesh),
            FLAGS.batch,
            FLAGS.seq_len,
            FLAGS.param_dtype,
            FLAGS.cache_dtype,
        )
    ]
    out = dict(rows[0])
    if FLAGS.extractor_config:
        ext = plan(
            FLAGS.extractor_config,
            parse_mesh(FLAGS.extractor_mesh),
            FLAGS.batch,
            FLAGS.seq_len,
            FLAGS.param_dtype,
            FLAGS.cache_dtype,
        )
        rows.append(ext)
        out["extractor"] = ext
        out["total_devices_disjoint"] = rows[0]["devices"] + ext["devices"]
    print(json.dumps(out))
    print(table(rows))
    print("per device; AdamW mu+nu in float32; grads in param dtype; activations excluded", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
