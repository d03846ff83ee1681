"""Each study's arms differ only in what the study varies (issue 28.1): the resolved configs are diffed key by key.

One task setting (``config.apply_tasks``) serves the single-task runs, Table 1, task scaling and the capacity study;
each env keeps its own limits (``envs.registry.Limits``) under the mixture's caps. WORKSPACE "Study configs" prints
these diffs.
"""

from __future__ import annotations

import pytest

from comprl_jax import config as config_lib
from comprl_jax.envs import registry
from launch.common import config_diff, config_tree

FLAG_KEYS = {k for flags in config_lib.METHOD_FLAGS.values() for k in flags} | {"method"}


def _diff(a: str, b: str) -> dict[str, tuple]:
    ca, cb = (config_tree(config_lib.load_file(f"configs/{x}")) for x in (a, b))
    return {k: (va, vb) for k, va, vb in config_diff(ca, cb)}


# (arm a, arm b, the keys allowed -- and required -- to differ)
PAIRS = [
    # Task scaling: the mixture only (tasks=1 is MiniHack Room's own single-task run: its steps, turns, backend).
    ("task_scaling.py:tasks=3", "multitask3.py", {"experiment"}),
    ("task_scaling.py:tasks=6", "multitask6.py", {"experiment"}),
    ("task_scaling.py:tasks=1", "minihack_room.py", {"experiment"}),
    ("task_scaling.py:tasks=3", "task_scaling.py:tasks=6", {"env.tasks"}),
    (
        "task_scaling.py:tasks=1",
        "task_scaling.py:tasks=3",
        {"env.tasks", "env.max_turns", "env.backend", "train.steps"},
    ),
    # Capacity: the extractor only.
    ("multitask3.py", "extractor_capacity.py", {"experiment", "extractor.model"}),
    ("multitask3.py:tiny", "extractor_capacity.py:tiny", {"experiment", "extractor.model"}),
    ("task_scaling.py:tiny,tasks=3", "task_scaling.py:tiny,tasks=6", {"env.tasks"}),
]


@pytest.mark.parametrize("a,b,allowed", PAIRS)
def test_study_arms_differ_only_in_what_the_study_varies(a, b, allowed):
    assert set(_diff(a, b)) == allowed, _diff(a, b)


@pytest.mark.parametrize("method", ["baseline", "static_online", "exp_only", "offline", "blank_exp"])
def test_table1_arms_differ_only_in_method_flags(method):
    d = _diff("multitask3.py", f"multitask3.py:{method}")
    assert "method" in d and set(d) <= FLAG_KEYS, d


def test_each_env_keeps_its_own_limits_in_the_mixture():
    """Table 1's mixture is sized for its widest env (MiniHack's 32,768 context, ALFWorld's 40 turns); ALFWorld
    still plays 2,048-token turns in 16,384 and WebShop 30 turns in 16,384 (SPEC §9)."""
    c = config_lib.load_file("configs/multitask3.py")
    assert (c.env.max_turns, c.actor.sampling.max_new_tokens, c.rollout.max_context) == (40, 4096, 32768)
    got = {
        e: registry.capped(e, c.env.max_turns, c.actor.sampling.max_new_tokens, c.rollout.max_context)
        for e in c.env.tasks
    }
    assert got == {
        "comprl/MiniHack-Room-Ultimate-5x5-v0": registry.Limits(30, 4096, 32768),
        "comprl/WebShop-v0": registry.Limits(30, 4096, 16384),
        "comprl/ALFWorld-v0": registry.Limits(40, 2048, 16384),
    }
    tiny = config_lib.load_file("configs/multitask3.py:tiny")  # the scale caps every env
    lim = registry.capped("comprl/ALFWorld-v0", tiny.env.max_turns, tiny.actor.sampling.max_new_tokens, 2048)
    assert lim.max_turns == 10 and lim.context == 2048
    steps = {
        f: config_lib.load_file(f"configs/{f}.py").train.steps
        for f in ("minihack_room", "webshop", "alfworld")
    }
    assert steps == {"minihack_room": 145, "webshop": 256, "alfworld": 128}


def test_swe_lite_is_an_optional_task_of_the_mixtures():
    """Issue 32: `swe=1` adds SWE-Lite to a mixture; the paper's sets stay as they are without it."""
    from comprl_jax.config import TASKS3, TASKS6, load_file

    for name, tasks in (("multitask3", TASKS3), ("multitask6", TASKS6), ("task_scaling", TASKS3)):
        plain = load_file(f"configs/{name}.py:tiny")
        swe = load_file(f"configs/{name}.py:tiny,swe=1")
        assert plain.env.tasks == tasks and swe.env.tasks == (*tasks, "comprl/SWE-Lite-v0")
        assert swe.env.backend == "process"  # a mixture
    with pytest.raises(ValueError, match="swe='yes'"):
        load_file("configs/multitask3.py:tiny,swe=yes")
