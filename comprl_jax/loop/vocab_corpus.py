"""The text a tiny run's SentencePiece vocabulary is trained on (``models.zoo.tiny_tokenizer``).

Each module that writes prompt text lists its own strings (``corpus_strings()`` beside the templates it covers:
the rollout's turn and tool prompts, the extractor's ops, the experience block, the actor-critic's judgement);
this module only joins them with the envs' system prompts and a few real first observations.
"""

from __future__ import annotations

from comprl_jax.experience import ops, retrieval
from comprl_jax.roles import actor_critic
from comprl_jax.rollout import search_ask
from comprl_jax.rollout.pools import Pools


def tokenizer_corpus(pools: Pools, ask_max: int, seeds: int = 3) -> list[str]:
    """System prompts, the first observation and goal of ``seeds`` resets per env, and every module's template
    strings (``ask_max``: the search & ask budget the tool prompt states)."""
    text = list(pools.system_prompts.values())
    for pool in pools.pools.values():
        for seed in range(seeds):
            obs, info = pool.submit_reset(0, seed).result()
            text.append(f"Observation: {obs}")
            text.append(str(info.get("goal", "")))
    return (
        text
        + ops.corpus_strings()
        + search_ask.corpus_strings(ask_max)
        + retrieval.corpus_strings()
        + actor_critic.corpus_strings()
    )


def action_words(pools: Pools) -> list[str]:
    """The static action names of the run's envs (MiniHack, Sokoban), in order, each once: a tiny vocabulary
    holds each as one token (``models.zoo.tiny_tokenizer``)."""
    words = [a for actions, _ in pools.action_spaces.values() for a in (actions or ())]
    return list(dict.fromkeys(words))
