"""The Complementary RL loop end to end (issue 7): smoke runs of every experiment config and baseline, exact
resume after SIGKILL, and survival of env faults and malformed extractor output."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from trainer_helpers import REPO, flags, load_config

pytestmark = pytest.mark.slow

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "TOKENIZERS_PARALLELISM": "false"}


def _train(workdir, **over):
    """``launch/train.py`` on minihack_room:tiny with the MINI overrides (plus ``over``) in a subprocess."""
    cmd = [
        sys.executable,
        "launch/train.py",
        "--config=configs/minihack_room.py:tiny",
        f"--workdir={workdir}",
    ]
    return subprocess.run(cmd + flags(**over), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _strip_times(rows):
    return [
        {k: v for k, v in r.items() if not (k.startswith("time") or k.endswith("_s") or "ms" in k)}
        for r in rows
    ]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for the module: later runs reuse earlier runs' compiled programs."""
    import jax

    d = str(tmp_path_factory.mktemp("xla_cache"))
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield d
    jax.config.update("jax_compilation_cache_dir", None)


SMOKE = [
    ("minihack_room", "tiny"),
    ("minihack_room", "tiny,baseline"),
    ("minihack_room", "tiny,static_online"),
    ("minihack_room", "tiny,exp_only"),
    ("minihack_room", "tiny,offline"),
    ("ablation_no_merge", "tiny"),
    ("ablation_no_search_ask", "tiny"),
    ("extractor_capacity", "tiny"),
    ("webshop", "tiny"),
    ("alfworld", "tiny"),
    ("multitask3", "tiny"),
    ("multitask6", "tiny"),
    ("task_scaling", "tiny,tasks=1"),
]


@pytest.mark.parametrize("name,variant", SMOKE)
def test_smoke_two_steps(name, variant, tmp_path, compile_cache):
    from comprl_jax import trainer

    c = load_config(name, variant)
    out = trainer.run(c, str(tmp_path), progress=False)
    assert out["step"] == 2
    rows = _read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["success"] <= 1.0 for r in rows)
    assert os.path.exists(tmp_path / "curves.png") and os.path.exists(tmp_path / "eval.json")
    assert (tmp_path / "checkpoints" / "2").is_dir()
    experience = c.method != "baseline"
    assert ("bank/size" in rows[-1]) == experience
    if c.method == "exp_only":
        assert not any(k.startswith("actor/") for k in rows[-1])
    if c.method in ("static_online", "offline", "baseline"):
        assert not any(k.startswith("extractor/") for k in rows[-1])


def test_paper_memory_knobs_waves_remat_chunked_head(tmp_path, compile_cache):
    """The paper-scale update and rollout paths on tiny models: episodes in waves of one row, per-layer remat
    and the chunked output head for both roles."""
    from comprl_jax import trainer

    over = {"rollout.rows_per_wave": 1, "actor.remat": True, "extractor.remat": True}
    c = load_config(
        "minihack_room", "tiny", **over, **{"actor.logits_chunk": 16, "extractor.logits_chunk": 16}
    )
    out = trainer.run(c, str(tmp_path), progress=False)
    assert out["step"] == 2
    rows = _read(tmp_path / "metrics.jsonl")
    assert all(np.isfinite(r["actor/grad_norm"]) for r in rows)  # (zero when both rows score alike)
    waves = [
        e for e in _read(tmp_path / "timeline.jsonl") if e["event"] == "actor_rollout" and e["step"] == 0
    ]
    assert len(waves) == 2  # group_size 2, one row per wave
    bad = load_config("minihack_room", "tiny", **{"rollout.rows_per_wave": 3})
    with pytest.raises(ValueError, match="rollout.rows_per_wave"):
        trainer.run(bad, str(tmp_path / "bad"), progress=False)


def test_swebench_needs_a_sandbox(tmp_path, compile_cache):
    from comprl_jax import trainer

    c = load_config("swebench", "tiny")
    with pytest.raises(KeyError, match="SWEBench-Verified-v0"):
        trainer.run(c, str(tmp_path), progress=False)


def test_launch_main_runs_and_resumes(tmp_path):
    """The real absl entry point: 2 steps, then a second invocation with more steps resumes at step 2."""
    r = _train(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2:" in r.stdout
    r = _train(tmp_path, **{"train.steps": 3})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in r.stderr
    assert [row["step"] for row in _read(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def _final_state(workdir):
    """Parameters of the last checkpoint (numpy) and the bank's entries/vectors."""
    import orbax.checkpoint as ocp

    steps = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
    with ocp.StandardCheckpointer() as ck:
        train = ck.restore(workdir / "checkpoints" / str(steps[-1]) / "train")
    flat = {
        "/".join(map(str, p)): np.asarray(v)
        for p, v in __import__("jax").tree_util.tree_leaves_with_path(train)
    }
    exp = workdir / "experience" / str(steps[-1])
    with open(exp / "entries.json") as f:
        entries = json.load(f)
    return steps[-1], flat, entries, np.load(exp / "embeddings.npy")


def test_exact_resume_after_sigkill(tmp_path):
    """Kill a run with SIGKILL mid-way, resume it, and compare with an uninterrupted run: metrics (less
    timings), parameters, optimizer state and bank are bit-identical."""
    over = {"train.steps": 4}
    ref = tmp_path / "ref"
    r = _train(ref, **over)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    cmd = [sys.executable, "launch/train.py", "--config=configs/minihack_room.py:tiny", f"--workdir={run}"]
    p = subprocess.Popen(
        cmd + flags(**over), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 600
    # Kill once step 2's metrics line is written, i.e. somewhere inside step 2's checkpoint or step 3.
    while time.time() < deadline:
        path = run / "metrics.jsonl"
        if path.exists() and len(_read(path)) >= 2:
            break
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    r = _train(run, **over)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step" in r.stderr
    assert _strip_times(_read(run / "metrics.jsonl")) == _strip_times(_read(ref / "metrics.jsonl"))
    s1, p1, e1, v1 = _final_state(ref)
    s2, p2, e2, v2 = _final_state(run)
    assert s1 == s2 == 4
    assert p1.keys() == p2.keys()
    for k in p1:
        np.testing.assert_array_equal(p1[k], p2[k], err_msg=k)
    assert e1 == e2
    np.testing.assert_array_equal(v1, v2)
    with open(ref / "eval.json") as f1, open(run / "eval.json") as f2:
        assert json.load(f1) == json.load(f2)
