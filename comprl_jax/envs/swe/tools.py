"""The paper's SWE tools as one env base class: ``execute_bash``, ``str_replace_editor`` and ``submit`` (issue 32).

Every SWE env (SWE-Lite on bubblewrap, ``env.py``; SWE-bench-format tasks on a container runtime or bubblewrap,
``bench.py``) is a :class:`ToolEnv`: the tool calls are parsed and answered here, the same way for both; a subclass
supplies where the repository is (``repo_dir``, ``files``: files.py) and three hooks: ``_bash(command) -> Result``,
``evaluate() -> (reward, report[, info])`` (what ``submit`` does; ``info`` joins the step's: ``tampering``,
``submission_error``) and its own ``_reset``.

An action is one tool call as JSON inside ``<answer>...</answer>``::

    {"name": "execute_bash", "arguments": {"command": "grep -n 'def take' toolz/*.py"}}
    {"name": "str_replace_editor", "arguments": {"command": "view", "path": "/repo/toolz/itertoolz.py",
                                                  "view_range": [400, 420]}}
    {"name": "str_replace_editor", "arguments": {"command": "str_replace", "path": "/repo/toolz/itertoolz.py",
                                                  "old_str": "n - 1", "new_str": "n"}}
    {"name": "submit", "arguments": {}}

``str_replace_editor`` follows SWE-agent's tool: ``view`` (a file with line numbers, or a directory two levels
deep), ``create``, ``str_replace`` (``old_str`` must occur exactly once), ``insert`` (after ``insert_line``; 0 = at
the top), ``undo_edit``; paths are absolute under the repository and may not leave it (links are resolved first).
A turn that is not a valid tool call is an invalid action (the observation says why), and so is one past the caps
on what a model writes (COMMAND_CHARS, PATH_CHARS, NAME_BYTES, ARGUMENT_CHARS; a NUL or a lone surrogate in a
command or a path; JSON nested past Python's recursion limit or a number past its digit limit): ``step`` answers
every call with an observation (tests/test_swe_robust.py drives it with arbitrary calls).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from comprl_jax.envs.base import TextEnv, echo
from comprl_jax.envs.swe.files import ToolError

OBS_CHARS = 6000  # what one tool result shows at most
# caps on what a model writes (issue 50 point 3): past them the call is an invalid action with this message, never
# a raise (a command's text is one argv string, which Linux caps at 128 KiB; a name at 255 bytes)
COMMAND_CHARS = 16_384
PATH_CHARS = 1024
NAME_BYTES = 255
ARGUMENT_CHARS = 1 << 20
VIEW_LINES = 200  # a file view without view_range shows this many lines, then says how to see more
TOOLS = ("execute_bash", "str_replace_editor", "submit")
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")


class ToolEnv(TextEnv):
    """Subclasses set ``self.repo_dir`` (before the first reset: the system prompt names it) and start each episode
    with :meth:`_start_episode` (its files, HostFiles / ShellFiles)."""

    repo_dir = "/repo"
    files: Any = None

    def __init__(self, max_turns: int):
        super().__init__(max_turns)
        self._history: dict[str, list[str]] = {}  # undo_edit: earlier contents per resolved path

    # -- hooks ---------------------------------------------------------------------------------------
    def _bash(self, command: str):
        raise NotImplementedError

    def evaluate(self) -> tuple[float, str]:
        raise NotImplementedError

    def _over_limits(self) -> str | None:
        """Checked after every command and edit: why the working copy is past what an episode may hold (disk,
        files), which ends the episode as the agent's failure; None when within them (the default: no check)."""
        return None

    def _start_episode(self, files, task_id: str, project: str, goal: str, seed: int) -> dict[str, Any]:
        """Starts an episode on ``files`` (no edit to undo yet); returns its info dict."""
        self.files, self._history = files, {}
        return {
            "task_id": task_id,
            "goal": goal,
            "query": f"{project}: {goal[:1500]}",
            "project": project,
            "seed": int(seed),
        }

    # -- tools ---------------------------------------------------------------------------------------
    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        call, error = parse_call(action)
        if error:
            return f"Invalid action{echo(action)}: {error}", 0.0, False, {"invalid_action": True}
        name, args = call
        if name == "submit":
            reward, report, *extra = self.evaluate()
            info = {**(extra[0] if extra else {}), "invalid_action": False, "success": reward == 1.0}
            return report, reward, True, info
        if name == "execute_bash":
            cmd = args.get("command")
            if not isinstance(cmd, str) or not cmd.strip():
                return (
                    "execute_bash needs a non-empty string 'command'.",
                    0.0,
                    False,
                    {"invalid_action": True},
                )
            bad = _bad_text(cmd, "command", COMMAND_CHARS)
            if bad:
                return f"execute_bash: {bad}", 0.0, False, {"invalid_action": True}
            r = self._bash(cmd)
            return self._checked(cap(r.observation()) or "(no output)")
        try:
            out = self._editor(args)
        except ToolError as e:
            return f"str_replace_editor: {e}", 0.0, False, {"invalid_action": True}
        return self._checked(cap(out))

    def _checked(self, obs: str) -> tuple[str, float, bool, dict[str, Any]]:
        why = self._over_limits()
        if why is None:
            return obs, 0.0, False, {"invalid_action": False}
        end = f"\n[episode ended: {why}]"
        return obs + end, 0.0, True, {"invalid_action": False, "success": False, "limit": why}

    def _resolve(self, path: Any) -> tuple[str | None, Any, str]:
        """(kind, key, shown path) of an agent's path; ToolError when it is not an absolute path in the repo."""
        repo = self.repo_dir
        if not isinstance(path, str) or not path.startswith("/"):
            raise ToolError(f"'path' must be an absolute path under {repo}, got {echo(str(path)).strip()}")
        bad = _bad_text(path, "path", PATH_CHARS)
        if bad or any(len(part.encode()) > NAME_BYTES for part in path.split("/")):
            raise ToolError(bad or f"a name in 'path' is longer than {NAME_BYTES} bytes")
        norm = os.path.normpath(path)
        if norm != repo and not norm.startswith(repo + "/"):
            raise ToolError(f"{norm} is outside the repository {repo}")
        rel = os.path.relpath(norm, repo)
        rel = "" if rel == "." else rel
        with _naming(norm):
            kind, key = self.files.stat(rel)
        return kind, key, norm

    def _editor(self, args: dict) -> str:
        cmd = args.get("command")
        if cmd not in EDITOR_COMMANDS:
            raise ToolError(f"'command' must be one of {', '.join(EDITOR_COMMANDS)}")
        for k in ("file_text", "old_str", "new_str"):
            v = args.get(k)
            if isinstance(v, str) and len(v) > ARGUMENT_CHARS:
                raise ToolError(f"'{k}' is longer than {ARGUMENT_CHARS} characters")
        kind, key, shown = self._resolve(args.get("path"))
        if kind is None and cmd != "create":
            raise ToolError(f"{shown} does not exist")
        if kind == "other":
            raise ToolError(f"{shown} is not a regular file or directory")
        if cmd == "view":
            if kind == "dir":
                return _tree(self.files.tree(key), shown)
            lines = self._read(key, shown).splitlines()
            lo, hi = 1, min(len(lines), VIEW_LINES)
            rng = args.get("view_range")
            if rng is not None:
                if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng)):
                    raise ToolError("'view_range' must be [first, last] line numbers (last -1 = to the end)")
                lo, hi = rng[0], len(lines) if rng[1] == -1 else rng[1]
                if not 1 <= lo <= max(len(lines), 1) or hi < lo:
                    raise ToolError(f"view_range {rng} is outside the file's {len(lines)} lines")
            body = "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, min(hi, len(lines)) + 1))
            more = ""
            if rng is None and len(lines) > hi:
                more = f"\n[{len(lines) - hi} more lines: view with view_range [{hi + 1}, -1]]"
            return f"Here is {shown} (lines {lo}-{min(hi, len(lines))} of {len(lines)}):\n{body}{more}"
        if kind == "dir":
            raise ToolError(f"{shown} is a directory")
        if cmd == "create":
            text = args.get("file_text")
            if not isinstance(text, str):
                raise ToolError("create needs a string 'file_text'")
            if kind is not None:
                raise ToolError(f"{shown} exists already: edit it with str_replace or insert")
            self._put(key, shown, text)
            return f"Created {shown} ({len(text.splitlines())} lines)."
        if cmd == "undo_edit":
            hist = self._history.get(str(key))
            if not hist:
                raise ToolError(f"no edit of {shown} to undo")
            self._put(key, shown, hist.pop())
            return f"Undid the last edit of {shown}."
        text = self._read(key, shown)
        if cmd == "str_replace":
            old, new = args.get("old_str"), args.get("new_str", "")
            if not isinstance(old, str) or not old or not isinstance(new, str):
                raise ToolError("str_replace needs a non-empty string 'old_str' and a string 'new_str'")
            n = text.count(old)
            if n != 1:
                raise ToolError(f"old_str occurs {n} times in {shown}; it must occur exactly once")
            edited = text.replace(old, new, 1)
            self._write(key, shown, text, edited)
            line = text[: text.index(old)].count("\n") + 1
            return f"Edited {shown} at line {line}.\n" + _snippet(edited, line, new.count("\n") + 1)
        # insert
        at, new = args.get("insert_line"), args.get("new_str")
        lines = text.splitlines(keepends=True)
        if not isinstance(at, int) or not 0 <= at <= len(lines) or not isinstance(new, str):
            raise ToolError(
                f"insert needs an integer 'insert_line' in [0, {len(lines)}] and a string 'new_str'"
            )
        add = new if new.endswith("\n") else new + "\n"
        if at and not lines[at - 1].endswith("\n"):
            lines[at - 1] += "\n"
        out = "".join(lines[:at]) + add + "".join(lines[at:])
        self._write(key, shown, text, out)
        return f"Inserted after line {at} of {shown}.\n" + _snippet(out, at + 1, add.count("\n"))

    def _read(self, key, shown: str) -> str:
        with _naming(shown):
            return self.files.read(key)

    def _put(self, key, shown: str, text: str) -> None:
        with _naming(shown):
            self.files.write(key, text)

    def _write(self, key, shown: str, before: str, after: str) -> None:
        self._put(key, shown, after)
        self._history.setdefault(str(key), []).append(before)

    def system_prompt(self) -> str:
        repo = self.repo_dir
        return (
            f"You are a software engineer fixing a bug in a Python repository at {repo}. Each turn, call one tool: "
            "think briefly inside <think>...</think>, then give the call as JSON inside <answer>...</answer>.\n"
            "Tools:\n"
            f'- {{"name": "execute_bash", "arguments": {{"command": "..."}}}}: run a shell command in {repo} '
            "(no network).\n"
            '- {"name": "str_replace_editor", "arguments": {"command": "view"|"create"|"str_replace"|"insert"|'
            f'"undo_edit", "path": "{repo}/...", ...}}}}: view a file (optional "view_range": [first, last]) or '
            'directory; create (needs "file_text"); str_replace ("old_str" must occur exactly once, "new_str"); '
            'insert ("insert_line", "new_str"); undo_edit.\n'
            '- {"name": "submit", "arguments": {}}: submit your fix; hidden tests decide the reward.\n'
            'Example: <answer>{"name": "execute_bash", "arguments": {"command": "ls"}}</answer>'
        )


