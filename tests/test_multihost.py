"""Multi-controller training (issue 8): two processes on this CPU, 4 fake devices each, one global mesh.

Both processes run ``launch/train.py`` with ``--coordinator/--num_processes/--process_id`` on a shared run
directory: every process issues the same jitted calls in the same order, steps the env slots it owns and
all-gathers the results, and keeps a replica of the experience bank. At the end each process writes
``digest_p<i>.json`` (SHA-256 of its replica of the actor / extractor parameters and of the host state: bank
entries, key vectors, op log, extractor buffer, counters, task sampler); they must be identical.
"""

import json
import os
import subprocess
import sys

import pytest
from trainer_helpers import REPO, TWO_PROCESS_OVER, cache_env, flags, free_port

pytestmark = pytest.mark.slow

OVER = {**TWO_PROCESS_OVER, "train.steps": 3}


@pytest.fixture(scope="session")  # once per xdist worker even when other modules run between its tests
def xla_cache(tmp_path_factory):
    """One persistent XLA cache for every launch of the module: the runs compile the same programs."""
    return tmp_path_factory.mktemp("xla_cache")


def _launch(workdir, steps, cache, **over):
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "TOKENIZERS_PARALLELISM": "false",
        **cache_env(cache),
    }
    procs = []
    for pid in range(2):
        cmd = [
            sys.executable,
            "launch/train.py",
            "--config=configs/minihack_room.py:tiny",
            f"--workdir={workdir}",
            f"--stop_after={steps}",
            f"--coordinator=127.0.0.1:{port}",
            "--num_processes=2",
            f"--process_id={pid}",
        ] + flags(**{**OVER, **over})
        log = open(os.path.join(str(workdir) + f".p{pid}.log"), "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=600))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
        log.close()
    for pid, code in enumerate(codes):
        if code != 0:
            with open(str(workdir) + f".p{pid}.log") as f:
                pytest.fail(f"process {pid} exited {code}:\n{f.read()[-4000:]}")


def _digests(work):
    d0 = json.loads((work / "digest_p0.json").read_text())
    d1 = json.loads((work / "digest_p1.json").read_text())
    assert d0.pop("process") == 0 and d1.pop("process") == 1
    return d0, d1


@pytest.fixture(scope="session")  # once per xdist worker even when other modules run between its tests
def colocated_two_steps(tmp_path_factory, xla_cache):
    """One uninterrupted 2-step co-located run, shared by the replica and the resume tests."""
    work = tmp_path_factory.mktemp("colocated") / "run"
    _launch(work, steps=2, cache=xla_cache, **{"mesh.placement": "colocated"})
    return work


@pytest.mark.parametrize("placement,steps", [("colocated", 2), ("disjoint", 1)])
def test_two_processes_identical_replicas(tmp_path, placement, steps, request, xla_cache):
    """Disjoint: each process gives 2 of its 4 devices to the actor (data 4 across processes) and 2 to the
    extractor; the micro-batches of 8 rows split 2 per actor device. (One step there: ~2 min budget.)"""
    if placement == "colocated":
        work = request.getfixturevalue("colocated_two_steps")
    else:
        work = tmp_path / "run"
        _launch(work, steps=steps, cache=xla_cache, **{"mesh.placement": placement})
    d0, d1 = _digests(work)
    assert d0 == d1 and d0["step"] == steps
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))  # process 0 writes the metrics
    assert rows[-1]["bank/searches"] > 0
    # Disjoint overlaps a step's distillation with the next rollout (extractor.distill_overlap=auto): its lessons
    # reach the bank at the next join (here the checkpoint), after the step's metrics row was written.
    store = json.loads((work / "experience" / str(steps) / "entries.json").read_text())
    assert len(store) >= 1 and (placement == "disjoint" or rows[-1]["bank/size"] == len(store))
    assert rows[-1]["actor/step"] == steps  # one optimizer step per rollout batch, on every process
    # The update saw a learning signal exactly when some group had mixed outcomes (non-zero advantages); 8 random
    # episodes a step may hold no success at all, so which case a run lands in is up to its random stream.
    signal = any(r.get(f"actor/adv_std_{h}", 0) > 0 for r in rows for h in ("free", "guided"))
    assert any(r.get("actor/grad_norm", 0) > 0 for r in rows) == signal
    # One Orbax checkpoint per step (every process took part) and one experience store (process 0 wrote it).
    assert sorted(os.listdir(work / "checkpoints")) == [str(s) for s in range(1, steps + 1)]


def test_two_processes_resume_exactly(tmp_path, colocated_two_steps, xla_cache):
    """Both processes stopped after step 1 and relaunched (Orbax restore on every process, the experience store
    read back by each) end where the uninterrupted 2-step run ends: same parameters and host state."""
    work = tmp_path / "run"
    _launch(work, steps=1, cache=xla_cache, **{"mesh.placement": "colocated"})
    assert _digests(work)[0]["step"] == 1
    _launch(work, steps=1, cache=xla_cache, **{"mesh.placement": "colocated"})  # resumes from checkpoint 1
    d0, d1 = _digests(work)
    want, _ = _digests(colocated_two_steps)
    assert d0 == d1 == want and d0["step"] == 2
