"""HiddenRule (issue 31): rules fixed by the run's seed, disjoint training and held-out instances, and the two
reference successes (uniform random, knows the rules) measured by play against their exact values."""

import math

import numpy as np
import pytest

from comprl_jax.envs import hidden_rule as hr
from comprl_jax.envs import make, registry
from comprl_jax.rollout.pools import Pools
from comprl_jax.rollout.tasks import TaskSampler


def _play(env, seed, policy):
    obs, info = env.reset(seed=seed)
    done = False
    while not done:
        obs, reward, term, trunc, info2 = env.step(f"<answer>{policy(info)}</answer>")
        done = term or trunc
    return info2["success"], reward


def test_rules_are_drawn_from_the_run_seed_and_fixed_for_it():
    a, b, c = hr.rules(0), hr.rules(0), hr.rules(1)
    assert a == b and a != c
    assert list(a) == list(hr.FAMILIES) and len(a) == 16
    assert all(len(code) == 1 and code[0] in hr.ACTIONS for code in a.values())
    # rule seed 0 uses several different actions (a rule set that is one verb for all would teach nothing)
    assert len({code for code in a.values()}) >= 4
    two = hr.rules(3, families=5, code_len=2)
    assert list(two) == list(hr.FAMILIES[:5]) and all(len(c) == 2 for c in two.values())
    # the run's seed reaches the env through the registry and the pools (the trainer passes config.seed)
    assert registry.run_kwargs("comprl/HiddenRule-v0", 7) == {"rule_seed": 7}
    assert registry.run_kwargs("comprl/Sokoban-6x6-2-v0", 7) == {}
    pools = Pools(["comprl/HiddenRule-v0"], 2, 1, "thread", 4, 30.0, run_seed=7)
    try:
        obs, info = pools.pools["comprl/HiddenRule-v0"].submit_reset(0, 11).result()
        family = info["family"]
        right = hr.rules(7)[family][0]
        *_, info2 = pools.pools["comprl/HiddenRule-v0"].submit_step(0, f"<answer>{right}</answer>").result()
        assert info2["success"]
    finally:
        pools.close()


def test_training_and_held_out_instances_are_disjoint_names_in_the_same_families():
    sampler = TaskSampler(("comprl/HiddenRule-v0",), 64, 0)
    train = [hr.instance(t.seed) for _ in range(40) for t in sampler.next()]
    held = [hr.instance(t.seed) for t in sampler.eval_tasks(2000)]
    assert {n for _, n in train} <= set(hr.TRAIN_NAMES) and {n for _, n in held} <= set(hr.EVAL_NAMES)
    assert not set(hr.TRAIN_NAMES) & set(hr.EVAL_NAMES)
    assert {f for f, _ in train} == {f for f, _ in held} == set(hr.FAMILIES)
    assert not {x for x in train} & {x for x in held}


def test_the_goal_names_the_family_and_the_observation_never_shows_the_rule():
    env = make("comprl/HiddenRule-v0", rule_seed=0)
    for seed in range(50):
        obs, info = env.reset(seed=seed)
        assert info["family"] in info["goal"] and info["query"] == info["goal"]
        assert not any(a in obs.split() for a in hr.ACTIONS)
    prompt = env.system_prompt()
    for word in hr.ACTIONS + hr.COLOURS + hr.KINDS:  # a tiny vocabulary is trained on this text
        assert word in prompt


@pytest.mark.parametrize("code_len,attempts", [(1, 1), (1, 3), (2, 1)])
def test_random_and_rule_knowing_success_match_their_exact_values(code_len, attempts):
    env = make("comprl/HiddenRule-v0", rule_seed=5, code_len=code_len, attempts=attempts, max_turns=30)
    want = hr.success_rates(code_len, attempts)
    rng = np.random.default_rng(0)
    n = 4000
    wins = sum(_play(env, s, lambda info: rng.choice(hr.ACTIONS))[0] for s in range(n))
    p = want["uniform_random"]
    assert abs(wins / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (wins / n, p)

    def knows(info):  # the next action of the family's code in the current try
        return env.rule(info["family"])[env._progress]

    for seed in range(200):
        ok, reward = _play(env, seed, knows)
        assert ok and reward == 1.0


def test_wrong_actions_spend_attempts_and_invalid_ones_only_a_turn():
    env = make("comprl/HiddenRule-v0", rule_seed=0, attempts=2, max_turns=10)
    obs, info = env.reset(seed=3)
    right = env.rule(info["family"])[0]
    wrong = next(a for a in hr.ACTIONS if a != right)
    obs, r, term, trunc, i = env.step("<answer>dance</answer>")
    assert i["invalid_action"] and not term and "Invalid action" in obs
    obs, r, term, trunc, i = env.step(f"<answer>{wrong}</answer>")
    assert not term and r == 0.0 and "Nothing happens" in obs
    obs, r, term, trunc, i = env.step(f"<answer>{wrong}</answer>")
    assert term and not i["success"] and "jams" in obs
    obs, info = env.reset(seed=3)
    obs, r, term, trunc, i = env.step(f"<answer>{right}</answer>")
    assert term and i["success"] and r == 1.0 and "opens" in obs


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="families"):
        make("comprl/HiddenRule-v0", families=17)
    with pytest.raises(ValueError, match="code_len and attempts"):
        make("comprl/HiddenRule-v0", attempts=0)
