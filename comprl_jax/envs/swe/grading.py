"""Grading that the graded code cannot forge (issue 50 point 1): what a submission may change, sentinel tests, and
verdicts read from pytest's JUnit XML report.

The threat: an RL policy is rewarded when the hidden tests pass, so it will try to make the *report* say they pass
instead of fixing the bug. What each layer does, and what it cannot do:

| layer | what it stops | where |
|---|---|---|
| only source files travel | a submission reaches the grading copy only as changes to files the fix may touch: SWE-Lite takes ``.py`` files under the project's package (not tests, not ``sitecustomize`` / ``usercustomize``); SWE-bench drops files that load before or beside the runner (``*.dist-info`` / ``*.egg-info``, ``*.pth``, ``sitecustomize.py``, ``usercustomize.py``, ``conftest.py``, pytest ini files, top-level modules named like the runner's). A shadowing ``pytest.py``, a ``sitecustomize.py`` or a plugin entry point never reaches the grading copy: the forgery fails as an ordinary wrong fix | :func:`lite_admissible`, :func:`bench_admissible`, :func:`filter_diff` |
| an isolated runner | SWE-Lite's interpreter starts with ``-P -s`` (the working directory and user site not on ``sys.path``), the project's import root appended *after* the runner's packages, plugin autoload off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``) | ``tasks.grading_command`` |
| a structured report | verdicts come from the JUnit XML pytest writes (``--junitxml``), never from lines of the log the code under test can print | :func:`parse_junit` |
| sentinels | the code under test runs in the runner's process and can still rewrite anything the runner writes (its report, its hooks). Each grading adds a test file of random name in a random directory: tests that must pass, tests that must fail, and *decoys* named like the task's fail-to-pass tests that must fail. A forgery that flips verdicts wholesale, or by the task's test names, flips a sentinel too: reward 0 and ``info["tampering"]`` | :func:`make_sentinels`, :func:`judge` |

What it cannot guarantee: code that reads the grader's generated files (or this module) to tell the sentinels from
the task's tests, and then forges only the latter, is not caught; nor is a kernel exploit. The sentinel names come
from ``secrets`` at grading time, so nothing the policy saw in earlier episodes predicts them.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
import secrets
import xml.etree.ElementTree as ET

REPORT_BYTES = 32 << 20  # a larger report is refused (a policy could write a huge one)
# files that load before or beside the test runner, whatever directory they sit in
_LOADERS = ("sitecustomize.py", "usercustomize.py", "conftest.py")
_INI = ("pytest.ini", ".pytest.ini", "tox.ini")
# top-level names a module of the repository could shadow the runner with
_RUNNER_MODULES = ("pytest", "_pytest", "pluggy", "py", "iniconfig", "xdist", "pytest_cov", "coverage")


class ReportError(ValueError):
    """The report is missing, too large or malformed: no verdict can be read from it."""


def lite_admissible(rel: str, package: str, is_test_path) -> bool:
    """Whether a SWE-Lite submission's change of ``rel`` (relative to the project root) reaches the grading copy:
    a ``.py`` file inside the project's package directory, not test code and not a file Python loads by name."""
    parts = rel.split("/")
    return (
        rel.endswith(".py")
        and rel.startswith(package.rstrip("/") + "/")
        and not is_test_path(rel)
        and parts[-1] not in _LOADERS
        and not any(p.startswith(".") or p.endswith((".dist-info", ".egg-info")) for p in parts)
    )


def bench_admissible(rel: str) -> bool:
    """Whether a SWE-bench submission's change of ``rel`` is graded: anything but files that load before or beside
    the runner (the harness's own images install the repository in development mode, so its root is on the path)."""
    parts = rel.split("/")
    top = parts[0][:-3] if len(parts) == 1 and parts[0].endswith(".py") else parts[0]
    return not (
        parts[-1] in _LOADERS
        or parts[-1] in _INI
        or parts[-1].endswith(".pth")
        or any(p.endswith((".dist-info", ".egg-info")) for p in parts)
        or top in _RUNNER_MODULES
    )


def loader_files(paths) -> list[str]:
    """The paths among ``paths`` that Python or pytest would load by name, before or beside the runner: what a
    forger writes (``sitecustomize.py``, ``*.pth``, ``*.dist-info``, a top-level ``pytest.py``...). The env names
    them in ``info["tampering"]``; they never reach the grading copy either way."""
    return sorted(p for p in paths if not bench_admissible(p))


_DIFF_START = re.compile(r"^diff --git ", re.M)
_DIFF_FILE = re.compile(r"diff --git a/(\S+) b/(\S+)\n")


def filter_diff(patch: str, admissible=bench_admissible) -> tuple[str, list[str]]:
    """A ``git diff`` cut to the files ``admissible`` accepts: (kept diff, dropped paths). A section whose old or
    new path is refused is dropped whole (a rename cannot smuggle a file in), and so is one whose header does not
    read as two plain paths (a name with a space or git's quoting: never a place to hide a loader file)."""
    starts = [m.start() for m in _DIFF_START.finditer(patch)]
    if not starts:
        return patch, []
    kept, dropped = [patch[: starts[0]]], []
    for i, s in enumerate(starts):
        section = patch[s : starts[i + 1] if i + 1 < len(starts) else len(patch)]
        m = _DIFF_FILE.match(section)
        if m and admissible(m.group(1)) and admissible(m.group(2)):
            kept.append(section)
        else:
            dropped.append(m.group(2) if m else section.split("\n", 1)[0][len("diff --git ") :])
    return "".join(kept), sorted(set(dropped))


