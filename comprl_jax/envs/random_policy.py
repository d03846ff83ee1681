"""The uniform-random policy: the floor an actor's success is read against (launch/bench/random_reference.py, the
warm models' Room-5x5 figures in launch/bench/warm_start.py)."""

from __future__ import annotations

import numpy as np


def play(env, seed: int, episodes: int, max_turns: int, rng: np.random.Generator) -> list[bool]:
    """``episodes`` episodes of the level ``seed`` of ``env`` (a registry env with a static ``actions`` set), each
    up to ``max_turns`` actions drawn uniformly from it; their binary successes."""
    if not getattr(env, "actions", None):
        raise ValueError(f"{type(env).__name__} has no static action set: a uniform-random policy needs one")
    out = []
    for _ in range(episodes):
        env.reset(seed=seed)
        success = False
        for _ in range(max_turns):
            action = str(rng.choice(env.actions))
            _, _, term, trunc, info = env.step(f"<answer>{action}</answer>")
            success = bool(info["success"])
            if term or trunc:
                break
        out.append(success)
    return out
