"""SWE-bench-format tasks (comprl_jax/envs/swe/bench.py, issue 32 point 5): the harness's log formats, the eval
script, the editor's shell file access against the host one, and whole episodes on the bubblewrap backend over a
hand-built git repository (the container backend runs the same commands through `docker exec`; no image can be
pulled here)."""

import json
import os
import shutil
import subprocess
import textwrap

import pytest

from comprl_jax.envs.swe import bench, tasks
from comprl_jax.envs.swe.files import HostFiles, ShellFiles, ToolError
from comprl_jax.envs.swe.sandbox import Sandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: `make setup`")


def call(name, **arguments):
    return "<answer>" + json.dumps({"name": name, "arguments": arguments}) + "</answer>"


# -- logs and scripts (no sandbox) ------------------------------------------------------------------------------
def test_pytest_summary_lines_are_read_as_the_harness_reads_them():
    log = textwrap.dedent("""\
        tests/test_a.py::test_x PASSED                                     [ 25%]
        =========================== short test summary info ============================
        PASSED tests/test_a.py::test_x
        PASSED tests/test_a.py::test_p[1-2]
        \x1b[31mFAILED\x1b[0m tests/test_a.py::test_y - AssertionError: assert 1 == 2
        ERROR tests/test_b.py::test_z - ValueError
        tests/test_b.py::test_v FAILED                                     [ 50%]
        XFAIL tests/test_a.py::test_w - reason
        SKIPPED [1] tests/test_a.py:9: no network
        ======================== 2 passed, 1 failed in 0.12s =========================
        """)
    assert bench.parse_test_log(log, "pytest") == {
        "tests/test_a.py::test_x": "passed",
        "tests/test_a.py::test_p[1-2]": "passed",
        "tests/test_a.py::test_y": "failed",
        "tests/test_b.py::test_z": "failed",
        "tests/test_b.py::test_v": "failed",  # a -v line: "id STATUS"
        "tests/test_a.py::test_w": "passed",  # an expected failure counts as a pass, as in the harness
        "[1]": "skipped",
    }


def test_django_and_sympy_logs():
    django = textwrap.dedent("""\
        test_add (utils_tests.test_text.TestUtilsText) ... ok
        test_sub (utils_tests.test_text.TestUtilsText) ... FAIL
        test_net (utils_tests.test_text.TestUtilsText) ... skipped 'no network'
        test_old (utils_tests.test_text.TestUtilsText) ... expected failure
        ======================================================================
        ERROR: test_err (utils_tests.test_text.TestUtilsText)
        """)
    assert bench.parse_test_log(django, "django") == {
        "test_add (utils_tests.test_text.TestUtilsText)": "passed",
        "test_sub (utils_tests.test_text.TestUtilsText)": "failed",
        "test_net (utils_tests.test_text.TestUtilsText)": "skipped",
        "test_old (utils_tests.test_text.TestUtilsText)": "passed",
        "test_err (utils_tests.test_text.TestUtilsText)": "failed",
    }
    sympy = "test_one ok\ntest_two F\ntest_three E\ntest_five f\n____ sympy/core/tests/test_basic.py:test_four ____\n"
    assert bench.parse_test_log(sympy, "sympy") == {
        "test_one": "passed",
        "test_two": "failed",
        "test_three": "failed",
        "test_five": "failed",  # as the harness reads sympy's "f"
        "test_four": "failed",
    }
    with pytest.raises(ValueError, match="log_format"):
        bench.parse_test_log("", "maven")


def test_the_eval_script_restores_test_files_applies_the_test_patch_and_runs_the_command():
    patch = (
        "diff --git a/t/test_a.py b/t/test_a.py\n--- a/t/test_a.py\n+++ b/t/test_a.py\n@@ -1 +1 @@\n-x\n+y\n"
    )
    task = {"base_commit": "abc123", "test_patch": patch, "test_cmd": "pytest -rA t/test_a.py"}
    assert bench.eval_script(task) == (
        "git checkout -q abc123 -- t/test_a.py 2>/dev/null || rm -f -- t/test_a.py\n"
        "git apply -v - <<'EOF_TEST_PATCH'\n" + patch + "EOF_TEST_PATCH\npytest -rA t/test_a.py\n"
    )
    # a patch holding the delimiter gets a longer one; the harness's own script is used as given
    tricky = {**task, "test_patch": patch + "EOF_TEST_PATCH\n"}
    assert "<<'EOF_TEST_PATCH_'\n" in bench.eval_script(tricky)
    assert bench.eval_script({**task, "eval_script": "run it"}) == "run it"


