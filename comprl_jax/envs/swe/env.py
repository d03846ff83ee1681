"""``comprl/SWE-Lite-v0``: repair a procedurally broken Python project with the paper's tools (issue 32 point 2).

One task per episode (``seed % n`` of the split's tasks, in file order). The agent's working copy is the project's
pristine sdist with the task's bug applied and the task's test files removed (they are the hidden tests; the
problem statement shows their failing output). The tools and the action format are tools.py's (``ToolEnv``):
``execute_bash`` runs in the sandbox (``sandbox.py``: the working copy at ``/repo`` is the only writable path, no
network, capped CPU, memory, processes, output and wall time); ``str_replace_editor`` edits the host's copy
(``files.HostFiles``, chowned to the sandbox's uid). ``submit`` ends the episode: the ``.py`` files the agent
changed inside the project's package (grading.py: nothing else travels; loader files such as ``sitecustomize.py`` or
a ``*.dist-info`` are named in ``info["tampering"]``) are copied onto a fresh bugged copy with the task's test files,
and the tests run in a fresh sandbox under an isolated runner, sentinel tests beside them, the verdicts read from
pytest's JUnit report. Reward 1 iff every fail-to-pass test passes, no test of the task's files fails and every
sentinel came back as expected; else 0 (a wrong sentinel: ``info["tampering"]``). Whatever the agent leaves in its
working copy, ``submit`` answers (bounded walks: MAX_FILES, MAX_DEPTH, SUBMIT_BYTES; past them the submission is
not graded and says why), within the step timeout: a failure the agent caused is a failed episode, never an env
error (issue 50).

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

from comprl_jax.envs.swe import bugs, grading
from comprl_jax.envs.swe import projects as projects_lib
from comprl_jax.envs.swe import tasks as tasks_lib
from comprl_jax.envs.swe.files import READ_BYTES, HostFiles, decode
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
        grade_limits: SandboxLimits = tasks_lib.GRADE_LIMITS,
    ):
        super().__init__(max_turns)
        self.split = split
        self.tasks = split_tasks(load_tasks(task_file), split)
        if not self.tasks:
            raise ValueError(f"SWE-Lite split {split!r} has no task in {task_file or TASK_FILE}")
        self.cache = Path(cache_dir) if cache_dir else tasks_lib.swe_cache()
        # both well inside the pool's step timeout (env.step_timeout_s, 60 s): a command or a grading run that the
        # agent's code makes slow ends at these limits as the agent's failure, never as an env that hung
        self.bash_limits, self.grade_limits = bash_limits, grade_limits
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
        box, self.sandbox = getattr(self, "sandbox", None), None
        if box is not None:
            tasks_lib.close_box(box)  # its uid and any resources it holds go back before the copy is removed
        if self._episode is not None:
            _remove_tree(self._episode)
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

    def _over_limits(self) -> str | None:
        used, entries = disk_usage(self.work, COPY_BYTES, COPY_ENTRIES)
        if used > COPY_BYTES:
            return f"the working copy holds more than {COPY_BYTES >> 20} MiB"
        if entries > COPY_ENTRIES:
            return f"the working copy holds more than {COPY_ENTRIES} files and directories"
        return None

    # -- reward --------------------------------------------------------------------------------------
    def changed_files(self, admissible=None) -> dict[str, str | None]:
        """The agent's changes to library files: ``{relative path: new text, or None when deleted}``; with
        ``admissible`` (a predicate on the relative path), only the files it accepts."""
        return self._compare(admissible)[0]

    def _compare(self, admissible=None) -> tuple[dict[str, str | None], list[str]]:
        """(the changes to non-test files ``admissible`` accepts, with their text; the paths of the other changed
        non-test files, never read past their size). The walk of the working copy is bounded
        (:func:`walk_files`): a copy past its bounds, or an accepted file over READ_BYTES, raises
        :class:`WorkingCopyTooLarge`."""
        assert self.task is not None
        ref = self._episode / "ref"
        if not ref.exists():
            self._bugged_copy(self.task, ref, with_tests=False)
        work_files = {rel: p for rel, p in walk_files(self.work) if not tasks_lib.is_test_path(rel)}
        ref_files = {rel: p for rel, p in walk_files(ref) if not tasks_lib.is_test_path(rel)}
        take = admissible or (lambda rel: True)
        out: dict[str, str | None] = {}
        other: list[str] = []
        total = 0
        for rel, p in sorted(work_files.items()):
            q = ref_files.get(rel)
            if q is not None and _same(p, q):
                continue
            if not take(rel):
                other.append(rel)
            elif _size(p) > READ_BYTES:
                raise WorkingCopyTooLarge(f"{rel} is larger than {READ_BYTES >> 20} MiB")
            else:
                total += _size(p)
                if total > SUBMIT_BYTES:
                    raise WorkingCopyTooLarge(
                        f"its changed source files hold more than {SUBMIT_BYTES >> 20} MiB"
                    )
                out[rel] = _read(p)
        for rel in sorted(set(ref_files) - set(work_files)):
            (out.__setitem__(rel, None) if take(rel) else other.append(rel))
        return out, sorted(other)

    def _admissible(self, rel: str) -> bool:
        return grading.lite_admissible(rel, self._project(self.task).package, tasks_lib.is_test_path)

    def diff(self) -> str:
        """The agent's changes as a unified diff (what a submission is)."""
        ref = self._episode / "ref"
        return "".join(
            bugs.unified_diff(rel, _read(ref / rel) if (ref / rel).is_file() else "", new or "")
            for rel, new in sorted(self.changed_files().items())
        )

    def evaluate(self) -> tuple[float, str, dict[str, Any]]:
        """Runs the task's tests on a fresh bugged copy with the agent's changes to the package's source files
        (grading.py: nothing else travels), sentinels beside them: (reward, report, info). A forgery the sentinels
        catch gives reward 0 and ``info["tampering"]``."""
        assert self.task is not None
        try:
            changes, ignored = self._compare(self._admissible)
        except WorkingCopyTooLarge as e:
            return 0.0, f"Not solved: the submission was not graded: {e}.", {"submission_error": str(e)}
        fresh = self._episode / "eval"
        _remove_tree(fresh)
        self._bugged_copy(self.task, fresh, with_tests=True)
        note = ""
        if ignored:
            shown = ", ".join(ignored[:5]) + (f" and {len(ignored) - 5} more" if len(ignored) > 5 else "")
            note = f" Ignored {len(ignored)} changed file(s) outside the package's source: {shown}."
        try:
            for rel, text in changes.items():
                dest = fresh / rel
                if text is None:
                    dest.unlink(missing_ok=True)
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_text(text, errors="replace")
        except OSError as e:  # a path the agent shaped so that it cannot land on a clean copy
            _remove_tree(fresh)
            msg = f"the changes cannot be applied to a clean copy ({e.strerror}: {_rel_name(e, fresh)})"
            return 0.0, f"Not solved: {msg}.{note}", {"submission_error": msg}
        project = self._project(self.task)
        try:
            g = tasks_lib.grade(
                fresh, project, self._runner, self.task["pass_to_pass"], self.task["fail_to_pass"],
                decoys=self.task["fail_to_pass"], limits=self.grade_limits,
            )  # fmt: skip
        finally:
            _remove_tree(fresh)
        head = f"Submitted {len(changes)} changed file(s).{note} "
        if g.verdict is None:
            why = "the test run was killed at the time limit" if g.killed == "wall" else g.error
            return 0.0, head + f"Hidden tests: no verdict ({why}). Not solved.", {"submission_error": why}
        v = g.verdict
        loaders = grading.loader_files(ignored)
        info: dict[str, Any] = {"ignored_files": ignored} if ignored else {}
        if (
            loaders
        ):  # neutralised (never graded), but named: a policy that writes them is hunting for the reward
            info["tampering"] = "files that load beside the test runner were not graded: " + ", ".join(
                loaders[:10]
            )
        if v.tampering:
            info["tampering"] = "; ".join(filter(None, (v.tampering, info.get("tampering"))))
            return 0.0, head + "Hidden tests: the grader's checks failed. Not solved.", info
        f2p = self.task["fail_to_pass"]
        fixed = sum(v.outcomes[t] == "passed" for t in f2p)
        solved = fixed == len(f2p) and not v.failing and g.killed is None
        report = head + (
            f"Hidden tests: {fixed}/{len(f2p)} failing tests fixed, {len(v.failing)} test(s) failing. "
            + ("Solved." if solved else "Not solved.")
        )
        return (1.0 if solved else 0.0), report, info


