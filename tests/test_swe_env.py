"""comprl/SWE-Lite-v0 (comprl_jax/envs/swe/env.py): the tools, the hidden tests and the reward, on real tasks built
here from the pinned inflection sdist (issue 32 points 2 and 4)."""

import json
import shutil
import subprocess

import pytest

from comprl_jax.envs.swe import env as swe_env
from comprl_jax.envs.swe import projects, tasks

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap missing: `make setup` installs it"
)


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """Three validated inflection tasks (its sdist is pinned; pip fetches it once into the cache)."""
    built = tasks.build_project(projects.get("inflection", "0.5.1"), seed=0, quota=3)
    path = tmp_path_factory.mktemp("swe") / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks.splits(built, projects.PROJECTS)))
    return str(path)


@pytest.fixture
def env(task_file):
    e = swe_env.SWELiteEnv(split="eval", task_file=task_file, max_turns=30)
    yield e
    e.close()


def call(name, **arguments):
    return "<answer>" + json.dumps({"name": name, "arguments": arguments}) + "</answer>"


def test_reverse_patch_solves_every_task_and_untouched_code_none(env):
    for seed in range(len(env.tasks)):
        env.reset(seed=seed)
        *_, info = env.step(call("submit"))
        assert not info["success"]
        env.reset(seed=seed)
        subprocess.run(
            ["patch", "-p1", "-R", "-s"], input=env.task["patch"], text=True, cwd=env.work, check=True
        )
        obs, reward, terminated, truncated, info = env.step(call("submit"))
        assert reward == 1.0 and terminated and info["success"], obs


def test_hidden_tests_are_not_in_the_working_copy_and_edits_to_tests_do_not_count(env):
    obs, info = env.reset(seed=0)
    assert info["task_id"] == env.task["instance_id"] and env.task["problem_statement"] in obs
    out = env.step(call("execute_bash", command="ls /repo; ls /repo/test_inflection.py"))[0]
    assert "No such file or directory" in out and "inflection" in out
    # a conftest.py that skips every test, and a test file: ignored by the reward (the real tests are restored)
    skip_all = "import pytest\ndef pytest_collection_modifyitems(items):\n    items.clear()\n"
    env.step(call("str_replace_editor", command="create", path="/repo/conftest.py", file_text=skip_all))
    env.step(
        call(
            "str_replace_editor",
            command="create",
            path="/repo/test_inflection.py",
            file_text="def test_x(): pass\n",
        )
    )
    assert env.changed_files() == {}
    assert env.step(call("submit"))[1] == 0.0


def test_editor_view_create_replace_insert_undo(env):
    env.reset(seed=0)
    step = lambda **a: env.step(call("str_replace_editor", **a))  # noqa: E731
    obs, _, _, _, info = step(command="view", path="/repo")
    assert "/repo/inflection/__init__.py" in obs and not info["invalid_action"]
    obs = step(command="view", path="/repo/inflection/__init__.py", view_range=[1, 3])[0]
    assert obs.splitlines()[1].startswith("     1\t")
    obs = step(command="create", path="/repo/notes/a.txt", file_text="one\ntwo\ntwo\n")[0]
    assert (
        obs == "Created /repo/notes/a.txt (3 lines)."
        and (env.work / "notes/a.txt").read_text() == "one\ntwo\ntwo\n"
    )
    obs, _, _, _, info = step(command="str_replace", path="/repo/notes/a.txt", old_str="two", new_str="2")
    assert info["invalid_action"] and "occurs 2 times" in obs
    step(command="str_replace", path="/repo/notes/a.txt", old_str="one\n", new_str="1\n")
    step(command="insert", path="/repo/notes/a.txt", insert_line=0, new_str="zero")
    assert (env.work / "notes/a.txt").read_text() == "zero\n1\ntwo\ntwo\n"
    step(command="undo_edit", path="/repo/notes/a.txt")
    assert (env.work / "notes/a.txt").read_text() == "1\ntwo\ntwo\n"
    assert (
        env.step(call("execute_bash", command="cat notes/a.txt"))[0] == "1\ntwo\ntwo\n"
    )  # the sandbox sees it
    assert env.changed_files() == {"notes/a.txt": "1\ntwo\ntwo\n"}


