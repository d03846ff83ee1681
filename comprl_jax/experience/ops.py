"""Extractor I/O: prompt builders (distill, merge, search-and-ask) and the strict op parser (SPEC §4).

The extractor answers with optional ``<think>…</think>`` reasoning, then ``<answer>[…]</answer>`` holding a JSON list of
operations on the bank::

    {"function_name": "add", "parameters": {"new_memory": "<title>…</title><content>…</content>"}}
    {"function_name": "update", "parameters": {"target_idx": [1, 2], "new_memory": "…"}}
    {"function_name": "return"}

Model output is untrusted: it is parsed with ``json`` and regexes only. Every op is validated on its own and an invalid
op is dropped with a counted reason; a valid op is never applied half-way (an update with one bad target is dropped
whole). The caller applies the surviving ops atomically under the bank's writer lock.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from collections.abc import Sequence

MEMORY_RE = re.compile(r"^\s*<title>(.+?)</title>\s*<content>(.+?)</content>\s*$", re.DOTALL)
_ANSWER_RE = re.compile(r"\s*<answer>(.*)</answer>\s*$", re.DOTALL)  # used with match(text, pos)
_THINK_END = "</think>"
FUNCTIONS = ("add", "update", "return")

# Reasons an op (or a whole output) is skipped; counted by the caller.
REASONS = (
    "unparsable",  # no <answer>…</answer>, or not valid JSON
    "not_a_list",  # answer JSON is not a list
    "not_an_object",  # an op is not a JSON object
    "unknown_function",
    "bad_params",  # missing/extra/mistyped parameters
    "target_out_of_range",
    "duplicate_target",  # a target index used twice in the same output
    "oversized",
    "bad_format",  # new_memory is not <title>…</title><content>…</content>
    "stale_target",  # target removed concurrently before the op was applied (set by the bank)
    "duplicate",  # cosine dedup (set by the bank)
)


@dataclasses.dataclass(frozen=True)
class Op:
    """One validated extractor operation. ``targets`` are 0-based positions into the lessons shown."""

    function: str
    new_memory: str | None = None
    targets: tuple[int, ...] = ()


@dataclasses.dataclass
class ParseResult:
    ops: list[Op]
    rejected: collections.Counter
    think: str | None = None
    num_returns: int = 0
    num_items: int = 1  # ops in the output (1 for an unparsable output): = len(ops) + num_returns + rejected


def format_lessons(lessons: Sequence[str]) -> str:
    if not lessons:
        return "(none)"
    return "\n".join(f"[{i}] {text}" for i, text in enumerate(lessons, start=1))


_OP_FORMAT = (
    "Answer with optional reasoning in <think>...</think>, then <answer> followed by a JSON list of operations and "
    "</answer>. Operations:\n"
    '  {"function_name": "add", "parameters": {"new_memory": "<title>...</title><content>...</content>"}}\n'
    '  {"function_name": "update", "parameters": {"target_idx": [1, 2], "new_memory": "<title>...</title>'
    '<content>...</content>"}}  (replaces the listed previous lessons, numbered from 1, by one new lesson)\n'
    '  {"function_name": "return"}  (nothing worth keeping)\n'
)


def distill_prompt(goal: str, success: bool, trajectory: str, previous: Sequence[str], max_chars: int) -> str:
    """Prompt asking the extractor to distil one finished episode into bank operations.

    Args:
      goal: the task description.
      success: the episode outcome.
      trajectory: the episode rendered as text (observations, actions).
      previous: texts of related lessons already in the bank, shown numbered from 1 (update targets refer to them).
      max_chars: size limit of one lesson, stated to the model and enforced by the parser.
    """
    outcome = "SUCCESS" if success else "FAILURE"
    return (
        "You distil reusable lessons from an agent's episode into a shared experience bank.\n"
        f"Goal: {goal}\nOutcome: {outcome}\n\nTrajectory:\n{trajectory}\n\n"
        f"Previous lessons:\n{format_lessons(previous)}\n\n"
        "Write short, general, actionable lessons that would help the agent on similar tasks; update previous "
        f"lessons that this episode corrects or refines. Each lesson is at most {max_chars} characters.\n"
        + _OP_FORMAT
    )


def merge_prompt(chunk: Sequence[str], max_chars: int) -> str:
    """Prompt asking the extractor to merge a chunk of lessons (SPEC §4 periodic merge).

    The answer's ``add``/``update`` items become the merged lessons that replace the whole chunk; ``return`` keeps
    the chunk unchanged.
    """
    return (
        "You maintain an experience bank. Merge the lessons below: combine duplicates, drop contradicted or useless "
        "advice, keep every distinct useful insight. Emit one add operation per merged lesson (they replace all the "
        'lessons shown), or [{"function_name": "return"}] to keep them as they are. '
        f"Each lesson is at most {max_chars} characters.\n\nPrevious lessons:\n{format_lessons(chunk)}\n\n"
        + _OP_FORMAT
    )


def refine_prompt(question: str, situation: str, hits: Sequence[str]) -> str:
    """Search-and-ask prompt: rewrite the retrieved lessons into an answer for the actor's current situation."""
    return (
        "An agent asked the experience bank a question in the middle of an episode.\n"
        f"Question: {question}\n\nCurrent situation:\n{situation}\n\n"
        f"Retrieved lessons:\n{format_lessons(hits)}\n\n"
        "Rewrite what is relevant into a short, concrete answer for this situation. Reason in <think>...</think> "
        "if needed, then give the answer inside <answer>...</answer>."
    )


