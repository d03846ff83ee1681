"""Multi-task, 6 tasks (task scaling, +8.1% in the paper): the 3 of Table 1 plus MiniHack Maze, MiniHack KeyRoom
and Sokoban.

Launch: python launch/train.py --config=configs/multitask6.py --workdir=runs/mt6
Tiny CPU variant: python launch/train.py --config=configs/multitask6.py:tiny --workdir=runs/mt6_tiny
"""

from comprl_jax.config import TASKS6, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = TASKS6
        c.env.backend = "process"
        c.rollout.tasks_per_step = 16
        c.rollout.max_context = 16384
        c.train.steps = 128

    return build(arg, "multitask6", edit)
