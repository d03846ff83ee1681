"""Extractor capacity (paper: Qwen3-30B-A3B extractor, +5% average) on the 3-task mixture.

The MoE extractor needs an MoE decoder, which comprl_jax does not implement yet: at paper scale this config
names the model and fails at model load with a message saying so. `:tiny` compares two tiny dense extractor
sizes instead (`size=small|large`).
Launch: python launch/train.py --config=configs/extractor_capacity.py --workdir=runs/cap
Tiny CPU variant: python launch/train.py --config=configs/extractor_capacity.py:tiny,size=large --workdir=runs/cap_tiny
"""

from comprl_jax.config import TASKS3, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = TASKS3
        c.env.backend = "process"
        c.extractor.model = "Qwen/Qwen3-30B-A3B-Thinking-2507"
        c.train.steps = 128

    return build(arg, "extractor_capacity", edit)
