"""SWE-Lite tasks (issue 32 point 1): procedural bugs in pinned PyPI projects, kept when the tests say so.

A task is one :mod:`bugs` edit of one project file such that, in the sandbox, at least one test that passes on the
pristine source fails (``fail_to_pass``), every other test that passed still passes (``pass_to_pass``, stored as the
test files: every pristine-passing test in them except the fail-to-pass ones), and the task's tests run within the
time limit. The problem statement is the failing tests' short output on the bugged copy; the patch is never shown.

One JSON line per task::

    {"instance_id": "toolz-1.0.0-0007", "project": "toolz", "version": "1.0.0", "file": "toolz/itertoolz.py",
     "kind": "op_swap", "line": 412, "patch": "--- a/toolz/itertoolz.py\\n+++ ...",   # pristine -> bugged
     "fail_to_pass": ["toolz/tests/test_itertoolz.py::test_take"], "pass_to_pass": ["toolz/tests/test_itertoolz.py"],
     "problem_statement": "...", "split": "train", "same_project_split": "eval"}

Deterministic given the pinned versions (sha256-checked sdists), the runner's pytest and the seed: candidates come
in :func:`bugs.candidates` order per file, files in sorted order, shuffled by a generator seeded with
``(seed, project, version)``; a test counts as passing only if it passed in two pristine runs.

Layout of the cache (``data_paths.cache_root()/swe``): ``sdists/`` (downloads), ``src/NAME-VERSION/`` (pristine
trees), ``runner/`` (the venv whose pytest runs every test, mounted read-only in the sandbox), ``scratch/`` (working
copies, removed after use).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from comprl_jax.envs import data_paths
from comprl_jax.envs.swe import bugs, grading
from comprl_jax.envs.swe.sandbox import Sandbox, SandboxLimits

RUNNER_REQUIREMENTS = ("pytest==8.3.4",)  # the runner venv: what every project's tests run under
MAX_FAIL_TO_PASS = 20  # a bug that breaks more tests than this is a crash, not a task
TEST_LIMIT_S = 15.0  # a task's tests must run within this (issue 32)
STATEMENT_CHARS = 3000
_TIMING_RE = re.compile(
    r"( (?:passed|failed|error|errors|skipped|xfailed|xpassed|warnings?|deselected)) in [0-9.]+s\b"
)
_RESULT_RE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")


@dataclasses.dataclass(frozen=True)
class Project:
    """A pinned PyPI source distribution and how to test it."""

    name: str
    version: str
    sha256: str  # of the sdist: a changed upload fails loudly
    package: str  # the directory of the code bugs go into, relative to the sdist root
    tests: tuple[str, ...]  # pytest targets, relative to the sdist root
    pythonpath: str = "."  # relative to the sdist root ("src" for a src layout)
    split: str = "train"  # by project: no eval project is seen in training
    deselect: tuple[str, ...] = ()  # tests that cannot pass offline or in a sandbox

    def __post_init__(self):
        if self.split not in ("train", "eval"):
            raise ValueError(f"Project {self.name}: split must be 'train' or 'eval', got {self.split!r}")

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


def swe_cache() -> Path:
    root = data_paths.cache_root() / "swe"
    root.mkdir(parents=True, exist_ok=True)
    return root


# -- the runner and the sources ------------------------------------------------------------------------
def runner_env(cache: Path | None = None) -> Path:
    """The venv (created once, stamped by its requirements) whose ``bin/python -m pytest`` runs the tests."""
    venv = (cache or swe_cache()) / "runner"
    stamp = venv / (".stamp-" + hashlib.sha1(" ".join(RUNNER_REQUIREMENTS).encode()).hexdigest()[:12])
    if stamp.exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    python = _system_python()
    if python is None:
        raise FileNotFoundError(
            "no /usr/bin/python3: the SWE runner venv needs a system python the sandbox mounts"
        )
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *RUNNER_REQUIREMENTS], check=True)
    stamp.touch()
    return venv


def _system_python() -> str | None:
    """A python under /usr (mounted in the sandbox), so the runner venv's interpreter exists inside it."""
    for p in ("/usr/bin/python3",):
        if os.path.exists(p):
            return p
    return None


