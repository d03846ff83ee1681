"""comprl_jax/envs/random_policy.py: the uniform-random floor (random_reference.py, the warm models' Room figures)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from comprl_jax.envs import random_policy, registry


def test_random_play_on_hidden_rule_wins_one_in_eight_and_stops_at_the_first_wrong_action():
    """HiddenRule with one attempt: 8 actions, one opens the lock, a wrong one ends the episode; 400 episodes of
    one instance win 1/8 of the time (|z| < 4), and the same generator state gives the same episodes."""
    env = registry.make("comprl/HiddenRule-v0", max_turns=5, **registry.run_kwargs("comprl/HiddenRule-v0", 3))
    try:
        wins = random_policy.play(env, 11, 400, 5, np.random.default_rng(0))
        again = random_policy.play(env, 11, 400, 5, np.random.default_rng(0))
    finally:
        env.close()
    p = float(np.mean(wins))
    assert len(wins) == 400 and wins == again
    assert abs(p - 1 / 8) / math.sqrt((1 / 8) * (7 / 8) / 400) < 4, p


def test_an_env_without_a_static_action_set_is_refused_by_name():
    class FreeText:  # the shape of an env whose actions are free text (WebShop, SWE)
        actions = None

    with pytest.raises(ValueError, match="FreeText has no static action set"):
        random_policy.play(FreeText(), 0, 1, 1, np.random.default_rng(0))