# -- node ids and the JUnit report ----------------------------------------------------------------------
def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) that pytest's JUnit XML gives the test ``nodeid`` (``_pytest.junitxml.mangle_test_address``:
    the file path with ``/`` -> ``.`` and no ``.py``, classes appended with dots; the name keeps its parameters)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def parse_junit(text: str | bytes) -> dict[tuple[str, str], str]:
    """``{(classname, name): "passed" | "failed" | "skipped"}`` from pytest's JUnit XML (``failure`` or ``error``
    children fail a test case, ``skipped`` skips it). A document type (entities) is refused; a test case reported
    twice with different outcomes is a :class:`ReportError` (pytest writes each case once)."""
    if len(text) > REPORT_BYTES:
        raise ReportError(f"the test report is larger than {REPORT_BYTES >> 20} MiB")
    raw = text.encode("utf-8", "replace") if isinstance(text, str) else text
    if b"<!DOCTYPE" in raw or b"<!ENTITY" in raw:
        raise ReportError("the test report declares a document type")
    try:
        root = ET.fromstring(raw)
    except ET.ParseError as e:
        raise ReportError(f"the test report is not XML ({e})") from None
    out: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else ("skipped" if "skipped" in tags else "passed")
        if key in out and out[key] != outcome:
            raise ReportError(f"test {key[0]}::{key[1]} is reported twice, {out[key]} and {outcome}")
        out[key] = outcome
    return out


# -- sentinels ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sentinels:
    """A test file the grader adds to the grading copy at ``path`` (relative to the repository root)."""

    path: str
    text: str
    expected: dict[tuple[str, str], str]  # JUnit key -> "passed" | "failed"


def _name(prefix: str = "test_") -> str:
    return prefix + secrets.token_hex(6)


def make_sentinels(decoys: list[str] = (), n_pass: int = 2, n_fail: int = 2) -> Sentinels:
    """Sentinel tests of random names in a random directory: ``n_pass`` that must pass, ``n_fail`` that must fail,
    and one decoy per distinct fail-to-pass test name in ``decoys`` (node ids; the function and class names are
    copied, the parameters dropped) that must fail."""
    folder, module = _name("sentinel_"), _name()
    path = f"{folder}/{module}.py"
    lines = ["# written by the grader: tests whose verdicts are known before the run", "import unittest", ""]
    expected: dict[tuple[str, str], str] = {}
    base = f"{folder}.{module}"
    for _ in range(n_pass):
        fn, k = _name(), secrets.randbelow(1000) + 2
        lines += [f"def {fn}():", f"    assert sum(range({k})) == {k * (k - 1) // 2}", ""]
        expected[(base, fn)] = "passed"
    for _ in range(n_fail):
        fn, k = _name(), secrets.randbelow(1000) + 2
        lines += [f"def {fn}():", f"    assert sum(range({k})) == {k * (k - 1) // 2 + 1}", ""]
        expected[(base, fn)] = "failed"
    functions: dict[str, None] = {}
    classes: dict[str, dict[str, None]] = {}
    for nodeid in decoys:
        names = nodeid.partition("[")[0].split("::")[1:]
        if not names or not all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
            continue
        if len(names) == 1:
            functions[names[0]] = None
        else:  # the innermost class only: nested test classes are rare and the names are what a forger keys on
            classes.setdefault(names[-2], {})[names[-1]] = None
    for fn in functions:
        lines += [f"def {fn}():", "    assert False, 'decoy'", ""]
        expected[(base, fn)] = "failed"
    for cls, methods in classes.items():
        # a TestCase whatever its name: the task's class may be a unittest one that pytest's "Test*" rule would skip
        lines.append(f"class {cls}(unittest.TestCase):")
        for fn in methods:
            lines += [f"    def {fn}(self):", "        assert False, 'decoy'", ""]
            expected[(f"{base}.{cls}", fn)] = "failed"
    return Sentinels(path=path, text="\n".join(lines), expected=expected)


@dataclasses.dataclass(frozen=True)
class Verdict:
    outcomes: dict[str, str]  # the task's tests by node id (absent from the report: "missing")
    failing: list[str]  # the report's test cases (sentinels excluded) that failed, as classname::name
    tampering: str | None  # what the sentinels caught, or None


def _sentinel_result(report: dict[tuple[str, str], str], key: tuple[str, str]) -> str:
    """A sentinel's outcome in ``report``: its class name matched by suffix (``test_<hex>`` or
    ``test_<hex>.Class``), since the directories above it depend on the rootdir pytest picks; ``missing`` if
    absent."""
    cls, name = key
    suffix = cls.split(".", 1)[1]  # drop the random directory: the module's random name is unique enough
    found = {o for (c, n), o in report.items() if n == name and (c == suffix or c.endswith("." + suffix))}
    return found.pop() if len(found) == 1 else ("missing" if not found else "ambiguous")


def judge(report: dict[tuple[str, str], str], tests: list[str], sentinels: Sentinels) -> Verdict:
    """The verdict of ``tests`` (node ids) in ``report``, and whether every sentinel came back as expected."""
    wrong = []
    matched = set()
    for k, want in sentinels.expected.items():
        got = _sentinel_result(report, k)
        if got != want:
            wrong.append(f"{'must-fail' if want == 'failed' else 'must-pass'} sentinel reported {got}")
    module = sentinels.path.rsplit("/", 1)[-1][:-3]
    for c, n in report:
        if c.split(".")[-1] == module or f".{module}." in f".{c}.":
            matched.add((c, n))
    tampering = "sentinel tests came back wrong: " + ", ".join(sorted(set(wrong))) if wrong else None
    outcomes = {t: report.get(junit_key(t), "missing") for t in tests}
    failing = sorted(f"{c}::{n}" for (c, n), o in report.items() if o == "failed" and (c, n) not in matched)
    return Verdict(outcomes=outcomes, failing=failing, tampering=tampering)
