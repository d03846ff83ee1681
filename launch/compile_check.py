#!/usr/bin/env python
r"""Ahead-of-time compile a run config's device functions at their real shapes and report per-chip memory.

The TPU compiler runs on this CPU: with ``libtpu`` importable (``make libtpu`` installs it into ``.libtpu/``, which
this script puts on ``sys.path`` itself; on a TPU host ``pip install -e .[tpu]``), ``jax.experimental.topologies``
gives the devices of a TPU slice (``--topology=v5p:4x4x2`` = a v5p-64, 32 chips) to build meshes on and to
``.lower(...).compile()`` against; nothing is allocated (parameters, optimizer state, batches and caches are
``jax.ShapeDtypeStruct``\ s with their shardings). ``compiled.memory_analysis()`` is the compiler's own per-chip
figure; a program that does not fit fails to compile with ``RESOURCE_EXHAUSTED``, which is caught and reported with
the size the compiler asked for. ``--fake_devices=8`` compiles on 8 fake CPU devices instead (a stand-in for a GPU
node: XLA:CPU's buffer plan, not a GPU compiler's; every line says ``"platform": "cpu"`` and carries a caveat).

Functions (``--functions``, comma list; default: the first four):
  actor_update       one optimizer step as ``roles.build_role`` builds it (``make_update_fn`` over ``roles.scorer``):
                     micro-batches of ``rows`` sequences (the config's ``actor.micro_batch`` rounded up to a multiple
                     of the mesh's batch devices, as launch/reproduce.py sets it: one sequence per fsdp group),
                     ``micro_batches`` of them per step (the step's rows / rows: the float32 gradient accumulator and
                     the scan are in the program), ``seq_len = rollout.max_context`` tokens.
  extractor_update   the same for the extractor (rows per step = ``extractor.buffer.batch_size``, ``extractor.max_context``).
  prefill            the sampler's prefill (``sampling.decode.prefill`` with the sampler's row groups) of a wave of
                     rollout rows (``rollout.rows_per_wave``, 0 = the step's episodes; rounded as the sampler's
                     ``batch_bucket``) with prompts of ``prompt_len`` tokens (default 2,048: a first turn's system
                     prompt + observation + retrieved experience) into a cache of ``rollout.max_context`` slots.
  decode             the sampler's jitted turn (``sampling.decode.make_decode_fn``: prefill + ``while_loop`` decode) for
                     the same wave, 16 new input tokens per row (the smallest input bucket: a decode-bound turn) on a
                     full-context cache, ``actor.sampling.max_new_tokens`` output slots; memory = cache + loop carry +
                     one decode step.
  extractor_prefill, extractor_decode   the same for the extractor's generation (distillation): rows =
                     ``extractor.rows_per_call`` (0 = one per episode), prompt 16,384 tokens (``transcript_chars`` of
                     60,000 at ~4 characters per token, bucketed), cache ``extractor.max_context``; a fresh
                     prefill (``extend(fresh=True)``: the cache is empty, the prompt attends among its own tokens
                     through ``extractor.attention``), as ``SamplerService.generate`` runs it.
  The sampler functions' cache is ``<role>.kv_cache``: dense, or paged (``--set=actor.kv_cache=paged``: a pool with
                     every row's pages assigned, as ``SamplerService.new_cache`` makes it; the pool is replicated
                     over the batch axes, so at paper scale it does not fit: WORKSPACE "The paged pool on a mesh").
  actor_logprobs, extractor_logprobs    ``make_logprob_fn`` (pi_old before the first step: the extractor always, the
                     actor with ``actor.updates_per_batch > 1``) over the step's rows.

Meshes: ``data=1, fsdp=-1, tensor=mesh.tensor`` (extractor: ``mesh.extractor_tensor`` when set) over the role's
devices, which is what launch/reproduce.py's ``mesh_overrides`` gives paper runs; ``--mesh`` / ``--extractor_mesh``
set others (``fsdp=16,tensor=2``), ``--mesh=config`` takes the config's ``mesh.*`` as is. ``mesh.placement=disjoint``
splits the devices as the trainer does. Dtypes: ``<role>.dtype`` / ``<role>.param_dtype`` config keys when present,
else bfloat16 compute and float32 parameters (``--dtype`` / ``--param_dtype`` override both roles). The sampler's
weights and mesh come from :func:`sampler_layout`: the library's decode layout (compute dtype, tensor-parallel and/or
replicated over the role's devices; ``<role>.rollout_tensor``, 0 = chosen against the target's HBM).
Attention (the updates' and log-prob passes' forward): ``<role>.attention`` (default ``auto``: the Pallas splash
kernel on a TPU topology, ``xla`` on fake CPU devices; ``comprl_jax/models/attention.py``); ``--attention=xla|splash``
overrides both roles, as ``--set=actor.attention=splash`` does one. Each line's ``attention`` names the backend that
runs (``auto -> splash``).

COMMAND:
  make libtpu   # once: libtpu==0.0.42.* (the version jax[tpu] pins for jax 0.10.2) into .libtpu/
  .venv/bin/python launch/compile_check.py --config=configs/minihack_room.py --topology=v5p:4x4x2
  .venv/bin/python launch/compile_check.py --config=configs/extractor_capacity.py --topology=v5p:4x4x2 \
      --functions=extractor_update --moe_dispatch=capacity   # Qwen3-30B-A3B extractor (the default dropless
      # dispatch's batched ragged_dot_general does not lower for TPU: "CHLO => [StableHLO+Shape] => StableHLO failed")
  .venv/bin/python launch/compile_check.py --config=configs/minihack_room.py --fake_devices=8 --hbm_gib=79.6
  .venv/bin/python launch/compile_check.py --config=configs/minihack_room.py --topology=v5p:2x2x1 \
      --functions=actor_update --attention=xla   # the chunked reference attention instead of splash
  # small model, e.g. for a test: --model=path/config.json --extractor_model=path/config.json --mesh=fsdp=4
Topologies: v5p:2x2x1 (4 chips), v5p:4x4x2 (v5p-64), v5p:4x4x4 (v5p-128), v5e:16x16 (v5e-256), v6e:..., v4:...
One JSON line per function (``bench: "compile_check"``); exit status 1 when any function failed for a reason other
than memory. ``cost_analysis()`` is not reported: it counts a while-loop / scan body once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

FUNCTIONS = (
    "actor_update",
    "extractor_update",
    "prefill",
    "decode",
    "extractor_prefill",
    "extractor_decode",
    "actor_logprobs",
    "extractor_logprobs",
)
DEFAULT_FUNCTIONS = FUNCTIONS[:4]
GIB = 1024**3
# HBM per device as the TPU compiler reports it ("exceeds available HBM (95.74G)", G = GiB), measured by compiling
# an oversized program on each topology (2026-12-03, libtpu 0.0.42.1). v4 topologies expose one device per core.
HBM_GIB = {"TPU v5": 95.74, "TPU v5p": 95.74, "TPU v5 lite": 15.75, "TPU v6 lite": 31.25, "TPU v4": 15.25}
FAKE_HBM_GIB = 79.6  # --fake_devices default: an H100 80 GB (81,559 MiB)
CPU_CAVEAT = (
    "compiled by XLA:CPU on fake devices: its buffer plan stands in for a GPU node's (fusion, collectives and "
    "allocator differ); fits compares peak_gib with hbm_gib"
)
LIBTPU_PIN = "libtpu==0.0.42.*"
# Prompt tokens of one prefill row: a first actor turn (system prompt, observation, retrieved experience), and a
# distillation prompt (extractor.transcript_chars = 60,000 characters at ~4 per token, bucketed).
PROMPT_LEN = {"actor": 2048, "extractor": 16384}
DECODE_INPUT = 16  # the sampler's smallest input bucket (SamplerService.run: bucket(..., minimum=16))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="configs/x.py[:variant]")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", help="TPU topology, e.g. v5p:4x4x2 (v5p-64), v5p:4x4x4, v5e:16x16")
    where.add_argument(
        "--fake_devices", type=int, help="compile on this many fake CPU devices (GPU stand-in)"
    )
    p.add_argument("--functions", default=",".join(DEFAULT_FUNCTIONS), help=f"comma list of {FUNCTIONS}")
    p.add_argument(
        "--mesh", default="", help="actor mesh, e.g. fsdp=32 or fsdp=16,tensor=2; 'config': mesh.*"
    )
    p.add_argument("--extractor_mesh", default="", help="extractor mesh (default as --mesh's default)")
    p.add_argument("--rows", type=int, default=0, help="rows of every function (update: per micro-batch)")
    p.add_argument(
        "--seq_len", type=int, default=0, help="update tokens and sampler cache slots of every function"
    )
    p.add_argument(
        "--prompt_len", type=int, default=0, help="prefill tokens per row (default 2,048 / 16,384)"
    )
    p.add_argument(
        "--micro_batches", type=int, default=0, help="micro-batches per update (default: the step's)"
    )
    p.add_argument(
        "--model", default="", help="actor model: a comprl_jax/models/presets name or a config.json path"
    )
    p.add_argument("--extractor_model", default="", help="extractor model (as --model)")
    p.add_argument(
        "--dtype", default="", help="compute dtype of both roles (default <role>.dtype or bfloat16)"
    )
    p.add_argument(
        "--param_dtype", default="", help="parameter dtype (default <role>.param_dtype or float32)"
    )
    p.add_argument(
        "--moe_dispatch",
        default="",
        help="MoE models: dropless | capacity | gmm (default: <role>.moe_dispatch, else the model's)",
    )
    p.add_argument(
        "--attention",
        default="",
        help="attention backend of both roles' forwards: auto | xla | cudnn | splash (default <role>.attention)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override, as a run gets it (reproduce.py's --config.KEY=VALUE flags), e.g. "
        "--set=extractor.rows_per_call=160 --set=mesh.extractor_tensor=2; repeatable",
    )
    p.add_argument("--hbm_gib", type=float, default=0.0, help="HBM per device (default: per chip kind)")
    p.add_argument("--libtpu_dir", default=os.path.join(REPO, ".libtpu"), help="where `make libtpu` installs")
    args = p.parse_args(argv)
    args.functions = [f for f in args.functions.split(",") if f]
    unknown = sorted(set(args.functions) - set(FUNCTIONS))
    if unknown:
        p.error(f"--functions: unknown {unknown}; known: {', '.join(FUNCTIONS)}")
    if args.fake_devices is not None and args.fake_devices < 1:
        p.error("--fake_devices must be >= 1")
    return args


def setup_backend(args) -> None:
    """Before JAX is imported: fake CPU devices, or libtpu on ``sys.path`` (no TPU is probed: JAX runs on CPU)."""
    if "jax" in sys.modules:
        raise RuntimeError("compile_check must set up the backend before jax is imported")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.fake_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.fake_devices}".strip()
        )
        return
    # libtpu takes a lock file (/tmp/libtpu_lockfile) for the chips of the host; we only compile (JAX itself runs
    # on CPU), so several compile checks (and a test beside a run) may load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if importlib.util.find_spec("libtpu") is not None:
        return
    if os.path.isdir(os.path.join(args.libtpu_dir, "libtpu")):
        sys.path.insert(0, args.libtpu_dir)
        return
    sys.exit(
        f"compile_check: libtpu (the TPU compiler) is not importable and not in {args.libtpu_dir}; run `make libtpu` "
        f"(pip install --target .libtpu '{LIBTPU_PIN}'), or on a TPU host `pip install -e .[tpu]`"
    )


def parse_mesh(spec: str) -> dict[str, int]:
    out = {}
    for part in spec.split(","):
        k, _, v = part.partition("=")
        if not v:
            raise SystemExit(
                f"compile_check: mesh {spec!r}: expected axis=size[,axis=size] (e.g. fsdp=16,tensor=2)"
            )
        out[k.strip()] = int(v)
    return out


def gib(x: float) -> float:
    return round(x / GIB, 3)


_SIZE = r"([\d.]+)\s*([KMGTP]i?)?B?"
_UNITS = {None: 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4, "P": 1024**5}


def _bytes(num: str, unit: str | None) -> float:
    return float(num) * _UNITS[unit[0] if unit else None]


def parse_resource_exhausted(msg: str) -> dict:
    """``requested_gib`` / ``available_gib`` from the TPU compiler's out-of-memory message (both known forms)."""
    for pat in (
        rf"\({_SIZE}\)\s*exceeds available HBM\s*\({_SIZE}\)",
        rf"Used {_SIZE} of {_SIZE} hbm",
    ):
        m = re.search(pat, msg)
        if m:
            return {
                "requested_gib": gib(_bytes(m.group(1), m.group(2))),
                "available_gib": gib(_bytes(m.group(3), m.group(4))),
            }
    return {}