def test_paths_outside_the_repository_and_bad_calls_are_invalid_actions(env):
    env.reset(seed=0)
    env.step(call("execute_bash", command="ln -s /etc /repo/etc_link; ln -s /etc/passwd /repo/pw"))
    for args, msg in [
        ({"command": "view", "path": "/etc/passwd"}, "outside the repository"),
        ({"command": "view", "path": "/repo/../etc/passwd"}, "outside the repository"),
        ({"command": "view", "path": "/repo/pw"}, "resolves outside the repository"),
        (
            {"command": "create", "path": "/repo/etc_link/x", "file_text": "x"},
            "resolves outside the repository",
        ),
        ({"command": "view", "path": "repo/x"}, "must be an absolute path"),
        ({"command": "explode", "path": "/repo"}, "'command' must be one of"),
        ({"command": "view", "path": "/repo/nope.py"}, "does not exist"),
    ]:
        obs, reward, terminated, _, info = env.step(call("str_replace_editor", **args))
        assert info["invalid_action"] and msg in obs and not terminated, (args, obs)
    for reply, msg in [
        ("<answer>ls</answer>", "not JSON"),
        ('<answer>{"name": "rm_rf"}</answer>', "'name' is one of"),
        ("no answer", "no <answer>"),
        (call("execute_bash", command=""), "non-empty string 'command'"),
    ]:
        obs, _, _, _, info = env.step(reply)
        assert info["invalid_action"] and msg in obs, (reply, obs)


def test_the_scripted_agent_fixes_a_bug_its_reproduction_catches(env):
    from comprl_jax.envs.swe.scripted import ScriptedAgent

    _, info = env.reset(seed=1)  # camelize(string)[1:] -> [0:]: the failing line reads only literals
    assert "assert 'capital' == inflection.camelize('Capital', False)" in info["goal"]
    seen = []

    def step(reply):
        obs, reward, terminated, truncated, _ = env.step(reply)
        seen.append(reply)
        return obs, reward, terminated or truncated

    assert ScriptedAgent().play(info["goal"], step) == 1.0
    assert '"name": "submit"' in seen[-1] and any(
        "REPRO-OK" in r for r in seen
    )  # it checked before submitting


def test_the_shipped_tasks_match_the_registry_and_split_by_project():
    from collections import Counter

    from comprl_jax.envs import registry

    all_tasks = swe_env.load_tasks()
    assert len(all_tasks) >= 300 and len({t["instance_id"] for t in all_tasks}) == len(all_tasks)
    spec = registry.spec("comprl/SWE-Lite-v0")
    assert spec.eval_sizes == {s: len(swe_env.split_tasks(all_tasks, s)) for s in spec.eval_splits}
    train = {t["project"] for t in swe_env.split_tasks(all_tasks, "train")}
    held_out = {t["project"] for t in swe_env.split_tasks(all_tasks, "eval")}
    assert len(train) >= 5 and len(held_out) >= 2 and not train & held_out
    assert {t["project"] for t in swe_env.split_tasks(all_tasks, "same_project_eval")} <= train
    assert Counter(t["project"] for t in all_tasks) == {
        p.name: projects.QUOTAS[p.name] for p in projects.PROJECTS
    }
    for t in all_tasks:  # the statement never shows the patch's removed (pristine) lines
        assert t["fail_to_pass"] and t["pass_to_pass"]
        for ln in t["patch"].splitlines():
            if ln.startswith("-") and not ln.startswith("---") and len(ln.strip()) > 12:
                assert ln[1:] not in t["problem_statement"], (t["instance_id"], ln)
