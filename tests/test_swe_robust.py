"""Whatever a model writes, SWE-Lite's ``env.step`` answers with an observation (issue 50 point 3): the inputs that
raised before (an oversize command, NUL and lone surrogates in commands and paths, a 300-byte name, deep JSON, a
5,000-digit number, a file replaced by a directory, a 1,100-level tree, an undecodable file name), a property test
over arbitrary tool calls, and held-out evaluation counting an infra-failed SWE episode as a failure."""

import json
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_swe_env import call, env, task_file  # noqa: F401  (fixtures)

from comprl_jax.envs.swe import tools


def _valid(text):
    text.encode("utf-8")  # raises on a lone surrogate: what the tokenizer would have choked on
    return text


def step(env, reply):  # noqa: F811
    obs, reward, terminated, truncated, info = env.step(reply)
    return _valid(obs), reward, terminated, info


def raw(name, **arguments):
    """A tool call as the model writes it, surrogates and NULs kept as JSON escapes."""
    return "<answer>" + json.dumps({"name": name, "arguments": arguments}) + "</answer>"


@pytest.mark.parametrize(
    "reply, says",
    [
        (raw("execute_bash", command="echo " + "a" * (130 << 10)), "longer than"),
        (raw("execute_bash", command="echo a\x00b"), "NUL"),
        (raw("execute_bash", command="echo \ud800"), "surrogate"),
        (raw("str_replace_editor", command="view", path="/repo/a\x00b"), "NUL"),
        (raw("str_replace_editor", command="view", path="/repo/\udcff"), "surrogate"),
        (raw("str_replace_editor", command="create", path="/repo/" + "n" * 300, file_text="x"), "255 bytes"),
        ("<answer>" + "[" * 100_000 + "</answer>", "nests too deeply"),
        ('<answer>{"name": "submit", "arguments": {"x": ' + "9" * 5000 + "}}</answer>", "cannot be read"),
        (
            raw("str_replace_editor", command="create", path="/repo/a.py", file_text="x" * (2 << 20)),
            "longer than",
        ),
    ],
)
def test_inputs_that_raised_are_invalid_actions(env, reply, says):  # noqa: F811
    env.reset(seed=0)
    obs, reward, done, info = step(env, reply)
    assert says in obs and info["invalid_action"] and not done, obs
    obs, *_ = step(env, call("execute_bash", command="echo alive"))  # the episode goes on
    assert "alive" in obs


def test_submit_after_a_file_became_a_directory(env):  # noqa: F811
    env.reset(seed=0)
    step(
        env, call("execute_bash", command="rm inflection/__init__.py && mkdir -p inflection/__init__.py/x.py")
    )
    obs, reward, done, info = step(env, call("submit"))
    assert done and reward == 0.0 and "Not solved" in obs, obs


def test_a_1100_level_tree_ends_the_submission_not_the_env(env):  # noqa: F811
    env.reset(seed=0)
    # one command builds it (bash's cd walks down relative steps; no path is ever longer than a name)
    obs, *_ = step(
        env,
        call("execute_bash", command="for i in $(seq 1100); do mkdir d && cd d || break; done; pwd | wc -c"),
    )
    obs, *_ = step(env, call("str_replace_editor", command="view", path="/repo"))
    assert "/repo/d/d" in obs
    obs, *_ = step(env, call("str_replace_editor", command="view", path="/repo/" + "/".join(["d"] * 1000)))
    assert "str_replace_editor:" in obs  # a clear refusal (the path is too long), not a raise
    episode = env._episode
    obs, reward, done, info = step(env, call("submit"))
    assert done and reward == 0.0 and "nest deeper" in obs and "submission_error" in info, obs
    env.reset(seed=1)  # the old episode's directory goes, however deep
    assert not episode.exists()
    env.close()
    assert not list((env.cache / "episodes").glob(episode.name))


def test_an_undecodable_file_name_reaches_the_observation_as_valid_text(env):  # noqa: F811
    env.reset(seed=0)
    step(env, call("execute_bash", command="touch $'bad\\xff\\xfename.py' && ls"))
    obs, *_ = step(env, call("str_replace_editor", command="view", path="/repo"))
    assert "bad" in obs and "name.py" in obs  # the bytes shown as replacement characters


def test_many_files_are_listed_and_submitted_within_bounds(env):  # noqa: F811
    env.reset(seed=0)
    obs, *_ = step(
        env, call("execute_bash", command="mkdir f && cd f && seq 15000 | xargs touch && ls | wc -l")
    )
    assert "15000" in obs
    obs, *_ = step(env, call("str_replace_editor", command="view", path="/repo"))
    assert len(obs) < tools.OBS_CHARS + 100 and "more characters not shown" in obs  # bounded, and says so
    obs, reward, done, info = step(env, call("submit"))
    assert done and reward == 0.0 and "failing tests fixed" in obs, obs  # graded as usual