def test_task_records_are_checked(tmp_path):
    good = {
        "instance_id": "django__django-1",
        "repo": "django/django",
        "base_commit": "abc",
        "problem_statement": "p",
        "test_patch": "",
        "FAIL_TO_PASS": '["t1"]',  # the dataset's JSON-encoded lists
        "PASS_TO_PASS": [],
        "test_cmd": "./tests/runtests.py",
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n")
    (t,) = bench.load_instances(path)
    assert t["FAIL_TO_PASS"] == ["t1"] and t["log_format"] == "django"
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "test_cmd"}) + "\n")
    with pytest.raises(ValueError, match="'eval_script'.*'test_cmd'"):
        bench.load_instances(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "base_commit"}) + "\n")
    with pytest.raises(ValueError, match="lacks \\['base_commit'\\]"):
        bench.load_instances(path)
    with pytest.raises(FileNotFoundError, match="missing"):
        bench.load_instances(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="backend must be one of"):
        bench.SWEBenchEnv(task_file=str(tmp_path / "none.jsonl"), backend="lxc")
    # the system prompt names the repository of the backend before any reset (the pools read it from a fresh env)
    path.write_text(json.dumps(good) + "\n")
    assert (
        '"path": "/testbed/..."' in bench.SWEBenchEnv(task_file=str(path), backend="podman").system_prompt()
    )


# -- the editor's file access: shell commands in the sandbox == the host's ---------------------------------------
@needs_bwrap
def test_shell_file_access_in_the_sandbox_matches_the_host(tmp_path):
    root = tmp_path / "copy"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\ny = 'é'\n")
    (root / "pkg" / "sub" / "deep.py").write_text("")
    (root / ".git").mkdir()
    (root / "pkg" / "__pycache__").mkdir()
    (root / "out").symlink_to("/etc")
    (root / "inner").symlink_to("pkg")
    box = Sandbox(str(root))
    shell, host = ShellFiles(box, "/repo"), HostFiles(root)
    for rel in ("", "pkg", "pkg/a.py", "inner/a.py", "missing.py", "pkg/new/b.py"):
        (k1, _), (k2, _) = shell.stat(rel), host.stat(rel)
        assert k1 == k2, rel
    assert shell.stat("inner/a.py")[1] == "/repo/pkg/a.py"
    for files in (shell, host):
        with pytest.raises(ToolError, match="outside the repository"):
            files.stat("out/passwd")
        with pytest.raises(ToolError, match="outside the repository"):
            files.stat("../x")
    assert shell.read("/repo/pkg/a.py") == host.read(root / "pkg" / "a.py") == "x = 1\ny = 'é'\n"
    assert (
        shell.tree("/repo")
        == host.tree(root)
        == [
            ("inner", False),  # a link is listed, not followed
            ("out", False),
            ("pkg", True),
            ("pkg/a.py", False),
            ("pkg/sub", True),
        ]
    )
    shell.write("/repo/pkg/new/b.py", "z = 'ü'\n")  # through stdin, parents made, as the sandbox's uid
    assert (root / "pkg" / "new" / "b.py").read_text() == "z = 'ü'\n"
    if os.geteuid() == 0:
        assert (root / "pkg" / "new" / "b.py").stat().st_uid == box.uid
    with pytest.raises(ToolError, match="failed"):
        shell.read("/repo/pkg")
    for files, key in ((shell, "/repo/pkg/a.py/x"), (host, root / "pkg" / "a.py" / "x")):
        with pytest.raises(ToolError):  # a parent that is a file: the agent's mistake, not a crash
            files.write(key, "x")
    shell.write("/repo/pkg/s.py", "a\ud800b")  # a lone surrogate, as JSON allows
    assert (root / "pkg" / "s.py").read_text() == "a?b"


class _NoisyBox:
    """A box whose runtime prints warnings of its own into the merged output (as podman's WARN lines do)."""

    def __init__(self, box):
        self.box = box

    def run(self, command, limits=None, stdin=None):
        return self.box.run(
            f"echo 'WARN[0000] runtime' >&2; {command}; echo 'WARN[0001] done' >&2", limits, stdin
        )


