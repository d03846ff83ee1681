"""launch/reproduce.py: every run of each paper table with the right configs / methods / seeds, commands that
train.py and the recipes accept, and device-hour estimates that follow their formula (checked by hand).

Nothing trains and no model is loaded: configs are built and validated, train.py runs with --print_config, the
recipes with their own dry-run hooks (tpu_pod.sh DRY_RUN=1, slurm.sbatch SRUN=echo).
"""

import functools
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "reproduce.py")
SEEDS = {0, 1, 2}
T1 = ("complementary", "baseline", "static_online", "exp_only", "offline")
# Every arm of every table, by hand: (config, variant).
EXPECTED = {
    "1": {("multitask3", m) for m in T1},
    "scaling": {("task_scaling", f"tasks={n},{m}") for n in (1, 3, 6) for m in ("complementary", "baseline")},
    "capacity": {("extractor_capacity", "complementary")},
    "single": {
        (c, m)
        for c in ("minihack_room", "alfworld", "webshop", "swebench")
        for m in ("complementary", "baseline")
    }
    | {("ablation_no_merge", "complementary"), ("ablation_no_search_ask", "complementary")},
}
QWEN25_7B = 7_615_616_512  # tests/test_plan_memory.py counts it by hand from config.json
SMOLLM2 = (
    134_515_008  # 30 x (2 x 576^2 + 2 x 576 x 192 + 3 x 576 x 1536 + 2 x 576) + 49152 x 576 + 576 (tied)
)


