"""launch/tpu_pod.sh and launch/slurm.sbatch: valid bash, and the command every host runs is our trainer's
multi-host entry point (dry runs: DRY_RUN=1 prints the gcloud command, SRUN=echo prints the srun line)."""

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **env):
    return subprocess.run(
        args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=60
    )


def test_scripts_parse():
    for script in ("launch/tpu_pod.sh", "launch/slurm.sbatch"):
        out = _run(["bash", "-n", script])
        assert out.returncode == 0, out.stderr


def test_tpu_pod_train_starts_each_worker_with_its_process_id_and_worker_0_as_coordinator():
    out = _run(
        ["bash", "launch/tpu_pod.sh", "train", "my-v5p-64", "us-east5-a", "configs/minihack_room.py", "/mnt/r",
         "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.actor.model=/m/Qwen 7B"],
        DRY_RUN="1", DRY_RUN_HOSTS="10.0.0.2;10.0.0.3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert (
        len(lines) == 2
    )  # one ssh per worker: no --worker=all, JAX cannot find a pod's layout off TPU hardware
    for i, line in enumerate(lines):
        argv = shlex.split(line)
        assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-64"]
        assert f"--worker={i}" in argv and "--zone=us-east5-a" in argv
        remote = shlex.split(next(a for a in argv if a.startswith("--command=")).split("=", 1)[1])
        assert remote[remote.index("nohup") - 1] == "{" and remote[-2:] == ["&", "}"]  # only the run detached
        run = shlex.split(remote[remote.index("-c", remote.index("nohup")) + 1])
        i0 = run.index("launch/train.py")
        assert run[i0 + 1 : i0 + 9] == [
            "--coordinator=10.0.0.2:8476", "--num_processes=2", f"--process_id={i}",
            "--config=configs/minihack_room.py", "--workdir=/mnt/r",
            "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.actor.model=/m/Qwen 7B",
        ]  # fmt: skip
        assert run[i0 + 9 :] == [
            ">",
            f"/mnt/r/logs/host{i}.log",
            "2>&1;",
            "echo",
            "$?",
            ">",
            f"/mnt/r/logs/host{i}.exit",
        ]


def test_tpu_pod_usage_errors():
    out = _run(["bash", "launch/tpu_pod.sh", "train", "tpu", "zone"], DRY_RUN="1")
    assert out.returncode == 2 and "launch/tpu_pod.sh train" in out.stderr
    out = _run(["bash", "launch/tpu_pod.sh", "setup", "tpu", "zone"], DRY_RUN="1", REPO_URL="")
    assert out.returncode in (0, 2)  # 0 when this checkout has an origin remote, else it asks for REPO_URL


def test_slurm_runs_srun_with_distributed_and_flags_train_accepts(tmp_path):
    out = _run(
        [
            "bash",
            "launch/slurm.sbatch",
            "configs/minihack_room.py:smollm",
            "/shared/r",
            "--config.mesh.tensor=2",
        ],
        SRUN="echo",
        LOG_DIR=str(tmp_path),
        SLURM_CPUS_PER_TASK="32",
    )
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:4] == [
        "--kill-on-bad-exit=1",
        f"--output={tmp_path}/host%t.log",
        ".venv/bin/python",
        "launch/train.py",
    ]
    assert argv[4:] == [
        "--distributed", "--config=configs/minihack_room.py:smollm", "--workdir=/shared/r", "--config.mesh.tensor=2"
    ]  # fmt: skip
    assert _run(["bash", "launch/slurm.sbatch"], SRUN="echo").returncode == 2
    # the CPUs of --cpus-per-task reach srun's step (Slurm >= 22.05 reads SRUN_CPUS_PER_TASK, not the job's)
    assert (
        "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK"
        in open(os.path.join(ROOT, "launch/slurm.sbatch")).read()
    )
    # the flags the recipes pass are train.py's own
    helpfull = _run([sys.executable, "launch/train.py", "--helpfull"]).stdout
    for flag in ("--distributed", "--coordinator", "--num_processes", "--process_id", "--workdir"):
        assert flag in helpfull, flag
