"""The pod recipes run as printed, end to end, against local stand-ins of gcloud and SLURM (issue 51 point 1):
``tests/standins/gcloud`` runs a TPU VM's ``ssh --worker=i --command=...`` as a local process per worker, and
``tests/standins/sbatch`` / ``srun`` run a job step as local processes with the variables a real step has (JAX's own
SLURM detection starts them). Two "hosts" of 4 fake CPU devices each train ``configs/minihack_room.py:tiny``; each
run writes a log per host, and a host killed mid-run stops the others (with its reason) and the relaunch resumes to
the same parameters and host state as an uninterrupted run (the digests every process writes at the end)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from trainer_helpers import REPO, TWO_PROCESS_OVER, cache_env, flags, free_port

pytestmark = pytest.mark.slow

STANDINS = os.path.join(REPO, "tests", "standins")
OVER = {**TWO_PROCESS_OVER, "train.steps": 2, "mesh.placement": "colocated"}
CONFIG = "configs/minihack_room.py:tiny"


@pytest.fixture(scope="module")
def pod_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pod")
    python_dir = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(REPO, ".venv", "bin", "python")), "the recipes run .venv/bin/python"
    return {
        **os.environ,
        "PATH": f"{STANDINS}:{python_dir}:{os.environ['PATH']}",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "TOKENIZERS_PARALLELISM": "false",
        "REPO_DIR": REPO,
        "FAKE_TPU_ROOT": str(root / "hosts"),
        "FAKE_TPU_WORKERS": "2",
        "FAKE_SLURM_ROOT": str(root / "slurm"),
        "FAKE_GCLOUD_LOG": str(root / "gcloud.jsonl"),
        "POLL_S": "1",
        "COORDINATOR_PORT": str(free_port()),
        **cache_env(root / "xla_cache"),
    }


def _free_slurm_job_id() -> str:
    """A job id whose coordinator port (JAX's SLURM rule: id % 4096 + 61440) is free here."""
    for port in range(61440 + 1000, 65536):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(4096 + port - 61440)
    raise RuntimeError("no free port in [62440, 65535]")


def _tpu(env, *args, timeout=900, **extra):
    return subprocess.run(
        ["bash", "launch/tpu_pod.sh", *args],
        cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _trainers(work, process_id: int) -> list[int]:
    """Pids of the run's ``launch/train.py`` processes of ``process_id`` (their argv, read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (
            len(argv) > 2
            and argv[1] == "launch/train.py"
            and f"--process_id={process_id}" in argv
            and f"--workdir={work}" in argv
        ):
            out.append(int(d))
    return out


def _digests(work):
    d = [json.loads((work / f"digest_p{i}.json").read_text()) for i in range(2)]
    assert [x.pop("process") for x in d] == [0, 1]
    return d


@pytest.fixture(scope="module")
def tpu_run(pod_env, tmp_path_factory):
    """One uninterrupted 2-step run through launch/tpu_pod.sh and the gcloud stand-in."""
    work = tmp_path_factory.mktemp("tpu") / "run"
    out = _tpu(pod_env, "train", "fake-v5p", "zone-a", CONFIG, str(work), *flags(**OVER))
    assert out.returncode == 0, out.stderr[-3000:] + _logs(work)
    return work, out


def _logs(work) -> str:
    logs = work / "logs"
    if not logs.exists():
        return ""
    return "".join(f"\n--- {p.name}:\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("host*.log")))


def test_the_tpu_recipe_runs_every_host_detached_with_a_log_each(tpu_run, pod_env):
    work, out = tpu_run
    assert "all 2 hosts finished" in out.stderr
    assert [(work / "logs" / f"host{i}.exit").read_text().strip() for i in range(2)] == ["0", "0"]
    assert all((work / "logs" / f"host{i}.log").stat().st_size > 0 for i in range(2))
    d0, d1 = _digests(work)
    assert d0 == d1 and d0["step"] == 2
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # the recipe asked for the workers' addresses and gave each its process id and worker 0 as coordinator
    calls = [json.loads(line) for line in open(pod_env["FAKE_GCLOUD_LOG"])]
    assert ["describe", "fake-v5p", "--zone=zone-a", "--format=value(networkEndpoints[].ipAddress)"] in [
        c[3:] for c in calls
    ]
    starts = [c for c in calls if any(a.startswith("--command=") and "launch/train.py" in a for a in c)]
    assert sorted(next(a for a in c if a.startswith("--worker=")) for c in starts) == [
        "--worker=0",
        "--worker=1",
    ]
    port = pod_env["COORDINATOR_PORT"]
    for i, c in enumerate(sorted(starts, key=lambda c: c[6])):
        assert f"--coordinator=127.0.0.1:{port}" in c[-1] and f"--process_id={i}" in c[-1]


def test_a_killed_host_stops_the_others_and_the_run_resumes_exactly(tpu_run, pod_env, tmp_path):
    ref, _ = tpu_run
    work = tmp_path / "run"
    env = {**pod_env, "COORDINATOR_PORT": str(free_port())}
    out = _tpu(env, "train", "fake-v5p", "zone-a", CONFIG, str(work), *flags(**OVER), DETACH="1")
    assert out.returncode == 0, out.stderr
    # kill host 1 once the first step's checkpoint is there: mid-run, in step 1
    deadline = time.monotonic() + 600
    while not (work / "checkpoints" / "1").exists():
        assert time.monotonic() < deadline, _logs(work)
        assert not (work / "logs" / "host1.exit").exists(), _logs(work)
        time.sleep(0.5)
    # the trainer itself, not the bash that waits for it to write its exit status
    pids = _trainers(work, process_id=1)
    assert pids, (
        "host 1's trainer is not running:\n"
        + subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout[-6000:]
    )
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    out = _tpu(env, "wait", "fake-v5p", "zone-a", str(work))
    assert out.returncode != 0 and "host 1 exited with 137" in out.stderr, out.stderr
    assert (work / "logs" / "host0.exit").read_text().strip() != "0"  # stopped, not finished
    # relaunched as printed, it resumes from the last checkpoint and ends where the uninterrupted run ends
    out = _tpu(env, "train", "fake-v5p", "zone-a", CONFIG, str(work), *flags(**OVER))
    assert out.returncode == 0, out.stderr[-3000:] + _logs(work)
    assert _digests(work) == _digests(ref)


def test_the_slurm_recipe_runs_a_step_of_two_tasks_with_a_log_each(pod_env, tmp_path):
    work = tmp_path / "run"
    log = tmp_path / "srun.jsonl"
    out = subprocess.run(
        ["sbatch", "--nodes=2", "--job-name=comprl-test", "--cpus-per-task=3", f"--output={tmp_path}/%x-%j.out",
         "launch/slurm.sbatch", CONFIG, str(work), *flags(**OVER)],
        cwd=REPO, env={**pod_env, "FAKE_SRUN_LOG": str(log), "FAKE_SLURM_JOB_ID": _free_slurm_job_id()},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    job_out = "".join(p.read_text() for p in tmp_path.glob("comprl-test-*.out"))
    assert out.returncode == 0, out.stdout + out.stderr + job_out + _logs(work)
    assert out.stdout.startswith("Submitted batch job")
    assert all((work / "logs" / f"host{i}.log").stat().st_size > 0 for i in range(2))
    d0, d1 = _digests(work)
    assert d0 == d1 and d0["step"] == 2
    # the CPUs of --cpus-per-task reached the step (SRUN_CPUS_PER_TASK: Slurm >= 22.05 needs it)
    step = json.loads(log.read_text().splitlines()[0])
    assert step["cpus_per_task"] == "3" and step["tasks"] == 2