# --- set-up (JAX imported lazily, after setup_backend) ------------------------------------------------------------


@dataclasses.dataclass
class Target:
    platform: str  # "tpu" | "cpu"
    topology: str
    devices: list
    device_kind: str
    hbm_gib: float


def target(args) -> Target:
    import jax

    if args.fake_devices:
        devs = jax.devices("cpu")[: args.fake_devices]
        if len(devs) < args.fake_devices:
            raise SystemExit(f"compile_check: {len(devs)} CPU devices, wanted {args.fake_devices}")
        return Target("cpu", f"cpu:{args.fake_devices}", devs, "cpu", args.hbm_gib or FAKE_HBM_GIB)
    from jax.experimental import topologies

    devs = list(topologies.get_topology_desc(args.topology, platform="tpu").devices)
    kind = devs[0].device_kind
    hbm = args.hbm_gib or HBM_GIB.get(kind)
    if hbm is None:
        raise SystemExit(f"compile_check: no HBM size known for {kind!r}; pass --hbm_gib")
    return Target("tpu", args.topology, devs, kind, hbm)


def model_spec(spec: str) -> str:
    """A config's model (HF folder path, hub id or preset) as a ``models.config.named_config`` argument: the
    path itself when it exists, else the shipped comprl_jax/models/presets name (``Qwen/Qwen2.5-7B-Instruct`` ->
    ``qwen2.5-7b-instruct``)."""
    if os.path.exists(spec):
        return spec
    return spec.rstrip("/").split("/")[-1].lower().replace("_", "-")


