"""The container backend of the SWE tools (comprl_jax/envs/swe/container.py): command construction only; no image
can be pulled on this machine, so running it is untested here (WORKSPACE "SWE-Lite")."""

import pytest

from comprl_jax.envs.swe.container import ContainerSandbox, image_for
from comprl_jax.envs.swe.sandbox import SandboxLimits


def test_the_official_image_name_of_an_instance():
    assert image_for("django__django-11099") == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert image_for("Astropy__astropy-12907", arch="arm64") == (
        "swebench/sweb.eval.arm64.astropy_1776_astropy-12907:latest"
    )
    with pytest.raises(ValueError, match="owner__repo-number"):
        image_for("django-11099")


def test_start_exec_and_stop_commands_carry_the_sandbox_caps():
    lim = SandboxLimits(
        wall_s=30, cpu_s=20, memory_mb=2048, processes=128, file_mb=64, tmp_mb=32, open_files=512
    )
    box = ContainerSandbox("sympy__sympy-20590", runtime="podman", limits=lim, name="comprl-swe-x")
    assert box.start_argv() == [
        "podman", "run", "--detach", "--rm", "--name", "comprl-swe-x", "--network", "none",
        "--memory", "2048m", "--memory-swap", "2048m", "--pids-limit", "128", "--cpus", "1",
        "--ulimit", f"fsize={64 << 20}", "--ulimit", "nofile=512:512",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--tmpfs", "/tmp:rw,size=32m",
        "--workdir", "/testbed", "swebench/sweb.eval.x86_64.sympy_1776_sympy-20590:latest", "sleep", "21600",
    ]  # fmt: skip
    assert box.exec_argv("git diff") == [
        "podman", "exec", "--workdir", "/testbed", "--env", "PYTHONDONTWRITEBYTECODE=1", "comprl-swe-x",
        "timeout", "-s", "KILL", "30", "bash", "-c", "ulimit -t 20; git diff",
    ]  # fmt: skip
    # a file the editor writes goes in on the exec's stdin
    assert box.exec_argv("cat > /testbed/a.py", stdin=True)[:3] == ["podman", "exec", "--interactive"]
    assert box.repo_dir == "/testbed"
    assert box.stop_argv() == ["podman", "rm", "--force", "--time", "0", "comprl-swe-x"]
    assert ContainerSandbox("a__b-1", runtime="docker", name="c").stop_argv() == [
        "docker",
        "rm",
        "--force",
        "c",
    ]
    with pytest.raises(ValueError, match="runtime must be one of"):
        ContainerSandbox("a__b-1", runtime="lxc")


def test_a_missing_runtime_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no runtime on PATH
    with pytest.raises(FileNotFoundError, match="container runtime 'podman' not found"):
        ContainerSandbox("a__b-1", runtime="podman").start()
