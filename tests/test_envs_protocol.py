"""The TextEnv protocol on every registered env kind, with inputs an agent or a caller gets wrong: step before reset,
step after the end, replies that are not text, and a 10,000-character invalid answer."""

import shutil

import pytest

from comprl_jax.envs import make
from comprl_jax.envs.base import ECHO_CHARS, echo

# One id per env class (the MiniHack ids share one class). ALFWorld's reset takes ~1 s.
ENV_IDS = [
    "comprl/MiniHack-Room-5x5-v0",
    "comprl/Sokoban-6x6-2-v0",
    "comprl/ALFWorld-v0",
    "comprl/WebShop-v0",
    "comprl/HiddenRule-v0",
    pytest.param(
        "comprl/SWE-Lite-v0",
        marks=pytest.mark.skipif(
            shutil.which("bwrap") is None, reason="bubblewrap missing: `make setup` installs it"
        ),
    ),
]


@pytest.fixture(scope="module", params=ENV_IDS)
def fresh_env(request):
    """A never-reset env (module scope: built once per id; the tests that reset it come after the one that needs it
    fresh, in file order)."""
    env = make(request.param, max_turns=5)
    yield env
    env.close()


def test_step_before_reset_raises_one_clear_error(fresh_env):
    # Before: Sokoban scored 1.0 on an empty grid, WebShop raised AttributeError, ALFWorld said "Nothing happens.".
    for reply in ["<answer>north</answer>", "<answer>click[buy now]</answer>", "<answer>look</answer>"]:
        with pytest.raises(RuntimeError, match=r"step called before reset\(\); call reset\(\) first"):
            fresh_env.step(reply)


def test_non_string_replies_are_invalid_actions(fresh_env):
    obs0, _ = fresh_env.reset(seed=0)
    for turn, reply in enumerate([b"<answer>north</answer>", 7, None, 2.5, ["<answer>north</answer>"]], 1):
        obs, reward, terminated, truncated, info = fresh_env.step(reply)
        assert info["invalid_action"] and info["action"] is None and info["num_invalid"] == turn
        assert reward <= 0.0 and not terminated and isinstance(obs, str)
    assert truncated  # max_turns=5: the invalid turns still count


def test_step_after_the_end_raises(fresh_env):
    fresh_env.reset(seed=0)
    for _ in range(5):
        *_, truncated, _ = fresh_env.step("no answer")
    assert truncated
    with pytest.raises(RuntimeError, match=r"after the episode ended; call reset\(\) first"):
        fresh_env.step("<answer>north</answer>")


def test_a_long_invalid_answer_is_not_echoed_whole(fresh_env):
    obs0, _ = fresh_env.reset(seed=1)
    long = "x" * 10_000
    obs, reward, terminated, truncated, info = fresh_env.step(f"<answer>{long}</answer>")
    assert info["invalid_action"] and not terminated
    # The page / map text itself is unchanged, so the observation grows by the short note at most.
    assert "x" * (ECHO_CHARS + 1) not in obs and len(obs) < len(obs0) + 200, len(obs)


def test_echo_cuts_and_quotes():
    assert echo(None) == ""
    assert echo("go nrth") == " 'go nrth'"
    assert echo("a\nb") == " 'a\\nb'"  # one visible line
    assert echo("y" * 1000) == " '" + "y" * ECHO_CHARS + "...'"
