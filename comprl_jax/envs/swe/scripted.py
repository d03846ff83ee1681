"""A scripted SWE-Lite agent: "grep the failing test, edit the line" over the tool interface (issue 32 point 4).

A reference point for the env, not a method: it plays through the same ``<answer>`` tool calls a model would and
sees only what a model sees (the problem statement and tool output; never the patch or the hidden tests).

1. From the statement it takes the library frames of the tracebacks (``path:line: in name`` outside test files) and
   the names called on the failing test's source line, and finds each name's ``def`` with ``grep -rn``.
2. It views those files and lists the one-token edits of :mod:`bugs` (operator swaps, off-by-one, constants,
   argument swaps) on the traceback lines first, then on the lines of the functions found.
3. A failing test line that reads only literals and the library (``assert 'capital' == inflection.camelize(...)``)
   becomes a reproduction: it runs in the sandbox before each edit and after it; an edit that makes it pass is
   submitted, one that does not is undone. Without a reproduction it submits the first edit.

Removed statements cannot be undone this way (their text is gone), so those tasks stay unsolved by construction.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

from comprl_jax.envs.swe import bugs
from comprl_jax.envs.swe.tasks import is_test_path

INVERTIBLE = ("op_swap", "off_by_one", "wrong_constant", "swap_args")
_FRAME_RE = re.compile(r"^([\w./-]+\.py):(\d+): in (\w+)", re.MULTILINE)
_CALL_RE = re.compile(r"([A-Za-z_][\w.]*)\(")


def call(name: str, **arguments) -> str:
    return "<answer>" + json.dumps({"name": name, "arguments": arguments}) + "</answer>"


def _failing_lines(statement: str) -> list[str]:
    """The source line under each test frame of the tracebacks (the line that failed)."""
    lines = statement.splitlines()
    out = []
    for i, ln in enumerate(lines[:-1]):
        m = _FRAME_RE.match(ln)
        if m and is_test_path(m.group(1)):
            src = lines[i + 1].strip()
            if src and not src.startswith("E "):
                out.append(src)
    return out


def _reproduction(src: str, package: str) -> str | None:
    """``src`` as a standalone check when it reads only literals and the package (no test locals)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    if not src.startswith("assert") or names - {
        package,
        "True",
        "False",
        "None",
        "len",
        "list",
        "str",
        "int",
    }:
        return None
    return f"import {package}\n{src}\nprint('REPRO-OK')"


class ScriptedAgent:
    """``play(statement, step) -> reward``, where ``step(reply) -> (obs, reward, done)`` is the env's step."""

    def __init__(self, max_tries: int = 8, view_lines: int = 80):
        self.max_tries, self.view_lines = max_tries, view_lines

    def play(self, statement: str, step: Callable[[str], tuple[str, float, bool]]) -> float:
        frames = [(p, int(n), f) for p, n, f in _FRAME_RE.findall(statement) if not is_test_path(p)]
        failing = _failing_lines(statement)
        names = [f for _, _, f in frames]
        for src in failing:
            names += [c.split(".")[-1] for c in _CALL_RE.findall(src)]
        names = list(dict.fromkeys(n for n in names if n not in _BUILTINS))
        # 1. where each function is defined (library files only)
        defs: list[tuple[str, int]] = []
        for name in names[:6]:
            out, _, done = step(
                call("execute_bash", command=f"grep -rn --include=*.py 'def {name}(' . | head -5")
            )
            if done:
                return 0.0
            for ln in out.splitlines():
                path, _, rest = ln.removeprefix("./").partition(":")
                num = rest.split(":", 1)[0]
                if path.endswith(".py") and not is_test_path(path) and num.isdigit():
                    defs.append((path, int(num)))
        hot = {(p, n) for p, n, _ in frames}
        # 2. the one-token edits of those functions, the traceback's own lines first
        edits: list[tuple[int, int, str, str, str]] = []  # (priority, line, path, old line, new line)
        for path, first in list(dict.fromkeys(defs))[:6]:
            view, _, done = step(
                call("str_replace_editor", command="view", path=f"/repo/{path}",
                     view_range=[first, first + self.view_lines])
            )  # fmt: skip
            if done:
                return 0.0
            for line, old, new in _function_edits(view, first):
                edits.append((0 if (path, line) in hot else 1, line, path, old, new))
        edits.sort(key=lambda e: (e[0], e[2], e[1]))
        package = _package(frames, defs)
        repro = next((r for r in (_reproduction(s, package) for s in failing) if r and package), None)
        # 3. try them against the reproduction (or submit the first one)
        for _, _, path, old, new in edits[: self.max_tries]:
            obs, _, done = step(
                call(
                    "str_replace_editor",
                    command="str_replace",
                    path=f"/repo/{path}",
                    old_str=old,
                    new_str=new,
                )
            )
            if done:
                return 0.0
            if not obs.startswith("Edited"):
                continue  # the line occurs more than once: leave it
            if repro is None:
                return step(call("submit"))[1]
            out, _, done = step(
                call("execute_bash", command=f"PYTHONPATH=/repo/src:/repo python3 - <<'EOF'\n{repro}\nEOF")
            )
            if done:
                return 0.0
            if "REPRO-OK" in out:
                return step(call("submit"))[1]
            step(call("str_replace_editor", command="undo_edit", path=f"/repo/{path}"))
        return step(call("submit"))[1]


_BUILTINS = {
    "len",
    "list",
    "str",
    "int",
    "repr",
    "dict",
    "set",
    "tuple",
    "sorted",
    "isinstance",
    "type",
    "print",
}


def _package(frames, defs) -> str | None:
    paths = [p for p, _, _ in frames] + [p for p, _ in defs]
    if not paths:
        return None
    parts = paths[0].split("/")
    if parts[0] == "src" and len(parts) > 1:
        parts = parts[1:]
    return parts[0].removesuffix(".py")


def _function_edits(view: str, first: int) -> list[tuple[int, str, str]]:
    """(line, old line, new line) of every invertible one-token edit of the function whose ``def`` opens the
    editor view (starting at line ``first``)."""
    rows = []
    for ln in view.splitlines()[1:]:
        num, sep, rest = ln.partition("\t")
        if not sep or not num.strip().isdigit():
            break
        rows.append(rest)
    if not rows:
        return []
    indent = len(rows[0]) - len(rows[0].lstrip())
    block = [rows[0]]
    for r in rows[1:]:  # the function ends at the first non-blank line indented no deeper than its def
        if (
            r.strip()
            and len(r) - len(r.lstrip()) <= indent
            and not r.lstrip().startswith(("#", ")", "]", "}"))
        ):
            break
        block.append(r)
    text = "\n".join(r[indent:] if r.strip() else "" for r in block) + "\n"
    out = []
    for m in bugs.candidates(text):
        if m.kind not in INVERTIBLE:
            continue
        after = bugs.apply(text, m).splitlines()
        before = text.splitlines()
        i = m.line - 1
        if len(after) != len(before) or i >= len(before) or after[i] == before[i]:
            continue
        out.append((first + i, " " * indent + before[i], " " * indent + after[i]))
    return out