@needs_bwrap
def test_runtime_warnings_never_reach_a_files_text(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    shell = ShellFiles(_NoisyBox(Sandbox(str(tmp_path))), "/repo")
    assert shell.read("/repo/a.py") == "x = 1\n"
    assert shell.stat("a.py") == ("file", "/repo/a.py")
    shell.write("/repo/a.py", "y = 2\n")
    assert (tmp_path / "a.py").read_text() == "y = 2\n"


# -- whole episodes on the bubblewrap backend -----------------------------------------------------------------
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]


def _git(cwd, *args):
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """A repository with a bug in ``add`` and a SWE-bench record whose test patch adds ``test_add``."""
    base = tmp_path_factory.mktemp("swebench")
    repo = base / "checkouts" / "local__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
    )
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
    )
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n"
        "def test_add():\n    assert add(2, 3) == 5\n"
    )
    test_patch = _git(repo, "diff")
    _git(repo, "checkout", "-q", "--", ".")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "later work the task must not see")
    runner = tasks.runner_env()
    record = {
        "instance_id": "local__calc-1",
        "split": "eval",
        "repo": "local/calc",
        "base_commit": commit,
        "problem_statement": "add(2, 3) returns -1; it should return 5.",
        "test_patch": test_patch,
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
        "test_cmd": f"{runner}/bin/python -m pytest -rA -p no:cacheprovider tests/test_calc.py",
    }
    path = base / "tasks.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path, base / "checkouts", str(runner)


@pytest.fixture
def env(task_file, tmp_path):
    path, checkouts, runner = task_file
    e = bench.SWEBenchEnv(
        task_file=str(path),
        backend="bubblewrap",
        checkouts=str(checkouts),
        ro_paths=(runner,),
        scratch=str(tmp_path),
    )
    yield e
    e.close()
    assert not list(tmp_path.iterdir()), "a clone was left behind"


@needs_bwrap
def test_an_edit_through_the_editor_solves_the_task_and_test_edits_do_not_count(env):
    obs, info = env.reset(seed=0)
    assert "add(2, 3) returns -1" in obs and "/repo" in obs and info["task_id"] == "local__calc-1"
    obs, *_ = env.step(
        call("execute_bash", command="git log --all --oneline | wc -l; git for-each-ref | wc -l; ls")
    )
    assert obs.split()[:2] == ["1", "0"] and "calc" in obs  # the base commit only: no ref reaches a later one
    later = _git(env.checkouts + "/local__calc", "rev-parse", "HEAD").strip()
    obs, *_ = env.step(call("execute_bash", command=f"git cat-file -t {later}"))
    assert "exit code" in obs  # the later commit's object is not in the copy
    obs, _, _, _, info = env.step(call("str_replace_editor", command="view", path="/repo/calc/__init__.py"))
    assert "return a - b" in obs and not info["invalid_action"]
    obs, *_ = env.step(
        call(
            "str_replace_editor",
            command="str_replace",
            path="/repo/calc/__init__.py",
            old_str="a - b",
            new_str="a + b",
        )
    )
    assert obs.startswith("Edited /repo/calc/__init__.py at line 2")
    # a new file and an undone edit travel in the diff as they should
    env.step(call("str_replace_editor", command="create", path="/repo/calc/notes.py", file_text="N = 1\n"))
    env.step(
        call(
            "str_replace_editor", command="insert", path="/repo/calc/notes.py", insert_line=1, new_str="M = 2"
        )
    )
    obs, *_ = env.step(call("str_replace_editor", command="undo_edit", path="/repo/calc/notes.py"))
    assert obs == "Undid the last edit of /repo/calc/notes.py."
    # an agent that rewrites the visible test to pass gains nothing: the eval script restores it
    env.step(call("execute_bash", command="printf 'def test_mul():\\n    pass\\n' > tests/test_calc.py"))
    diff = env.diff()
    assert "+    return a + b" in diff and "+++ b/calc/notes.py" in diff and "M = 2" not in diff
    obs, reward, done, _, info = env.step(call("submit"))
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert "1/1 failing tests fixed, 0/1 passing tests broken. Solved." in obs