@dataclasses.dataclass
class RoleSetup:
    name: str
    section: object  # c.actor / c.extractor
    model: object  # ModelConfig
    graphdef: object
    abs_params: object
    mesh: object
    seq_len: int
    hbm_gib: float = 0.0  # per chip of the target (the sampler's layout is chosen against it)


def role_devices(c, devices):
    if c.mesh.placement != "disjoint":
        return devices, devices
    n = max(1, min(len(devices) - 1, round(c.mesh.actor_fraction * len(devices))))
    return devices[:n], devices[n:]


def role_mesh(c, name: str, spec: str, devices):
    from comprl_jax.runtime import sharding as shd

    if spec == "config":
        t = c.mesh.tensor if name == "actor" else (c.mesh.extractor_tensor or c.mesh.tensor)
        axes = {"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": t}
    elif spec:
        axes = parse_mesh(spec)
    else:  # launch/reproduce.py's mesh_overrides: data=1, fsdp=-1 (+ the config's tensor split)
        t = c.mesh.tensor if name == "actor" else (c.mesh.extractor_tensor or c.mesh.tensor)
        axes = {"data": 1, "fsdp": -1, "tensor": t}
    return shd.make_mesh(axes, devices)


def build_role(c, args, name: str, devices) -> RoleSetup:
    from comprl_jax.models.config import MOE_EXCHANGE_TOKENS, named_config
    from comprl_jax.models.decoder import abstract_decoder

    section = c[name]
    spec = (args.model if name == "actor" else args.extractor_model) or section.model
    dtype = args.dtype or section.get("dtype") or "bfloat16"
    param_dtype = args.param_dtype or section.get("param_dtype") or "float32"
    try:
        dispatch = args.moe_dispatch or section.get("moe_dispatch") or ""
        extra = {"moe_dispatch": dispatch} if dispatch else {}
        extra["moe_exchange_tokens"] = section.get("moe_exchange_tokens", MOE_EXCHANGE_TOKENS)
        extra["attention"] = args.attention or section.get("attention") or "auto"
        cfg = named_config(model_spec(spec), dtype=dtype, param_dtype=param_dtype, **extra)
    except FileNotFoundError as e:
        raise SystemExit(
            f"compile_check: {name}.model={spec!r}: {e}; pass --{'' if name == 'actor' else 'extractor_'}model"
        ) from None
    graphdef, abs_params = abstract_decoder(cfg)
    mesh = role_mesh(c, name, args.mesh if name == "actor" else args.extractor_mesh, devices)
    seq = args.seq_len or (c.rollout.max_context if name == "actor" else c.extractor.max_context)
    return RoleSetup(name, section, cfg, graphdef, abs_params, mesh, seq)


