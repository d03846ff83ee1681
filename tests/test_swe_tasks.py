"""SWE-Lite task building (comprl_jax/envs/swe/tasks.py) on a hand-written project: which bugs the tests keep,
and that a task's patch, fail-to-pass tests and statement are what they claim."""

import json
import shutil
import subprocess

import pytest

from comprl_jax.envs.swe import tasks

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap missing: `make setup` installs it"
)

OPS = """def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def total(xs, start=0):
    s = start
    for x in xs:
        s += x
    return s


def window(xs, n=2):
    return [xs[i : i + n] for i in range(len(xs) - n + 1)]
"""
TESTS = """from mathy.ops import clamp, total, window


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0


def test_clamp_high():
    assert clamp(50, 0, 10) == 10


def test_clamp_mid():
    assert clamp(5, 0, 10) == 5


def test_total():
    assert total([1, 2, 3]) == 6
    assert total([1], start=4) == 5


def test_window():
    assert window([1, 2, 3]) == [[1, 2], [2, 3]]
"""
PROJECT = tasks.Project("mathy", "0.1", "0" * 64, "mathy", ("tests",))


def _project(cache):
    root = cache / "src" / PROJECT.key
    (root / "mathy").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "mathy" / "__init__.py").write_text("")
    (root / "mathy" / "ops.py").write_text(OPS)
    (root / "tests" / "test_ops.py").write_text(TESTS)
    (root / ".complete").touch()  # what tasks.pristine leaves after unpacking an sdist
    return root


@pytest.fixture(scope="module")
def runner():
    return tasks.runner_env()  # pip installs the pinned pytest once into the shared cache


def test_the_tests_keep_the_bugs_they_catch_and_drop_equivalent_ones(tmp_path, runner):
    root = _project(tmp_path)
    got = tasks.build_project(PROJECT, seed=0, quota=100, cache=tmp_path, runner=runner)
    # 10 candidates (bugs.candidates of ops.py); `<` -> `<=` and `>` -> `>=` change no tested value: dropped
    assert [(t["kind"], t["line"], t["fail_to_pass"]) for t in got] == [
        ("remove_branch", 4, ["tests/test_ops.py::test_clamp_high"]),
        ("off_by_one", 17, ["tests/test_ops.py::test_window"]),
        ("remove_branch", 2, ["tests/test_ops.py::test_clamp_low"]),
        ("op_swap", 17, ["tests/test_ops.py::test_window"]),
        ("remove_statement", 10, ["tests/test_ops.py::test_total"]),
        ("op_swap", 17, ["tests/test_ops.py::test_window"]),
        ("op_swap", 17, ["tests/test_ops.py::test_window"]),
        ("off_by_one", 17, ["tests/test_ops.py::test_window"]),
    ]
    assert [t["instance_id"] for t in got] == [f"mathy-0.1-{i:04d}" for i in range(8)]
    for t in got:
        assert t["pass_to_pass"] == ["tests/test_ops.py"] and t["file"] == "mathy/ops.py"
        # the patch turns the pristine file into the bugged one, and its reverse turns it back
        work = tmp_path / "apply"
        shutil.copytree(root, work)
        subprocess.run(["patch", "-p1", "-s"], input=t["patch"], text=True, cwd=work, check=True)
        assert (work / "mathy/ops.py").read_text() != OPS
        subprocess.run(["patch", "-p1", "-R", "-s"], input=t["patch"], text=True, cwd=work, check=True)
        assert (work / "mathy/ops.py").read_text() == OPS
        shutil.rmtree(work)
        # the statement names the failing test, shows no removed (pristine) line, no host path, no timing
        st = t["problem_statement"]
        assert t["fail_to_pass"][0] in st and str(tmp_path) not in st and " in 0." not in st
        for ln in t["patch"].splitlines():
            if ln.startswith("-") and not ln.startswith("---") and ln[1:].strip():
                assert ln[1:] not in st
    # deterministic: a second build writes the same lines
    again = tasks.build_project(PROJECT, seed=0, quota=100, cache=tmp_path, runner=runner)
    assert [json.dumps(t, sort_keys=True) for t in again] == [json.dumps(t, sort_keys=True) for t in got]
    # the seed orders the candidates; a quota keeps the first ones accepted
    other = tasks.build_project(PROJECT, seed=1, quota=3, cache=tmp_path, runner=runner)
    assert len(other) == 3 and [t["patch"] for t in other] != [t["patch"] for t in got[:3]]
    assert not list((tmp_path / "scratch").iterdir())  # every scratch copy removed


