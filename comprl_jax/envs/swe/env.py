"""``comprl/SWE-Lite-v0``: repair a procedurally broken Python project with the paper's tools (issue 32 point 2).

One task per episode (``seed % n`` of the split's tasks, in file order). The agent's working copy is the project's
pristine sdist with the task's bug applied and the task's test files removed (they are the hidden tests; the
problem statement shows their failing output). Actions are one tool call as JSON inside ``<answer>...</answer>``::

    {"name": "execute_bash", "arguments": {"command": "grep -n 'def take' toolz/*.py"}}
    {"name": "str_replace_editor", "arguments": {"command": "view", "path": "/repo/toolz/itertoolz.py",
                                                  "view_range": [400, 420]}}
    {"name": "str_replace_editor", "arguments": {"command": "str_replace", "path": "/repo/toolz/itertoolz.py",
                                                  "old_str": "n - 1", "new_str": "n"}}
    {"name": "submit", "arguments": {}}

``execute_bash`` runs in the sandbox (``sandbox.py``: the working copy at ``/repo`` is the only writable path, no
network, capped CPU, memory, processes, output and wall time). ``str_replace_editor`` follows SWE-agent's tool:
``view`` (a file with line numbers, or a directory two levels deep), ``create``, ``str_replace`` (``old_str`` must
occur exactly once), ``insert`` (after ``insert_line``; 0 = at the top), ``undo_edit``; paths are absolute under
``/repo`` and may not leave it (links are resolved first). ``submit`` ends the episode: the library files the agent
changed (test files and ``conftest.py`` are ignored) are copied onto a fresh bugged copy, the task's test files are
restored, and the tests run in a fresh sandbox. Reward 1 iff every fail-to-pass test passes and no test of the
task's files fails; else 0. A turn that is not a valid tool call is an invalid action (the observation says why).

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

from comprl_jax.envs.base import TextEnv, echo
from comprl_jax.envs.swe import bugs
from comprl_jax.envs.swe import projects as projects_lib
from comprl_jax.envs.swe import tasks as tasks_lib
from comprl_jax.envs.swe.sandbox import MOUNT, Sandbox, SandboxLimits

TASK_FILE = Path(__file__).with_name("tasks.jsonl")
SPLITS = ("train", "eval", "same_project_eval")
OBS_CHARS = 6000  # what one tool result shows at most
VIEW_LINES = 200  # a file view without view_range shows this many lines, then says how to see more
TOOLS = ("execute_bash", "str_replace_editor", "submit")
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
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


class SWELiteEnv(TextEnv):
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
        self._history: dict[str, list[str]] = {}  # undo_edit: earlier contents per path

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
        self._history = {}
        goal = self.task["problem_statement"]
        obs = (
            f"Repository: {self.task['project']} {self.task['version']}, checked out at {MOUNT}.\n\n{goal}\n\n"
            f"Run Python as {self._runner}/bin/python (pytest is installed there)."
        )
        info = {
            "task_id": self.task["instance_id"],
            "goal": goal,
            "query": f"{self.task['project']}: {goal[:1500]}",
            "project": self.task["project"],
            "seed": int(seed),
        }
        return obs, info

    # -- tools ---------------------------------------------------------------------------------------
    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        call, error = _parse_call(action)
        if error:
            return f"Invalid action{echo(action)}: {error}", 0.0, False, {"invalid_action": True}
        name, args = call
        if name == "submit":
            reward, report = self.evaluate()
            return report, reward, True, {"invalid_action": False, "success": reward == 1.0}
        if name == "execute_bash":
            cmd = args.get("command")
            if not isinstance(cmd, str) or not cmd.strip():
                return (
                    "execute_bash needs a non-empty string 'command'.",
                    0.0,
                    False,
                    {"invalid_action": True},
                )
            r = self.sandbox.run(cmd)
            return _cap(r.observation()) or "(no output)", 0.0, False, {"invalid_action": False}
        try:
            out = self._editor(args)
        except _ToolError as e:
            return f"str_replace_editor: {e}", 0.0, False, {"invalid_action": True}
        return _cap(out), 0.0, False, {"invalid_action": False}

    def _resolve(self, path: Any, must_exist: bool = True) -> tuple[Path, str]:
        if not isinstance(path, str) or not path.startswith("/"):
            raise _ToolError(f"'path' must be an absolute path under {MOUNT}, got {echo(str(path)).strip()}")
        norm = os.path.normpath(path)
        if norm != MOUNT and not norm.startswith(MOUNT + "/"):
            raise _ToolError(f"{norm} is outside the repository {MOUNT}")
        rel = os.path.relpath(norm, MOUNT)
        host = (self.work / rel) if rel != "." else self.work
        real = Path(os.path.realpath(host))
        root = Path(os.path.realpath(self.work))
        if real != root and root not in real.parents:
            raise _ToolError(f"{norm} resolves outside the repository (a link?)")
        if must_exist and not real.exists():
            raise _ToolError(f"{norm} does not exist")
        return real, ("" if rel == "." else rel)

    def _editor(self, args: dict) -> str:
        cmd = args.get("command")
        if cmd not in EDITOR_COMMANDS:
            raise _ToolError(f"'command' must be one of {', '.join(EDITOR_COMMANDS)}")
        path, rel = self._resolve(args.get("path"), must_exist=cmd != "create")
        shown = f"{MOUNT}/{rel}" if rel else MOUNT
        if cmd == "view":
            if path.is_dir():
                return _tree(path, shown)
            lines = _read(path).splitlines()
            lo, hi = 1, min(len(lines), VIEW_LINES)
            rng = args.get("view_range")
            if rng is not None:
                if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng)):
                    raise _ToolError("'view_range' must be [first, last] line numbers (last -1 = to the end)")
                lo, hi = rng[0], len(lines) if rng[1] == -1 else rng[1]
                if not 1 <= lo <= max(len(lines), 1) or hi < lo:
                    raise _ToolError(f"view_range {rng} is outside the file's {len(lines)} lines")
            body = "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, min(hi, len(lines)) + 1))
            more = ""
            if rng is None and len(lines) > hi:
                more = f"\n[{len(lines) - hi} more lines: view with view_range [{hi + 1}, -1]]"
            return f"Here is {shown} (lines {lo}-{min(hi, len(lines))} of {len(lines)}):\n{body}{more}"
        if path.is_dir():
            raise _ToolError(f"{shown} is a directory")
        if cmd == "create":
            text = args.get("file_text")
            if not isinstance(text, str):
                raise _ToolError("create needs a string 'file_text'")
            if path.exists():
                raise _ToolError(f"{shown} exists already: edit it with str_replace or insert")
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write(path, rel, text, record=False)
            return f"Created {shown} ({len(text.splitlines())} lines)."
        if cmd == "undo_edit":
            hist = self._history.get(rel)
            if not hist:
                raise _ToolError(f"no edit of {shown} to undo")
            path.write_text(hist.pop())
            return f"Undid the last edit of {shown}."
        text = _read(path)
        if cmd == "str_replace":
            old, new = args.get("old_str"), args.get("new_str", "")
            if not isinstance(old, str) or not old or not isinstance(new, str):
                raise _ToolError("str_replace needs a non-empty string 'old_str' and a string 'new_str'")
            n = text.count(old)
            if n != 1:
                raise _ToolError(f"old_str occurs {n} times in {shown}; it must occur exactly once")
            edited = text.replace(old, new, 1)
            self._write(path, rel, edited)
            line = text[: text.index(old)].count("\n") + 1
            return f"Edited {shown} at line {line}.\n" + _snippet(edited, line, new.count("\n") + 1)
        # insert
        at, new = args.get("insert_line"), args.get("new_str")
        lines = text.splitlines(keepends=True)
        if not isinstance(at, int) or not 0 <= at <= len(lines) or not isinstance(new, str):
            raise _ToolError(
                f"insert needs an integer 'insert_line' in [0, {len(lines)}] and a string 'new_str'"
            )
        add = new if new.endswith("\n") else new + "\n"
        if at and not lines[at - 1].endswith("\n"):
            lines[at - 1] += "\n"
        out = "".join(lines[:at]) + add + "".join(lines[at:])
        self._write(path, rel, out)
        return f"Inserted after line {at} of {shown}.\n" + _snippet(out, at + 1, add.count("\n"))

    def _write(self, path: Path, rel: str, text: str, record: bool = True) -> None:
        if record:
            self._history.setdefault(rel, []).append(_read(path))
        path.write_text(text)
        if self.sandbox.root:  # the sandbox's uid owns the copy: keep it so
            os.chown(path, self.sandbox.uid, self.sandbox.uid)

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

    def system_prompt(self) -> str:
        return (
            "You are a software engineer fixing a bug in a Python repository at /repo. Each turn, call one tool: "
            "think briefly inside <think>...</think>, then give the call as JSON inside <answer>...</answer>.\n"
            "Tools:\n"
            '- {"name": "execute_bash", "arguments": {"command": "..."}}: run a shell command in /repo (no network).\n'
            '- {"name": "str_replace_editor", "arguments": {"command": "view"|"create"|"str_replace"|"insert"|'
            '"undo_edit", "path": "/repo/...", ...}}: view a file (optional "view_range": [first, last]) or '
            'directory; create (needs "file_text"); str_replace ("old_str" must occur exactly once, "new_str"); '
            'insert ("insert_line", "new_str"); undo_edit.\n'
            '- {"name": "submit", "arguments": {}}: submit your fix; hidden tests decide the reward.\n'
            'Example: <answer>{"name": "execute_bash", "arguments": {"command": "ls"}}</answer>'
        )


class _ToolError(ValueError):
    pass


def _parse_call(action: str | None) -> tuple[tuple[str, dict] | None, str | None]:
    if action is None:
        return None, 'no <answer>...</answer> holding a tool call such as {"name": "submit", "arguments": {}}'
    try:
        call = json.loads(action)
    except json.JSONDecodeError as e:
        return None, f"the answer is not JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict) or call.get("name") not in TOOLS:
        return None, f"the JSON must be an object whose 'name' is one of {', '.join(TOOLS)}"
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        return None, "'arguments' must be a JSON object"
    return (call["name"], args), None


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _cap(text: str) -> str:
    if len(text) <= OBS_CHARS:
        return text
    return text[:OBS_CHARS] + f"\n[... {len(text) - OBS_CHARS} more characters not shown ...]"


def _snippet(text: str, line: int, n: int, context: int = 3) -> str:
    lines = text.splitlines()
    lo, hi = max(1, line - context), min(len(lines), line + n - 1 + context)
    return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, hi + 1))


def _tree(path: Path, shown: str, depth: int = 2) -> str:
    out = [f"Files and directories in {shown}, two levels deep (hidden ones left out):"]
    base = len(path.parts)
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if len(p.parts) - base > depth or any(x.startswith(".") or x == "__pycache__" for x in rel.parts):
            continue
        out.append(f"{shown.rstrip('/')}/{rel.as_posix()}{'/' if p.is_dir() else ''}")
    return "\n".join(out)
