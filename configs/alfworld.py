"""Single task: ALFWorld (TextWorld household tasks; 128 steps, 40 turns x 2,048 tokens, reward +1 / -1).

Resets are GIL-bound PDDL grounding: the env pool uses its process backend.
Launch: python launch/train.py --config=configs/alfworld.py --workdir=runs/alfworld
Tiny CPU variant: python launch/train.py --config=configs/alfworld.py:tiny --workdir=runs/alfworld_tiny
"""

from comprl_jax.config import build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = ("comprl/ALFWorld-v0",)
        c.env.max_turns = 40
        c.env.backend = "process"
        c.actor.sampling.max_new_tokens = 2048
        c.rollout.max_context = 16384
        c.train.steps = 128

    return build(arg, "alfworld", edit)
