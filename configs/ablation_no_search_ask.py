"""Ablation on MiniHack Room: no search & ask tool (the paper reports it hurts).

Launch: python launch/train.py --config=configs/ablation_no_search_ask.py --workdir=runs/no_sa
Tiny CPU variant: python launch/train.py --config=configs/ablation_no_search_ask.py:tiny --workdir=runs/no_sa_tiny
"""

from comprl_jax.config import build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = ("comprl/MiniHack-Room-Ultimate-5x5-v0",)
        c.retrieval.search_and_ask = False

    return build(arg, "ablation_no_search_ask", edit)
