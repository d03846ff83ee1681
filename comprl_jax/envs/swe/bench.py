"""SWE-bench-format tasks (SWE-Bench Verified) with the same tools as SWE-Lite, on a container runtime or bubblewrap
(issue 32 point 5).

:class:`SWEBenchEnv` is a :class:`tools.ToolEnv` like ``SWELiteEnv``: the same ``execute_bash``,
``str_replace_editor`` and ``submit``, parsed and answered by the same code. What differs is where the repository
lives: in a *box* (``run(command, limits, stdin=)``, ``repo_dir``, ``close()``), and the editor reaches it with
shell commands (``files.ShellFiles``). Backends (``backend=``):

* ``"docker"`` / ``"podman"``: the task's official SWE-bench image (container.py), repository at ``/testbed``.
  **Untested here**: this machine pulls no image. Its commands are unit-tested (tests/test_swe_container.py), and
  every command it runs through them is the one the bubblewrap backend runs in tests/test_swe_bench.py.
* ``"bubblewrap"``: the task's ``base_commit`` (and its history, nothing later) fetched from a local checkout
  (``checkouts/<owner>__<name>``) into a fresh repository, in the sandbox of sandbox.py (repository at ``/repo``); ``ro_paths`` mounts an interpreter
  environment holding the project's dependencies. Tested end to end here on a hand-built repository.

Task records (JSONL, one per line): SWE-bench's fields, as in ``princeton-nlp/SWE-bench_Verified``:
``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``test_patch``, ``FAIL_TO_PASS``,
``PASS_TO_PASS`` (lists, or the dataset's JSON-encoded lists), plus how to run the tests, which the dataset does not
hold: ``eval_script`` (what the SWE-bench harness runs for the instance: ``make_test_spec(instance).eval_script``
in ``pip install swebench``), or ``test_cmd`` (a command run after the test patch is applied; the script is then
built here). Optional: ``image`` (another image than the official one), ``log_format`` (``pytest``, ``django`` or
``sympy``; by default from ``repo``, as the harness picks its log parser).

Grading (``submit``), following the harness: the agent's changes as ``git diff`` against ``base_commit`` (new files
included) are applied in a fresh box (``git apply``, then ``patch --fuzz=5`` as the harness falls back to); the
script restores the test files, applies ``test_patch`` and runs the tests; the log's outcomes are parsed
(:func:`parse_test_log`). Reward 1 iff every ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` test passed.

    env = SWEBenchEnv(task_file="verified.jsonl", backend="podman")
    obs, info = env.reset(seed=0)   # starts the instance's container

Not in the static registry (its task file and runtime are the user's); a launcher registers it before training, and
the trainer's held-out evaluation then plays the records whose ``"split"`` is ``"eval"``::

    from comprl_jax.envs import register
    register("comprl/SWE-Bench-Verified-v0", "comprl_jax.envs.swe.bench:SWEBenchEnv", levels="split",
             train_split="train", eval_splits=("eval",), eval_sizes={"eval": N}, task_file="/data/verified.jsonl",
             backend="podman")

and trains with ``--config.env.step_timeout_s=3600`` or so: a submit runs the tests in a fresh container (up to
``EVAL_LIMITS.wall_s``) and a reset may pull an image; the default 60 s would fail those steps.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from comprl_jax.envs.swe import grading
from comprl_jax.envs.swe.container import REPO_DIR, RUNTIMES, ContainerSandbox
from comprl_jax.envs.swe.files import ShellFiles, framed, unframe
from comprl_jax.envs.swe.sandbox import MOUNT, Result, Sandbox, SandboxLimits
from comprl_jax.envs.swe.tools import OBS_CHARS, ToolEnv

BACKENDS = (*RUNTIMES, "bubblewrap")
LOG_FORMATS = ("pytest", "django", "sympy")
_REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
BASH_LIMITS = SandboxLimits(wall_s=60, cpu_s=60, memory_mb=4096, processes=128, output_bytes=OBS_CHARS)
# a whole test module of a large project; the log is read whole (the summary is at its end)
EVAL_LIMITS = SandboxLimits(
    wall_s=1800, cpu_s=1800, memory_mb=8192, processes=256, file_mb=512, tmp_mb=1024,
    output_bytes=32 << 20, drain_bytes=64 << 20,
)  # fmt: skip
PATCH_LIMITS = SandboxLimits(wall_s=120, cpu_s=60, memory_mb=2048, processes=32, output_bytes=32 << 20)


def load_instances(path: str | os.PathLike) -> list[dict]:
    """SWE-bench task records from a JSONL file, checked for the fields grading needs."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"SWE-bench task file {str(p)!r} is missing: write the dataset's records as JSONL, each with an "
            "'eval_script' or a 'test_cmd' (see comprl_jax/envs/swe/bench.py)"
        )
    out = []
    with open(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            t = json.loads(line)
            missing = [k for k in _REQUIRED if k not in t]
            if missing:
                raise ValueError(f"{p}:{n}: task record lacks {missing}")
            if not t.get("eval_script") and not t.get("test_cmd"):
                raise ValueError(
                    f"{p}:{n} ({t['instance_id']}): give 'eval_script' (the SWE-bench harness's) or 'test_cmd'"
                )
            fmt = t.get("log_format") or default_log_format(t["repo"])
            if fmt not in LOG_FORMATS:
                raise ValueError(f"{p}:{n}: log_format must be one of {LOG_FORMATS}, got {fmt!r}")
            t = {**t, "log_format": fmt, "FAIL_TO_PASS": _as_list(t["FAIL_TO_PASS"])}
            t["PASS_TO_PASS"] = _as_list(t["PASS_TO_PASS"])
            out.append(t)
    if not out:
        raise ValueError(f"SWE-bench task file {str(p)!r} holds no task")
    return out


def _as_list(v: Any) -> list[str]:
    return json.loads(v) if isinstance(v, str) else list(v)


def default_log_format(repo: str) -> str:
    return {"django/django": "django", "sympy/sympy": "sympy"}.get(repo, "pytest")


def patch_files(patch: str) -> list[str]:
    """The files a patch touches (``diff --git a/X b/X``), in order."""
    return list(dict.fromkeys(re.findall(r"^diff --git a/\S+ b/(\S+)$", patch, flags=re.M)))


def eval_script(task: dict) -> str:
    """The task's own ``eval_script``, or one built from ``test_cmd``: restore the test files the test patch
    touches (a file it adds is removed), apply the test patch, run the tests."""
    if task.get("eval_script"):
        return task["eval_script"]
    base, patch = task["base_commit"], task["test_patch"]
    delim = "EOF_TEST_PATCH"
    while delim in patch:
        delim += "_"
    restore = "\n".join(
        f"git checkout -q {shlex.quote(base)} -- {shlex.quote(f)} 2>/dev/null || rm -f -- {shlex.quote(f)}"
        for f in patch_files(patch)
    )
    body = patch if patch.endswith("\n") else patch + "\n"
    return f"{restore}\ngit apply -v - <<'{delim}'\n{body}{delim}\n{task['test_cmd']}\n"


_PYTEST = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_PASSING = {"PASSED", "XFAIL"}  # the harness counts an expected failure as a pass
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PYTEST_VERBOSE = re.compile(rf"^(\S+::\S+) ({'|'.join(_PYTEST)})\b")  # pytest -v: "id STATUS [ n%]"
_DJANGO = re.compile(r"^(.+?) \.\.\. (ok|skipped.*|FAIL|ERROR|expected failure|unexpected success)\s*$")
_SYMPY_FAIL = re.compile(r"^_+ (?:.+\.py):(\S+) _+$")


def parse_test_log(log: str, fmt: str) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` from a test run's log, the ids spelled as SWE-bench's
    ``FAIL_TO_PASS`` lists spell them (the harness's parsers: pytest's ``-rA`` summary lines ``STATUS id`` and
    ``-v`` lines ``id STATUS``, Django's ``id ... ok``, sympy's ``id ok`` / ``id F`` / ``id E``). A later line about
    a test overrides an earlier one. Not reproduced: the harness's parsers for seaborn, sphinx and the
    ``pytest_options`` repositories, and Django's results printed after a test's own output; give such tasks an
    ``eval_script`` whose log these rules read."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {fmt!r}")
    out: dict[str, str] = {}
    for raw in log.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        if fmt == "pytest":
            word = line.split(" ", 1)[0]
            verbose = _PYTEST_VERBOSE.match(line)
            if word in _PYTEST:
                parts = line.replace(" - ", " ").split()
                if len(parts) > 1:
                    out[parts[1]] = _outcome(word in _PASSING, word == "SKIPPED")
            elif verbose:
                word = verbose.group(2)
                out[verbose.group(1)] = _outcome(word in _PASSING, word == "SKIPPED")
        elif fmt == "django":
            m = _DJANGO.match(line)
            if m:
                status = m.group(2)
                passed = status in ("ok", "expected failure")
                out[m.group(1)] = _outcome(passed, status.startswith("skipped"))
            elif line.startswith(("FAIL: ", "ERROR: ")):
                out[line.split(": ", 1)[1]] = "failed"
        else:  # sympy
            m = _SYMPY_FAIL.match(line)
            parts = line.split()
            if m:
                out[m.group(1)] = "failed"
            elif len(parts) == 2 and parts[0].startswith("test_") and parts[1] in ("ok", "F", "E", "f", "s"):
                out[parts[0]] = _outcome(parts[1] == "ok", parts[1] == "s")  # "f" fails, as in the harness
    return out


def _outcome(passed: bool, skipped: bool = False) -> str:
    return "skipped" if skipped else ("passed" if passed else "failed")


class CheckoutBox:
    """The bubblewrap backend's box: ``commit`` of ``checkout`` fetched into a fresh repository in a temporary
    directory (under ``scratch``), run through :class:`sandbox.Sandbox`. ``close()`` removes it."""

    def __init__(
        self,
        checkout: str | os.PathLike,
        commit: str,
        limits: SandboxLimits = BASH_LIMITS,
        ro_paths: tuple[str, ...] = (),
        scratch: str | None = None,
    ):
        src = Path(checkout)
        if not (src / ".git").exists():
            raise FileNotFoundError(f"{str(src)!r} is not a git checkout: clone the task's repository there")
        self.dir = Path(tempfile.mkdtemp(prefix="comprl-swe-", dir=scratch))
        work = self.dir / "repo"
        try:
            # Only the base commit and its history: a clone would keep the checkout's later commits (the fix)
            # reachable through its remote refs and tags (git log --all). Fetched objects are copies, never links
            # to the checkout's (the copy is chowned to the sandbox's uid).
            for argv in (
                ["git", "init", "-q", str(work)],
                ["git", "-C", str(work), "fetch", "-q", "--no-tags", str(src.resolve()), commit],
                ["git", "-C", str(work), "checkout", "-q", "--detach", "FETCH_HEAD"],
            ):
                r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                if r.returncode:
                    raise RuntimeError(
                        f"{' '.join(argv[:4])} ... failed for {str(src)!r} at {commit}: {r.stderr.strip()[-500:]}"
                    )
            (work / ".git" / "FETCH_HEAD").unlink(missing_ok=True)
            self.sandbox = Sandbox(str(work), limits=limits, ro_paths=ro_paths)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    @property
    def repo_dir(self) -> str:
        return self.sandbox.repo_dir

    def run(self, command: str, limits: SandboxLimits | None = None, stdin: bytes | None = None) -> Result:
        return self.sandbox.run(command, limits, stdin=stdin)

    def close(self) -> None:
        close = getattr(self.sandbox, "close", None) if hasattr(self, "sandbox") else None
        if close is not None:
            close()
        shutil.rmtree(self.dir, ignore_errors=True)


class SWEBenchEnv(ToolEnv):
    """One SWE-bench instance per episode (``seed % n`` of the file's tasks, in file order; ``split``: only the
    records whose ``"split"`` field is that); see the module text."""

    action_regex = None  # the full tool set: for models that write JSON unconstrained

    def __init__(
        self,
        task_file: str,
        backend: str = "docker",
        split: str | None = None,
        max_turns: int = 30,
        checkouts: str | None = None,
        ro_paths: tuple[str, ...] = (),
        scratch: str | None = None,
        bash_limits: SandboxLimits = BASH_LIMITS,
        eval_limits: SandboxLimits = EVAL_LIMITS,
    ):
        super().__init__(max_turns)
        if backend not in BACKENDS:
            raise ValueError(f"SWEBenchEnv backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "bubblewrap" and not checkouts:
            raise ValueError("the bubblewrap backend needs checkouts=DIR holding <owner>__<name> git clones")
        self.tasks = load_instances(task_file)
        if split is not None:  # records may carry a "split" of their own (SWE-bench Verified is one test set)
            self.tasks = [t for t in self.tasks if t.get("split") == split]
            if not self.tasks:
                raise ValueError(f'no task of {task_file!r} has "split": {split!r}')
        self.backend, self.checkouts, self.scratch = backend, checkouts, scratch
        self.ro_paths = tuple(ro_paths)
        self.bash_limits, self.eval_limits = bash_limits, eval_limits
        # known before the first reset: the pools read the system prompt (which names it) from a fresh env
        self.repo_dir = MOUNT if backend == "bubblewrap" else REPO_DIR
        self.task: dict | None = None
        self.box = None

    def new_box(self, task: dict, limits: SandboxLimits):
        """A started box holding the task's repository at its base commit."""
        if self.backend == "bubblewrap":
            checkout = Path(self.checkouts) / task["repo"].replace("/", "__")
            return CheckoutBox(checkout, task["base_commit"], limits, self.ro_paths, self.scratch)
        box = ContainerSandbox(
            task["instance_id"], runtime=self.backend, limits=limits, image=task.get("image")
        )
        try:
            box.start()
        except BaseException:
            box.close()  # a container that started but did not answer is not left behind
            raise
        return box

    def _close_box(self) -> None:
        if self.box is not None:
            self.box.close()
            self.box = None

    def close(self) -> None:
        self._close_box()
        super().close()

    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        self._close_box()
        if seed is None:
            seed = int(self.np_random.integers(0, len(self.tasks)))
        self.task = self.tasks[int(seed) % len(self.tasks)]
        self.box = self.new_box(self.task, self.bash_limits)
        assert self.box.repo_dir == self.repo_dir, (self.box.repo_dir, self.repo_dir)
        goal = self.task["problem_statement"]
        obs = f"Repository: {self.task['repo']}, checked out at {self.repo_dir}.\n\n{goal}"
        files = ShellFiles(self.box, self.repo_dir)
        return obs, self._start_episode(files, self.task["instance_id"], self.task["repo"], goal, seed)

    def _bash(self, command: str) -> Result:
        return self.box.run(command, self.bash_limits)

    def diff(self) -> str:
        """The agent's changes against the base commit, new files included (what a submission is)."""
        base = shlex.quote(self.task["base_commit"])
        r = self.box.run(
            framed(f"git add -A && git diff --cached --binary --no-color --no-ext-diff {base}"), PATCH_LIMITS
        )
        body = unframe(r)
        if body is None or not r.ok or r.truncated:
            raise RuntimeError(
                f"could not take the diff of {self.task['instance_id']}: {r.observation()[-500:]}"
            )
        return body

    def evaluate(self) -> tuple[float, str, dict[str, Any]]:
        """Grades the submission in a fresh box: (reward, report, info). grading.py's rules: files that load
        before or beside the runner are dropped from the diff; for pytest logs, sentinel tests run beside the
        task's and the verdicts come from pytest's JUnit report (``PYTEST_ADDOPTS`` adds both to whatever command
        the eval script runs); other log formats are read from the log (no sentinel)."""
        assert self.task is not None
        task = self.task
        try:
            patch = self.diff()
        except RuntimeError as e:
            return 0.0, f"Not solved: {e}", {"submission_error": str(e)}
        patch, dropped = grading.filter_diff(patch)
        note = (
            f" Ignored changes to {len(dropped)} file(s) that load beside the test runner." if dropped else ""
        )
        f2p, p2p = task["FAIL_TO_PASS"], task["PASS_TO_PASS"]
        structured = task["log_format"] == "pytest"
        box = self.new_box(task, self.eval_limits)
        try:
            if patch.strip():
                data = patch.encode()
                applied = box.run("git apply --verbose -", PATCH_LIMITS, stdin=data)
                if not applied.ok:
                    applied = box.run("patch --batch --fuzz=5 -p1", PATCH_LIMITS, stdin=data)
                if not applied.ok:
                    return (
                        0.0,
                        "Not solved: the submitted diff does not apply to a fresh checkout." + note,
                        {},
                    )
            script = eval_script(task)
            if structured:
                sentinels = grading.make_sentinels(f2p)
                put = box.run(
                    f"mkdir -p -- {shlex.quote(os.path.dirname(sentinels.path))} && cat > {shlex.quote(sentinels.path)}",
                    PATCH_LIMITS,
                    stdin=sentinels.text.encode(),
                )
                if not put.ok:
                    raise RuntimeError(
                        f"could not write the grader's sentinel tests: {put.observation()[-300:]}"
                    )
                report_path = f"{self.repo_dir}/.report-{secrets.token_hex(6)}.xml"
                opts = f"--junitxml={report_path} -o junit_family=xunit2 {self.repo_dir}/{sentinels.path}"
                script = f"export PYTEST_ADDOPTS={shlex.quote(opts)}\n{script}"
            run = box.run(script, self.eval_limits)
            if structured:
                got = box.run(framed(f"test ! -L {report_path} && cat -- {report_path}"), PATCH_LIMITS)
                text = unframe(got)
        finally:
            box.close()
        if structured:
            try:
                if text is None or not got.ok or got.truncated:
                    raise grading.ReportError("the test run wrote no report")
                verdict = grading.judge(grading.parse_junit(text), [*f2p, *p2p], sentinels)
            except grading.ReportError as e:
                return (
                    0.0,
                    f"Not solved: hidden tests gave no verdict ({e}).{note}",
                    {"submission_error": str(e)},
                )
            if verdict.tampering:
                return 0.0, "Not solved: the grader's checks failed." + note, {"tampering": verdict.tampering}
            outcomes = {t: ("failed" if o == "missing" else o) for t, o in verdict.outcomes.items()}
        else:
            outcomes = parse_test_log(run.output, task["log_format"])
        # the harness's rule: a test fails when its log says so or does not name it; a skipped one counts neither way
        failing = lambda t: outcomes.get(t, "failed") == "failed"  # noqa: E731
        fixed = sum(outcomes.get(t) == "passed" for t in f2p)
        broken = sum(failing(t) for t in p2p)
        solved = not any(failing(t) for t in f2p) and broken == 0 and run.killed is None
        report = (
            f"Submitted {len(patch_files(patch))} changed file(s).{note} Hidden tests: {fixed}/{len(f2p)} failing "
            f"tests fixed, {broken}/{len(p2p)} passing tests broken"
            + (f" (the test run was killed: {run.killed} limit)" if run.killed else "")
            + (". Solved." if solved else ". Not solved.")
        )
        return (1.0 if solved else 0.0), report, {}
