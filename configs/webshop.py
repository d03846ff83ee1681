"""Single task: WebShop on the 1,000-product catalogue (256 steps; actor max sequence 16,384).

Launch: python launch/train.py --config=configs/webshop.py --workdir=runs/webshop
Tiny CPU variant: python launch/train.py --config=configs/webshop.py:tiny --workdir=runs/webshop_tiny
"""

from comprl_jax.config import build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = ("comprl/WebShop-v0",)
        c.env.max_turns = 30
        c.rollout.max_context = 16384
        c.train.steps = 256

    return build(arg, "webshop", edit)
