"""Single task: WebShop on the 1,000-product catalogue (256 steps; actor max sequence 16,384).

Launch: python launch/train.py --config=configs/webshop.py --workdir=runs/webshop
Tiny CPU variant: python launch/train.py --config=configs/webshop.py:tiny --workdir=runs/webshop_tiny
"""

from comprl_jax.config import apply_tasks, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, ("comprl/WebShop-v0",))  # 256 steps, 30 turns, 16,384 context

    return build(arg, "webshop", edit)
