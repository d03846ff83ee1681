"""launch/bench/compare_warm.py: the pre-registered arms' configs, and exploratory overrides kept away from them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cw():
    spec = importlib.util.spec_from_file_location(
        "bench_compare_warm", os.path.join(REPO, "launch", "bench", "compare_warm.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arm_configs_are_the_pre_registered_ones_and_overrides_take_their_type(cw):
    c = cw.arm_config("main", "complementary", 2)
    assert (c.seed, c.train.steps, c.extractor.model) == (2, 30, "warm_extractor_early")
    assert c.extractor.lr == pytest.approx(3e-4)  # what `main` ran with, pinned
    assert cw.arm_config("v2", "complementary", 2).extractor.lr == pytest.approx(3e-5)  # the :warm scale's
    c = cw.arm_config("main", "complementary", 0, overrides=("extractor.lr=3e-5", "rollout.group_size=4"))
    assert c.extractor.lr == pytest.approx(3e-5) and isinstance(c.extractor.lr, float)
    assert c.rollout.group_size == 4 and isinstance(c.rollout.group_size, int)
    with pytest.raises(ValueError, match="key=value"):
        cw.arm_config("main", "complementary", 0, overrides=("extractor.lrr=1",))


def test_an_exploratory_run_needs_its_own_results_and_root():
    out = subprocess.run(
        [sys.executable, "launch/bench/compare_warm.py", "--set=extractor.lr=3e-5", "--arms=complementary"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "their own --results and --root" in out.stderr + out.stdout