class WorkingCopyTooLarge(Exception):
    """The working copy is past the bounds a submission is read within (files, depth): the agent's doing."""


MAX_FILES = 20_000  # entries a submission's walk visits at most (the largest pristine project holds ~200)
MAX_DEPTH = 32  # directory levels below the root
SUBMIT_BYTES = 16 << 20  # the changed source files a submission carries, all together


COPY_BYTES = 256 << 20  # disk the working copy may use (blocks allocated: a sparse file counts what it holds)
COPY_ENTRIES = 20_000  # files and directories it may hold (the largest pristine project holds ~200)


def disk_usage(root: Path, max_bytes: int, max_entries: int) -> tuple[int, int]:
    """(bytes allocated, entries) under ``root``, links not followed, iteratively; stops counting once past either
    bound (the answer is then just above it)."""
    used = entries = 0
    stack = [root]
    while stack:
        try:
            it = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in it:
            entries += 1
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            used += st.st_blocks * 512
            if used > max_bytes or entries > max_entries:
                return used, entries
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
    return used, entries


def walk_files(root: Path):
    """``(relative path, path)`` of every regular file under ``root`` (links not followed, ``__pycache__`` left out),
    iteratively and within MAX_FILES entries and MAX_DEPTH levels (else :class:`WorkingCopyTooLarge`)."""
    seen = 0
    stack = [(root, "", 0)]
    while stack:
        d, prefix, depth = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue  # unreadable or vanished: nothing of it is graded
        for e in entries:
            seen += 1
            if seen > MAX_FILES:
                raise WorkingCopyTooLarge(f"it holds more than {MAX_FILES} files and directories")
            name = e.name
            rel = prefix + name
            try:
                if e.is_symlink():
                    continue
                if e.is_dir(follow_symlinks=False):
                    if name == "__pycache__":
                        continue
                    if depth + 1 > MAX_DEPTH:
                        raise WorkingCopyTooLarge(f"its directories nest deeper than {MAX_DEPTH} levels")
                    stack.append((Path(e.path), rel + "/", depth + 1))
                elif e.is_file(follow_symlinks=False):
                    yield rel, Path(e.path)
            except OSError:
                continue


def _same(p: Path, q: Path) -> bool:
    """Same bytes; a file over READ_BYTES is never read (a sparse file of gigabytes would be read whole)."""
    try:
        n = p.stat().st_size
        return n == q.stat().st_size and n <= READ_BYTES and p.read_bytes() == q.read_bytes()
    except OSError:
        return False


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _rel_name(e: OSError, base: Path) -> str:
    name = str(e.filename or "")
    return name[len(str(base)) + 1 :] if name.startswith(str(base) + "/") else name


def _remove_tree(path: Path) -> None:
    """Removes ``path`` however the agent shaped it: ``rm -rf`` walks any depth (shutil.rmtree recurses, and a
    1,000-level tree raised RecursionError through ``ignore_errors``)."""
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, timeout=600)


def _read(path: Path) -> str:
    return decode(path.read_bytes())
