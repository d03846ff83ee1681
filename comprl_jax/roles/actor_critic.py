"""Actor-Critic option (SPEC §7, paper App. B.1; off by default, ``actor.actor_critic``).

Before a guided episode uses its retrieved entry m, the actor judges m given its running success rate on the task:
``accept`` (s = 1, m is used as is), ``refine: <text>`` (s = 0.5, the actor's rewrite replaces m in the prompt) or
``reject`` (s = 0, the episode runs with no experience). The entry's extractor reward for that episode becomes
s + r(m) (:meth:`comprl_jax.experience.manager.ExperienceManager.record_outcome`'s ``bonus``). The judgement is one
batched actor generation per rollout wave (the paper: it blocks rollouts; retrieval 0.04 s -> 1.2 s). The judging
call is not part of the actor's RL batch (the paper trains the actor on the episodes only).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from comprl_jax.experience.retrieval import format_entry, format_experience
from comprl_jax.rl.advantages import CRITIC_SCORES

# What a tiny (constrained) actor may answer; real models are parsed with the same regex.
DECISION_REGEX = r"<answer>(accept|reject|refine: [a-z][a-z ,]{0,79})</answer>"
_DECISION_RE = re.compile(
    r"<answer>\s*(accept|reject|refine\s*:\s*(.+?))\s*</answer>", re.DOTALL | re.IGNORECASE
)
REFINED_TITLE = "refined by the actor"


def critic_prompt(goal: str, entry_text: str, success_rate: float | None) -> str:
    rate = "unknown (no episodes yet)" if success_rate is None else f"{success_rate:.2f}"
    return (
        "Before starting a task you are shown one lesson distilled from earlier episodes. Judge it for your own "
        f"situation.\nTask: {goal}\nYour success rate on this task so far: {rate}\n"
        f"Lesson: {format_entry(entry_text)}\n\n"
        "Answer with <answer>accept</answer> to use it as is, <answer>reject</answer> if it is wrong or useless "
        "for you, or <answer>refine: your improved lesson</answer> to rewrite it."
    )


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: str  # accept | refine | reject
    refined: str | None = None

    @property
    def score(self) -> float:
        """s of SPEC §7."""
        return CRITIC_SCORES[self.verdict]

    def experience(self, original_block: str) -> str:
        """The experience block the episode then sees."""
        if self.verdict == "accept":
            return original_block
        if self.verdict == "reject":
            return format_experience([])
        return format_experience([f"<title>{REFINED_TITLE}</title><content>{self.refined}</content>"])


def parse_decision(text: str) -> Decision:
    """The actor's judgement; anything unparsable counts as ``accept`` (the entry is used as retrieved)."""
    m = _DECISION_RE.search(text or "")
    if not m:
        return Decision("accept")
    word = m.group(1).strip().lower()
    if word.startswith("refine"):
        refined = " ".join(m.group(2).split())
        return Decision("refine", refined) if refined else Decision("accept")
    return Decision(word)


def judge(
    sampler, tokenizer, sp, key, items: Sequence[tuple[str, str, float | None]], constraint=None
) -> list[Decision]:
    """One batched actor call over ``(goal, entry text, success rate)`` triples."""
    if not items:
        return []
    prompts = [tokenizer.encode_user_prompt(critic_prompt(*item)) for item in items]
    res = sampler.generate(prompts, key, sp, stop_strings=("</answer>",), constraint=constraint)
    return [
        parse_decision(tokenizer.decode(res.tokens[b, : int(res.lengths[b])].tolist(), skip_special=True))
        for b in range(len(items))
    ]


def corpus_strings() -> list[str]:
    """The judgement prompt and answers (a tiny run's tokenizer is trained on them)."""
    lesson = "<title>move east</title><content>the stairs are often east</content>"
    return [
        critic_prompt("reach the stairs", lesson, 0.25),
        critic_prompt("reach the stairs", lesson, None),
        "<answer>accept</answer> <answer>reject</answer> <answer>refine: go east first</answer>",
        format_experience([f"<title>{REFINED_TITLE}</title><content>go east</content>"]),
    ]
