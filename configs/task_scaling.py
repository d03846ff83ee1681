"""Task scaling (paper: +6.6% with 3 tasks, +8.1% with 6): `tasks=1|3|6` picks the mixture.

Launch: python launch/train.py --config=configs/task_scaling.py:tasks=3 --workdir=runs/scale3
Tiny CPU variant: python launch/train.py --config=configs/task_scaling.py:tiny,tasks=3 --workdir=runs/scale3_tiny
"""

from comprl_jax.config import build

_MIXTURES = {
    "1": ("comprl/MiniHack-Room-Ultimate-5x5-v0",),
    "3": ("comprl/MiniHack-Room-Ultimate-5x5-v0", "comprl/WebShop-v0", "comprl/ALFWorld-v0"),
    "6": (
        "comprl/MiniHack-Room-Ultimate-5x5-v0",
        "comprl/WebShop-v0",
        "comprl/ALFWorld-v0",
        "comprl/MiniHack-MazeWalk-9x9-v0",
        "comprl/MiniHack-KeyRoom-Dark-S5-v0",
        "comprl/Sokoban-6x6-2-v0",
    ),
}


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        n = extras.get("tasks", "3")
        if n not in _MIXTURES:
            raise ValueError(f"config variant tasks={n!r}: choose one of {sorted(_MIXTURES)}")
        c.env.tasks = _MIXTURES[n]
        c.env.backend = "process" if n != "1" else "thread"
        c.train.steps = 128

    return build(arg, "task_scaling", edit)