def test_splits_are_by_project_and_stable_within_one():
    ps = [PROJECT, tasks.Project("other", "1.0", "0" * 64, "other", ("tests",), split="eval")]
    ts = [{"instance_id": f"mathy-0.1-{i:04d}", "project": "mathy"} for i in range(200)]
    ts += [{"instance_id": "other-1.0-0000", "project": "other"}]
    out = tasks.splits(ts, ps)
    assert {t["split"] for t in out[:200]} == {"train"} and out[200]["split"] == "eval"
    n_eval = sum(t["same_project_split"] == "eval" for t in out[:200])
    assert 20 <= n_eval <= 60  # about 20% of 200 (binomial s.d. ~5.7)
    assert tasks.splits(ts, ps) == out


def test_pytest_summary_lines_parse_to_outcomes():
    text = (
        "PASSED tests/a.py::test_x\nFAILED tests/a.py::test_y - assert 1 == 2\nERROR tests/b.py - ImportError\n"
        "XFAIL tests/a.py::test_z - reason\nSKIPPED [1] tests/a.py:3: no\nPASSED tests/a.py::test_p[a - b]\n"
    )
    assert tasks.parse_results(text) == {
        "tests/a.py::test_x": "passed",
        "tests/a.py::test_y": "failed",
        "tests/b.py": "error",
        "tests/a.py::test_z": "xfail",
        "tests/a.py::test_p[a - b]": "passed",  # a PASSED line holds the id alone
    }


@pytest.mark.parametrize("name,version,n", [("inflection", "0.5.1", 3), ("parse", "1.22.4", 2)])
def test_the_shipped_task_file_rebuilds_the_same_lines(name, version, n, runner):
    """A sample of comprl_jax/envs/swe/tasks.jsonl rebuilt from the pinned sdist (launch/make_swe_tasks.py's seed):
    a project's first n tasks are the first n its candidates give, whatever the quota."""
    from comprl_jax.envs.swe import env as swe_env
    from comprl_jax.envs.swe import projects

    shipped = [t for t in swe_env.load_tasks() if t["project"] == name][:n]
    got = tasks.splits(
        tasks.build_project(projects.get(name, version), seed=0, quota=n, runner=runner), projects.PROJECTS
    )
    assert [json.dumps(t, sort_keys=True) for t in got] == [json.dumps(t, sort_keys=True) for t in shipped]


def test_a_bug_in_code_copied_from_the_stdlib_is_not_a_task(runner):
    """Its pristine code is visible in the sandbox (the interpreter needs its stdlib): the builder drops it. The one
    shipped task of that kind (tabulate's copy of textwrap's _wrap_chunks) was dropped by this rule."""
    import sysconfig
    from pathlib import Path

    from comprl_jax.envs.swe import bugs

    src = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    at = src.index("        if self.width <= 0:")
    vendored = "# vendored\n" + src[at - 400 : at + 400]
    patch = bugs.unified_diff(
        "pkg/wrap.py", vendored, vendored.replace("self.width <= 0", "self.width <= 1", 1)
    )
    assert tasks.in_stdlib(patch, runner)
    own = "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    return min(x, hi)\n"
    assert not tasks.in_stdlib(bugs.unified_diff("pkg/c.py", own, own.replace("x < lo", "x <= lo")), runner)
