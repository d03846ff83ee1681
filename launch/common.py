"""What the ``launch/*.py`` entry points share: quiet logs, one- or two-line errors, the workdir checks,
``--print_config``, the resume-with-a-changed-config check, and the TensorBoard command.

Errors: a launcher runs its ``main`` through :func:`run` (``absl.app.run`` with a flag parser and a guard). A
failure the user can fix (a bad flag or config key, a missing file, an unwritable or full disk) ends the program
with two lines on stderr, ``error: <what is wrong>`` and ``<what to do>``, and a non-zero exit: 2 for a bad
command line, 1 for a failure while running. ``--verbosity=0`` (or 1) prints the full traceback as well;
an exception of a type that means a bug in this code always prints its traceback.

Logs: library loggers (Orbax, JAX, absl) are set to WARNING and this package's own to INFO, so the progress bar,
the per-step summary and errors are what a user reads; any ``--verbosity`` given restores absl's meaning
(0 = INFO, 1 = DEBUG for every logger).
"""

from __future__ import annotations

import ast
import difflib
import errno
import io
import json
import logging
import os
import re
import shutil
import sys
import threading
import tokenize
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from comprl_jax.config import keys
from comprl_jax.config.keys import flatten

USAGE_EXIT = 2  # a bad command line: nothing ran
RUN_EXIT = 1  # a failure while running
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
# Keys that may change when a run resumes without --allow_config_change: they do not change what is trained.
RESUME_FREE_KEYS = (
    "train.steps",
    "train.eval_tasks",
    "train.eval_full_splits",
    "train.eval_every",
    "train.log_every",
)


class LaunchError(Exception):
    """A failure the user can fix: ``what`` is wrong (one line), ``todo`` says what to do (one line)."""

    def __init__(self, what: str, todo: str = "", code: int = USAGE_EXIT):
        super().__init__(what)
        self.what, self.todo, self.code = what, todo, code


# -- verbosity and logs -------------------------------------------------------------------------------
def argv_verbosity(argv: Iterable[str]) -> int | None:
    """The ``--verbosity`` / ``-v`` value given in ``argv`` (None when absent): read before the flags are
    parsed, so that a failure while parsing them knows whether to print its traceback."""
    args = list(argv)
    value = None
    for i, a in enumerate(args):
        m = re.fullmatch(r"--?(?:verbosity|v)(?:=(.*))?", a)
        if not m:
            continue
        raw = m.group(1) if m.group(1) is not None else (args[i + 1] if i + 1 < len(args) else "")
        try:
            value = int(raw)
        except ValueError:
            value = 0
    return value


def flag_verbosity() -> int | None:
    """The parsed ``--verbosity`` when it was given on the command line, else None."""
    from absl import flags

    f = flags.FLAGS["verbosity"]
    return int(f.value) if f.present else None


def configure_logging(verbosity: int | None) -> None:
    """No ``--verbosity``: WARNING for every library logger, INFO for ``comprl_jax``'s own lines (resume,
    skipped checkpoints), library ``warnings.warn`` hidden. With it: absl's levels, warnings shown."""
    logging.captureWarnings(True)
    if verbosity is not None:
        return  # absl already set the root level from the flag
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.NOTSET)  # Orbax logs through absl: follow the root
    logging.getLogger("comprl_jax").setLevel(logging.INFO)
    logging.getLogger("py.warnings").setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_first_line_only)
    threading.excepthook = _thread_exception_line
    sys.unraisablehook = lambda unraisable: None  # "Exception ignored in ..." at shutdown: library noise


def _first_line_only(record: logging.LogRecord) -> bool:
    """Library records in one line, without their traceback (Orbax logs one per failed write thread; the
    error that ends the program is reported once, by :func:`report`)."""
    if not record.name.startswith("comprl_jax"):
        msg = record.getMessage()
        record.msg, record.args = _one_line(msg.splitlines()[0] if msg else "")[:300], None
        record.exc_info = record.exc_text = record.stack_info = None
    return True


