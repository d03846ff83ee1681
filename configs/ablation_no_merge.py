"""Ablation on MiniHack Room: no periodic merge (the paper reports it hurts).

Launch: python launch/train.py --config=configs/ablation_no_merge.py --workdir=runs/no_merge
Tiny CPU variant: python launch/train.py --config=configs/ablation_no_merge.py:tiny --workdir=runs/no_merge_tiny
"""

from comprl_jax.config import build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = ("comprl/MiniHack-Room-Ultimate-5x5-v0",)
        c.bank.merge = False

    return build(arg, "ablation_no_merge", edit)