@functools.lru_cache(maxsize=1)
def _rp():
    spec = importlib.util.spec_from_file_location("reproduce", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines no absl flag (define_flags() runs only as a script)
    return mod


def _cli(*args, env=None):
    out = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out


def _runs(stdout: str) -> tuple[list[dict], list[str], list[dict]]:
    """(run JSON lines, command lines, table JSON lines) of a dry run."""
    runs, cmds, tables = [], [], []
    for line in stdout.splitlines():
        if line.startswith("# {"):
            row = json.loads(line[2:])
            (tables if "make_tables" in row else runs).append(row)
        elif line.startswith("# not runnable: "):
            cmds.append(line[len("# not runnable: ") :])
        elif line and not line.startswith("#"):
            cmds.append(line)
    return runs, cmds, tables


def _apply(c, overrides: list[str]):
    """Sets each ``--config.a.b=v`` on the built config (a locked ConfigDict refuses an unknown key), typed like
    the value it replaces; returns the other flags."""
    rest = []
    for flag in overrides:
        if not flag.startswith("--config."):
            rest.append(flag)
            continue
        key, value = flag[len("--config.") :].split("=", 1)
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        old = node[leaf]  # KeyError: the command names a key the config does not have
        node[leaf] = type(old)(value) if not isinstance(old, bool) else value == "True"
    return rest


@pytest.fixture(scope="module")
def dry_run():
    return _runs(_cli("--table=all", "--models_dir=/models").stdout)


def test_every_table_lists_its_runs(dry_run):
    runs, cmds, tables = dry_run
    assert len(runs) == len(cmds) == 15 + 18 + 3 + 30
    assert {t["table"]: t["runs"] for t in tables} == {"1": 15, "scaling": 18, "capacity": 3, "single": 30}
    for table, arms in EXPECTED.items():
        got = [r for r in runs if r["table"] == table]
        assert {(r["config"], r["variant"]) for r in got} == {(f"configs/{c}.py", v) for c, v in arms}
        for c, v in arms:  # every arm: the three seeds, each once
            seeds = [r["seed"] for r in got if (r["config"], r["variant"]) == (f"configs/{c}.py", v)]
            assert sorted(seeds) == sorted(SEEDS), (table, c, v)
    assert len({r["workdir"] for r in runs}) == len(runs)
    assert runs[0]["workdir"] == "runs/table1/multitask3_complementary_s0"
    assert {r["workdir"] for r in runs if r["config"] == "configs/task_scaling.py"} >= {
        "runs/scaling/task_scaling_tasks6_baseline_s2"
    }
    # every run is runnable (the SWE arm plays SWE-Lite); the capacity study goes to two 8xH200 nodes (one
    # node, 8xH100 or 8xH200, cannot hold its states, the updates and the samplers' copies)
    assert {r["config"] for r in runs if not r["runnable"]} == set()
    assert {r["hardware"] for r in runs if r["table"] == "capacity"} == {"16xh200"}
    assert {r["hardware"] for r in runs if r["table"] != "capacity"} == {"8xh100"}
    # make_tables reads the table's runs and, for the capacity study, Table 1's Complementary RL and baseline
    cap = next(t for t in tables if t["table"] == "capacity")["make_tables"]
    dirs = shlex.split(cap)[2].split("=", 1)[1].split(",")
    assert "runs/table1/multitask3_complementary_s1" in dirs and len(dirs) == 3 + 6


def test_every_command_builds_a_valid_config(dry_run):
    from comprl_jax.config import validate

    rp = _rp()
    runs, cmds, _ = dry_run
    for r, cmd in zip(runs, cmds, strict=True):
        argv = shlex.split(cmd)
        assert argv[:2] == [".venv/bin/python", "launch/train.py"] and cmd == r["command"]
        config = next(a for a in argv if a.startswith("--config="))[len("--config=") :]
        path, variant = config.split(":", 1)
        assert os.path.isfile(os.path.join(ROOT, path)), path
        name = os.path.basename(path)[: -len(".py")]
        c = rp.load_config(name, variant)
        assert c.method == variant.split(",")[-1] == r["method"]
        rest = _apply(c, argv[4:])
        assert rest == [] and f"--workdir={r['workdir']}" in argv
        validate(c)
        assert c.seed == r["seed"]
        episodes = c.rollout.tasks_per_step * c.rollout.group_size * len(c.env.tasks)
        assert c.rollout.rows_per_wave == 0 or episodes % c.rollout.rows_per_wave == 0
        assert (
            episodes % c.actor.micro_batch == 0
            and c.extractor.buffer.batch_size % c.extractor.micro_batch == 0
        )
        if c.experience.enabled:
            assert c.extractor.model.startswith("/models/")


def test_mesh_flags_follow_the_memory_plan():
    """8xH100: extractor fsdp=4 x tensor=2, the samplers over 4 and 8 GPUs, 16 rollout rows, 6 distillation rows
    that fit -> 4 per extractor call (the sampler buckets rows to a power of two: 6 would ask for 8; WORKSPACE
    "Memory plans"); v5p-64: plain fsdp=32 (272 rollout and 136 distillation rows: more than a step's 128), the
    capacity study's extractor over tensor=4 (fsdp=8) with the TPU's gmm dispatch (its expert exchange, 14.56 GiB,
    leaves 64 rollout rows at once; the dropless plan, which does not lower for TPU, had 152 -> 128); GPUs keep
    the model's dispatch (no flag)."""
    rp = _rp()
    flags, plan = rp.mesh_overrides("8xh100", "main", 128)
    assert plan["fits"] and (plan["rollout_rows_at_once"], plan["distill_rows_at_once"]) == (16, 6)
    assert flags == [
        "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.mesh.extractor_tensor=2",
        "--config.actor.micro_batch=8", "--config.extractor.micro_batch=4", "--config.actor.rollout_tensor=4",
        "--config.extractor.rollout_tensor=8", "--config.rollout.rows_per_wave=16",
        "--config.extractor.rows_per_call=4",
    ]  # fmt: skip
    flags, _ = rp.mesh_overrides("v5p-64", "main", 128)
    assert flags == [
        "--config.mesh.data=1",
        "--config.mesh.fsdp=-1",
        "--config.actor.micro_batch=32",
        "--config.extractor.micro_batch=32",
        "--config.actor.rollout_tensor=4",
        "--config.extractor.rollout_tensor=4",
    ]  # fmt: skip  (272 rows fit: one wave)
    flags, plan = rp.mesh_overrides("v5p-64", "capacity", 384)
    assert plan["fits"] and plan["update_activations_gib"]["extractor"]["expert_exchange"] == 14.56
    assert "--config.extractor.moe_dispatch=gmm" in flags and "--config.mesh.extractor_tensor=4" in flags
    assert "--config.rollout.rows_per_wave=64" in flags
    assert "--config.extractor.micro_batch=8" in flags and "--config.extractor.rows_per_call=64" in flags
    flags, plan = rp.mesh_overrides("8xh100", "capacity", 384)
    assert not plan["fits"] and not any("moe_dispatch" in f for f in flags)
    assert [
        rp.moe_dispatch_for(h, s)
        for h, s in [("v5p-64", "capacity"), ("v5p-64", "main"), ("16xh200", "capacity")]
    ] == ["gmm", "", ""]
    assert rp.bucketed_rows(6, 1, 128) == 4 and rp.bucketed_rows(152, 8, 384) == 128
    assert rp.bucketed_rows(7, 8, 1024) == 0  # fewer rows than data groups: nothing a bucket can hold


def test_smollm_scale_runs_one_gpu_without_mesh_flags():
    rp = _rp()
    opts = {
        "scale": "smollm", "seeds": [0, 1, 2], "root": "runs", "launcher": "local", "hardware": "none",
        "models_dir": "/models", "tpu_name": "t", "zone": "z", "nodes": 1, "tasks_per_step": 0, "train_flags": [],
    }  # fmt: skip
    runs = rp.plan_runs("single", opts)
    assert len(runs) == 30 and all(r["variant"].startswith("smollm,") for r in runs)
    assert all(r["overrides"] == [f"--config.seed={r['seed']}"] for r in runs)  # no mesh, no model paths
    assert runs[0]["workdir"] == "runs/single_smollm/minihack_room_complementary_s0"
    assert rp.plan_runs("capacity", opts) == []  # both extractors would be SmolLM2: nothing to compare


def test_train_py_accepts_a_printed_command(tmp_path):
    """--execute through the local launcher, with train.py's --print_config: the real entry point parses the
    command (every override key exists, the final config validates) and exits before touching the workdir."""
    out = _cli(
        "--table=capacity", "--hardware=v5p-64", "--seeds=1", f"--root={tmp_path}", "--models_dir=/models",
        "--train_flags=--print_config", "--execute", "--compile_plans=",  # the plan's command, unchecked
    )  # fmt: skip
    lines = {ln.split("#")[0].split("=", 1)[0].strip(): ln.split("#")[0].split("=", 1)[1].strip()
             for ln in out.stdout.splitlines() if " = " in ln and not ln.startswith("#")}  # fmt: skip
    assert lines["seed"] == "1" and lines["mesh.extractor_tensor"] == "4"
    assert lines["extractor.micro_batch"] == "8" and lines["rollout.rows_per_wave"] == "64"  # the gmm plan's
    assert lines["extractor.moe_dispatch"].strip("'\"") == "gmm"
    assert lines["actor.rollout_tensor"] == "4" and lines["extractor.rollout_tensor"] == "4"
    assert lines["extractor.model"].strip("'\"") == "/models/Qwen3-30B-A3B-Instruct-2507"
    assert "running: " in out.stderr and os.listdir(tmp_path) == []


def test_slurm_commands_run_the_recipe(tmp_path):
    out = _cli("--table=1", "--launcher=slurm", "--seeds=2", "--root=/shared/runs")
    runs, cmds, _ = _runs(out.stdout)
    assert len(runs) == 5
    argv = shlex.split(cmds[0])
    assert argv[:4] == [
        "sbatch",
        "--nodes=1",
        "--job-name=comprl-multitask3_complementary_s2",
        "launch/slurm.sbatch",
    ]
    assert argv[4:6] == [
        "configs/multitask3.py:complementary",
        "/shared/runs/table1/multitask3_complementary_s2",
    ]
    # the recipe itself, with its srun hook: the line every node runs
    srun = subprocess.run(
        ["bash", *argv[3:]], capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "SRUN": "echo", "LOG_DIR": str(tmp_path)},  # the recipe makes its log directory
    )  # fmt: skip
    assert srun.returncode == 0, srun.stderr
    line = shlex.split(srun.stdout)
    assert line[:2] == ["--kill-on-bad-exit=1", f"--output={tmp_path}/host%t.log"]
    assert line[2:6] == [".venv/bin/python", "launch/train.py", "--distributed", f"--config={argv[4]}"]
    assert line[6] == f"--workdir={argv[5]}" and line[7:] == argv[6:]
    assert "--config.seed=2" in line and "--config.mesh.extractor_tensor=2" in line  # 8xH100 plan


