"""Search & ask (SPEC §5) as both engines play it, written once.

An episode that may ask (``EpisodeSpec.can_ask``; at most ``max_calls`` questions) replies
``<knowledge_search_and_ask>question</knowledge_search_and_ask>`` without an ``<answer>``; instead of an env step the
question goes to the extractor (``ask``: one batched call for every question of a round / chunk) and its answer
comes back as a tool message, the episode's next input. The tool turn does not use up an action. The engines
differ only in *when* they call ``ask`` (lock-step: at once, between a round's generation and its env steps;
continuous: on an ask thread while the other slots decode); what a reply means and what an answer does to the
episode are here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from comprl_jax.rollout.episodes import Episode, next_input

ASK_OPEN = "<knowledge_search_and_ask>"
ASK_CLOSE = "</knowledge_search_and_ask>"
ASK_RE = re.compile(r"<knowledge_search_and_ask>(.*?)</knowledge_search_and_ask>", re.DOTALL)
ANSWER_OPEN = "<answer>"
# What the constraint automaton lets a tiny model ask (search & ask): a short lowercase question.
ASK_QUERY_REGEX = r"[a-z][a-z ]{0,23}"

# ``[(question, situation, env_id)] -> [(answer | None, extractor sample key | None)]``
AskFn = Callable[[list[tuple[str, str, str]]], list[tuple[str | None, Any]]]


def search_ask_prompt(max_calls: int) -> str:
    """The tool description added to the system message of episodes that may use search & ask (SPEC §5)."""
    return (
        "Tool: you may ask the experience bank a question instead of acting, by replying with "
        f"{ASK_OPEN}your question{ASK_CLOSE} (no <answer>). The answer comes back as a tool message and does not "
        f"use up an action. At most {max_calls} questions per episode."
    )


def ask_situation(e: Episode) -> str:
    """What search & ask's refinement call sees of the asking episode: its goal (ALFWorld's and WebShop's goal is
    only in the first observation) and the current observation."""
    goal = str(e.info0.get("goal", "")).strip()
    return f"Goal: {goal}\nCurrent observation: {e.obs}" if goal else e.obs


@dataclasses.dataclass(frozen=True)
class SearchAsk:
    """The tool as one rollout offers it: ``ask`` answers a batch of questions (None: the tool is off, and every
    method here says so), ``max_calls`` questions per episode at most."""

    ask: AskFn | None = None
    max_calls: int = 2

    @property
    def enabled(self) -> bool:
        return self.ask is not None

    @property
    def tool_text(self) -> str:
        """The system message's tool description ("" when off)."""
        return search_ask_prompt(self.max_calls) if self.enabled else ""

    @property
    def extra_turns(self) -> int:
        """Replies an episode may spend on questions beyond its env actions."""
        return self.max_calls if self.enabled else 0

    def stop_strings(self, base: Sequence[str]) -> tuple[str, ...]:
        """A reply also ends at the tool's closing tag."""
        return tuple(base) + ((ASK_CLOSE,) if self.enabled else ())

    def may_ask(self, e: Episode) -> bool:
        """The episode may still ask (its constraint then also allows the tool tag)."""
        return self.enabled and e.spec.can_ask and len(e.asked) < self.max_calls

    def question(self, e: Episode, reply: str) -> str | None:
        """The question ``reply`` asks, or None when it is an action (or the episode may not ask)."""
        if not self.may_ask(e):
            return None
        q = ASK_RE.search(reply)
        return q.group(1).strip() if q and ANSWER_OPEN not in reply else None

    @staticmethod
    def items(questions: Sequence[tuple[Episode, str]]) -> list[tuple[str, str, str]]:
        """``ask``'s input for ``[(episode, question)]``: ``[(question, situation, env_id)]`` (read from the episodes
        now, on the engine's thread)."""
        return [(q, ask_situation(e), e.spec.task.env_id) for e, q in questions]

    def call(self, questions: Sequence[tuple[Episode, str]]) -> list[tuple[str | None, Any]]:
        """One batched call of ``ask`` for ``[(episode, question)]``: ``[(answer | None, sample key | None)]``."""
        return self.ask(self.items(questions))

    @staticmethod
    def answer(
        e: Episode,
        reply: str,
        answer: str | None,
        sample_key,
        ids: list[int],
        reply_len: int,
        tokenizer,
        im_end: int | None,
    ) -> None:
        """One tool turn: ``reply`` (its ``reply_len`` sampled ids end ``ids``, the context so far) asked a question;
        ``answer`` (None: unparsable) comes back as a tool message, the next input. The exchange's token span is
        recorded for self-distillation's stripping (SPEC §7)."""
        text = answer if answer is not None else "[No answer]"
        e.asked.append(sample_key)
        e.record(reply)
        e.transcript.append((f"[search & ask answer] {text}", ""))  # reply: the next turn's
        e.pending = next_input(ids, {"role": "tool", "content": text}, tokenizer, im_end)
        e.ask_spans.append((len(ids) - reply_len, len(ids) + len(e.pending)))


NO_SEARCH_ASK = SearchAsk()


def corpus_strings(ask_max: int = 2) -> list[str]:
    """Strings of the actor's prompts built by the engines (a tiny run's tokenizer is trained on them)."""
    return [
        "Observation: ",
        search_ask_prompt(ask_max),
        f"{ASK_OPEN}where are the stairs{ASK_CLOSE}",
        "[search & ask answer] [No answer]",
    ]