def _thread_exception_line(args) -> None:
    """A library thread's exception in one line; one raised through this package's code keeps its traceback."""
    if args.exc_type is SystemExit:
        return
    frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback is not None else []
    if any(f"{os.sep}comprl_jax{os.sep}" in f.filename for f in frames):
        threading.__excepthook__(args)
        return
    name = args.thread.name if args.thread is not None else "?"
    print(
        f"warning: thread {name}: {args.exc_type.__name__}: {_one_line(args.exc_value)[:300]}",
        file=sys.stderr,
    )


# -- errors --------------------------------------------------------------------------------------------
def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def describe(exc: BaseException, workdir: str | None = None) -> LaunchError | None:
    """The two-line form of an exception the user can act on, or None for one that means a bug here."""
    if isinstance(exc, LaunchError):
        return exc
    for e in _chain(exc):
        # tensorstore (Orbax) reports a full disk as ValueError("RESOURCE_EXHAUSTED: ... [os_error_code='28']")
        full = (isinstance(e, OSError) and e.errno in _DISK_FULL) or re.search(
            r"No space left on device|os_error_code='?(?:28|122)\b", str(e)
        )
        if full:
            where = getattr(e, "filename", None) or workdir or "the run directory"
            return LaunchError(
                f"no space left on the device holding {where}",
                "free some space and run the same command again (a run resumes from its last checkpoint)",
                RUN_EXIT,
            )
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _NOT_WRITABLE:
            return LaunchError(
                f"cannot access {e.filename or workdir}: {e.strerror}",
                "check that path's permissions (a --workdir must be writable)",
                RUN_EXIT,
            )
    if isinstance(exc, FileNotFoundError):
        # Our loaders' messages name the path and how to point the project elsewhere.
        return LaunchError(_one_line(exc), "fix the path it names, then run the same command again", RUN_EXIT)
    if isinstance(exc, KeyError) and "unknown env id" in str(exc):
        return LaunchError(_one_line(exc.args[0]), "fix --config.env.tasks (or the config file)", USAGE_EXIT)
    if isinstance(exc, ValueError) and str(exc).startswith("config key "):
        key = str(exc)[len("config key ") :].split(":", 1)[0].split(" ")[0]
        return LaunchError(
            _one_line(exc), f"set it with --config.{key}=...; --print_config lists every key", USAGE_EXIT
        )
    return None


def report(exc: BaseException, verbosity: int | None, workdir: str | None = None) -> int:
    """Prints an exception as two lines (plus its traceback when ``verbosity`` >= 0 or it is a bug);
    returns the exit code."""
    err = describe(exc, workdir)
    if err is None or (verbosity is not None and verbosity >= 0):
        traceback.print_exception(exc, file=sys.stderr)
    if err is None:
        print(f"error: {type(exc).__name__}: {_one_line(exc)[:500]}", file=sys.stderr)
        print("this looks like a bug in comprl_jax: the traceback above says where", file=sys.stderr)
        return RUN_EXIT
    print(f"error: {err.what}", file=sys.stderr)
    if err.todo:
        print(err.todo, file=sys.stderr)
    return err.code


# -- the command line ----------------------------------------------------------------------------------
def _check_config_file(argv: list[str]) -> None:
    """A missing ``--config`` file, named with the experiments that exist (config_flags defers that error)."""
    for a in argv:
        if not a.startswith("--config="):
            continue
        spec = a.split("=", 1)[1]
        path = spec.split(":", 1)[0]
        if os.path.isfile(path):
            return
        folder = os.path.dirname(path) or "."
        have = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(folder) else []
        near = difflib.get_close_matches(os.path.basename(path), have, n=1)
        hint = f'Did you mean "{os.path.join(folder, near[0])}"? ' if near else ""
        raise LaunchError(
            f"config file {path!r} not found (--config={spec})",
            hint + (f"experiments in {folder}/: {', '.join(h[:-3] for h in have)}" if have else ""),
        )


