"""SWE-Lite's reward against a policy that forges it (issue 50 point 1): each attempt is written through ``env.step``
the way a model would act (files created with the editor or the shell, then ``submit``), on a real inflection task
whose bug is left in place. Isolation neutralises the forgeries that load code before or beside the runner (they
fail as wrong fixes, and the loader files are named in ``info["tampering"]``); the sentinels catch the ones that run
inside the runner and rewrite its verdicts (reward 0, ``info["tampering"]`` names the sentinels)."""

import json

import pytest
from test_swe_env import call, env, task_file  # noqa: F401  (fixtures)

from comprl_jax.envs.swe import grading


def create(env, path, text):  # noqa: F811
    obs, _, _, _, info = env.step(call("str_replace_editor", command="create", path=path, file_text=text))
    assert not info["invalid_action"], obs


def append(env, path, text):  # noqa: F811
    body = env.files.read(env.work / path.removeprefix("/repo/"))
    obs, _, _, _, info = env.step(
        call(
            "str_replace_editor",
            command="insert",
            path=path,
            insert_line=len(body.splitlines()),
            new_str=text,
        )
    )
    assert not info["invalid_action"], obs


def submit(env):  # noqa: F811
    obs, reward, done, _, info = env.step(call("submit"))
    assert done
    return obs, reward, info


def _pass_lines(env):  # noqa: F811
    return "".join(f"PASSED {t}\n" for t in env.task["fail_to_pass"])


FAKE_RUNNER = """import sys
print({lines!r})
print("{n} passed")
sys.exit(0)
"""


@pytest.mark.parametrize("where", ["pytest.py", "_pytest/__init__.py", "inflection/pytest.py"])
def test_a_module_that_shadows_the_runner_is_a_wrong_fix(env, where):  # noqa: F811
    env.reset(seed=0)
    create(env, f"/repo/{where}", FAKE_RUNNER.format(lines=_pass_lines(env), n=len(env.task["fail_to_pass"])))
    obs, reward, info = submit(env)
    assert reward == 0.0 and not info["success"], obs
    if not where.startswith("inflection/"):
        assert "Ignored 1 changed file(s)" in obs and where in info["tampering"]


FORCE_PASS_PLUGIN = """import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    out = yield
    rep = out.get_result()
    rep.outcome, rep.longrepr = "passed", None
"""


@pytest.mark.parametrize("where", ["sitecustomize.py", "usercustomize.py", "inflection/sitecustomize.py"])
def test_sitecustomize_is_never_loaded(env, where):  # noqa: F811
    env.reset(seed=0)
    create(env, f"/repo/{where}", _patch_reports())
    obs, reward, info = submit(env)
    assert reward == 0.0 and where in info["tampering"] and "sentinel" not in info["tampering"], obs


@pytest.mark.parametrize("root", ["", "inflection/"])
def test_a_pytest11_entry_point_is_never_loaded(env, root):  # noqa: F811
    env.reset(seed=0)
    create(env, f"/repo/{root}forge_plugin.py", FORCE_PASS_PLUGIN)
    create(
        env, f"/repo/{root}forge-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: forge\nVersion: 1.0\n"
    )
    create(
        env,
        f"/repo/{root}forge-1.0.dist-info/entry_points.txt",
        f"[pytest11]\nforge = {root.replace('/', '.')}forge_plugin\n",
    )
    create(env, f"/repo/{root}forge.pth", f"import {root.replace('/', '.')}forge_plugin\n")
    obs, reward, info = submit(env)
    assert reward == 0.0 and "dist-info" in info["tampering"] and ".pth" in info["tampering"], obs
    assert "sentinel" not in info["tampering"]  # never loaded: nothing flipped a verdict


def test_printing_passed_lines_at_exit_changes_nothing(env):  # noqa: F811
    env.reset(seed=0)
    lines = _pass_lines(env)
    append(env, "/repo/inflection/__init__.py", f"import atexit\natexit.register(print, {lines!r})\n")
    obs, reward, info = submit(env)
    assert reward == 0.0 and "tampering" not in info and "failing tests fixed" in obs, obs


def _atexit_rewrite_all():
    """Library code that, when the run ends, strips every failure from the JUnit report pytest was told to write."""
    return (
        "import atexit, sys\n"
        "def _rewrite():\n"
        "    import re\n"
        "    for a in sys.argv:\n"
        "        if a.startswith('--junitxml='):\n"
        "            p = a.split('=', 1)[1]\n"
        "            t = open(p).read()\n"
        "            t = re.sub(r'<(failure|error)[^>]*?(/>|>.*?</\\1>)', '', t, flags=re.S)\n"
        "            open(p, 'w').write(t)\n"
        "atexit.register(_rewrite)\n"
    )


def _patch_reports(names=None):
    """Library code that, on import, makes pytest report its tests passed: every test, or only those named in
    ``names`` (a forger who read the task's failing test names from the problem statement)."""
    cond = "True" if names is None else f"item.name.split('[')[0] in {sorted(names)!r}"
    return (
        "def _forge():\n"
        "    from _pytest import reports\n"
        "    orig = reports.TestReport.from_item_and_call.__func__\n"
        "    def fake(cls, item, call):\n"
        "        rep = orig(cls, item, call)\n"
        f"        if {cond}:\n"
        "            rep.outcome, rep.longrepr = 'passed', None\n"
        "        return rep\n"
        "    reports.TestReport.from_item_and_call = classmethod(fake)\n"
        "try:\n"
        "    _forge()\n"
        "except Exception:\n"
        "    pass\n"
    )


