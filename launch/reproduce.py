r"""The reproduction protocol of the paper's tables (SPEC §11): every run a table needs, its command, its cost.

A table is a list of runs: a config file (``configs/*.py``), a variant (``tasks=3``, the method word
``complementary`` / ``baseline`` / ``static_online`` / ``exp_only`` / ``offline``, ``smollm`` for the one-GPU
scale), a seed (``--config.seed``; the paper gives no seed count, we run 3: 0, 1, 2) and a workdir
``<root>/<table>[_smollm]/<experiment>[_tasksN]_<method>_s<seed>``. Then ``launch/make_tables.py`` over those
workdirs prints ours beside the paper's.

  .venv/bin/python launch/reproduce.py --table=1                      # dry run: one command per line, then
                                                                       # a '# {json}' line per run
  .venv/bin/python launch/reproduce.py --table=1 --launcher=tpu_pod --tpu_name=my-v5p-64 --zone=us-east5-a \
      --root=/mnt/shared/runs --models_dir=/mnt/shared/models          # through launch/tpu_pod.sh (v5p-64)
  .venv/bin/python launch/reproduce.py --table=single --launcher=slurm --models_dir=/shared/models  # sbatch, 8xH100
  .venv/bin/python launch/reproduce.py --table=single --scale=smollm  # SmolLM2-135M actor + extractor, one GPU
  ... --execute                                                        # run (local, tpu_pod) or submit (slurm)
  .venv/bin/python launch/reproduce.py --table=all --estimate         # device-hour estimates, JSON lines

Tables: ``1`` (multitask3.py x 5 methods), ``scaling`` (task_scaling.py:tasks=1|3|6, Complementary RL and the
baseline), ``capacity`` (extractor_capacity.py, Complementary RL; read beside Table 1's runs), ``single``
(minihack_room.py, alfworld.py, webshop.py, swebench.py: Complementary RL and the baseline; the ablations
ablation_no_merge.py / ablation_no_search_ask.py: Complementary RL, read beside minihack_room's runs).

Paper scale: each run gets the meshes of the memory plan (``launch/plan_memory.py``'s ``best_paper_plan``,
co-located): ``mesh.data=1, mesh.fsdp=-1``, the extractor's tensor split where the plan needs one, micro-batches
of one sequence per fsdp group, the samplers' splits ``{role}.rollout_tensor``, ``rollout.rows_per_wave`` from the
rows that fit and ``extractor.rows_per_call`` from the distillation rows that fit. Where ``launch/compile_plans.jsonl``
holds the TPU compiler's figures for the hardware (``launch/compile_check.py``), the splits and both wave sizes come
from those instead (:func:`compiler_layout`), the updates' meshes and micro-batches are checked to be the compiled
ones (:func:`stale_reason`), and a run that the compiler cannot fit is listed as not runnable. The capacity study's
MoE extractor runs ``extractor.moe_dispatch=gmm`` on TPU hardware (:func:`moe_dispatch_for`), planned and checked
against lines compiled with that dispatch. ``--models_dir=D`` passes
``D/<name>`` for every Hugging Face model the config names (``Qwen/Qwen2.5-7B-Instruct`` -> ``D/Qwen2.5-7B-
Instruct``). The SWE arm runs on SWE-Lite (``comprl/SWE-Lite-v0``, a bubblewrap sandbox, offline); SWE-Bench
Verified itself needs its per-task container images (``comprl_jax/envs/swe/container.py``, untested here).

Estimates (``--estimate``): FLOPs per step over (chips x peak FLOP/s x MFU); see :func:`run_estimate` for the
formula and :data:`ASSUMED` for every assumed number. Modelled, not measured on accelerators: the one
measurement behind them is the CPU anchor (:func:`cpu_anchor`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys

from absl import flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comprl_jax import config as config_lib
from launch import common as lu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = ("1", "scaling", "capacity", "single")
SEEDS_DEFAULT = ("0", "1", "2")  # the paper reports no seed count: three per arm (mean ± s.e. in make_tables)

METHODS_T1 = ("complementary", "baseline", "static_online", "exp_only", "offline")
PAIR = ("complementary", "baseline")


def table_arms(table: str) -> list[dict]:
    """The arms of ``table``: ``{"config", "extras", "methods", "note"}`` (extras: ``key=value`` variant words)."""
    if table == "1":
        return [
            {
                "config": "multitask3",
                "extras": "",
                "methods": METHODS_T1,
                "note": "Table 1; offline (SPEC §8 Offline Exp.) has no paper figure in SPEC §11",
            }
        ]
    if table == "scaling":
        return [
            {"config": "task_scaling", "extras": f"tasks={n}", "methods": PAIR, "note": f"{n} task(s)"}
            for n in (1, 3, 6)
        ]
    if table == "capacity":
        return [
            {
                "config": "extractor_capacity",
                "extras": "",
                "methods": ("complementary",),
                "note": "Qwen3-30B-A3B extractor; compare with Table 1's multitask3 complementary runs (+5%)",
            }
        ]
    if table == "single":
        arms = [
            {"config": name, "extras": "", "methods": PAIR, "note": "single task"}
            for name in ("minihack_room", "alfworld", "webshop", "swebench")
        ]
        arms += [
            {
                "config": name,
                "extras": "",
                "methods": ("complementary",),
                "note": "ablation on MiniHack Room; compare with minihack_room complementary",
            }
            for name in ("ablation_no_merge", "ablation_no_search_ask")
        ]
        return arms
    raise ValueError(f"--table={table!r}: choose one of {TABLES} or 'all'")


SMOLLM_SKIPS = {
    "capacity": "at --scale=smollm both extractors are SmolLM2-135M: there is no capacity comparison to run",
}


def arms(table: str, scale: str) -> list[dict]:
    """:func:`table_arms`, none where a table means nothing at ``scale`` (:data:`SMOLLM_SKIPS`)."""
    return [] if scale == "smollm" and table in SMOLLM_SKIPS else table_arms(table)


# Runs of another table that a table is read against (make_tables reads them too; they are not launched again).
REUSES = {
    "capacity": [("1", "multitask3", "", m) for m in PAIR],
    "single": [],
    "1": [],
    "scaling": [],
}
# Configs a table lists but no run can execute ({name: why}); empty since SWE-Lite (issue 32) made swebench.py run.
NOT_RUNNABLE: dict[str, str] = {}


def load_config(name: str, variant: str):
    """``configs/<name>.py:get_config(variant)``: built and validated (raises naming the file)."""
    path = os.path.join(ROOT, "configs", f"{name}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found (a table names a config file that does not exist)")
    return config_lib.load_file(f"{path}:{variant}")


def _plan_memory():
    """launch/plan_memory.py as a module (read-only reuse of its model shapes and memory plans)."""
    if "plan_memory" in sys.modules:  # absl flags are defined once per process
        return sys.modules["plan_memory"]
    spec = importlib.util.spec_from_file_location(
        "plan_memory", os.path.join(ROOT, "launch", "plan_memory.py")
    )
    pm = importlib.util.module_from_spec(spec)
    sys.modules["plan_memory"] = pm
    try:
        spec.loader.exec_module(pm)
    except BaseException:  # never leave a half-initialised module cached for the next caller
        del sys.modules["plan_memory"]
        raise
    return pm


TPU_HARDWARE_PREFIXES = ("v4-", "v5p-", "v5e-", "v6e-")


def moe_dispatch_for(hardware: str, study: str) -> str:
    """The MoE extractor's dispatch (``extractor.moe_dispatch``) for a study on ``hardware``: the capacity study
    on a TPU runs ``gmm`` (megablox kernels, expert-parallel exchange; the model's own dropless dispatch does not
    lower for TPU and ``capacity`` drops tokens); elsewhere "" (the model's dropless dispatch)."""
    return "gmm" if study == "capacity" and hardware.startswith(TPU_HARDWARE_PREFIXES) else ""


def mesh_overrides(
    hardware: str, study: str, episodes: int, layout: dict | None = None, plan: dict | None = None
) -> tuple[list[str], dict]:
    """``--config.*`` flags that put a paper-scale run on the memory plan of ``hardware`` (co-located), and the
    plan. ``episodes``: the step's trajectories (``rows_per_wave`` must divide it). ``layout``: the TPU compiler's
    (:func:`compiler_layout`), whose rollout tensor splits and wave sizes replace the plan's. ``plan``: that
    plan when the caller has it already (``best_paper_plan`` searches every split)."""
    dispatch = moe_dispatch_for(hardware, study)
    p = plan or _plan_memory().best_paper_plan(hardware, "colocated", study=study, moe_dispatch=dispatch)
    a, e = p["mesh"]["actor"], p["mesh"]["extractor"]
    out = ["--config.mesh.data=1", "--config.mesh.fsdp=-1"]
    if dispatch:
        out.append(f"--config.extractor.moe_dispatch={dispatch}")
    if a["tensor"] > 1:
        out.append(f"--config.mesh.tensor={a['tensor']}")
    if e["tensor"] != a["tensor"]:
        out.append(f"--config.mesh.extractor_tensor={e['tensor']}")
    # one sequence per fsdp group per micro-batch, as the plan's activations assume
    out += [f"--config.actor.micro_batch={a['fsdp']}", f"--config.extractor.micro_batch={e['fsdp']}"]
    if layout is not None:  # the compiler's figures: rollout layouts and the rows that fit beside the updates
        for role in ("actor", "extractor"):
            out.append(f"--config.{role}.rollout_tensor={layout['rollout_tensor'][role]}")
        if 0 < layout["rows_per_wave"] < episodes:
            out.append(f"--config.rollout.rows_per_wave={layout['rows_per_wave']}")
        if 0 < layout["rows_per_call"] < episodes:
            out.append(f"--config.extractor.rows_per_call={layout['rows_per_call']}")
        return out, p
    # the plan's sampler layouts (the library's automatic split may differ)
    for role in ("actor", "extractor"):
        out.append(f"--config.{role}.rollout_tensor={p['rollout_tensor'][role]}")
    # the rows that fit, as the sampler will bucket them (a power of two, a multiple of its data groups)
    groups = {r: p["mesh"][r]["fsdp"] * p["mesh"][r]["tensor"] // p["rollout_tensor"][r] for r in p["mesh"]}
    rows = bucketed_rows(p["rollout_rows_at_once"], groups["actor"], episodes)
    if 0 < rows < episodes:
        out.append(f"--config.rollout.rows_per_wave={rows}")
    distill = bucketed_rows(p["distill_rows_at_once"], groups["extractor"], episodes)
    if 0 < distill < episodes:  # distillation prompts at full extractor context that fit at once
        out.append(f"--config.extractor.rows_per_call={distill}")
    return out, p


# launch/compile_check.py's JSON lines for the paper runs' device functions, per hardware (the TPU compiler's
# per-chip figures; refresh with the commands in WORKSPACE "Paper scale through the TPU compiler").
COMPILE_PLANS = os.path.join(ROOT, "launch", "compile_plans.jsonl")
# Which compile_check config stands for a study: the paper's largest contexts (32,768 actor, 65,536 extractor),
# an upper bound for the configs with shorter ones.
COMPILE_CONFIG = {"main": "configs/minihack_room.py", "capacity": "configs/extractor_capacity.py"}


def compiler_lines(hardware: str, study: str, path: str = COMPILE_PLANS) -> list[dict]:
    """Every ``compile_check`` line of ``path`` for ``hardware`` and ``study``, in file order ([] when none). An
    MoE model's line counts only when it was compiled with the dispatch the run uses (:func:`moe_dispatch_for`;
    "" = the model's ``dropless``): another dispatch is another program."""
    if not path or not os.path.isfile(path):
        return []
    want = moe_dispatch_for(hardware, study) or "dropless"
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if d.get("hardware") != hardware or d.get("config") != COMPILE_CONFIG[study]:
                continue
            if d.get("moe_dispatch", want) == want:
                out.append(d)
    return out


def compiler_figures(hardware: str, study: str, path: str = COMPILE_PLANS) -> dict[str, dict]:
    """``{function: compile_check line}`` for ``hardware`` and ``study`` ({} when none were compiled); of several
    lines for one function the last in the file wins (compile with reproduce.py's overrides last)."""
    return {d["function"]: d for d in compiler_lines(hardware, study, path)}


def _role_of(function: str) -> str:
    """The role a compile_check function belongs to (``extractor_*``: the extractor; else the actor)."""
    return "extractor" if function.startswith("extractor_") else "actor"


def stale_reason(plan: dict, line: dict, rollout_tensor: dict) -> str | None:
    """Why a compile line does not describe the run (another update mesh or micro-batch, another rollout tensor
    split), or None. ``rollout_tensor``: ``{role: split}`` the run uses."""
    fn = line["function"]
    role = _role_of(fn)
    if fn.endswith("_update"):
        m = plan["mesh"][role]
        want = {"data": 1, "fsdp": m["fsdp"], "tensor": m["tensor"]}
        if line["mesh"] != want or line["shapes"].get("micro_batch_rows") != m["fsdp"]:
            return (
                f"compiled on {line['mesh']} x {line['shapes'].get('micro_batch_rows')} rows; "
                f"the run uses {want} x {m['fsdp']}"
            )
        return None
    if line["mesh"]["tensor"] != rollout_tensor[role]:
        return f"compiled at rollout tensor {line['mesh']['tensor']}; the run uses {rollout_tensor[role]}"
    return None


def compiler_check(plan: dict, figures: dict[str, dict], layout: dict | None = None) -> dict:
    """The memory plan beside the compiler: per function the compiler's peak GiB per chip and fits, and for each
    update the plan's figure for that role alone (its resident state + update activations) over the compiler's
    peak (``plan_over_compiler``; > 1: the plan is conservative). ``fits``: every compiled function fits. A line
    compiled for another mesh, micro-batch or rollout split than the run's (``layout``'s, else the plan's) is
    listed under ``stale`` and counts for nothing."""
    tensors = (layout or plan)["rollout_tensor"]
    out = {"functions": {}, "plan_over_compiler": {}, "stale": {}}
    for fn, d in sorted(figures.items()):
        why = stale_reason(plan, d, tensors)
        if why:
            out["stale"][fn] = why
            continue
        out["functions"][fn] = {
            "peak_gib": d.get("peak_gib") or d.get("requested_gib"),
            "fits": d.get("fits"),
        }
    for role in ("actor", "extractor"):
        d = figures.get(f"{role}_update")
        if d and d.get("peak_gib") and f"{role}_update" in out["functions"]:
            planned = sum(plan["state_gib"][role].values()) + sum(
                plan["update_activations_gib"][role].values()
            )
            out["plan_over_compiler"][f"{role}_update"] = round(planned / d["peak_gib"], 3)
    out["fits"] = all(v["fits"] is True for v in out["functions"].values())
    return out


def chosen_figures(lines: list[dict], rollout_tensor: dict) -> dict[str, dict]:
    """``{function: line}``: the last line of each function; a sampler function's at the run's rollout tensor
    split (``{role: split}``) when one was compiled."""
    out = {}
    for d in lines:
        role = _role_of(d["function"])
        if d["function"] in out and not d["function"].endswith("_update"):
            if (
                d["mesh"]["tensor"] != rollout_tensor[role]
                and out[d["function"]]["mesh"]["tensor"] == rollout_tensor[role]
            ):
                continue
        out[d["function"]] = d
    return out


def sampler_cost(line_prefill: dict, line_decode: dict, kv_row_gib: float) -> dict:
    """One role's generation on one chip, from the compiler's lines for its prefill and decode at one rollout
    layout (mesh ``data x tensor``; a row's KV cache split over its ``tensor`` chips, rows over ``data``).

    ``kv_gib``: one row's share of the KV cache per chip (exact: ``kv_row_gib``, bf16 K and V at full context).
    ``copy_gib``: the sampler's weight copy per chip = the decode's arguments less its rows' cache. ``work_gib``:
    the larger of prefill's and decode's temporaries at the compiled rows; taken to grow in proportion beyond them
    (attention scores and logits are per row), never to shrink below.
    """
    mesh, shapes = line_decode["mesh"], line_decode["shapes"]
    rows_chip = shapes["rows"] / mesh["data"]  # rows per tensor group: each chip holds 1/tensor of each
    return {
        "tensor": mesh["tensor"],
        "groups": mesh["data"],
        "rows_compiled": rows_chip,
        "kv_gib": kv_row_gib,
        "copy_gib": max(line_decode["args_gib"] - rows_chip * kv_row_gib, 0.0),
        "work_gib": max(line_prefill["temp_gib"], line_decode["temp_gib"]),
    }


def rows_that_fit(cost: dict, free_gib: float) -> int:
    """Rows per tensor group whose cache, the weight copy and the working set fit in ``free_gib`` per chip."""
    room = free_gib - cost["copy_gib"]
    n = math.floor((room - cost["work_gib"]) / cost["kv_gib"])
    if n > cost["rows_compiled"]:  # beyond the compiled rows the working set grows with the rows
        n = max(
            math.floor(room / (cost["kv_gib"] + cost["work_gib"] / cost["rows_compiled"])),
            int(cost["rows_compiled"]),
        )
    return max(n, 0)


def bucketed_rows(total: int, groups: int, divides: int) -> int:
    """The most rows a wave may ask for: ``d <= total`` dividing ``divides`` (a step's episodes) whose sampler
    bucket (``sampling.bucket``: a power of two, a multiple of the batch shards) is still ``<= total``; 0 if none."""
    from comprl_jax.sampling import bucket

    for d in range(min(total, divides), 0, -1):
        if divides % d == 0 and bucket(d, minimum=1, multiple=groups) <= total:
            return d
    return 0


def compiler_layout(plan: dict, lines: list[dict], episodes: int) -> dict | None:
    """The rollout layout and wave sizes of a co-located paper run from the TPU compiler's figures.

    Per chip, with the compiler's numbers: a role's resident state is its update's arguments (float32 params and
    Adam moments), an update's peak is its peak, a sampler's copy / cache / working set are :func:`sampler_cost`.
    The phases that overlap (trainer.py) must fit ``hbm_gib x plan_memory.USABLE``:

      rollout || extractor update: actor state + extractor update peak + both sampler copies + embedder
                                   + actor working set + rows x actor KV row
      distillation || actor update: extractor state + actor update peak + both sampler copies + embedder
                                   + extractor working set + rows x extractor KV row

    Every compiled rollout tensor split of each role (``{role}.rollout_tensor``) is tried; the pair with the fewest
    rollout + distillation waves wins (ties: the smaller split). ``None`` when the lines lack a role's update or
    sampler functions. The updates' meshes and micro-batches must be the plan's (``mismatch`` otherwise: the
    figures describe another run, recompile)."""
    pm = _plan_memory()
    by_fn: dict[str, list[dict]] = {}
    for d in lines:
        by_fn.setdefault(d["function"], []).append(d)
    ups = {r: (by_fn.get(f"{r}_update") or [None])[-1] for r in ("actor", "extractor")}
    if not all(u and u.get("peak_gib") for u in ups.values()):
        return None
    mismatch = [
        f"{r}_update {why}" for r, u in ups.items() if (why := stale_reason(plan, u, plan["rollout_tensor"]))
    ]
    seq = {"actor": pm.PAPER["actor_seq"], "extractor": pm.PAPER["extractor_seq"]}
    cfgs = {"actor": pm.named_config(pm.PAPER["actor"]), "extractor": pm.named_config(plan["extractor"])}
    costs: dict[str, dict[int, dict]] = {}
    for r, prefix in (("actor", ""), ("extractor", "extractor_")):
        pre = {d["mesh"]["tensor"]: d for d in by_fn.get(f"{prefix}prefill", []) if d.get("fits")}
        dec = {d["mesh"]["tensor"]: d for d in by_fn.get(f"{prefix}decode", []) if d.get("fits")}
        costs[r] = {
            t: sampler_cost(pre[t], dec[t], pm.kv_bytes_per_row(cfgs[r], seq[r], t) / pm.GIB)
            for t in sorted(set(pre) & set(dec))
        }
        if not costs[r]:
            return None
    usable = ups["actor"]["hbm_gib"] * pm.USABLE
    emb = plan["state_gib"]["embedder"]
    best = None
    for ta, ca in costs["actor"].items():
        for te, ce in costs["extractor"].items():
            copies = ca["copy_gib"] + ce["copy_gib"]
            free_rollout = (
                usable - ups["actor"]["args_gib"] - ups["extractor"]["peak_gib"] - emb - ce["copy_gib"]
            )
            free_distill = (
                usable - ups["extractor"]["args_gib"] - ups["actor"]["peak_gib"] - emb - ca["copy_gib"]
            )
            rollout = bucketed_rows(rows_that_fit(ca, free_rollout) * ca["groups"], ca["groups"], episodes)
            distill = bucketed_rows(rows_that_fit(ce, free_distill) * ce["groups"], ce["groups"], episodes)
            waves = (-(-episodes // rollout) if rollout else math.inf) + (
                -(-episodes // distill) if distill else math.inf
            )
            cand = {
                "rollout_tensor": {"actor": ta, "extractor": te},
                "rows_per_wave": rollout,
                "rows_per_call": distill,
                "rollout_waves": -(-episodes // rollout) if rollout else None,
                "distill_waves": -(-episodes // distill) if distill else None,
                "sampler_copies_gib": round(copies, 2),
                "free_gib": {"rollout": round(free_rollout, 2), "distill": round(free_distill, 2)},
                "usable_gib": round(usable, 2),
                "fits": bool(rollout and distill) and not mismatch,
                "mismatch": mismatch,
                "_key": (waves, ta * te),
            }
            if best is None or cand["_key"] < best["_key"]:
                best = cand
    best.pop("_key")
    return best


def _model_dir(models_dir: str, name: str) -> str:
    return os.path.join(models_dir, name.rstrip("/").split("/")[-1])


def _variant(scale: str, extras: str, method: str) -> str:
    return ",".join(w for w in ("smollm" if scale == "smollm" else "", extras, method) if w)


def workdir(root: str, table: str, scale: str, name: str, extras: str, method: str, seed) -> str:
    tag = "".join("_" + w.replace("=", "") for w in extras.split(",") if w)
    sub = f"table{table}" if table == "1" else table
    return os.path.join(root, sub + ("_smollm" if scale == "smollm" else ""), f"{name}{tag}_{method}_s{seed}")


def default_hardware(launcher: str, scale: str, hardware: str) -> str:
    if scale == "smollm":
        if hardware not in ("", "none"):
            raise lu.LaunchError(
                f"--hardware={hardware} plans the paper's models; --scale=smollm runs on one device",
                "drop --hardware (or use --hardware=none)",
            )
        return "none"
    return hardware or "auto"


def run_hardware(hardware: str, launcher: str, study: str) -> str:
    """``auto``: a v5p-64 through tpu_pod, else one 8xH100 node, or two 8xH200 nodes for the capacity study (its
    MoE extractor, with the samplers' weight copies, fits neither 8xH100 nor one 8xH200 node: WORKSPACE "Mixture of
    experts")."""
    if hardware != "auto":
        return hardware
    if launcher == "tpu_pod":
        return "v5p-64"
    return "16xh200" if study == "capacity" else "8xh100"


def launcher_argv(launcher: str, config_arg: str, wd: str, train_args: list[str], opts: dict) -> list[str]:
    """The command of one run through a recipe (argument conventions of launch/tpu_pod.sh, slurm.sbatch)."""
    if launcher == "local":
        return [
            ".venv/bin/python",
            "launch/train.py",
            f"--config={config_arg}",
            f"--workdir={wd}",
            *train_args,
        ]
    if launcher == "tpu_pod":
        return ["launch/tpu_pod.sh", "train", opts["tpu_name"], opts["zone"], config_arg, wd, *train_args]
    if launcher == "slurm":
        name = "comprl-" + os.path.basename(wd)
        nodes = opts["nodes"] or _hosts(opts["hardware"])
        sbatch = ["sbatch", f"--nodes={nodes}", f"--job-name={name}"]
        return [*sbatch, "launch/slurm.sbatch", config_arg, wd, *train_args]
    raise ValueError(f"launcher {launcher!r} unknown")


def paper_setup(
    hw: str, study: str, episodes: int, opts: dict
) -> tuple[dict, dict | None, dict | None, bool]:
    """A paper run on ``hw``: ``(plan, layout, compiler, fits)``. The memory plan (with the study's MoE dispatch
    there), the TPU compiler's layout and check where ``opts["compile_plans"]`` has lines for it (else None), and
    whether it fits: the plan, and the compiler's word on the same functions, which overrides the plan's."""
    plan = _plan_memory().best_paper_plan(
        hw, "colocated", study=study, moe_dispatch=moe_dispatch_for(hw, study)
    )
    lines = compiler_lines(hw, study, opts.get("compile_plans", COMPILE_PLANS))
    layout = compiler_layout(plan, lines, episodes) if lines else None
    fits, compiler = plan["fits"], None
    if lines:
        compiler = compiler_check(plan, chosen_figures(lines, (layout or plan)["rollout_tensor"]), layout)
        compiler["layout"] = layout
        fits = fits and compiler["fits"] and (layout is None or layout["fits"])
    return plan, layout, compiler, fits


def plan_runs(table: str, opts: dict) -> list[dict]:
    """Every run of ``table``: ``{"table", "config", "variant", "method", "seed", "workdir", "command",
    "argv", "overrides", "runnable", "fits", "note"}``; ``opts`` holds the flag values (see :func:`options`)."""
    scale = opts["scale"]
    runs = []
    for arm in arms(table, scale):
        name, extras = arm["config"], arm["extras"]
        for method in arm["methods"]:
            variant = _variant(scale, extras, method)
            c = load_config(name, variant)  # builds and validates: the command's config exists
            tasks = opts["tasks_per_step"] or c.rollout.tasks_per_step
            episodes = tasks * c.rollout.group_size * len(c.env.tasks)
            study = "capacity" if name == "extractor_capacity" else "main"
            hw = run_hardware(opts["hardware"], opts["launcher"], study)
            # the same for every seed: the plan's meshes, the compiler's layout and verdict
            mesh, fits, plan, compiler = [], True, None, None
            if hw != "none":
                plan, layout, compiler, fits = paper_setup(hw, study, episodes, opts)
                mesh, _ = mesh_overrides(hw, study, episodes, layout, plan)
            for seed in opts["seeds"]:
                args = [f"--config.seed={int(seed)}"]
                if opts["tasks_per_step"]:
                    args.append(f"--config.rollout.tasks_per_step={tasks}")
                args += mesh
                if opts["models_dir"] and scale == "paper":
                    args.append(f"--config.actor.model={_model_dir(opts['models_dir'], c.actor.model)}")
                    if c.experience.enabled:
                        args.append(
                            f"--config.extractor.model={_model_dir(opts['models_dir'], c.extractor.model)}"
                        )
                        args.append(
                            f"--config.retrieval.embedder="
                            f"{_model_dir(opts['models_dir'], c.retrieval.embedder)}"
                        )
                args += list(opts["train_flags"])
                wd = workdir(opts["root"], table, scale, name, extras, method, seed)
                config_arg = f"configs/{name}.py:{variant}"
                argv = launcher_argv(opts["launcher"], config_arg, wd, args, {**opts, "hardware": hw})
                note = arm["note"]
                if name in NOT_RUNNABLE:
                    note += "; NOT RUNNABLE: " + NOT_RUNNABLE[name]
                if not fits:
                    why = "memory plan" if plan is not None and not plan["fits"] else "TPU compiler"
                    note += f"; does not fit {hw} ({why}): use another --hardware"
                runs.append(
                    {
                        "table": table,
                        "scale": scale,
                        "config": f"configs/{name}.py",
                        "variant": variant,
                        "experiment": c.experiment,
                        "method": method,
                        "seed": int(seed),
                        "workdir": wd,
                        "launcher": opts["launcher"],
                        "hardware": hw,
                        "overrides": args,
                        "argv": argv,
                        "command": shlex.join(argv),
                        "runnable": name not in NOT_RUNNABLE and fits,
                        "fits": fits,
                        "compiler": compiler,
                        "steps": int(c.train.steps),
                        "episodes_per_step": episodes,
                        "note": note,
                    }
                )
    return runs


def reused_workdirs(table: str, opts: dict) -> list[str]:
    """Workdirs of the other tables' runs that ``table`` is read against."""
    return [
        workdir(opts["root"], t, opts["scale"], name, extras, method, seed)
        for t, name, extras, method in REUSES.get(table, [])
        for seed in opts["seeds"]
    ]


def make_tables_command(table: str, runs: list[dict], opts: dict) -> str:
    """``launch/make_tables.py`` over the table's workdirs (and the runs it is read against)."""
    dirs = [r["workdir"] for r in runs] + reused_workdirs(table, opts)
    stem = os.path.join(opts["root"], f"table{table}" if table == "1" else table)
    stem += "_smollm" if opts["scale"] == "smollm" else ""
    return shlex.join(
        [
            ".venv/bin/python",
            "launch/make_tables.py",
            "--runs=" + ",".join(dirs),
            f"--out={stem}.md",
            f"--plot={stem}.png",
        ]
    )


# -- estimates ---------------------------------------------------------------------------------------------
# Every assumed number of the throughput model (none measured on an accelerator). Token counts per turn:
# generated (the actor's <think> + <answer>; constrained runs: the measured "<answer>...</answer>" + end token)
# and observation (SmolLM2's tokenizer on MiniHack Room: 55-71 tokens; Qwen's BPE is comparable).
ASSUMED = {
    "peak_flops": {  # dense, per chip (vendor figures)
        "v5p": 459e12,  # bf16
        "h100_bf16": 989e12,  # H100/H200 SXM, bf16 dense
        "h100_tf32": 495e12,  # float32 dots at XLA's default precision (TF32): the :smollm models' dtype
        "cpu_2core": 2 * 2.45e9 * 32,  # this machine: 2 cores x 2.45 GHz x 32 fp32 FLOP/cycle (AVX2, 2 FMA)
    },
    "mfu": {  # model FLOPs utilisation (remat recompute is not model FLOPs: it hides in these)
        "paper": {"update": 0.35, "generate": 0.05},
        "smollm_gpu": {"update": 0.10, "generate": 0.01},
    },
    "tokens": {
        "prompt": {
            "paper": 512,
            "smollm": 256,
        },  # system + goal + first observation (measured 217-230, SmolLM2)
        "experience_block": 512,  # a guided episode's retrieved entry (<= 2,000 chars) + header + tool text
        "generate_per_turn": 256,  # unconstrained actor (capped by actor.sampling.max_new_tokens)
        "generate_per_turn_constrained": {"default": 10, "comprl/ALFWorld-v0": 13, "comprl/WebShop-v0": 13},
        "observation_per_turn": {
            "default": 80,
            "comprl/MiniHack-MazeWalk-9x9-v0": 150,
            "comprl/ALFWorld-v0": 100,
            "comprl/WebShop-v0": 400,
            "comprl/SWEBench-Verified-v0": 1500,
            "comprl/SWE-Lite-v0": 1500,  # tool output, capped at 6,000 characters (envs/swe/tools.py OBS_CHARS)
        },
        "swe_generate_per_turn": 1024,
        "extractor_instructions": 256,  # distil / merge prompt text, chat-wrapped (measured: 252, SmolLM2)
        "previous_lessons": 512,  # related lessons shown to the distillation call (none while the bank is empty)
        "refine_instructions": 128,  # search & ask prompt text (measured: 106) + the question
        "extractor_generate": 2048,  # a Thinking extractor's reply (capped by extractor.sampling.max_new_tokens)
        "chars_per_token": 4,
        "merge_entry": 256,
    },
    "turn_fraction": 1.0,  # episodes play env.max_turns (an upper bound: successes end early)
    "search_ask_per_guided_episode": 1.0,  # of at most 2
    "bank_net_adds_per_distillation": 0.5,  # bank growth net of merges (capped at bank.capacity)
    "overhead_s_per_turn": 0.1,  # host work per turn and wave: env steps, tokenisation, dispatch
}
HARDWARE = {  # chips and per-chip peak; v5p-64 / 8xH100 / 8xH200 as launch/plan_memory.HARDWARE
    "v5p-64": (32, ASSUMED["peak_flops"]["v5p"]),
    "8xh100": (8, ASSUMED["peak_flops"]["h100_bf16"]),
    "8xh200": (8, ASSUMED["peak_flops"]["h100_bf16"]),
    "16xh100": (16, ASSUMED["peak_flops"]["h100_bf16"]),
    "16xh200": (16, ASSUMED["peak_flops"]["h100_bf16"]),
    "1xh100": (1, ASSUMED["peak_flops"]["h100_tf32"]),
    "cpu": (1, ASSUMED["peak_flops"]["cpu_2core"]),
}
_ALIASES = {"qwen3-4b-instruct-2507": "qwen3-4b-thinking-2507"}  # same architecture (4.02 B)


def model_shape(spec: str) -> dict:
    """``{"params", "active", "layers", "attn_width"}`` of a model named in a config (HF name or preset), from
    ``comprl_jax/models/presets/*.json`` through plan_memory's abstract parameter tree (MoE: active = top-k experts)."""
    pm = _plan_memory()
    from comprl_jax.models.config import named_config

    name = spec.rstrip("/").split("/")[-1].lower().replace("_", "-")
    name = _ALIASES.get(name, name)
    cfg = named_config(name)
    total = pm.plan(name, {"data": 1, "fsdp": 1, "tensor": 1}, 1, 1, "float32", "bfloat16")["param_count"]
    active = total
    if cfg.num_experts:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        active -= len(cfg.moe_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    return {
        "params": total,
        "active": active,
        "layers": cfg.num_layers,
        "attn_width": cfg.num_heads * cfg.head_dim,
    }


def fwd_flops(shape: dict, tokens: float, context: float) -> float:
    """Forward FLOPs of ``tokens`` tokens of sequences ``context`` long: 2 N per token (N = active parameters)
    plus causal attention, 4 x layers x H x dh x (context / 2) per token (QK^T and AV over half the keys)."""
    return tokens * (2 * shape["active"] + 2 * shape["layers"] * shape["attn_width"] * context)


def _bucket(n: int, cap: int) -> int:
    from comprl_jax.roles.batching import bucket

    return bucket(min(n, cap), maximum=cap)


def trajectory_tokens(c, scale: str, empty_bank: bool = False) -> dict:
    """Assumed tokens of one free / guided trajectory per env (``turns x (generated + observation)`` + prompt,
    capped at ``rollout.max_context``), and the generated share. ``empty_bank``: the first step (no entry to
    put in a guided prompt yet)."""
    t = ASSUMED["tokens"]
    block = 0 if empty_bank else t["experience_block"]
    out = {}
    for env in c.env.tasks:
        turns = c.env.max_turns * ASSUMED["turn_fraction"]
        if c.actor.constrained:
            gen = t["generate_per_turn_constrained"].get(env, t["generate_per_turn_constrained"]["default"])
        else:
            gen = t["swe_generate_per_turn"] if "SWE" in env else t["generate_per_turn"]
            gen = min(gen, c.actor.sampling.max_new_tokens)
        obs = t["observation_per_turn"].get(env, t["observation_per_turn"]["default"])
        free = t["prompt"][scale] + turns * (gen + obs)
        out[env] = {
            "free": min(free, c.rollout.max_context),
            "guided": min(free + block, c.rollout.max_context),
            "generated": min(turns * gen, c.rollout.max_context),
        }
    return out


def step_flops(c, scale: str, tasks_per_step: int = 0, first_step: bool = False) -> dict:
    """Model FLOPs of one training step of config ``c`` (method flags as the config sets them), by phase.

    * actor rollout: forward over every trajectory token (prefill + decode with a KV cache);
    * actor update: 3 forwards (forward + backward) + 1 (pi_old recomputed on the pre-update weights) over the
      batch padded to its power-of-two length bucket (``batching.bucket``), one row per trajectory;
    * distillation (experience runs, not Offline): one extractor call per trajectory (``distill_from=all``; half
      for ``guided``) over instructions + transcript (<= ``transcript_chars`` / 4 tokens) + its reply;
      search & ask: one call per guided episode; merge every ``merge_every`` steps over the bank in chunks
      (bank size: the run's mean of ``min(capacity, net adds x step)``);
    * extractor update (``extractor.train``): 3 forwards per sample token; samples per step = unique entries
      retrieved (one per guided episode) + search & ask calls (the buffer pops them 64 at a time).

    ``first_step``: step 0 of a run as measured (empty bank: no experience block, no merge; the extractor
    updates only if one step's samples fill ``extractor.buffer.batch_size``). Otherwise a step of the run on average.
    """
    t = ASSUMED["tokens"]
    tasks = tasks_per_step or c.rollout.tasks_per_step
    K = c.rollout.group_size
    actor = model_shape(c.actor.model)
    experience = bool(c.experience.enabled)
    guided_frac = 0.5 if experience else 0.0
    trajs = trajectory_tokens(c, scale, empty_bank=first_step)
    out = {"actor_rollout": 0.0, "actor_update": 0.0, "distillation": 0.0, "extractor_update": 0.0}
    episodes = tasks * K * len(c.env.tasks)
    longest = 0
    distill_tokens = []  # (calls, tokens per call) per env
    for tok in trajs.values():
        n = tasks * K
        n_g, n_f = n * guided_frac, n * (1 - guided_frac)
        out["actor_rollout"] += fwd_flops(actor, n_f * tok["free"], tok["free"])
        out["actor_rollout"] += fwd_flops(actor, n_g * tok["guided"], tok["guided"])
        longest = max(longest, tok["guided"] if experience else tok["free"])
        transcript = min(tok["guided"], c.extractor.transcript_chars / t["chars_per_token"])
        gen_e = min(t["extractor_generate"], c.extractor.sampling.max_new_tokens)
        lessons = 0 if first_step else t["previous_lessons"]
        call = min(t["extractor_instructions"] + lessons + transcript + gen_e, c.extractor.max_context)
        calls = n * (1.0 if c.extractor.distill_from == "all" else 0.5)
        distill_tokens.append((calls, call))
    if c.actor.train:
        T = _bucket(int(math.ceil(longest)), c.rollout.max_context)
        out["actor_update"] = 4 * fwd_flops(actor, episodes * T, T)
    guided = episodes * guided_frac
    if experience:
        ext = model_shape(c.extractor.model)
        gen_e = min(t["extractor_generate"], c.extractor.sampling.max_new_tokens)
        ask_calls = guided * ASSUMED["search_ask_per_guided_episode"] if c.retrieval.search_and_ask else 0.0
        ask_tokens = t["refine_instructions"] + (0 if first_step else t["experience_block"]) + gen_e
        if not c.bank.offline:
            for calls, call in distill_tokens:
                out["distillation"] += fwd_flops(ext, calls * call, call)
            if c.bank.merge and not first_step:
                adds = sum(calls for calls, _ in distill_tokens) * ASSUMED["bank_net_adds_per_distillation"]
                steps = c.train.steps
                mean_bank = sum(min(c.bank.capacity, adds * s) for s in range(steps)) / steps
                merge_calls = mean_bank / (c.bank.merge_chunk * c.bank.merge_every)
                merge_tokens = t["extractor_instructions"] + c.bank.merge_chunk * t["merge_entry"] + gen_e
                out["distillation"] += fwd_flops(ext, merge_calls * merge_tokens, merge_tokens)
        out["distillation"] += fwd_flops(ext, ask_calls * ask_tokens, ask_tokens)
        if c.extractor.train and not (first_step and guided + ask_calls < c.extractor.buffer.batch_size):
            mean_call = sum(n * k for n, k in distill_tokens) / max(sum(n for n, _ in distill_tokens), 1)
            samples = guided + ask_calls
            S = _bucket(int(math.ceil(mean_call)), c.extractor.max_context)
            out["extractor_update"] = 3 * fwd_flops(ext, samples * S, S)
    out["episodes"] = episodes
    out["trajectory_tokens"] = trajs
    return out


def eval_flops(c, scale: str) -> float:
    """The final held-out evaluation: ``eval_tasks`` x K/2 episodes per env and split, without experience and
    (experience runs) with it; rollout only."""
    from comprl_jax.envs import registry

    actor = model_shape(c.actor.model)
    total = 0.0
    modes = 2 if c.experience.enabled else 1
    for env, tok in trajectory_tokens(c, scale).items():
        try:
            splits = len(registry.eval_splits(env, c.env.eval_split))
        except KeyError:  # an env this project does not ship (SWE-Bench): one split
            splits = 1
        n = c.train.eval_tasks * (c.rollout.group_size // 2) * splits * modes
        total += fwd_flops(actor, n * tok["free"], tok["free"])
    return total


def run_estimate(c, scale: str, hardware: str, waves: int = 1, tasks_per_step: int = 0) -> dict:
    """Wall hours and device-hours of one run of config ``c`` on ``hardware``:

    step_s = generate FLOPs / (chips x peak x MFU_generate) + update FLOPs / (chips x peak x MFU_update)
             + env.max_turns x waves x overhead_s_per_turn
    run_s  = steps x step_s + evaluation (generate) + Offline Exp.'s bank build (``offline_build_steps`` x the
             step's rollout + distillation).
    Phases add up: co-located roles share every chip, so overlapping them saves no FLOPs.
    """
    chips, peak = HARDWARE[hardware]
    mfu = ASSUMED["mfu"]["paper" if scale == "paper" else "smollm_gpu"]
    f = step_flops(c, scale, tasks_per_step)
    gen = f["actor_rollout"] + f["distillation"]
    upd = f["actor_update"] + f["extractor_update"]
    gen_rate, upd_rate = chips * peak * mfu["generate"], chips * peak * mfu["update"]
    overhead = c.env.max_turns * ASSUMED["turn_fraction"] * waves * ASSUMED["overhead_s_per_turn"]
    step_s = gen / gen_rate + upd / upd_rate + overhead
    extra_s = eval_flops(c, scale) / gen_rate
    if c.bank.offline:
        extra_s += c.bank.offline_build_steps * (f["actor_rollout"] + f["distillation"]) / gen_rate
    run_s = c.train.steps * step_s + extra_s
    return {
        "hardware": hardware,
        "chips": chips,
        "flops_per_step": {
            k: f[k] for k in ("actor_rollout", "actor_update", "distillation", "extractor_update")
        },
        "episodes_per_step": f["episodes"],
        "trajectory_tokens": f["trajectory_tokens"],
        "step_s": step_s,
        "steps": int(c.train.steps),
        "eval_and_build_s": extra_s,
        "wall_h": run_s / 3600,
        "device_h": chips * run_s / 3600,
    }


def cpu_anchor() -> dict:
    """The model against the one measured step time: ``configs/minihack_room.py:smollm`` at 1 task x 4 episodes
    x 3 turns on this 2-core CPU took 70-82 s per step, 53-57 s of it the actor update (issue 19, idle machine).
    Returns the model's FLOPs for that step and the efficiency the measurement implies."""
    import ml_collections

    c = ml_collections.ConfigDict(load_config("minihack_room", "smollm").to_dict())
    c.rollout.tasks_per_step, c.rollout.group_size, c.env.max_turns = 1, 4, 3
    f = step_flops(c, "smollm", first_step=True)
    _, peak = HARDWARE["cpu"]
    update_s, step_s = (53 + 57) / 2, (70 + 82) / 2
    gen = f["actor_rollout"] + f["distillation"]
    return {
        "anchor": "configs/minihack_room.py:smollm, 1 task x 4 episodes x 3 turns, 2-core CPU (issue 19)",
        "measured_step_s": [70, 82],
        "measured_actor_update_s": [53, 57],
        "flops": {k: f[k] for k in ("actor_rollout", "actor_update", "distillation", "extractor_update")},
        "cpu_peak_flops": peak,
        "implied_update_efficiency": f["actor_update"] / (update_s * peak),
        "implied_generate_efficiency": gen / ((step_s - update_s) * peak),
        # one efficiency fitted to the update alone, applied to every FLOP of the step
        "model_step_s_at_update_efficiency": (gen + f["actor_update"]) / (f["actor_update"] / update_s),
        "note": "one fitted efficiency reproduces the whole measured step: on this CPU the step is compute-bound; "
        "accelerator figures are modelled with assumed MFUs, not measured",
    }


def define_flags() -> None:
    """The command line (defined only when run as a script: importing this module defines no absl flag)."""
    flags.DEFINE_enum("table", None, [*TABLES, "all"], "which paper table (SPEC §11)")
    flags.DEFINE_enum(
        "scale", "paper", ["paper", "smollm"], "paper models, or SmolLM2-135M-Instruct on one GPU"
    )
    flags.DEFINE_list("seeds", list(SEEDS_DEFAULT), "seeds of every arm (--config.seed)")
    flags.DEFINE_string("root", "runs", "run directories go under <root>/<table>/ (shared by all hosts)")
    flags.DEFINE_enum(
        "launcher", "local", ["local", "tpu_pod", "slurm"], "launch/train.py, tpu_pod.sh or slurm.sbatch"
    )
    flags.DEFINE_enum(
        "hardware",
        "",
        ["", "v5p-64", "8xh100", "8xh200", "16xh100", "16xh200", "none"],
        "meshes from the memory plan of this hardware (default: tpu_pod v5p-64, else 8xh100, capacity 16xh200)",
    )
    flags.DEFINE_string("models_dir", "", "folder of downloaded HF models, one sub-folder per repo name")
    flags.DEFINE_string("tpu_name", "TPU_NAME", "tpu_pod: the TPU VM slice")
    flags.DEFINE_string("zone", "ZONE", "tpu_pod: its zone")
    flags.DEFINE_integer("nodes", 0, "slurm: nodes per run (0 = the hardware's hosts)")
    flags.DEFINE_integer(
        "tasks_per_step",
        0,
        "override rollout.tasks_per_step (0 = the configs' 16 per env; 128 = the 128 x 8 reading)",
    )
    flags.DEFINE_list("train_flags", [], "extra launch/train.py flags for every run (e.g. --stop_after=1)")
    flags.DEFINE_string(
        "compile_plans",
        COMPILE_PLANS,
        "launch/compile_check.py lines that check each run's functions on its hardware ('' = the memory plan alone)",
    )
    flags.DEFINE_bool("execute", False, "run the commands (local, tpu_pod) or submit them (slurm)")
    flags.DEFINE_bool("estimate", False, "print device-hour estimates (JSON lines) instead")
    flags.DEFINE_list(
        "estimate_on", [], "hardware of the estimates (default: v5p-64,8xh100,16xh200; smollm: 1xh100)"
    )


# -- main --------------------------------------------------------------------------------------------------
def options() -> dict:
    F = flags.FLAGS
    scale = F.scale
    return {
        "scale": scale,
        "seeds": [int(s) for s in F.seeds],
        "root": F.root,
        "launcher": F.launcher,
        "hardware": default_hardware(F.launcher, scale, F.hardware),
        "models_dir": F.models_dir,
        "tpu_name": F.tpu_name,
        "zone": F.zone,
        "nodes": F.nodes,  # 0: the hardware's hosts
        "tasks_per_step": F.tasks_per_step,
        "train_flags": F.train_flags,
        "compile_plans": F.compile_plans,
    }


def _hosts(hardware: str) -> int:
    return {"16xh100": 2, "16xh200": 2}.get(hardware, 1)


def estimates(tables: list[str], opts: dict, on: list[str]) -> list[dict]:
    """One row per (run, hardware), then one total per (table, hardware)."""
    rows = [{"anchor": cpu_anchor()}] if opts["scale"] == "smollm" or "cpu" in on else []
    for table in tables:
        totals: dict[str, dict] = {}
        for arm in arms(table, opts["scale"]):
            for method in arm["methods"]:
                variant = _variant(opts["scale"], arm["extras"], method)
                c = load_config(arm["config"], variant)
                study = "capacity" if arm["config"] == "extractor_capacity" else "main"
                for hw in on:
                    fits, waves = True, 1
                    if opts["scale"] == "paper" and hw in _plan_memory().HARDWARE:
                        tasks = opts["tasks_per_step"] or c.rollout.tasks_per_step
                        episodes = tasks * c.rollout.group_size * len(c.env.tasks)
                        p, layout, _, fits = paper_setup(hw, study, episodes, opts)
                        if layout is not None:  # the waves the run will use: the compiler's
                            waves = layout["rollout_waves"] or 0
                        else:
                            rows_at_once = p["rollout_rows_at_once"]
                            waves = -(-episodes // rows_at_once) if rows_at_once else 0
                    row = {
                        "table": table,
                        "config": f"configs/{arm['config']}.py:{variant}",
                        "method": method,
                        "seeds": len(opts["seeds"]),
                        "fits": fits,
                    }
                    if fits:
                        e = run_estimate(c, opts["scale"], hw, waves, opts["tasks_per_step"])
                        row.update(e)
                        tot = totals.setdefault(hw, {"runs": 0, "wall_h": 0.0, "device_h": 0.0})
                        tot["runs"] += len(opts["seeds"])
                        tot["wall_h"] += len(opts["seeds"]) * e["wall_h"]
                        tot["device_h"] += len(opts["seeds"]) * e["device_h"]
                    else:
                        row.update({"hardware": hw, "wall_h": None, "device_h": None})
                        totals.setdefault(hw, {"runs": 0, "wall_h": 0.0, "device_h": 0.0, "unfit": 0})
                        totals[hw]["unfit"] = totals[hw].get("unfit", 0) + len(opts["seeds"])
                    rows.append(row)
        for hw, tot in totals.items():
            rows.append({"table": table, "total": True, "hardware": hw, "scale": opts["scale"], **tot})
    return rows


def main(argv):
    del argv
    lu.configure_logging(lu.flag_verbosity())
    F = flags.FLAGS
    if F.table is None:
        raise lu.LaunchError("--table is required", f"choose one of {TABLES} or all")
    tables = list(TABLES) if F.table == "all" else [F.table]
    opts = options()
    if F.estimate:
        on = F.estimate_on or (["1xh100"] if opts["scale"] == "smollm" else ["v5p-64", "8xh100", "16xh200"])
        unknown = [h for h in on if h not in HARDWARE]
        if unknown:
            raise lu.LaunchError(f"--estimate_on: {unknown} unknown", f"choose from {sorted(HARDWARE)}")
        for row in estimates(tables, opts, on):
            print(json.dumps(row))
        print("# modelled, not measured on accelerators: see launch/reproduce.py ASSUMED", file=sys.stderr)
        return
    if opts["launcher"] != "local" and not os.path.isabs(opts["root"]):
        print(
            f"warning: --root={opts['root']} is relative: every host of a {opts['launcher']} run must see one "
            "shared workdir (e.g. --root=/mnt/shared/runs)",
            file=sys.stderr,
        )
    for table in tables:
        runs = plan_runs(table, opts)
        if not runs:
            print(f"# table {table}: no runs at --scale={opts['scale']}: {SMOLLM_SKIPS[table]}")
            continue
        for r in runs:
            print(("" if r["runnable"] else "# not runnable: ") + r["command"])
            print("# " + json.dumps({k: v for k, v in r.items() if k not in ("argv",)}))
        mt = make_tables_command(table, runs, opts)
        if reused_workdirs(table, opts):
            print(
                "# reads beside these runs (launched by another table): "
                + " ".join(reused_workdirs(table, opts))
            )
        print("# when the runs are done: " + mt)
        print("# " + json.dumps({"table": table, "make_tables": mt, "runs": len(runs)}))
        if F.execute:
            execute(runs, opts)


def execute(runs: list[dict], opts: dict) -> None:
    """Runs each runnable command from the repository root, in order; stops at the first failure."""
    if opts["launcher"] == "tpu_pod" and (opts["tpu_name"] == "TPU_NAME" or opts["zone"] == "ZONE"):
        raise lu.LaunchError("--execute --launcher=tpu_pod needs --tpu_name and --zone", "pass both")
    for r in runs:
        if not r["runnable"]:
            print(f"skipped (not runnable): {r['workdir']}: {r['note']}", file=sys.stderr)
            continue
        argv = list(r["argv"])
        if argv[0] == ".venv/bin/python" and not os.path.exists(os.path.join(ROOT, argv[0])):
            argv[0] = sys.executable
        print(f"running: {shlex.join(argv)}", file=sys.stderr, flush=True)
        code = subprocess.run(argv, cwd=ROOT).returncode
        if code:
            raise lu.LaunchError(
                f"run {r['workdir']} exited with {code}",
                "fix it and re-run: finished runs resume (auto-resume)",
                1,
            )


if __name__ == "__main__":
    define_flags()
    lu.run(main)
