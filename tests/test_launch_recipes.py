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


def test_tpu_pod_train_runs_the_same_command_on_every_host():
    out = _run(
        ["bash", "launch/tpu_pod.sh", "train", "my-v5p-64", "us-east5-a", "configs/minihack_room.py", "/mnt/r",
         "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.actor.model=/m/Qwen 7B"],
        DRY_RUN="1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-64"]
    assert "--worker=all" in argv and "--zone=us-east5-a" in argv
    remote = shlex.split(next(a for a in argv if a.startswith("--command=")).split("=", 1)[1])
    i = remote.index("launch/train.py")
    assert remote[i + 1 : i + 4] == ["--distributed", "--config=configs/minihack_room.py", "--workdir=/mnt/r"]
    assert remote[i + 4 :] == [
        "--config.mesh.data=1",
        "--config.mesh.fsdp=-1",
        "--config.actor.model=/m/Qwen 7B",
    ]


def test_tpu_pod_usage_errors():
    out = _run(["bash", "launch/tpu_pod.sh", "train", "tpu", "zone"], DRY_RUN="1")
    assert out.returncode == 2 and "launch/tpu_pod.sh train" in out.stderr
    out = _run(["bash", "launch/tpu_pod.sh", "setup", "tpu", "zone"], DRY_RUN="1", REPO_URL="")
    assert out.returncode in (0, 2)  # 0 when this checkout has an origin remote, else it asks for REPO_URL


def test_slurm_runs_srun_with_distributed_and_flags_train_accepts():
    out = _run(
        [
            "bash",
            "launch/slurm.sbatch",
            "configs/minihack_room.py:smollm",
            "/shared/r",
            "--config.mesh.tensor=2",
        ],
        SRUN="echo",
    )
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[:3] == ["--kill-on-bad-exit=1", ".venv/bin/python", "launch/train.py"]
    assert argv[3:] == [
        "--distributed", "--config=configs/minihack_room.py:smollm", "--workdir=/shared/r", "--config.mesh.tensor=2"
    ]  # fmt: skip
    assert _run(["bash", "launch/slurm.sbatch"], SRUN="echo").returncode == 2
    # the flags the recipes pass are train.py's own
    helpfull = _run([sys.executable, "launch/train.py", "--helpfull"]).stdout
    for flag in ("--distributed", "--coordinator", "--num_processes", "--process_id", "--workdir"):
        assert flag in helpfull, flag
