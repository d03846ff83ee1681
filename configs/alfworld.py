"""Single task: ALFWorld (TextWorld household tasks; 128 steps, 40 turns x 2,048 tokens, reward +1 / -1).

Resets are GIL-bound PDDL grounding: the env pool uses its process backend.
Launch: python launch/train.py --config=configs/alfworld.py --workdir=runs/alfworld
Tiny CPU variant: python launch/train.py --config=configs/alfworld.py:tiny --workdir=runs/alfworld_tiny
"""

from comprl_jax.config import apply_tasks, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, ("comprl/ALFWorld-v0",))  # 128 steps, its own limits, process backend

    return build(arg, "alfworld", edit)