@pytest.mark.parametrize("attack", ["rewrite_report_at_exit", "patch_all_reports", "patch_named_reports"])
def test_code_in_the_runner_that_rewrites_verdicts_is_caught_by_the_sentinels(env, attack):  # noqa: F811
    env.reset(seed=0)
    names = {t.split("::")[-1].split("[")[0] for t in env.task["fail_to_pass"]}
    code = {
        "rewrite_report_at_exit": _atexit_rewrite_all(),
        "patch_all_reports": _patch_reports(),
        "patch_named_reports": _patch_reports(names),
    }[attack]
    append(env, "/repo/inflection/__init__.py", code)
    obs, reward, info = submit(env)
    assert reward == 0.0 and not info["success"], obs
    assert "sentinel" in info["tampering"], info
    assert "must-fail sentinel reported passed" in info["tampering"]


def test_the_same_code_without_the_forgery_is_graded_normally(env):  # noqa: F811
    """The control: harmless library code of the same shape leaves the grading as it was (no tampering), and the
    real fix with it still solves the task."""
    import subprocess

    env.reset(seed=0)
    subprocess.run(["patch", "-p1", "-R", "-s"], input=env.task["patch"], text=True, cwd=env.work, check=True)
    append(env, "/repo/inflection/__init__.py", "import atexit\natexit.register(lambda: None)\n")
    obs, reward, info = submit(env)
    assert reward == 1.0 and "tampering" not in info, obs


# -- the grader's parts, by hand ----------------------------------------------------------------------------
def test_junit_keys_follow_pytests_mangling():
    assert grading.junit_key("tests/test_a.py::test_x") == ("tests.test_a", "test_x")
    assert grading.junit_key("tests/test_a.py::TestK::test_x[1-a/b]") == (
        "tests.test_a.TestK",
        "test_x[1-a/b]",
    )
    assert grading.junit_key("test_inflection.py::test_y[a::b]") == ("test_inflection", "test_y[a::b]")


def test_a_report_with_a_doctype_or_a_contradiction_is_refused():
    bomb = '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaa">]><testsuites>&a;</testsuites>'
    with pytest.raises(grading.ReportError, match="document type"):
        grading.parse_junit(bomb)
    twice = (
        '<testsuites><testsuite><testcase classname="m" name="t"/>'
        '<testcase classname="m" name="t"><failure/></testcase></testsuite></testsuites>'
    )
    with pytest.raises(grading.ReportError, match="twice"):
        grading.parse_junit(twice)
    with pytest.raises(grading.ReportError, match="not XML"):
        grading.parse_junit("PASSED test_x")


def test_sentinels_are_random_and_decoys_take_the_tasks_names():
    a = grading.make_sentinels(["t.py::test_take", "t.py::TestK::test_a[1]", "t.py::TestK::test_b"])
    b = grading.make_sentinels([])
    assert a.path != b.path and not set(a.expected) & set(b.expected)
    assert (
        sorted(a.expected.values()).count("failed") == 2 + 3
        and list(a.expected.values()).count("passed") == 2
    )
    assert (
        "def test_take():" in a.text
        and a.text.count("class TestK(unittest.TestCase):") == 1
        and "def test_b(self):" in a.text
    )
    compile(a.text, a.path, "exec")  # valid Python


def test_filter_diff_drops_loader_files_whole():
    diff = (
        "diff --git a/pkg/m.py b/pkg/m.py\n--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/sitecustomize.py b/sitecustomize.py\nnew file mode 100644\n--- /dev/null\n+++ b/sitecustomize.py\n"
        "@@ -0,0 +1 @@\n+x\n"
        "diff --git a/x.dist-info/entry_points.txt b/x.dist-info/entry_points.txt\n+[pytest11]\n"
        "diff --git a/pytest.py b/pytest.py\n+y\n"
        "diff --git a/forge .dist-info/entry_points.txt b/forge .dist-info/entry_points.txt\n+[pytest11]\n"
    )
    kept, dropped = grading.filter_diff(diff)
    assert kept.count("diff --git") == 1 and "pkg/m.py" in kept
    assert (
        dropped
        == [
            "a/forge .dist-info/entry_points.txt b/forge .dist-info/entry_points.txt",  # a header that is not two paths
            "pytest.py",
            "sitecustomize.py",
            "x.dist-info/entry_points.txt",
        ]
    )
    assert json.dumps(kept)  # plain text


def test_every_sentinel_and_decoy_is_collected_and_comes_back_as_expected(tmp_path):
    """Run by pytest itself (no forgery): the report holds every sentinel with its expected verdict, decoys of
    function, pytest-class and unittest-class tests included (a decoy pytest skips would read as tampering)."""
    import subprocess
    import sys

    s = grading.make_sentinels(
        ["t.py::test_take", "t.py::TestK::test_a[1]", "t.py::UnboundMethodTest::test_b"]
    )
    (tmp_path / s.path).parent.mkdir()
    (tmp_path / s.path).write_text(s.text)
    report = tmp_path / "r.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", s.path],
        cwd=tmp_path, capture_output=True, check=False,
    )  # fmt: skip
    v = grading.judge(grading.parse_junit(report.read_bytes()), [], s)
    assert v.tampering is None and v.failing == [] and len(s.expected) == 2 + 2 + 3