@needs_bwrap
def test_a_registered_entry_builds_it_from_json_able_kwargs(task_file, tmp_path):
    """What a launcher does for SWE-Bench Verified (bench.py's docstring), with this backend and repository."""
    from comprl_jax.envs import registry

    path, checkouts, runner = task_file
    kwargs = dict(task_file=str(path), backend="bubblewrap", checkouts=str(checkouts), ro_paths=[runner])
    registry.register(
        "test/SWE-bench-local-v0",
        "comprl_jax.envs.swe.bench:SWEBenchEnv",
        levels="split",
        train_split="train",
        eval_splits=("eval",),
        eval_sizes={"eval": 1},
        **kwargs,
    )
    try:
        env = registry.make("test/SWE-bench-local-v0", split="eval", scratch=str(tmp_path), max_turns=2)
        obs, _ = env.reset(seed=3)
        assert env.task["instance_id"] == "local__calc-1" and env.max_turns == 2
        env.close()
        with pytest.raises(ValueError, match="has \"split\": 'train'"):
            registry.make("test/SWE-bench-local-v0", split="train")
    finally:
        registry._REGISTRY.pop("test/SWE-bench-local-v0")
    assert not list(tmp_path.iterdir())


@needs_bwrap
def test_untouched_or_wrong_fixes_are_not_solved_and_links_cannot_leave_the_repo(env):
    env.reset(seed=0)
    obs, reward, *_ = env.step(call("submit"))
    assert reward == 0.0 and "0/1 failing tests fixed, 0/1 passing tests broken. Not solved." in obs
    env.reset(seed=0)
    env.step(call("execute_bash", command="sed -i 's/a - b/a + b/; s/a \\* b/a + b/' calc/__init__.py"))
    obs, reward, *_ = env.step(call("submit"))
    assert reward == 0.0 and "1/1 failing tests fixed, 1/1 passing tests broken" in obs
    env.reset(seed=0)
    env.step(call("execute_bash", command="ln -s /etc out"))
    obs, _, _, _, info = env.step(call("str_replace_editor", command="view", path="/repo/out/passwd"))
    assert info["invalid_action"] and "resolves outside the repository" in obs
    obs, _, _, _, info = env.step(call("str_replace_editor", command="view", path="/etc/passwd"))
    assert info["invalid_action"] and "outside the repository /repo" in obs
    obs, _, _, _, info = env.step(
        call("str_replace_editor", command="create", path="/repo/calc/__init__.py/x", file_text="1")
    )
    assert info["invalid_action"] and obs.startswith("str_replace_editor: /repo/calc/__init__.py/x")


PATCH_REPORTS = (
    "\ndef _forge():\n"
    "    from _pytest import reports\n"
    "    orig = reports.TestReport.from_item_and_call.__func__\n"
    "    def fake(cls, item, call):\n"
    "        rep = orig(cls, item, call)\n"
    "        rep.outcome, rep.longrepr = 'passed', None\n"
    "        return rep\n"
    "    reports.TestReport.from_item_and_call = classmethod(fake)\n"
    "_forge()\n"
)


@needs_bwrap
def test_the_harness_path_reads_a_junit_report_and_catches_forged_verdicts(env):
    """Issue 50 point 5: the SWE-bench grading path (container or bubblewrap) drops loader files from the diff,
    ignores PASSED lines printed by the code under test, and its sentinels catch verdicts rewritten in the runner."""
    env.reset(seed=0)
    env.step(
        call(
            "execute_bash",
            command="printf 'import atexit\\natexit.register(print, \"PASSED tests/test_calc.py::test_add\")\\n' >> calc/__init__.py",
        )
    )
    obs, reward, _, _, info = env.step(call("submit"))
    assert reward == 0.0 and "0/1 failing tests fixed" in obs and "tampering" not in info, obs
    env.reset(seed=0)
    env.step(
        call("str_replace_editor", command="create", path="/repo/sitecustomize.py", file_text=PATCH_REPORTS)
    )
    env.step(call("str_replace_editor", command="create", path="/repo/conftest.py", file_text=PATCH_REPORTS))
    obs, reward, _, _, info = env.step(call("submit"))
    assert reward == 0.0 and "Ignored changes to 2 file(s)" in obs, obs
    env.reset(seed=0)
    env.step(call("execute_bash", command=f"cat >> calc/__init__.py <<'EOF'\n{PATCH_REPORTS}\nEOF"))
    obs, reward, _, _, info = env.step(call("submit"))
    assert reward == 0.0 and "must-fail sentinel reported passed" in info["tampering"], (obs, info)