def _flag_error(exc: BaseException, argv: list[str]) -> LaunchError:
    """Turns what absl / ml_collections raise for a bad flag, ``--config`` or ``--config.<key>`` into two lines."""
    from absl import flags

    text = str(exc)
    config_arg = next((a for a in argv if a.startswith("--config=")), None)
    keys_hint = f"list the keys with: launch/train.py {config_arg or '--config=...'} --print_config"
    if isinstance(exc, AttributeError | KeyError):
        # ml_collections: AttributeError("'llr'\nDid you mean \"lr\" instead of \"llr\"?")
        m = re.search(r'instead of "([^"]+)"', text) or re.search(r"'([A-Za-z0-9_]+)", text)
        bad = m.group(1) if m else _one_line(text)
        overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
        arg = next((a for a in overrides if bad in a.split(".")), f"--config.{bad}")
        mean = re.search(r'Did you mean "[^"]*" instead of "[^"]*"\?', text)
        what = f"{arg}: config key {arg[len('--config.') :]} does not exist"
        return LaunchError(what + (f". {mean.group(0)}" if mean else ""), keys_hint)
    if isinstance(exc, flags.UnrecognizedFlagError):
        return LaunchError(_one_line(text), "see --helpfull for the flags")
    if "Error whilst parsing config file" in text or "Configuration is not available" in text:
        # The config file raised: the message carries its traceback; its last line says what is wrong.
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        last = re.sub(r"^[A-Za-z_.]*(?:Error|Exception): ", "", lines[-1])
        m = re.search(r"config variant word '([^']*)' unknown", last)
        if m:
            from comprl_jax.config import METHODS, SCALES

            near = difflib.get_close_matches(m.group(1), list(SCALES) + list(METHODS), n=1)
            last += f'. Did you mean "{near[0]}"?' if near else ""
        return LaunchError(f"{config_arg}: {last}", "fix the config file or its variant words")
    msg = _one_line(text)
    return LaunchError(msg, keys_hint if msg.startswith("flag --config") else "see --helpfull for the flags")


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parser for :func:`run`: bad flags and config errors end in two lines, exit code 2."""
    from absl import flags

    try:
        _check_config_file(argv[1:])
        return flags.FLAGS(argv)
    except SystemExit:
        raise
    except BrokenPipeError:  # `--helpfull | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 -- every parse failure is the command line's fault
        verbosity = argv_verbosity(argv)
        if verbosity is not None and verbosity >= 0:
            traceback.print_exception(exc, file=sys.stderr)
        err = exc if isinstance(exc, LaunchError) else _flag_error(exc, argv[1:])
        print(f"error: {err.what}", file=sys.stderr)
        if err.todo:
            print(err.todo, file=sys.stderr)
        sys.exit(USAGE_EXIT)


def run(main: Callable[[list[str]], Any], workdir: Callable[[], str | None] = lambda: None) -> None:
    """``absl.app.run(main)`` with :func:`parse_flags` and errors reported as two lines (see module doc)."""
    from absl import app

    def guarded(argv):
        try:
            return main(argv)
        except BrokenPipeError:  # e.g. `--print_config | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(RUN_EXIT)
        except KeyboardInterrupt:
            print(
                "interrupted: run the same command again to resume from the last checkpoint", file=sys.stderr
            )
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 -- reported as two lines, or with its traceback if a bug
            sys.exit(report(exc, flag_verbosity(), workdir()))

    app.run(guarded, flags_parser=parse_flags)


# -- the run directory ---------------------------------------------------------------------------------
def prepare_workdir(path: str) -> str | None:
    """Checks that ``path`` is (or can be made) a writable directory, creating it if needed.

    Returns:
      What to undo if this invocation fails before its first checkpoint: ``"remove"`` (the directory did not
      exist), ``"empty"`` (it existed, empty) or None (it already held files: left alone).
    Raises:
      LaunchError: a file in the way, or a directory that cannot be written (permissions, read-only, full).
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise LaunchError(
            f"--workdir={path} is a file, not a directory", "pass a directory path (created if missing)"
        )
    existed = os.path.isdir(path)
    undo = ("empty" if not os.listdir(path) else None) if existed else "remove"
    probe = os.path.join(path, f".write_test.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:  # one byte: a full disk fails here, not hours later
            f.write("x")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if not existed and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        if e.errno in _DISK_FULL:
            raise LaunchError(
                f"--workdir={path}: no space left on its device ({e.strerror})",
                "free some space or choose another --workdir",
                RUN_EXIT,
            ) from e
        if isinstance(e, NotADirectoryError | FileExistsError):
            raise LaunchError(
                f"--workdir={path}: a part of the path is a file ({e.strerror})", "choose another --workdir"
            ) from e
        raise LaunchError(
            f"--workdir={path} is not writable ({e.strerror})", "choose a --workdir you can write to"
        ) from e
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return undo


def undo_workdir(path: str, undo: str | None) -> None:
    """After a failed first start (no checkpoint written): leave no half-made run directory behind."""
    if undo is None or latest_checkpoint_step(path) is not None or not os.path.isdir(path):
        return
    if undo == "remove":
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.remove(p)


def latest_checkpoint_step(workdir: str) -> int | None:
    """Newest finished checkpoint step under ``<workdir>/checkpoints`` (Orbax names finished steps by their
    number; a save in progress has a suffix), or None."""
    d = os.path.join(workdir, "checkpoints")
    steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
    return max(steps) if steps else None


# -- configs: print, compare ---------------------------------------------------------------------------
def config_tree(config) -> dict[str, Any]:
    """A ConfigDict as the JSON tree the trainer writes to ``config.json`` (same key order, lists)."""
    return json.loads(config.to_json_best_effort())


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[tuple]:
    """``[(key, old value, new value)]`` for every flattened key that differs (missing = None)."""
    a, b = flatten(old), flatten(new)
    skip = set(ignore)
    keys = list(b) + [k for k in a if k not in b]
    return [(k, a.get(k), b.get(k)) for k in keys if k not in skip and a.get(k) != b.get(k)]


def config_comments(source_path: str | None = None) -> dict[str, str]:
    """``{"actor.lr": "comment", ...}`` from the comments beside the assignments in ``base_config``.

    Read from the source text of comprl_jax/config/schema.py (the comments are the documentation of the keys): an
    inline comment belongs to its assignment; a block of comment lines belongs to the assignment below it; a
    comment line starting in lower case right after a commented assignment continues that comment.
    """
    if source_path is None:
        from comprl_jax.config import schema

        source_path = schema.__file__
    with open(source_path) as f:
        text = f.read()
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    func = next(
        n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "base_config"
    )
    out: dict[str, str] = {}
    prev_end, prev_key = None, None
    for node in func.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        parts, t = [], node.targets[0]
        while isinstance(t, ast.Attribute):
            parts.append(t.attr)
            t = t.value
        if not (isinstance(t, ast.Name) and t.id == "c") or not parts:
            continue
        key = ".".join(reversed(parts))
        # comment-only lines between the previous assignment and this one
        block = []
        ln = node.lineno - 1
        while ln in comments and ln not in code_lines:
            block.insert(0, ln)
            ln -= 1
        if block and prev_key in out and prev_end == block[0] - 1 and comments[block[0]][:1].islower():
            out[prev_key] += " " + comments[block.pop(0)]
        inline = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
        text_ = " ".join(inline) or " ".join(comments[i] for i in block)
        if text_:
            out[key] = text_
        prev_end, prev_key = node.end_lineno, key
    return out


def format_config(config, comments: Mapping[str, str] | None = None) -> str:
    """One ``key = value  # comment`` line per key of the final config, in the order of config/schema.py; values in
    Python syntax, as ``--config.key=value`` overrides take them."""
    comments = config_comments() if comments is None else comments

    pairs = [(k, repr(keys.get(config, k))) for k in flatten(config_tree(config))]
    width = max(len(f"{k} = {v}") for k, v in pairs)
    lines = []
    for k, v in pairs:
        c = comments.get(k)
        lines.append(f"{f'{k} = {v}':<{width}}  # {c}" if c else f"{k} = {v}")
    return "\n".join(lines)


# -- TensorBoard ---------------------------------------------------------------------------------------
def tensorboard_command(logdir: str) -> str:
    """A command that shows ``logdir`` in TensorBoard from this environment: the ``tensorboard`` next to this
    Python when installed, else the install command first."""
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    rel = os.path.relpath(exe)
    exe = exe if rel.startswith("..") else rel  # `.venv/bin/tensorboard` from the repository root
    if os.path.exists(exe):
        return f"{exe} --logdir {logdir}"
    return f"{sys.executable} -m pip install tensorboard && {exe} --logdir {logdir}"
