"""Multi-task, 6 tasks (task scaling, +8.1% in the paper): the 3 of Table 1 plus MiniHack Maze, MiniHack KeyRoom
and Sokoban.

Launch: python launch/train.py --config=configs/multitask6.py --workdir=runs/mt6
Tiny CPU variant: python launch/train.py --config=configs/multitask6.py:tiny --workdir=runs/mt6_tiny
"""

from comprl_jax.config import TASKS6, apply_tasks, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, TASKS6)  # the mixture setting of config.apply_tasks

    return build(arg, "multitask6", edit)