def attention_backend(cfg, platform: str) -> str:
    """``cfg.attention`` as the forward resolves it on ``platform`` (``"auto -> splash"`` for auto)."""
    from comprl_jax.models import attention

    got = attention.resolve(cfg.attention, cfg.dtype, cfg.head_dim, platform=platform)
    return got if got == cfg.attention else f"{cfg.attention} -> {got}"


def batch_devices(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def sds(shape, dtype, sharding):
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct(
        tuple(shape), jnp.dtype(dtype) if isinstance(dtype, str) else dtype, sharding=sharding
    )


def with_shardings(abstract, shardings):
    import jax

    return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), abstract, shardings)


def sampler_layout(role: RoleSetup):
    """The sampler's mesh and parameters (abstract, with shardings) for prefill / decode: the library's decode
    layout (``comprl_jax.sampling.layout.rollout_layout``, as ``roles.build_role`` builds it): the compute dtype
    on a ``data x tensor`` mesh over the role's devices, ``<role>.rollout_tensor`` (0: chosen against this
    target's HBM per chip)."""
    from comprl_jax.sampling.layout import rollout_layout

    layout = rollout_layout(
        role.abs_params,
        role.model,
        role.mesh,
        int(role.section.get("rollout_tensor", 0)),
        device_bytes=int(role.hbm_gib * GIB),
    )
    cast = jax_cast_abstract(role.abs_params, layout.dtype)
    return layout.mesh, with_shardings(cast, layout.shardings)


