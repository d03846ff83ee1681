"""The editor's file access, one interface over two places a repository can live (issue 32 point 5).

``str_replace_editor`` (tools.py) needs four things of a working copy: what a path is (after links are resolved,
and never outside the repository), a file's text, writing a file, and a directory listing. :class:`HostFiles`
does them on a host directory (SWE-Lite: the bubblewrap sandbox binds that directory, so the host sees the agent's
copy). :class:`ShellFiles` does them with shell commands run by a box's ``run(command, limits, stdin=)``: a
container (``docker exec``; SWE-Bench Verified's images) or the bubblewrap sandbox, so the same commands are tested
here that a container runs.

Paths: ``rel`` is a normalised path relative to the repository root (``""`` = the root); ``key`` is what
:meth:`stat` resolved it to (a host ``Path`` or an absolute path inside the box), passed back to read/write/tree.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
from pathlib import Path

from comprl_jax.envs.swe.sandbox import SandboxLimits

KINDS = ("file", "dir", "other")  # stat's kinds; None = missing
READ_BYTES = 4 << 20  # the largest file the editor reads


class ToolError(ValueError):
    """A tool call the agent got wrong: the message is its observation."""


def decode(data: bytes | str) -> str:
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data


def encode(text: str) -> bytes:
    """UTF-8; a lone surrogate (JSON allows ``"\\ud800"``) becomes ``?`` instead of failing the step."""
    return text.encode("utf-8", errors="replace")


TREE_ENTRIES = 1000  # a directory view lists at most this many entries (then says how many more)


class HostFiles:
    """A working copy on this host at ``root``; files written are chowned to ``uid`` (the sandbox's) where given.
    Every operation's OSError (a name too long, a path through a file, a vanished entry) is the agent's
    :class:`ToolError`, never a raise out of the env."""

    def __init__(self, root: Path, uid: int | None = None):
        self.root = Path(os.path.realpath(root))
        self.uid = uid

    def stat(self, rel: str) -> tuple[str | None, Path]:
        try:
            real = Path(os.path.realpath(self.root / rel if rel else self.root))
            if real != self.root and self.root not in real.parents:
                raise ToolError("resolves outside the repository (a link?)")
            if real.is_dir():
                return "dir", real
            if real.is_file():
                return "file", real
            return ("other" if real.exists() or real.is_symlink() else None), real
        except (OSError, ValueError) as e:
            raise ToolError(f"cannot be looked up: {_why(e)}") from None

    def read(self, key: Path) -> str:
        try:
            if key.stat().st_size > READ_BYTES:
                raise ToolError(f"is larger than {READ_BYTES >> 20} MiB; look at it with execute_bash")
            return decode(key.read_bytes())
        except OSError as e:
            raise ToolError(f"cannot be read: {_why(e)}") from None

    def write(self, key: Path, text: str) -> None:
        try:
            made = [p for p in reversed(key.parents) if self.root in p.parents and not p.exists()]
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(encode(text))
            if self.uid is not None:  # the sandbox's uid owns the copy: keep it so (new directories too)
                for p in (*made, key):
                    os.chown(p, self.uid, self.uid)
        except OSError as e:  # a parent that is a file, a read-only path: the agent's mistake, not a crash
            raise ToolError(f"cannot be written: {_why(e)}") from None

    def tree(self, key: Path, depth: int = 2) -> list[tuple[str, bool]]:
        """``[(path relative to key, is a directory)]``, ``depth`` levels, hidden entries and caches left out; a link
        is an entry, not a directory (the shell's ``find`` says the same). At most TREE_ENTRIES entries are
        visited (a last row ``("[... more entries not listed ...]", False)`` says so)."""
        out: list[tuple[str, bool]] = []
        stack = [(key, "", 1)]
        while stack:
            d, prefix, level = stack.pop()
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.name.startswith(".") or e.name == "__pycache__":
                    continue
                if len(out) >= TREE_ENTRIES:
                    return sorted(out) + [("[... more entries not listed ...]", False)]
                try:
                    is_dir = e.is_dir(follow_symlinks=False)  # a link is listed, not followed
                except OSError:
                    is_dir = False
                out.append((prefix + e.name, is_dir))
                if is_dir and level < depth:
                    stack.append((Path(e.path), prefix + e.name + "/", level + 1))
        return sorted(out)


def _why(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:200]


# One command per operation; the path travels as a shell-quoted word, never inside the script's text.
_STAT = (
    'r=$(realpath -m -- {root}) && p=$(realpath -m -- {path}) && case "$p" in "$r"|"$r"/*) ;; *) echo outside; '
    'exit 0;; esac; if [ -d "$p" ]; then k=dir; elif [ -f "$p" ]; then k=file; elif [ -e "$p" ] || [ -L "$p" ]; '
    'then k=other; else k=missing; fi; printf \'%s\\n%s\' "$k" "$p"'
)
_TREE = r"find {path} -mindepth 1 -maxdepth {depth} \( -name '.*' -o -name __pycache__ \) -prune -o -printf '%y %P\n'"
# base64 of a file is 4/3 of it; processes: without root RLIMIT_NPROC counts every process of our uid
_LIMITS = SandboxLimits(
    wall_s=30, cpu_s=10, memory_mb=512, processes=64, output_bytes=(READ_BYTES * 4) // 3 + 4096
)
_BEGIN, _END = "<<<COMPRL-OUT", "COMPRL-OUT>>>"
_FRAME = re.compile(re.escape(_BEGIN) + r"([A-Za-z0-9+/=]*)" + re.escape(_END))


def framed(command: str) -> str:
    """``command`` with its stdout base64-encoded between two markers and its stderr after them: a box's output
    merges stdout and stderr, and a container runtime may add warnings of its own, none of which may end up in a
    file's text (:func:`unframe` takes the stdout back)."""
    return (
        f"e=$(mktemp) || exit 1; printf %s '{_BEGIN}'; ( {command} ) 2>\"$e\" | base64 -w0; "
        f's=${{PIPESTATUS[0]}}; printf %s \'{_END}\'; cat "$e"; rm -f "$e"; exit $s'
    )


def unframe(result) -> str | None:
    """The framed command's stdout (UTF-8, undecodable bytes replaced), or None when the frame is not there whole
    (output cut at the limit, the shell killed)."""
    m = _FRAME.search(result.output)
    return None if m is None else decode(base64.b64decode(m.group(1)))


class ShellFiles:
    """A working copy at ``root`` inside ``box`` (anything with ``run(command, limits, stdin=) -> Result``)."""

    def __init__(self, box, root: str, limits: SandboxLimits = _LIMITS):
        self.box, self.root, self.limits = box, root.rstrip("/") or "/", limits

    def _run(self, command: str, stdin: bytes | None = None) -> str:
        r = self.box.run(framed(command), self.limits, stdin=stdin)
        out = unframe(r)
        if r.truncated or (out is None and r.ok):
            raise ToolError(f"is larger than {READ_BYTES >> 20} MiB; look at it with execute_bash")
        if not r.ok or out is None:
            err = r.output.split(_END, 1)[-1].strip() or r.observation().strip()
            raise ToolError(f"the file operation failed: {err[-500:]}")
        return out

    def stat(self, rel: str) -> tuple[str | None, str]:
        path = f"{self.root}/{rel}" if rel else self.root
        out = self._run(_STAT.format(root=shlex.quote(self.root), path=shlex.quote(path)))
        kind, _, real = out.partition("\n")
        if kind == "outside":
            raise ToolError("resolves outside the repository (a link?)")
        if kind not in (*KINDS, "missing"):
            raise ToolError(f"could not tell what the path is: {out.strip()[-300:]}")
        return (None if kind == "missing" else kind), real

    def read(self, key: str) -> str:
        return self._run(f"cat -- {shlex.quote(key)}")

    def write(self, key: str, text: str) -> None:
        q = shlex.quote(key)
        self._run(f'mkdir -p -- "$(dirname -- {q})" && cat > {q}', stdin=encode(text))

    def tree(self, key: str, depth: int = 2) -> list[tuple[str, bool]]:
        out = self._run(_TREE.format(path=shlex.quote(key), depth=int(depth)))
        rows = [line.split(" ", 1) for line in out.splitlines() if " " in line]
        return sorted((rel, kind == "d") for kind, rel in rows)
