"""Multi-task, 6 tasks (task scaling, +8.1% in the paper): the 3 of Table 1 plus MiniHack Maze, MiniHack KeyRoom
and Sokoban.

Launch: python launch/train.py --config=configs/multitask6.py --workdir=runs/mt6
Tiny CPU variant: python launch/train.py --config=configs/multitask6.py:tiny --workdir=runs/mt6_tiny
Optional: add `swe=1` to the variant (e.g. `:tiny,swe=1`) to train on SWE-Lite too (not in the paper's sets).
"""

from comprl_jax.config import TASKS6, apply_tasks, build, with_optional_swe


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, with_optional_swe(TASKS6, extras))  # the mixture setting; `swe=1`: + SWE-Lite

    return build(arg, "multitask6", edit)