@contextlib.contextmanager
def _naming(shown: str):
    """A file access's ToolError ("does not exist", ...) names the agent's path first."""
    try:
        yield
    except ToolError as e:
        raise ToolError(f"{shown} {e}") from None


def _bad_text(text: str, what: str, limit: int) -> str | None:
    """Why ``text`` cannot be used as a command or path (too long, a NUL, a lone surrogate), or None."""
    if len(text) > limit:
        return f"'{what}' is longer than {limit} characters"
    if "\x00" in text:
        return f"'{what}' holds a NUL character"
    if any("\ud800" <= c <= "\udfff" for c in text):
        return f"'{what}' holds a lone surrogate (not valid UTF-8)"
    return None


def parse_call(action: str | None) -> tuple[tuple[str, dict] | None, str | None]:
    if action is None:
        return None, 'no <answer>...</answer> holding a tool call such as {"name": "submit", "arguments": {}}'
    try:
        call = json.loads(action)
    except json.JSONDecodeError as e:
        return None, f"the answer is not JSON ({e.msg} at character {e.pos})"
    except RecursionError:
        return None, "the answer's JSON nests too deeply"
    except ValueError as e:  # a number past Python's int-string digit limit, say
        return None, f"the answer's JSON cannot be read ({str(e)[:120]})"
    if not isinstance(call, dict) or call.get("name") not in TOOLS:
        return None, f"the JSON must be an object whose 'name' is one of {', '.join(TOOLS)}"
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        return None, "'arguments' must be a JSON object"
    return (call["name"], args), None


def cap(text: str) -> str:
    if len(text) <= OBS_CHARS:
        return text
    return text[:OBS_CHARS] + f"\n[... {len(text) - OBS_CHARS} more characters not shown ...]"


def _snippet(text: str, line: int, n: int, context: int = 3) -> str:
    lines = text.splitlines()
    lo, hi = max(1, line - context), min(len(lines), line + n - 1 + context)
    return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, hi + 1))


def _tree(entries: list[tuple[str, bool]], shown: str) -> str:
    out = [f"Files and directories in {shown}, two levels deep (hidden ones left out):"]
    out += [f"{shown.rstrip('/')}/{rel}{'/' if is_dir else ''}" for rel, is_dir in entries]
    return "\n".join(out)