def _split_answer(text: str) -> tuple[re.Match | None, str | None]:
    """Finds the answer block: the text after the first ``</think>`` that leaves exactly ``<answer>…</answer>``.

    Trying each ``</think>`` in order (rather than only the last) keeps a literal "</think>" inside the answer JSON
    from hiding the answer. Thinking models often get "<think>" from the chat template, so only the closing tag is
    required.
    """
    cuts, pos = [0], text.find(_THINK_END)
    while pos >= 0 and len(cuts) <= 4:  # bounded: each try is a linear regex scan of untrusted text
        cuts.append(pos + len(_THINK_END))
        pos = text.find(_THINK_END, pos + 1)
    for cut in cuts:
        m = _ANSWER_RE.match(text, cut)
        if m:
            think = text[: cut - len(_THINK_END)] if cut else None
            if think is not None and "<think>" in think:
                think = think[think.find("<think>") + 7 :]
            return m, think
    return None, None


def parse_refine(text: str) -> str | None:
    """The refined answer of a search-and-ask call, or None when the output has no ``<answer>…</answer>``."""
    m, _ = _split_answer(text or "")
    if not m or not m.group(1).strip():
        return None
    return m.group(1).strip()


def check_memory(text, max_chars: int) -> str | None:
    """Returns the rejection reason for a lesson text, or None if it is valid."""
    if not isinstance(text, str):
        return "bad_params"
    if len(text) > max_chars:
        return "oversized"
    if not MEMORY_RE.match(text):
        return "bad_format"
    return None


def parse_ops(text: str, num_previous: int, max_chars: int) -> ParseResult:
    """Strictly parses an extractor output into validated ops.

    Args:
      text: raw model output (untrusted).
      num_previous: how many previous lessons were shown (valid 1-based targets are 1..num_previous).
      max_chars: maximum length of a lesson.

    Returns:
      ParseResult with the valid ops in order (targets converted to 0-based) and a Counter of rejection reasons.
      Never raises on any string input.
    """
    rejected: collections.Counter = collections.Counter()
    if not isinstance(text, str):
        rejected["unparsable"] += 1
        return ParseResult([], rejected)
    m, think = _split_answer(text)
    if not m:
        rejected["unparsable"] += 1
        return ParseResult([], rejected, think)
    try:
        payload = json.loads(m.group(1))
    except (ValueError, RecursionError):
        rejected["unparsable"] += 1
        return ParseResult([], rejected, think)
    if not isinstance(payload, list):
        rejected["not_a_list"] += 1
        return ParseResult([], rejected, think)
    if not payload:  # an empty list is a valid "nothing to do"
        return ParseResult([], rejected, think, 0, 0)
    ops: list[Op] = []
    used: set[int] = set()
    returns = 0
    for raw in payload:
        op, reason = _parse_one(raw, num_previous, max_chars, used)
        if reason is not None:
            rejected[reason] += 1
        elif op.function == "return":
            returns += 1
        else:
            used.update(op.targets)
            ops.append(op)
    return ParseResult(ops, rejected, think, returns, len(payload))


def _parse_one(raw, num_previous: int, max_chars: int, used: set[int]) -> tuple[Op | None, str | None]:
    if not isinstance(raw, dict):
        return None, "not_an_object"
    fn = raw.get("function_name")
    if not isinstance(fn, str) or fn not in FUNCTIONS:
        return None, "unknown_function"
    if set(raw) - {"function_name", "parameters"}:
        return None, "bad_params"
    params = raw.get("parameters", {})
    if not isinstance(params, dict):
        return None, "bad_params"
    if fn == "return":
        return (Op("return"), None) if not params else (None, "bad_params")
    expected = {"new_memory"} if fn == "add" else {"new_memory", "target_idx"}
    if set(params) != expected:
        return None, "bad_params"
    reason = check_memory(params["new_memory"], max_chars)
    if reason is not None:
        return None, reason
    if fn == "add":
        return Op("add", params["new_memory"]), None
    idx = params["target_idx"]
    if (
        not isinstance(idx, list)
        or not idx
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in idx)
    ):
        return None, "bad_params"
    if not all(1 <= i <= num_previous for i in idx):
        return None, "target_out_of_range"
    targets = tuple(i - 1 for i in idx)
    if len(set(targets)) != len(targets) or used.intersection(targets):
        return None, "duplicate_target"
    return Op("update", params["new_memory"], targets), None


def corpus_strings() -> list[str]:
    """Text of every extractor prompt template and the op format: a tiny run's tokenizer is trained on it."""
    lesson = "<title>move east</title><content>the stairs are often east</content>"
    return [
        distill_prompt("goal", True, "Observation: x\nAction: y", [lesson], 10),
        distill_prompt("goal", False, "Observation: x\nAction: y", [], 10),
        merge_prompt([lesson, lesson], 10),
        refine_prompt("where are the stairs", "Observation: x", [lesson]),
        '[{"function_name": "add", "parameters": {"new_memory": "',
        '{"function_name": "update", "parameters": {"target_idx": [1], "new_memory": "',
        '{"function_name": "return"}',
    ]
