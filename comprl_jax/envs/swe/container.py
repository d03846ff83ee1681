"""A container backend for the SWE tools: SWE-Bench Verified's per-task images under docker or podman (issue 32
point 5). UNTESTED HERE: this machine reaches no image registry, so only the command construction is tested
(tests/test_swe_container.py); the bubblewrap sandbox (sandbox.py) is what runs on this machine.

One :class:`ContainerSandbox` holds one running container per episode, started from the task's official image
(``swebench/sweb.eval.x86_64.<instance id, "__" -> "_1776_">:latest``, the SWE-bench harness's naming) with no
network, capped CPU, memory and processes; :meth:`run` is ``<runtime> exec`` of ``bash -c COMMAND`` under
``timeout`` in the repository (``/testbed``), its output read and capped exactly as :class:`sandbox.Sandbox` does
(same :class:`sandbox.Result`), so the env's tools work unchanged. :meth:`close` removes the container.

    box = ContainerSandbox("django__django-11099", runtime="podman")
    box.start(); r = box.run("git status"); box.close()

Grading (``bench.SWEBenchEnv.submit``) follows the harness: the submitted diff is applied in a fresh container,
the record's eval script or test command runs, and FAIL_TO_PASS / PASS_TO_PASS are read from its log.

The container's main process is ``sleep LIFETIME_S`` under ``--rm``: a container whose owner died without
closing it (a worker process killed with SIGKILL) removes itself after at most that long.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import uuid

from comprl_jax.envs.swe.sandbox import Result, SandboxLimits, run_capped

RUNTIMES = ("docker", "podman")
REPO_DIR = "/testbed"  # where SWE-bench images hold the repository
LIFETIME_S = 6 * 3600  # far above any episode (30 turns of commands capped at minutes each, then one grading)


def image_for(instance_id: str, namespace: str = "swebench", arch: str = "x86_64") -> str:
    """The official per-task image of a SWE-bench instance: ``django__django-11099`` ->
    ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest`` (the harness lower-cases and replaces ``__``)."""
    if "__" not in instance_id:
        raise ValueError(f"SWE-bench instance ids look like 'owner__repo-number', got {instance_id!r}")
    return f"{namespace}/sweb.eval.{arch}.{instance_id.lower().replace('__', '_1776_')}:latest"


@dataclasses.dataclass
class ContainerSandbox:
    instance_id: str
    runtime: str = "docker"
    limits: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    image: str | None = None  # default: image_for(instance_id)
    name: str = dataclasses.field(default_factory=lambda: f"comprl-swe-{uuid.uuid4().hex[:12]}")
    lifetime_s: int = LIFETIME_S  # the container removes itself after this long, closed or not

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise ValueError(f"container runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        self.image = self.image or image_for(self.instance_id)

    def start_argv(self) -> list[str]:
        """Starts the episode's container, idle for at most ``lifetime_s``, with no network and the sandbox's caps."""
        lim = self.limits
        return [
            self.runtime, "run", "--detach", "--rm", "--name", self.name,
            "--network", "none",
            "--memory", f"{lim.memory_mb}m", "--memory-swap", f"{lim.memory_mb}m",
            "--pids-limit", str(lim.processes),
            "--cpus", "1",
            "--ulimit", f"fsize={lim.file_mb << 20}",
            "--ulimit", f"nofile={lim.open_files}:{lim.open_files}",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--tmpfs", f"/tmp:rw,size={lim.tmp_mb}m",
            "--workdir", REPO_DIR,
            self.image, "sleep", str(int(self.lifetime_s)),
        ]  # fmt: skip

    @property
    def repo_dir(self) -> str:
        return REPO_DIR

    def exec_argv(self, command: str, limits: SandboxLimits | None = None, stdin: bool = False) -> list[str]:
        """One tool command in the running container; ``timeout -s KILL`` bounds it inside, the caller's wall
        clock outside. ``stdin``: keep the exec's stdin open (``-i``) for bytes the caller feeds (an edited file)."""
        lim = limits or self.limits
        return [
            self.runtime, "exec", *(["--interactive"] if stdin else []), "--workdir", REPO_DIR,
            "--env", "PYTHONDONTWRITEBYTECODE=1", self.name,
            "timeout", "-s", "KILL", f"{lim.wall_s:g}", "bash", "-c", f"ulimit -t {lim.cpu_s}; {command}",
        ]  # fmt: skip

    def stop_argv(self) -> list[str]:
        # podman's rm --force first stops the container with a 10 s grace (its `sleep` ignores SIGTERM); --time 0
        # kills at once, as docker's rm --force does
        return [
            self.runtime,
            "rm",
            "--force",
            *(["--time", "0"] if self.runtime == "podman" else []),
            self.name,
        ]

    def start(self) -> None:
        if shutil.which(self.runtime) is None:
            raise FileNotFoundError(
                f"container runtime {self.runtime!r} not found on PATH (install docker or podman)"
            )
        subprocess.run(self.start_argv(), check=True, capture_output=True, timeout=600)

    def run(self, command: str, limits: SandboxLimits | None = None, stdin: bytes | None = None) -> Result:
        lim = limits or self.limits
        return run_capped(self.exec_argv(command, lim, stdin=stdin is not None), lim, stdin=stdin)

    def close(self) -> None:
        subprocess.run(self.stop_argv(), capture_output=True, timeout=120)