def jax_cast_abstract(abstract, dtype: str):
    """Abstract parameters with their floating leaves in ``dtype`` (the sampler's copy)."""
    import jax
    import jax.numpy as jnp

    def one(x):
        dt = jnp.dtype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dt)

    return jax.tree.map(one, abstract)


# --- the device functions ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Lowerable:
    fn: object  # a jax.jit function
    args: tuple
    kwargs: dict
    mesh: object
    shapes: dict
    mesh_of: str  # whose mesh (the sampler's may differ)


def step_rows(c, name: str) -> int:
    """Rows of one optimizer step of ``name`` as the trainer builds it."""
    if name == "extractor":
        return c.extractor.buffer.batch_size
    episodes = c.rollout.tasks_per_step * c.rollout.group_size * len(c.env.tasks)
    sft = episodes // 2 if (c.experience.enabled and c.actor.self_distill_coef > 0) else 0
    return (episodes + sft) // c.actor.updates_per_batch


def update_shapes(c, args, role: RoleSetup) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches per step)."""
    nb = batch_devices(role.mesh)
    mb = args.rows or -(-role.section.micro_batch // nb) * nb
    m = args.micro_batches or max(1, step_rows(c, role.name) // mb)
    return mb, m


def actor_sft(c) -> bool:
    return bool(c.experience.enabled and c.actor.self_distill_coef > 0)


def update_batch(c, role: RoleSetup, rows: int, with_old: bool):
    from comprl_jax.runtime import sharding as shd

    sh = shd.named_sharding(role.mesh, ("batch",))
    T = role.seq_len
    b = {
        "tokens": sds((rows, T), "int32", sh),
        "positions": sds((rows, T), "int32", sh),
        "attn_mask": sds((rows, T), "bool", sh),
        "loss_mask": sds((rows, T), "float32", sh),
        "advantages": sds((rows,), "float32", sh),
    }
    if role.name == "actor":  # train_batches.actor_batch (+ the behaviour keys roles.dispatch_update passes)
        b["subgroup"] = sds((rows,), "int32", sh)
        if actor_sft(c):
            b["sft_row"] = sds((rows,), "float32", sh)
    else:  # train_batches.extractor_batch
        b["sample_weight"] = sds((rows,), "float32", sh)
    if with_old:
        b["old_logprobs"] = sds((rows, T), "float32", sh)
    else:
        b["behaviour_logprobs"] = sds((rows, T), "float32", sh)
        b["behaviour_mask"] = sds((rows, T), "float32", sh)
    return b


def _train_pieces(c, role: RoleSetup):
    import jax
    import jax.numpy as jnp

    from comprl_jax.rl.train_state import OptimConfig, TrainState, make_optimizer, train_state_shardings
    from comprl_jax.roles import role as roles

    s = role.section
    tx = make_optimizer(OptimConfig(lr=s.lr, weight_decay=s.weight_decay, grad_clip=s.grad_clip))
    abstract = jax.eval_shape(
        lambda p: TrainState(params=p, opt_state=tx.init(p), step=jnp.zeros((), jnp.int32)), role.abs_params
    )
    shardings = train_state_shardings(abstract, role.mesh)
    n = role.model.num_layers
    frozen = n - s.trainable_layers if 0 < s.trainable_layers <= n else 0
    logits_fn = roles.scorer(role.graphdef, s.remat, s.logits_chunk, frozen)
    return tx, abstract, shardings, logits_fn


def update_fn(c, args, role: RoleSetup) -> Lowerable:
    from comprl_jax.rl import make_update_fn
    from comprl_jax.rl.losses import loss_config

    mb, m = update_shapes(c, args, role)
    tx, abstract, shardings, logits_fn = _train_pieces(c, role)
    extra = {"sft_coef": c.actor.self_distill_coef} if role.name == "actor" and actor_sft(c) else {}
    loss = loss_config(c, role.name, **extra)
    fn = make_update_fn(logits_fn, loss, tx, num_micro_batches=m, mesh=role.mesh, state_shardings=shardings)
    # roles.dispatch_update: one step on fresh samples takes pi_old from its own forward pass (behaviour keys in
    # the batch); the extractor (stale buffer samples) and a multi-step actor pass old_logprobs.
    with_old = role.name == "extractor" or c.actor.updates_per_batch > 1
    batch = update_batch(c, role, mb * m, with_old)
    shapes = {"rows": mb * m, "micro_batch_rows": mb, "micro_batches": m, "seq_len": role.seq_len}
    return Lowerable(fn, (with_shardings(abstract, shardings), batch), {}, role.mesh, shapes, role.name)


def logprobs_fn(c, args, role: RoleSetup) -> Lowerable:
    from comprl_jax.rl import make_logprob_fn
    from comprl_jax.rl.update import MODEL_KEYS

    mb, m = update_shapes(c, args, role)
    _, abstract, shardings, logits_fn = _train_pieces(c, role)
    fn = make_logprob_fn(logits_fn, num_micro_batches=m, mesh=role.mesh, param_shardings=shardings.params)
    batch = {k: v for k, v in update_batch(c, role, mb * m, True).items() if k in MODEL_KEYS}
    shapes = {"rows": mb * m, "micro_batch_rows": mb, "micro_batches": m, "seq_len": role.seq_len}
    return Lowerable(
        fn, (with_shardings(abstract.params, shardings.params), batch), {}, role.mesh, shapes, role.name
    )


def sampler_rows(c, args, role: RoleSetup, mesh) -> int:
    """A wave's rows, rounded as ``SamplerService.batch_bucket`` (a power of two, a multiple of the batch shards)."""
    from comprl_jax.sampling import bucket

    if args.rows:
        rows = args.rows
    else:
        episodes = c.rollout.tasks_per_step * c.rollout.group_size * len(c.env.tasks)
        per = c.rollout.rows_per_wave if role.name == "actor" else c.extractor.rows_per_call
        rows = min(per, episodes) if per else episodes
    return bucket(rows, minimum=1, multiple=batch_devices(mesh))


