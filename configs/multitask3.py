"""Multi-task, 3 tasks (paper Table 1): MiniHack Room + WebShop + ALFWorld, 128 tasks per env per step,
one bank partition per task, 128 steps.

Launch: python launch/train.py --config=configs/multitask3.py --workdir=runs/mt3
Tiny CPU variant: python launch/train.py --config=configs/multitask3.py:tiny --workdir=runs/mt3_tiny
Table 1: python launch/make_tables.py --runs=runs/mt3,runs/mt3_baseline,...
"""

from comprl_jax.config import TASKS3, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = TASKS3
        c.env.backend = "process"
        c.rollout.tasks_per_step = 16  # x K=8 = 128 rollouts per task
        c.rollout.max_context = 16384
        c.train.steps = 128

    c = build(arg, "multitask3", edit)
    return c
