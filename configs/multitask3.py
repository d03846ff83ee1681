"""Multi-task, 3 tasks (paper Table 1): MiniHack Room + WebShop + ALFWorld, 128 rollouts per env per step, one
shared bank (experience transfers across tasks), 128 steps; each env at its own limits (ALFWorld 40 turns of 2,048
tokens in 16,384; WebShop 30 turns in 16,384; MiniHack 30 turns in 32,768): config.apply_tasks, the one mixture
definition task_scaling.py and extractor_capacity.py use too.

Launch: python launch/train.py --config=configs/multitask3.py --workdir=runs/mt3
Tiny CPU variant: python launch/train.py --config=configs/multitask3.py:tiny --workdir=runs/mt3_tiny
Optional: add `swe=1` to the variant (e.g. `:tiny,swe=1`) to train on SWE-Lite too (not in the paper's sets).
Table 1: python launch/make_tables.py --runs=runs/mt3,runs/mt3_baseline,...
"""

from comprl_jax.config import TASKS3, apply_tasks, build, with_optional_swe


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, with_optional_swe(TASKS3, extras))  # `swe=1`: + SWE-Lite

    c = build(arg, "multitask3", edit)
    return c