def prefill_groups(rows: int, width: int, multiple: int, cfg, fresh: bool) -> int:
    """The sampler's row groups (``SamplerService.prefill_groups`` at the default ``prefill_tokens``; ``cfg``'s
    attention on the ambient mesh's platform decides whether a prefill onto context runs a kernel)."""
    from comprl_jax import sampling
    from comprl_jax.sampling import service

    kernel = service.reads_context_through_kernel(cfg, width, fresh)
    return sampling.prefill_groups(rows, width, sampling.PREFILL_TOKENS, multiple, kernel)


def abstract_cache(role: RoleSetup, mesh, rows: int, slots: int):
    """The sampler's KV cache as ShapeDtypeStructs, laid out as ``SamplerService`` lays it out
    (``sampling.cache_shardings``)."""
    import jax

    from comprl_jax import sampling
    from comprl_jax.models import decoder

    if kv_kind(role) == "paged":
        # As SamplerService.new_cache(rows, slots) makes it: every row's pages assigned, a pool of rows x pages.
        from comprl_jax.models import kv_cache

        ps = kv_cache.PAGE_SIZE
        per_row = -(-slots // ps)
        abstract = jax.eval_shape(
            lambda: kv_cache.init_paged_cache(role.model, rows, per_row * ps, rows * per_row, ps)
        )
    else:
        # the layout for the mesh's platform (a TPU topology here, though this host is a CPU)
        cpu = mesh.devices.flat[0].platform == "cpu"
        abstract = jax.eval_shape(lambda: decoder.init_cache(role.model, rows, slots, keys_last=cpu))
    shardings = sampling.cache_shardings(mesh, role.model, abstract)
    return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), abstract, shardings)


