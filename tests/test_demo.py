"""`make demo` (launch/demo.py): its closing sentence is computed from its numbers, and it is sized as it says."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("launch_demo", "launch/demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["launch_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_closing_sentence_is_computed_from_the_numbers(demo):
    s = demo.verdict(0.9, 64, 0.2, 64)
    # se = sqrt(.9 * .1 / 64 + .2 * .8 / 64) = sqrt(0.00140625 + 0.0025) = 0.0625; z = 0.7 / 0.0625 = 11.2
    assert "0.900 +- 0.037 of 64" in s and "0.200 +- 0.050 of 64" in s
    assert "+0.700 +- 0.062 (z = 11.2)" in s and s.endswith("experience helped.")
    assert demo.verdict(0.25, 64, 0.2, 64).endswith("no clear difference either way.")  # z = 0.68
    assert demo.verdict(0.1, 64, 0.5, 64).endswith("experience hurt.")
    d = 0.3 - 0.1
    se = math.sqrt(0.3 * 0.7 / 100 + 0.1 * 0.9 / 80)
    assert f"(z = {d / se:.1f})" in demo.verdict(0.3, 100, 0.1, 80)


def test_the_demo_trains_hidden_rule_with_the_warm_models_and_evaluates_64_episodes_per_mode(demo):
    c = demo.demo_config(12)
    assert c.env.tasks == ("comprl/HiddenRule-v0",)
    assert (c.actor.model, c.extractor.model, c.method) == ("warm_actor", "warm_extractor", "complementary")
    assert c.train.eval_tasks * (c.rollout.group_size // 2) == 64
    room = demo.demo_config(9, room=True)
    assert room.env.tasks == ("comprl/MiniHack-Room-5x5-v0",) and room.actor.model == "tiny"