def fetch_sdist(project: Project, cache: Path | None = None) -> Path:
    """The project's sdist, downloaded once with pip and checked against its pinned sha256."""
    d = (cache or swe_cache()) / "sdists"
    d.mkdir(parents=True, exist_ok=True)
    found = [p for p in d.glob(f"*{project.version}.tar.gz") if _norm(p.name).startswith(_norm(project.name))]
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", f"{project.name}=={project.version}", "-d", str(d)],
            check=True,
        )  # fmt: skip
        found = [
            p for p in d.glob(f"*{project.version}.tar.gz") if _norm(p.name).startswith(_norm(project.name))
        ]
    if len(found) != 1:
        raise FileNotFoundError(f"{project.key}: expected one sdist in {d}, found {[p.name for p in found]}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != project.sha256:
        raise ValueError(
            f"{found[0]}: sha256 {digest} is not the pinned {project.sha256} of {project.key}: delete it to download "
            "again, or re-pin the project in comprl_jax/envs/swe/projects.py"
        )
    return found[0]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pristine(project: Project, cache: Path | None = None) -> Path:
    """The unpacked sdist (extracted once, read-only by convention): the root the project's paths are relative to."""
    cache = cache or swe_cache()
    dest = cache / "src" / project.key
    if (dest / ".complete").exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".extract-"))
    with tarfile.open(fetch_sdist(project, cache)) as tar:
        tar.extractall(tmp, filter="data")  # no absolute paths, links out of the tree or device files
    (top,) = [p for p in tmp.iterdir()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    top.rename(dest)
    shutil.rmtree(tmp)
    (dest / ".complete").touch()
    return dest


# -- running tests -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TestRun:
    outcomes: dict[str, str]  # node id -> "passed" | "failed" | "error" | "xfail" | "xpass"
    output: str
    exit_code: int | None
    wall_s: float


def parse_results(text: str) -> dict[str, str]:
    """``pytest -rA`` short-summary lines to ``{node id: outcome}`` (the last line wins for a repeated id). PASSED
    lines hold the id alone; FAILED / ERROR / XFAIL append `` - message``, cut at its first `` - `` (an id holding
    that text is cut short there: pytest's own separator)."""
    out = {}
    for line in text.splitlines():
        m = _RESULT_RE.match(line.rstrip())
        if m:
            word, rest = m.group(1), m.group(2)
            if word not in ("PASSED", "XPASS"):
                rest = rest.split(" - ", 1)[0]
            out[rest] = word.lower()
    return out


def pytest_command(project: Project, runner: Path, targets: Sequence[str], *, tb: str = "no") -> str:
    """The shell command that runs ``targets`` of ``project`` in its working copy (cwd = the copy)."""
    args = [f"{runner}/bin/python", "-m", "pytest", "-rA", "-q", f"--tb={tb}", "-p", "no:cacheprovider"]
    args += [
        "-o",
        "addopts=",
        "--color=no",
        "--no-header",
    ]  # a project's own addopts may need plugins we lack
    for d in project.deselect:
        args += ["--deselect", d]
    args += ["--", *targets]
    env = f"PYTHONPATH={_q(project.pythonpath)} PYTHONHASHSEED=0"
    return env + " " + " ".join(_q(a) for a in args)


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def run_tests(
    workdir: Path,
    project: Project,
    runner: Path,
    targets: Sequence[str],
    *,
    tb: str = "no",
    limits: SandboxLimits | None = None,
) -> TestRun:
    lim = limits or SandboxLimits(wall_s=60, cpu_s=60, memory_mb=2048, processes=64, output_bytes=4 << 20)
    box = Sandbox(str(workdir), limits=lim, ro_paths=(str(runner),))
    try:
        r = box.run(pytest_command(project, runner, targets, tb=tb))
    finally:
        close_box(box)
    return TestRun(parse_results(r.output), r.output, r.exit_code, r.wall_s)


GRADE_LIMITS = SandboxLimits(wall_s=40, cpu_s=40, memory_mb=2048, processes=64, output_bytes=64 << 10)
_BOOT = "import sys; sys.path.append({root!r}); import pytest; sys.exit(pytest.main(sys.argv[1:]))"


def grading_command(
    project: Project, runner: Path, targets: Sequence[str], report: str, mount: str = "/repo"
) -> str:
    """The command that grades a submission (grading.py's isolated runner): the interpreter with ``-P -s`` (neither
    the working directory nor a user site on ``sys.path``), pytest imported from the runner before the project's
    import root is *appended* to the path, plugin autoload off, the project's own ``addopts`` dropped, the JUnit
    report written to ``report`` (a path inside the box)."""
    root = os.path.normpath(f"{mount}/{project.pythonpath}")
    args = [f"{runner}/bin/python", "-P", "-s", "-c", _BOOT.format(root=root)]
    args += ["-q", "--tb=no", "-p", "no:cacheprovider", "-o", "addopts=", "-o", "junit_family=xunit2"]
    args += ["-o", "junit_logging=no", "--color=no", "--no-header", f"--junitxml={report}"]
    for d in project.deselect:
        args += ["--deselect", d]
    args += ["--", *targets]
    env = "PYTHONHASHSEED=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1"
    return env + " " + " ".join(_q(a) for a in args)


@dataclasses.dataclass(frozen=True)
class Graded:
    verdict: grading.Verdict | None  # None when no report could be read
    error: str | None  # why there is no verdict (no report, a malformed one)
    output: str
    wall_s: float
    killed: str | None


def grade(
    workdir: Path, project: Project, runner: Path, targets: Sequence[str], tests: Sequence[str],
    *, decoys: Sequence[str] = (), limits: SandboxLimits = GRADE_LIMITS,
) -> Graded:  # fmt: skip
    """Runs ``targets`` of the grading copy ``workdir`` with sentinels beside them (grading.py) and reads the
    verdicts of ``tests`` (node ids) from the JUnit report; the copy gains the sentinel file and the report."""
    sentinels = grading.make_sentinels(list(decoys))
    dest = workdir / sentinels.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(sentinels.text)
    report_rel = f".report-{secrets.token_hex(6)}.xml"
    box = Sandbox(str(workdir), limits=limits, ro_paths=(str(runner),))
    try:
        cmd = grading_command(project, runner, [*targets, sentinels.path], f"{box.repo_dir}/{report_rel}")
        r = box.run(cmd)
    finally:
        close_box(box)
    path = workdir / report_rel
    try:
        if path.is_symlink() or not path.is_file():
            raise grading.ReportError("the test run wrote no report")
        if path.stat().st_size > grading.REPORT_BYTES:
            raise grading.ReportError(f"the test report is larger than {grading.REPORT_BYTES >> 20} MiB")
        report = grading.parse_junit(path.read_bytes())
    except (grading.ReportError, OSError) as e:
        return Graded(None, str(e), r.output, r.wall_s, r.killed)
    return Graded(grading.judge(report, list(tests), sentinels), None, r.output, r.wall_s, r.killed)


def close_box(box) -> None:
    """``box.close()`` where the box has one (the sandbox's uid and resources go back)."""
    close = getattr(box, "close", None)
    if close is not None:
        close()


# -- building tasks ------------------------------------------------------------------------------------
def is_test_path(rel: str) -> bool:
    """Test code, by its path relative to the project root: no bug goes there, the env ignores a submission's
    changes there, and the scripted agent reads tracebacks through it."""
    parts = rel.split("/")
    return (
        any(p in ("tests", "test", "testing") for p in parts[:-1])
        or parts[-1].startswith("test_")
        or parts[-1].endswith("_test.py")
        or parts[-1] == "conftest.py"
    )


def source_files(root: Path, project: Project) -> list[str]:
    """Files bugs go into: the package's .py files outside test code, ``setup.py`` and vendored copies, sorted,
    relative to ``root``."""
    out = []
    for p in sorted((root / project.package).rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if is_test_path(rel) or rel.split("/")[-1] == "setup.py" or "/_vendor/" in rel:
            continue
        out.append(rel)
    return out


def passing_tests(root: Path, project: Project, runner: Path, scratch: Path) -> tuple[set[str], float]:
    """Tests that pass in two pristine runs (a flaky one is dropped), and the slower run's seconds."""
    runs = []
    for _ in range(2):
        with _copy(root, scratch) as work:
            runs.append(run_tests(work, project, runner, project.tests))
    ok = [{t for t, o in r.outcomes.items() if o == "passed"} for r in runs]
    if not ok[0]:
        raise RuntimeError(f"{project.key}: no test passed on the pristine source:\n{runs[0].output[-3000:]}")
    return ok[0] & ok[1], max(r.wall_s for r in runs)


class _copy:
    """A scratch working copy of ``root`` (removed on exit)."""

    def __init__(self, root: Path, scratch: Path):
        self.root, self.scratch = root, scratch

    def __enter__(self) -> Path:
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(dir=self.scratch))
        work = self.dir / "repo"
        shutil.copytree(
            self.root, work, symlinks=True, ignore=shutil.ignore_patterns(".complete", "__pycache__")
        )
        return work

    def __exit__(self, *exc):
        shutil.rmtree(self.dir, ignore_errors=True)


def statement(project: Project, output: str) -> str:
    """The problem statement: which tests fail and how (pytest's short tracebacks), cut to STATEMENT_CHARS."""
    body = output.strip()
    if len(body) > STATEMENT_CHARS:
        body = body[:STATEMENT_CHARS] + "\n[... more output not shown ...]"
    return (
        f"The test suite of {project.name} {project.version} fails. Running the failing tests gives:\n\n{body}\n\n"
        "Fix the library code (not the tests) so that these tests pass without breaking any other test."
    )


def old_sides(patch: str) -> list[list[str]]:
    """Each hunk's old side of a unified diff (its context and ``-`` lines, in order): the pristine code around a
    bug, which nothing visible to the agent may hold (tests/test_swe_visible_files.py scans for it)."""
    out: list[list[str]] = []
    cur: list[str] | None = None
    for line in patch.splitlines():
        if line.startswith("@@"):
            cur = []
            out.append(cur)
        elif cur is None or line.startswith(("--- ", "+++ ", "\\")):
            continue
        elif line.startswith((" ", "-")):
            cur.append(line[1:])
        elif line == "":  # a blank context line some tools write without its space
            cur.append("")
    return [n for n in out if n]


@functools.lru_cache(maxsize=4)
def _stdlib_texts(runner: Path) -> tuple[list[list[str]], frozenset[str]]:
    """The runner interpreter's standard library (its ``.py`` files, lines stripped of trailing blanks) and the set
    of all those lines: what the sandbox must show the agent whatever the task."""
    out = subprocess.run(
        [f"{runner}/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    files = []
    for p in sorted(Path(out.stdout.strip()).rglob("*.py")):
        try:
            files.append([line.rstrip() for line in p.read_text(errors="replace").splitlines()])
        except OSError:
            continue
    return files, frozenset(line for f in files for line in f)


def in_stdlib(patch: str, runner: Path) -> bool:
    """Whether a hunk's old side occurs verbatim (as consecutive lines) in the runner's standard library: a bug
    in code the library copied from the stdlib has its answer in plain sight inside the sandbox."""
    files, lines = _stdlib_texts(runner)
    for side in old_sides(patch):
        block = [line.rstrip() for line in side]
        if not all(line in lines for line in block):
            continue
        n = len(block)
        for f in files:
            for i in range(len(f) - n + 1):
                if f[i] == block[0] and f[i : i + n] == block:
                    return True
    return False


def validate(
    root: Path, project: Project, runner: Path, scratch: Path, passing: set[str], path: str, m: bugs.Mutation
) -> dict | None:
    """The task an edit makes, or None when the tests reject it."""
    src = (root / path).read_text()
    bugged = bugs.apply(src, m)
    if in_stdlib(bugs.unified_diff(path, src, bugged), runner):
        return None  # the pristine code is the stdlib's (a vendored textwrap, say): visible to the agent
    with _copy(root, scratch) as work:
        (work / path).write_text(bugged)
        run = run_tests(work, project, runner, project.tests)
        failing = sorted(t for t in passing if run.outcomes.get(t) != "passed")
        if not 1 <= len(failing) <= MAX_FAIL_TO_PASS:
            return None
        files = sorted({t.split("::")[0] for t in failing})
        timed = run_tests(work, project, runner, files)
        # the task's tests (its files) must fail only where fail_to_pass says, and run within the limit
        broken = {t for t, o in timed.outcomes.items() if o in ("failed", "error")}
        if broken != set(failing) or timed.wall_s > TEST_LIMIT_S:
            return None
        shown = run_tests(work, project, runner, failing, tb="short")
    return {
        "project": project.name,
        "version": project.version,
        "file": path,
        "kind": m.kind,
        "line": m.line,
        "patch": bugs.unified_diff(path, src, bugged),
        "fail_to_pass": failing,
        "pass_to_pass": files,
        "problem_statement": statement(project, _scrub(shown.output, work)),
    }


def _scrub(text: str, work: Path) -> str:
    """Host paths and timings out of pytest's output: the agent sees its copy at the sandbox's mount point, and the
    task file stays the same from one build to the next."""
    text = text.replace(str(work), "/repo")
    return _TIMING_RE.sub(r"\1", text)


def build_project(
    project: Project,
    *,
    seed: int,
    quota: int,
    cache: Path | None = None,
    runner: Path | None = None,
    workers: int = 2,
    max_candidates: int | None = None,
    log: Callable[[str], None] = lambda s: None,
    stats: dict | None = None,
) -> list[dict]:
    """Up to ``quota`` validated tasks of ``project`` (fewer when the candidates run out). ``cache``: where the
    sources and scratch copies live; ``runner``: the test venv (default: :func:`runner_env` of the shared cache)."""
    cache = cache or swe_cache()
    runner = runner or runner_env()
    root = pristine(project, cache)
    scratch = cache / "scratch"
    passing, suite_s = passing_tests(root, project, runner, scratch)
    log(f"{project.key}: {len(passing)} tests pass twice on the pristine source ({suite_s:.1f} s a run)")
    cands = [
        (path, m) for path in source_files(root, project) for m in bugs.candidates((root / path).read_text())
    ]
    random.Random(f"{seed}:{project.name}:{project.version}").shuffle(cands)
    if max_candidates is not None:
        cands = cands[:max_candidates]
    tasks: list[dict] = []
    tried = 0
    with ThreadPoolExecutor(max_workers=workers) as ex:
        # in order, `workers` at a time: the tasks kept are the first `quota` accepted candidates in shuffled order,
        # however many run at once
        for start in range(0, len(cands), workers):
            chunk = cands[start : start + workers]
            for task in ex.map(lambda c: validate(root, project, runner, scratch, passing, *c), chunk):
                tried += 1
                if task is not None and len(tasks) < quota:
                    task["instance_id"] = f"{project.key}-{len(tasks):04d}"
                    tasks.append(task)
            if len(tasks) >= quota:
                break
    log(f"{project.key}: {len(tasks)} tasks from {tried} candidates of {len(cands)}")
    if stats is not None:
        stats.update(
            candidates=len(cands), tried=tried, pristine_tests=len(passing), suite_s=round(suite_s, 1)
        )
    return tasks


def splits(tasks: Iterable[dict], projects: Sequence[Project], eval_fraction: float = 0.2) -> list[dict]:
    """Adds ``split`` (by project: the project's own) and ``same_project_split`` (by instance within each project:
    a stable hash puts about ``eval_fraction`` of every project's tasks in eval)."""
    by_name = {p.name: p for p in projects}
    out = []
    for t in tasks:
        h = int(hashlib.sha256(t["instance_id"].encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        out.append(
            {
                **t,
                "split": by_name[t["project"]].split,
                "same_project_split": "eval" if h < eval_fraction else "train",
            }
        )
    return out