def kv_kind(role: RoleSetup) -> str:
    """The role's sampler cache, ``<role>.kv_cache``: "dense" or "paged" (``--set=actor.kv_cache=paged``)."""
    return role.section.kv_cache


def starts_fresh(role: RoleSetup) -> bool:
    """Whether the role's sampler turn starts on an empty cache (``extend(fresh=True)``): the extractor generates
    from one (``SamplerService.generate``: a fresh prefill, the forward's causal attention); the actor's turns enter
    a rollout cache (the context path)."""
    return role.name == "extractor"


def prefill_fn(c, args, role: RoleSetup) -> Lowerable:
    import jax
    import jax.numpy as jnp

    from comprl_jax.models import decoder
    from comprl_jax.runtime import sharding as shd
    from comprl_jax.sampling import bucket

    decode_lib = importlib.import_module("comprl_jax.sampling.decode")  # the package re-exports decode()

    mesh, params = sampler_layout(role)
    rows = sampler_rows(c, args, role, mesh)
    width = min(bucket(args.prompt_len or PROMPT_LEN[role.name], minimum=16), role.seq_len)
    fresh = starts_fresh(role)
    with jax.set_mesh(mesh):  # the platform the groups' rule reads
        groups = prefill_groups(rows, width, batch_devices(mesh), role.model, fresh)
    graphdef = role.graphdef
    extend = functools.partial(decoder.extend, fresh=True) if fresh else decoder.extend

    def fn(params, cache, tokens, num_new):
        last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
        return decode_lib.prefill(graphdef, params, cache, tokens, num_new, last, extend, groups)

    sh = shd.named_sharding(mesh, ("batch",))
    a = (
        params,
        abstract_cache(role, mesh, rows, role.seq_len),
        sds((rows, width), "int32", sh),
        sds((rows,), "int32", sh),
    )
    shapes = {
        "rows": rows,
        "prompt_len": width,
        "cache_len": role.seq_len,
        "prefill_groups": groups,
        "fresh": fresh,
        "kv_cache": kv_kind(role),
    }
    return Lowerable(jax.jit(fn, donate_argnums=1), a, {}, mesh, shapes, role.name)


def decode_fn(c, args, role: RoleSetup) -> Lowerable:
    import jax

    from comprl_jax.models import decoder
    from comprl_jax.runtime import sharding as shd

    decode_lib = importlib.import_module("comprl_jax.sampling.decode")  # the package re-exports decode()

    mesh, params = sampler_layout(role)
    rows = sampler_rows(c, args, role, mesh)
    from comprl_jax.runtime.fields import from_section
    from comprl_jax.sampling import SamplingParams

    sp = from_section(SamplingParams, role.section.sampling, f"{role.name}.sampling")
    sh = shd.named_sharding(mesh, ("batch",))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))  # per-row keys (key_ids)
    a = (
        role.graphdef,
        params,
        abstract_cache(role, mesh, rows, role.seq_len),
        sds((rows, DECODE_INPUT), "int32", sh),
        sds((rows,), "int32", sh),
        sds((rows,), "int32", sh),
        sds(keys.shape, keys.dtype, sh),
        None,
        None,
    )
    fresh = starts_fresh(role)
    kw = dict(sp=sp, stop_ids=(1, 2), pad_id=0, window=None, prefill_groups=1, fresh=fresh)
    shapes = {
        "rows": rows,
        "input_len": DECODE_INPUT,
        "cache_len": role.seq_len,
        "max_new_tokens": sp.max_new_tokens,
        "fresh": fresh,
        "kv_cache": kv_kind(role),
    }
    return Lowerable(decode_lib.make_decode_fn(decoder.extend), a, kw, mesh, shapes, role.name)