@pytest.mark.parametrize(
    "command, says",
    [
        ("mkdir f && cd f && seq 25000 | xargs touch", "more than 20000 files"),
        ("for i in 1 2 3 4 5; do head -c 60000000 /dev/zero > f$i; done", "more than 256 MiB"),
    ],
)
def test_a_file_flood_or_a_disk_fill_ends_the_episode_with_a_message(env, command, says):  # noqa: F811
    env.reset(seed=0)
    obs, reward, done, info = step(env, call("execute_bash", command=command))
    assert done and reward == 0.0 and says in obs and says in info["limit"] and not info["success"], obs
    episode = env._episode
    env.reset(seed=0)
    assert not episode.exists()


# a tool call as a policy might write it: known and unknown tools, known and unknown keys, values of any JSON shape
_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=60)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_path = st.one_of(
    _text,
    st.builds(lambda s: "/repo/" + s, _text),
    st.sampled_from(["/repo", "/repo/inflection", "/", "/repo/.."]),
)
_editor = st.fixed_dictionaries(
    {"command": st.sampled_from([*tools.EDITOR_COMMANDS, "rm"]) | _text, "path": _path},
    optional={
        "file_text": _text | _json,
        "old_str": _text | _json,
        "new_str": _text | _json,
        "insert_line": _json,
        "view_range": _json,
    },
)
_calls = st.one_of(
    st.builds(lambda a: {"name": "str_replace_editor", "arguments": a}, _editor),
    st.builds(lambda c: {"name": "execute_bash", "arguments": {"command": c}}, _text | _json),
    st.builds(lambda n, a: {"name": n, "arguments": a}, _text | st.sampled_from(tools.TOOLS), _json),
)
_replies = st.one_of(st.builds(lambda c: "<answer>" + json.dumps(c) + "</answer>", _calls), _text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(replies=st.lists(_replies, min_size=1, max_size=4))
def test_any_tool_call_gets_an_observation(env, replies):  # noqa: F811
    env.reset(seed=0)
    for reply in replies:
        obs, reward, done, info = step(env, reply)
        assert isinstance(obs, str) and reward in (0.0, 1.0)
        if done:
            break


def test_evaluation_counts_an_infra_failure_as_a_failure_where_the_env_says_so():
    from comprl_jax.loop import evaluation
    from comprl_jax.rollout.episodes import Trajectory
    from comprl_jax.rollout.rollout_config import EnvConfig

    def traj(task, success, infra):
        spec = types.SimpleNamespace(task=task)  # what evaluation reads of an episode's spec
        return Trajectory(spec, [], [], float(success), success, 1, 0, "", "", [], "", infra_failed=infra)

    def player(outcomes):
        def play(specs, pools, key):
            return [traj(t, *outcomes[i % len(outcomes)]) for i, t in enumerate(specs)]

        return evaluation.Player(specs=lambda tasks, guided: list(tasks), play=play, pools=lambda split: None)

    outcomes = [(True, False), (False, False), (False, True), (False, True)]  # 1 success, 1 failure, 2 infra
    rows = {}
    for env_id in ("comprl/SWE-Lite-v0", "comprl/HiddenRule-v0"):
        cfg = EnvConfig(tasks=(env_id,), eval_split="eval")
        rows[env_id] = evaluation.evaluate(
            cfg, player(outcomes), 4, False, seed=0, per_call=4, full_splits=False
        )
    swe = rows["comprl/SWE-Lite-v0"]["comprl/SWE-Lite-v0"]
    hidden = rows["comprl/HiddenRule-v0"]["comprl/HiddenRule-v0"]
    assert swe["infra_failed"] == 2 and swe["success"] == pytest.approx(1 / 4)  # over every episode played
    assert hidden["infra_failed"] == 2 and hidden["success"] == pytest.approx(1 / 2)  # over the ones that ran


def test_a_submission_past_its_byte_cap_is_refused_with_a_message(env):  # noqa: F811
    env.reset(seed=0)
    make = "for i in 1 2 3 4 5 6; do head -c 3500000 /dev/zero | tr '\\0' a > inflection/big$i.py; done; ls inflection"
    obs, *_ = step(env, call("execute_bash", command=make))
    assert "big6.py" in obs
    obs, reward, done, info = step(env, call("submit"))
    assert done and reward == 0.0 and "more than 16 MiB" in obs and "submission_error" in info, obs


def test_library_code_that_hangs_the_grader_is_the_agents_failure(task_file):  # noqa: F811
    """Code the agent leaves that never returns (at import, under the hidden tests) ends at the grading limit, well
    inside the pool's step timeout: a failed episode with its reason, not an env that hung (an infra failure)."""
    import time

    from comprl_jax.envs.swe import env as swe_env
    from comprl_jax.envs.swe.sandbox import SandboxLimits

    e = swe_env.SWELiteEnv(split="eval", task_file=task_file, grade_limits=SandboxLimits(wall_s=4, cpu_s=4))
    try:
        e.reset(seed=0)
        e.step(
            call(
                "execute_bash",
                command="printf 'import time\\ntime.sleep(10**6)\\n' >> inflection/__init__.py",
            )
        )
        t0 = time.monotonic()
        obs, reward, done, _, info = e.step(call("submit"))
        assert done and reward == 0.0 and "killed at the time limit" in obs and "submission_error" in info, (
            obs
        )
        assert time.monotonic() - t0 < 20
    finally:
        e.close()
