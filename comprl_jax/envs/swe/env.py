"""``comprl/SWE-Lite-v0``: repair a procedurally broken Python project with the paper's tools (issue 32 point 2).

One task per episode (``seed % n`` of the split's tasks, in file order). The agent's working copy is the project's
pristine sdist with the task's bug applied and the task's test files removed (they are the hidden tests; the
problem statement shows their failing output). The tools and the action format are tools.py's (``ToolEnv``):
``execute_bash`` runs in the sandbox (``sandbox.py``: the working copy at ``/repo`` is the only writable path, no
network, capped CPU, memory, processes, output and wall time); ``str_replace_editor`` edits the host's copy
(``files.HostFiles``, chowned to the sandbox's uid). ``submit`` ends the episode: the library files the agent
changed (test files and ``conftest.py`` are ignored) are copied onto a fresh bugged copy, the task's test files are
restored, and the tests run in a fresh sandbox. Reward 1 iff every fail-to-pass test passes and no test of the
task's files fails; else 0.

Splits (``split=``): ``train`` (training projects, the tasks of their within-project train split), ``eval`` (every
task of the held-out projects: the primary figure), ``same_project_eval`` (training projects, their held-out tasks:
the second figure). Tasks come from the shipped ``tasks.jsonl`` (``launch/make_swe_tasks.py`` rebuilds it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from comprl_jax.envs.swe import bugs
from comprl_jax.envs.swe import projects as projects_lib
from comprl_jax.envs.swe import tasks as tasks_lib
from comprl_jax.envs.swe.files import HostFiles, decode
from comprl_jax.envs.swe.sandbox import MOUNT, Sandbox, SandboxLimits
from comprl_jax.envs.swe.tools import OBS_CHARS, ToolEnv

TASK_FILE = Path(__file__).with_name("tasks.jsonl")
SPLITS = ("train", "eval", "same_project_eval")
# The tool-call syntax for constrained decoding (tiny models, ``actor.constrained``): submit, a short shell command,
# or viewing a path; the full tool set stays open to unconstrained actors.
_CMD_CHARS = r"[a-zA-Z0-9 ./_*|=:-]"
_PATH_RE = r"/repo(/[a-zA-Z0-9._-]{1,30}){0,4}"
ACTION_REGEX = (
    r'<answer>(\{"name": "submit", "arguments": \{\}\}'
    rf'|\{{"name": "execute_bash", "arguments": \{{"command": "{_CMD_CHARS}{{1,60}}"\}}\}}'
    rf'|\{{"name": "str_replace_editor", "arguments": \{{"command": "view", "path": "{_PATH_RE}"\}}\}})</answer>'
)
BASH_LIMITS = SandboxLimits(wall_s=30, cpu_s=30, memory_mb=2048, processes=64, output_bytes=OBS_CHARS)


def load_tasks(path: str | os.PathLike | None = None) -> list[dict]:
    p = Path(path) if path else TASK_FILE
    if not p.exists():
        raise FileNotFoundError(
            f"SWE-Lite task file {str(p)!r} is missing: run launch/make_swe_tasks.py to build it"
        )
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def split_tasks(tasks: list[dict], split: str) -> list[dict]:
    if split == "train":
        return [t for t in tasks if t["split"] == "train" and t["same_project_split"] == "train"]
    if split == "eval":
        return [t for t in tasks if t["split"] == "eval"]
    if split == "same_project_eval":
        return [t for t in tasks if t["split"] == "train" and t["same_project_split"] == "eval"]
    raise ValueError(f"SWE-Lite split must be one of {SPLITS}, got {split!r}")


class SWELiteEnv(ToolEnv):
    action_regex = ACTION_REGEX

    def __init__(
        self,
        split: str = "train",
        max_turns: int = 30,
        task_file: str | None = None,
        cache_dir: str | None = None,
        bash_limits: SandboxLimits = BASH_LIMITS,
    ):
        super().__init__(max_turns)
        self.split = split
        self.tasks = split_tasks(load_tasks(task_file), split)
        if not self.tasks:
            raise ValueError(f"SWE-Lite split {split!r} has no task in {task_file or TASK_FILE}")
        self.cache = Path(cache_dir) if cache_dir else tasks_lib.swe_cache()
        self.bash_limits = bash_limits
        self.task: dict | None = None
        self._episode: Path | None = None

    # -- episodes ------------------------------------------------------------------------------------
    def _project(self, task: dict) -> tasks_lib.Project:
        return projects_lib.get(task["project"], task["version"])

    def _bugged_copy(self, task: dict, dest: Path, with_tests: bool) -> None:
        """Pristine sources + the task's bug; without the task's test files unless ``with_tests``."""
        project = self._project(task)
        root = tasks_lib.pristine(project, self.cache)
        shutil.copytree(root, dest, symlinks=True, ignore=shutil.ignore_patterns(".complete", "__pycache__"))
        subprocess.run(
            ["patch", "-p1", "-s", "--no-backup-if-mismatch"],
            input=task["patch"],
            text=True,
            cwd=dest,
            check=True,
        )
        if not with_tests:
            for rel in task["pass_to_pass"]:
                (dest / rel).unlink(missing_ok=True)

    def _cleanup(self) -> None:
        if self._episode is not None:
            shutil.rmtree(self._episode, ignore_errors=True)
            self._episode = None

    def close(self) -> None:
        self._cleanup()
        super().close()

    @property
    def work(self) -> Path:
        assert self._episode is not None
        return self._episode / "repo"

    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        self._cleanup()
        if seed is None:
            seed = int(self.np_random.integers(0, len(self.tasks)))
        self.task = self.tasks[int(seed) % len(self.tasks)]
        base = self.cache / "episodes"
        base.mkdir(parents=True, exist_ok=True)
        self._episode = Path(tempfile.mkdtemp(dir=base))
        self._bugged_copy(self.task, self.work, with_tests=False)
        self._runner = tasks_lib.runner_env()
        self.sandbox = Sandbox(str(self.work), limits=self.bash_limits, ro_paths=(str(self._runner),))
        files = HostFiles(self.work, uid=self.sandbox.uid if self.sandbox.root else None)
        goal = self.task["problem_statement"]
        obs = (
            f"Repository: {self.task['project']} {self.task['version']}, checked out at {MOUNT}.\n\n{goal}\n\n"
            f"Run Python as {self._runner}/bin/python (pytest is installed there)."
        )
        return obs, self._start_episode(files, self.task["instance_id"], self.task["project"], goal, seed)

    def _bash(self, command: str):
        return self.sandbox.run(command)

    # -- reward --------------------------------------------------------------------------------------
    def changed_files(self) -> dict[str, str | None]:
        """The agent's changes to library files: ``{relative path: new text, or None when deleted}``."""
        assert self.task is not None
        ref = self._episode / "ref"
        if not ref.exists():
            self._bugged_copy(self.task, ref, with_tests=False)
        out: dict[str, str | None] = {}
        work = self.work
        for base, other in ((work, ref), (ref, work)):
            for p in sorted(base.rglob("*")):
                if p.is_symlink() or not p.is_file() or "__pycache__" in p.parts:
                    continue
                rel = p.relative_to(base).as_posix()
                if tasks_lib.is_test_path(rel) or rel in out:
                    continue
                q = other / rel
                if base is work:
                    if not q.is_file() or q.read_bytes() != p.read_bytes():
                        out[rel] = _read(p)
                elif not q.exists():
                    out[rel] = None
        return out

    def diff(self) -> str:
        """The agent's changes as a unified diff (what a submission is)."""
        ref = self._episode / "ref"
        return "".join(
            bugs.unified_diff(rel, _read(ref / rel) if (ref / rel).is_file() else "", new or "")
            for rel, new in sorted(self.changed_files().items())
        )

    def evaluate(self) -> tuple[float, str]:
        """Runs the task's tests on a fresh bugged copy with the agent's library changes: (reward, report)."""
        assert self.task is not None
        changes = self.changed_files()
        fresh = self._episode / "eval"
        shutil.rmtree(fresh, ignore_errors=True)
        self._bugged_copy(self.task, fresh, with_tests=True)
        for rel, text in changes.items():
            dest = fresh / rel
            if text is None:
                dest.unlink(missing_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text)
        run = tasks_lib.run_tests(fresh, self._project(self.task), self._runner, self.task["pass_to_pass"])
        shutil.rmtree(fresh, ignore_errors=True)
        f2p_ok = all(run.outcomes.get(t) == "passed" for t in self.task["fail_to_pass"])
        broken = sorted(t for t, o in run.outcomes.items() if o in ("failed", "error"))
        solved = f2p_ok and not broken and bool(run.outcomes)
        fixed = sum(run.outcomes.get(t) == "passed" for t in self.task["fail_to_pass"])
        report = (
            f"Submitted {len(changes)} changed file(s). Hidden tests: {fixed}/{len(self.task['fail_to_pass'])} "
            f"failing tests fixed, {len(broken)} test(s) failing. " + ("Solved." if solved else "Not solved.")
        )
        return (1.0 if solved else 0.0), report


def _read(path: Path) -> str:
    return decode(path.read_bytes())
