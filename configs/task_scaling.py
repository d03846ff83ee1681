"""Task scaling (paper: +6.6% with 3 tasks, +8.1% with 6): `tasks=1|3|6` picks the mixture.

Launch: python launch/train.py --config=configs/task_scaling.py:tasks=3 --workdir=runs/scale3
Tiny CPU variant: python launch/train.py --config=configs/task_scaling.py:tiny,tasks=3 --workdir=runs/scale3_tiny
Optional: add `swe=1` to the variant (e.g. `:tiny,swe=1`) to train on SWE-Lite too (not in the paper's sets).
"""

from comprl_jax.config import TASKS1, TASKS3, TASKS6, apply_tasks, build, with_optional_swe

_MIXTURES = {"1": TASKS1, "3": TASKS3, "6": TASKS6}


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        n = extras.get("tasks", "3")
        if n not in _MIXTURES:
            raise ValueError(f"config variant tasks={n!r}: choose one of {sorted(_MIXTURES)}")
        apply_tasks(
            c, with_optional_swe(_MIXTURES[n], extras)
        )  # tasks=1 is MiniHack Room's single-task setting (145 steps)

    return build(arg, "task_scaling", edit)