def test_tpu_pod_execute_goes_through_the_recipe():
    """--execute with tpu_pod.sh's own DRY_RUN=1: one gcloud command per host, each running train.py with its
    process id and worker 0 as the coordinator."""
    out = _cli(
        "--table=capacity", "--launcher=tpu_pod", "--tpu_name=my-v5p-64", "--zone=us-east5-a", "--seeds=0",
        "--root=/mnt/shared/runs", "--execute", "--compile_plans=", env={"DRY_RUN": "1"},
    )  # fmt: skip
    runs, cmds, _ = _runs(out.stdout)
    assert shlex.split(cmds[0])[:4] == ["launch/tpu_pod.sh", "train", "my-v5p-64", "us-east5-a"]
    gcloud = [shlex.split(ln) for ln in out.stdout.splitlines() if ln.startswith("gcloud ")]
    assert len(gcloud) == 2  # DRY_RUN's two hosts (DRY_RUN_HOSTS)
    for pid, g in enumerate(gcloud):
        assert g[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-64"] and f"--worker={pid}" in g
        remote = shlex.split(next(a for a in g if a.startswith("--command=")).split("=", 1)[1])
        run = shlex.split(remote[remote.index("-c", remote.index("nohup")) + 1])
        i = run.index("launch/train.py")
        assert run[i + 1 : i + 6] == [
            "--coordinator=HOST0:8476", "--num_processes=2", f"--process_id={pid}",
            "--config=configs/extractor_capacity.py:complementary",
            "--workdir=/mnt/shared/runs/capacity/extractor_capacity_complementary_s0",
        ]  # fmt: skip
        assert run[i + 6 : run.index(">")] == runs[0]["overrides"]


# -- estimates ---------------------------------------------------------------------------------------------
def _fwd(n, layers, width, tokens, ctx):
    return tokens * (2 * n + 2 * layers * width * ctx)


def test_estimate_by_hand_minihack_baseline_v5p64():
    """configs/minihack_room.py:baseline: 16 tasks x 8 = 128 free episodes of 512 + 30 x (256 + 80) = 10,592
    tokens; the update pads them to 16,384; Qwen2.5-7B: 28 layers, 28 x 128 attention width."""
    rp = _rp()
    c = rp.load_config("minihack_room", "baseline")
    f = rp.step_flops(c, "paper")
    rollout = 128 * 10_592 * (2 * QWEN25_7B + 2 * 28 * 3584 * 10_592)
    update = 4 * 128 * 16_384 * (2 * QWEN25_7B + 2 * 28 * 3584 * 16_384)
    assert f["actor_rollout"] == pytest.approx(rollout, rel=1e-12)
    assert f["actor_update"] == pytest.approx(update, rel=1e-12)
    assert f["distillation"] == f["extractor_update"] == 0
    # 128 x 10,592 x (15,231,233,024 + 2,125,873,152); 4 x 128 x 16,384 x (15,231,233,024 + 3,288,334,336)
    assert rollout == pytest.approx(2.3532e16, rel=1e-4) and update == pytest.approx(1.5535e17, rel=1e-4)
    e = rp.run_estimate(c, "paper", "v5p-64", waves=1)
    pod = 32 * 459e12
    step = rollout / (pod * 0.05) + update / (pod * 0.35) + 30 * 0.1
    # 2.3532e16 / 7.344e14 = 32.04 s generating, 1.5535e17 / 5.1408e15 = 30.22 s updating, 3 s host work
    assert e["step_s"] == pytest.approx(step, rel=1e-12) and step == pytest.approx(65.26, abs=0.01)
    # final evaluation: 128 held-out tasks x 4 episodes, without experience only (a baseline)
    ev = 512 * 10_592 * (2 * QWEN25_7B + 2 * 28 * 3584 * 10_592) / (pod * 0.05)
    assert e["wall_h"] == pytest.approx((145 * step + ev) / 3600, rel=1e-12)
    assert e["device_h"] == pytest.approx(32 * e["wall_h"], rel=1e-12)


def test_estimate_scales_linearly_with_tasks_and_steps():
    rp = _rp()
    for method in ("baseline", "complementary"):
        c = rp.load_config("minihack_room", method)
        one, two = rp.step_flops(c, "paper", 16), rp.step_flops(c, "paper", 32)
        for k in ("actor_rollout", "actor_update", "distillation", "extractor_update"):
            assert two[k] == pytest.approx(2 * one[k], rel=1e-12), (method, k)
            assert method == "baseline" or one[k] > 0
    c = rp.load_config("minihack_room", "baseline")
    a = rp.run_estimate(c, "paper", "8xh100")
    c.train.steps = 290
    b = rp.run_estimate(c, "paper", "8xh100")
    assert b["step_s"] == a["step_s"]
    assert (b["wall_h"] - a["wall_h"]) * 3600 == pytest.approx(145 * a["step_s"], rel=1e-9)


def test_moe_extractor_counts_active_parameters():
    shape = _rp().model_shape("Qwen/Qwen3-30B-A3B-Instruct-2507")
    assert (
        shape["params"] == 30_532_122_624 and shape["active"] == 3_353_032_704
    )  # test_plan_memory's hand count


def test_cpu_anchor_by_hand():
    """The measured :smollm step (1 task x 4 episodes x 3 turns): 256 + 3 x (10 + 80) = 526 tokens, padded to
    1,024; four forwards of SmolLM2-135M over 4 x 1,024 tokens is the actor update the issue timed at 53-57 s."""
    a = _rp().cpu_anchor()
    update = 4 * _fwd(SMOLLM2, 30, 576, 4 * 1024, 1024)
    assert a["flops"]["actor_update"] == update == 4_987_608_367_104
    assert a["implied_update_efficiency"] == pytest.approx(update / (55 * 2 * 2.45e9 * 32), rel=1e-12)
    assert a["flops"]["extractor_update"] == 0  # 4 samples do not fill a buffer of 64


def test_estimate_cli_rows_are_positive_and_totals_add_up():
    out = _cli("--table=all", "--estimate")
    rows = [json.loads(ln) for ln in out.stdout.splitlines()]
    runs = [r for r in rows if not r.get("total")]
    assert len(runs) == 3 * (5 + 6 + 1 + 10)  # arms x the three default hardware
    for r in runs:
        if r["fits"]:
            assert r["wall_h"] > 0 and r["device_h"] == pytest.approx(r["chips"] * r["wall_h"])
            assert (
                all(v >= 0 for v in r["flops_per_step"].values()) and r["flops_per_step"]["actor_rollout"] > 0
            )
        else:
            # the memory plan: one 8xH100 node does not hold the capacity study
            assert (r["table"], r["hardware"]) == ("capacity", "8xh100"), r
    for t in (r for r in rows if r.get("total")):
        mine = [r for r in runs if (r["table"], r["hardware"]) == (t["table"], t["hardware"]) and r["fits"]]
        assert t["device_h"] == pytest.approx(sum(3 * r["device_h"] for r in mine))
        assert t["runs"] == 3 * len(mine)


def test_compiler_figures_check_the_plan(tmp_path):
    """reproduce.py reads launch/compile_check.py's lines for a hardware (launch/compile_plans.jsonl): each run
    carries the compiler's per-chip peaks, the plan's figure over the compiler's for each update, and a function
    the compiler cannot fit makes the run not runnable, whatever the analytic plan says."""
    rp = _rp()
    _, plan = rp.mesh_overrides("v5p-64", "main", 128)
    lines = rp.compiler_lines("v5p-64", "main")
    layout = rp.compiler_layout(plan, lines, 128)
    shipped = rp.chosen_figures(lines, layout["rollout_tensor"])
    assert {"actor_update", "extractor_update", "prefill", "decode", "extractor_decode"} <= set(shipped)
    check = rp.compiler_check(plan, shipped, layout)
    assert check["fits"] and all(v["fits"] for v in check["functions"].values()) and not check["stale"]
    # the plan's own rollout splits (4 and 4) were compiled too, the line of another split is stale
    other = rp.compiler_check(
        plan, {"prefill": {**shipped["prefill"], "mesh": {"data": 32, "fsdp": 1, "tensor": 1}}}
    )
    assert (
        other["stale"] == {"prefill": "compiled at rollout tensor 1; the run uses 4"}
        and other["functions"] == {}
    )
    # the analytic plan is conservative against the TPU compiler (WORKSPACE "Paper scale through the TPU
    # compiler": 1.21 / 1.19 on 2026-12-03), never optimistic
    for ratio in check["plan_over_compiler"].values():
        assert 1.0 <= ratio <= 1.35, check["plan_over_compiler"]
    line = {**shipped["actor_update"], "fits": False, "peak_gib": None, "requested_gib": 120.0}
    bad = tmp_path / "plans.jsonl"
    bad.write_text(json.dumps({**line, "hardware": "v5p-64"}) + "\n")
    figures = rp.compiler_figures("v5p-64", "main", str(bad))
    got = rp.compiler_check(plan, figures, layout)
    assert not got["fits"] and got["functions"]["actor_update"] == {"peak_gib": 120.0, "fits": False}
    assert rp.compiler_figures("v5p-64", "main", str(tmp_path / "missing.jsonl")) == {}


def test_the_capacity_study_runs_on_a_v5p_64_in_the_compilers_waves():
    """The capacity study on a v5p-64 runs the TPU's gmm dispatch (``extractor.moe_dispatch=gmm``); only lines
    compiled with gmm count (the ``capacity`` dispatch's, which drops tokens, are another program). The memory plan
    allows 64 rollout and 64 distillation rows at once; the TPU compiler's figures (launch/compile_plans.jsonl,
    2026-12-05) fit the run in smaller waves. By hand, per chip (usable 86.166 GiB, embedder 0.03):

    rollout beside the extractor update: 86.166 - 2.674 (actor state) - 56.656 (gmm MoE update peak, fsdp 8 x
    tensor 4) - 0.03 - 14.236 (the extractor sampler's copy: 17.236 - 2 rows x 1.5) = 12.57 free; the actor
    sampler's copy 7.047 - 8 x 0.4375 = 3.547 and working set 1.093 (the prefill's, above the decode's 0.185; the
    last lines, compiled at 64 rows, 8 per group, 2026-12-06, after the cache write batched its layers: the decode
    had 4.185, the prefill 2.345): (9.023 - 1.093) / 0.4375 = 18 > 8 compiled, so in proportion: 9.023 / (0.4375 +
    1.093 / 8) = 15 rows per group x 8 = 120, so 64 a wave (the most rows dividing 384 whose power-of-two bucket
    stays within 120: 6 waves). Distillation beside the actor update: 86.166 - 10.687 - 30.872 - 0.03 - 3.547 =
    41.03 free; 41.03 - 14.236 = 26.79; the extractor's working set at its last compiled size (16 rows, 2 per
    group) is its prefill's 4.103 (decode 0.400; 16.103 and 12.431 before the expert weights went to the megablox
    kernel transposed, 2026-12-06): (26.79 - 4.103) / 1.5 = 15 > 2 compiled, so in proportion: 26.79 / (1.5 +
    4.103 / 2) = 7 rows per group x 8 = 56, so 32 a call (the most rows dividing 384 whose bucket stays within 56:
    12 calls; 16 and 24 before)."""
    rp = _rp()
    flags, plan = rp.mesh_overrides("v5p-64", "capacity", 384)
    assert plan["fits"] and (plan["rollout_rows_at_once"], plan["distill_rows_at_once"]) == (64, 64)
    lines = rp.compiler_lines("v5p-64", "capacity")
    assert {d.get("moe_dispatch") for d in lines if d["function"].startswith("extractor_")} == {"gmm"}
    layout = rp.compiler_layout(plan, lines, 384)
    assert layout["fits"] and layout["free_gib"] == {"rollout": 12.57, "distill": 41.03}
    assert layout["sampler_copies_gib"] == 17.78  # 3.55 (7B over 4 chips) + 14.24 (30B over 4)
    assert (layout["rows_per_wave"], layout["rows_per_call"]) == (64, 32)
    assert (layout["rollout_waves"], layout["distill_waves"]) == (6, 12)
    check = rp.compiler_check(plan, rp.chosen_figures(lines, layout["rollout_tensor"]), layout)
    assert check["fits"] and not check["stale"]
    # the plan is close to the compiler on the gmm update (59.7 planned against 56.7 compiled)
    assert check["plan_over_compiler"]["extractor_update"] == pytest.approx(1.054, abs=0.001)
    out = _cli("--table=capacity", "--hardware=v5p-64", "--seeds=0")
    runs, _, _ = _runs(out.stdout)
    assert runs and all(r["runnable"] for r in runs)
    for r in runs:
        assert "--config.extractor.moe_dispatch=gmm" in r["overrides"]
        assert "--config.rollout.rows_per_wave=64" in r["overrides"]
        assert "--config.extractor.rows_per_call=32" in r["overrides"]
    # the file also holds the capacity dispatch's update (66.27 GiB at the same mesh): not this run's program
    with open(rp.COMPILE_PLANS) as f:
        shipped = [json.loads(line) for line in f if line.strip()]
    cap = [d for d in shipped if d.get("moe_dispatch") == "capacity" and d["function"] == "extractor_update"]
    assert cap and not any(d in lines for d in cap)


def _line(fn, mesh, shapes, **gib):
    return {"hardware": "v5p-64", "config": "configs/minihack_room.py", "function": fn, "mesh": mesh,
            "shapes": shapes, "fits": True, "hbm_gib": 95.74, **gib}  # fmt: skip


def test_rollout_layout_and_waves_come_from_the_compiler():
    """Hand-worked: usable 95.74 x 0.9 = 86.166 GiB per chip, embedder 0.03 (the plan's), KV rows 1.75 GiB
    (Qwen2.5-7B at 32k, /4 over a tensor split of 4) and 9 GiB (Qwen3-4B at 64k).

    Actor at tensor 1: copy 21 - 4 x 1.75 = 14, working set 3; rollout beside the extractor update:
    86.166 - 2 - 50 - 0.03 - 7.5 (the extractor's copy) = 26.636 free -> 5 rows per chip (5 > 4 compiled: 12.636 /
    (1.75 + 3/4) = 5.05) x 32 = 160 -> 128 a wave (8 waves). At tensor 4: copy 10.5 - 16 x 0.4375 = 3.5, working set
    1; 23.136 / (0.4375 + 1/16) = 46 rows per group x 8 groups = 368 -> 256 a wave (4 waves). Extractor at tensor
    1 beside the actor update: 86.166 - 1 - 30 - 0.03 - 3.5 = 51.636 free, copy 7.5, working set 4: 44.136 / 13 = 3
    rows per chip x 32 = 96 -> 64 a call (16 calls). Fewest waves: actor 4, extractor 1."""
    rp = _rp()
    _, plan = rp.mesh_overrides("v5p-64", "main", 1024)
    assert plan["state_gib"]["embedder"] == 0.03 and plan["mesh"]["actor"] == {
        "data": 1,
        "fsdp": 32,
        "tensor": 1,
    }
    upd = {"data": 1, "fsdp": 32, "tensor": 1}
    lines = [
        _line("actor_update", upd, {"micro_batch_rows": 32}, args_gib=2.0, peak_gib=30.0),
        _line("extractor_update", upd, {"micro_batch_rows": 32}, args_gib=1.0, peak_gib=50.0),
        _line("prefill", {"data": 32, "fsdp": 1, "tensor": 1}, {"rows": 128}, args_gib=21.0, temp_gib=3.0),
        _line("decode", {"data": 32, "fsdp": 1, "tensor": 1}, {"rows": 128}, args_gib=21.0, temp_gib=0.5),
        _line("prefill", {"data": 8, "fsdp": 1, "tensor": 4}, {"rows": 128}, args_gib=10.5, temp_gib=1.0),
        _line("decode", {"data": 8, "fsdp": 1, "tensor": 4}, {"rows": 128}, args_gib=10.5, temp_gib=0.2),
        _line("extractor_prefill", {"data": 32, "fsdp": 1, "tensor": 1}, {"rows": 32}, args_gib=16.5, temp_gib=4.0),
        _line("extractor_decode", {"data": 32, "fsdp": 1, "tensor": 1}, {"rows": 32}, args_gib=16.5, temp_gib=0.3),
    ]  # fmt: skip
    got = rp.compiler_layout(plan, lines, 1024)
    assert got["rollout_tensor"] == {"actor": 4, "extractor": 1}
    assert (got["rows_per_wave"], got["rows_per_call"]) == (256, 64)
    assert (got["rollout_waves"], got["distill_waves"]) == (4, 16)
    assert got["free_gib"] == {"rollout": 26.64, "distill": 51.64} and got["sampler_copies_gib"] == 11.0
    assert got["fits"] and got["mismatch"] == []
    flags, _ = rp.mesh_overrides("v5p-64", "main", 1024, got)
    assert flags[-4:] == [
        "--config.actor.rollout_tensor=4", "--config.extractor.rollout_tensor=1",
        "--config.rollout.rows_per_wave=256", "--config.extractor.rows_per_call=64",
    ]  # fmt: skip
    chosen = rp.chosen_figures(lines, got["rollout_tensor"])
    assert chosen["prefill"]["mesh"]["tensor"] == 4 and chosen["extractor_decode"]["mesh"]["tensor"] == 1
    # at tensor 1 alone the actor gets 128-row waves
    only1 = rp.compiler_layout(plan, [ln for ln in lines if ln["mesh"]["tensor"] == 1], 1024)
    assert (
        only1["rollout_tensor"]["actor"] == 1
        and only1["rows_per_wave"] == 128
        and only1["rollout_waves"] == 8
    )
    # figures of another mesh describe another run
    other = [{**lines[0], "mesh": {"data": 1, "fsdp": 16, "tensor": 2}}, *lines[1:]]
    bad = rp.compiler_layout(plan, other, 1024)
    assert not bad["fits"] and "actor_update compiled on" in bad["mismatch"][0]
    # no extractor generation compiled: no layout from the compiler (the plan's stands)
    assert rp.compiler_layout(plan, lines[:6], 1024) is None
    # no room for one extractor row beside the actor update: does not fit
    heavy = [{**lines[0], "peak_gib": 80.0}, *lines[1:]]
    assert not rp.compiler_layout(plan, heavy, 1024)["fits"]


def test_paper_runs_on_a_v5p_64_take_their_layout_from_the_compiler():
    """launch/compile_plans.jsonl holds the v5p-64 main setting's updates and its samplers' prefill and decode at
    rollout splits 1, 2 and 4 (prefills re-compiled 2026-12-06). Beside the compiled updates (actor 30.9,
    extractor 51.1 GiB peaks), both samplers' copies and the prefill's working set, one rollout wave of
    minihack_room's 128 rows and 64 distillation rows per call (3 waves) is the fewest, and the smallest splits
    reach it: both samplers on one chip. By hand, per chip (usable 86.166): the actor's copy 28.185 - 8 x 1.75 =
    14.185, the extractor's 25.492 - 2 x 9 = 7.492; rollout beside the extractor update: 86.166 - 2.666 - 51.089 -
    0.03 - 7.492 = 24.89 free, (24.89 - 14.185 - 3.613) / 1.75 = 4 rows x 32 = 128; distillation beside the actor
    update: 86.166 - 1.409 - 30.858 - 0.03 - 14.185 = 39.68 free, (39.68 - 7.492 - 12.494) / 9 = 2 rows x 32 = 64
    (prefill working sets 3.613 and 12.494 as re-compiled 2026-12-06 after the cache write batched its layers).
    (Before the prefill stopped carrying its cache: the actor over 2 chips and the extractor over 4, same waves.)
    The analytic plan would have allowed 272 and 136."""
    out = _cli("--table=single", "--launcher=tpu_pod", "--tpu_name=t", "--zone=z", "--seeds=0")
    runs, _, _ = _runs(out.stdout)
    room = next(
        r for r in runs if r["config"] == "configs/minihack_room.py" and r["method"] == "complementary"
    )
    assert room["hardware"] == "v5p-64" and room["runnable"], room["note"]
    lay = room["compiler"]["layout"]
    assert lay["rollout_tensor"] == {"actor": 1, "extractor": 1} and lay["fits"]
    assert (lay["rows_per_wave"], lay["rows_per_call"]) == (128, 64)
    assert lay["free_gib"] == {"rollout": 24.89, "distill": 39.68} and lay["sampler_copies_gib"] == 21.68
    flags = room["overrides"]
    assert "--config.actor.rollout_tensor=1" in flags and "--config.extractor.rollout_tensor=1" in flags
    assert "--config.extractor.rows_per_call=64" in flags
    assert not any(f.startswith("--config.rollout.rows_per_wave") for f in flags)  # 128 = the step's episodes
    assert room["compiler"]["fits"] and not room["compiler"]["stale"]