BUILDERS = {
    "actor_update": ("actor", update_fn),
    "extractor_update": ("extractor", update_fn),
    "prefill": ("actor", prefill_fn),
    "decode": ("actor", decode_fn),
    "extractor_prefill": ("extractor", prefill_fn),
    "extractor_decode": ("extractor", decode_fn),
    "actor_logprobs": ("actor", logprobs_fn),
    "extractor_logprobs": ("extractor", logprobs_fn),
}


def compile_one(lw: Lowerable, hbm_gib: float) -> dict:
    """Lower + compile; the memory figures, or ``fits: false`` with the compiler's requested size."""
    import jax

    t0 = time.perf_counter()
    try:
        # The model reads the ambient mesh to pin activations to the batch axes (as the sampler runs it).
        with jax.set_mesh(lw.mesh):
            compiled = lw.fn.lower(*lw.args, **lw.kwargs).compile()
    except Exception as e:  # noqa: BLE001 -- reported as a line, the next function still runs
        msg = str(e)
        first = next((ln.strip() for ln in msg.splitlines() if ln.strip()), type(e).__name__)
        out = {"compile_s": round(time.perf_counter() - t0, 1), "error": first[:500]}
        if "RESOURCE_EXHAUSTED" in msg:
            out["fits"] = False
            out.update(parse_resource_exhausted(msg))
        else:
            out["fits"] = None
        return out
    dt = time.perf_counter() - t0
    m = compiled.memory_analysis()
    args_b, temp_b = m.argument_size_in_bytes, m.temp_size_in_bytes
    out_b, alias_b = m.output_size_in_bytes, m.alias_size_in_bytes
    peak = args_b + temp_b + out_b - alias_b  # donated outputs alias their inputs
    return {
        "args_gib": gib(args_b),
        "temp_gib": gib(temp_b),
        "out_gib": gib(out_b),
        "alias_gib": gib(alias_b),
        "peak_gib": gib(peak),
        "fits": peak <= hbm_gib * GIB,
        "compile_s": round(dt, 1),
    }


def run(args) -> int:
    import jax

    tgt = target(args)
    c = load_config(args.config, args.set)
    actor_devs, ext_devs = role_devices(c, tgt.devices)
    roles_ = {}
    failed = False
    for fname in args.functions:
        rname, builder = BUILDERS[fname]
        if rname not in roles_:
            roles_[rname] = build_role(c, args, rname, actor_devs if rname == "actor" else ext_devs)
            roles_[rname].hbm_gib = tgt.hbm_gib
        role = roles_[rname]
        line = {
            "bench": "compile_check",
            "function": fname,
            "config": args.config,
            "platform": tgt.platform,
            "topology": tgt.topology,
            "device_kind": tgt.device_kind,
            "chips": len(tgt.devices),
            "model": model_spec(
                (args.model if rname == "actor" else args.extractor_model) or role.section.model
            ),
            "dtype": role.model.dtype,
            "param_dtype": role.model.param_dtype,
            "overrides": list(args.set),
        }
        if role.model.num_experts:
            line["moe_dispatch"] = role.model.moe_dispatch
        # the backend that runs on this target ("auto" resolved as models/attention.py does under the mesh)
        line["attention"] = attention_backend(role.model, tgt.platform)
        lw = builder(c, args, role)
        line["mesh"] = {k: int(v) for k, v in lw.mesh.shape.items()}
        line["shapes"] = lw.shapes
        line.update(compile_one(lw, tgt.hbm_gib))
        line["hbm_gib"] = tgt.hbm_gib
        if tgt.platform == "cpu":
            line["caveat"] = CPU_CAVEAT
        failed |= line["fits"] is None
        print(json.dumps(line), flush=True)
        jax.clear_caches()
    return 1 if failed else 0


def load_config(path_variant: str, sets: list[str]):
    """The run config with ``--set KEY=VALUE`` overrides applied (values parsed as JSON where they parse: 160,
    true, "x"; else kept as text), then validated as a run's would be."""
    from comprl_jax import config as config_lib

    c = config_lib.load_file(path_variant)
    with c.unlocked():
        for item in sets:
            key, eq, raw = item.partition("=")
            if not eq or not key:
                raise SystemExit(f"compile_check: --set {item!r} must look like KEY=VALUE")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            try:
                config_lib.set_key(c, key.removeprefix("config."), value)
            except (KeyError, AttributeError) as e:
                raise SystemExit(f"compile_check: --set {item!r}: no config key {key!r} ({e})") from None
    config_lib.validate(c)
    return c


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_backend(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
