"""Qwen-style ChatML rendering as a list of parts, so ids and the assistant mask come out together.

Format (Qwen2.5's ``chat_template``, without the ``tools=`` schema block):

    <|im_start|>{role}\n{content}<|im_end|>\n            system / user / assistant
    <|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n     role "tool"

Tool results: we follow Qwen2.5 and render ``{"role": "tool"}`` messages as a *user* turn wrapping each result in
``<tool_response>`` tags; consecutive tool messages share one user turn (one ``<tool_response>`` block each).
Assistant ``tool_calls`` (``[{"name": ..., "arguments": {...}}]`` or OpenAI's ``{"function": {...}}``) are rendered as
Qwen's ``<tool_call>`` JSON blocks inside the assistant turn.

Mask convention: 1 exactly on what the assistant generates after the generation prompt ``<|im_start|>assistant\n``:
its content (and tool calls) plus the closing ``<|im_end|>``; 0 on the header and on the ``\n`` after ``<|im_end|>``
(the sampler stops at ``<|im_end|>``, so that newline is context, not a generated token).

Token boundaries: text between two special tokens is encoded as one string, except that an assistant turn's header
``assistant\n`` and its generated text are encoded separately. This is exactly what token-in/token-out sampling
produces, and equals encoding the whole rendered string unless the assistant content itself starts with a
newline (which byte-level BPE would merge with the header's newline).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NamedTuple

ROLES = ("system", "user", "assistant", "tool")


class Part(NamedTuple):
    """One rendered piece: a special token (``special=True``, ``text`` is its string) or a text run."""

    text: str
    special: bool
    assistant: bool  # 1 in the assistant mask


def _check(messages: Sequence[dict]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"messages[{i}]: role must be one of {ROLES}, got {got!r}")
        content = m.get("content", "")
        if content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}] ({m['role']}): content must be a str, got {type(content).__name__}"
            )
        if m.get("tool_calls") and m["role"] != "assistant":
            raise ValueError(
                f"messages[{i}]: only assistant messages may have tool_calls (role {m['role']!r})"
            )


def _tool_calls_text(calls: Sequence[dict]) -> str:
    out = []
    for call in calls:
        fn = call.get("function", call)
        # json.dumps(ensure_ascii=False) is what transformers' ``tojson`` filter does.
        args = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
        out.append(
            '\n<tool_call>\n{"name": "' + str(fn["name"]) + '", "arguments": ' + args + "}\n</tool_call>"
        )
    return "".join(out)


def render_parts(
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = False,
    default_system: str | None = None,
    after_assistant: bool = False,
    generation_prefix: str = "",
) -> list[Part]:
    """Render messages to parts.

    Args:
      messages: ``[{"role": ..., "content": ...}, ...]``.
      add_generation_prompt: end with ``<|im_start|>assistant\n``.
      default_system: system prompt inserted when the first message is not a system message (Qwen2.5 inserts
        "You are Qwen, ..."; None inserts nothing, as Qwen3 does).
      after_assistant: continuation mode: the parts follow a live context whose last token is an assistant's
        ``<|im_end|>``; so they start with the ``\n`` that closes that turn, and no default system is inserted.
      generation_prefix: text the template puts after the generation prompt's header, as part of the prompt
        (Qwen3 thinking models: ``"<think>\n"``); mask 0.

    Returns:
      The parts in order.
    """
    _check(messages)
    S, E = "<|im_start|>", "<|im_end|>"
    parts: list[Part] = []

    def text(t: str, assistant: bool = False) -> None:
        if t:
            parts.append(Part(t, False, assistant))

    def special(t: str, assistant: bool = False) -> None:
        parts.append(Part(t, True, assistant))

    if after_assistant:
        text("\n")
    elif default_system is not None and (not messages or messages[0]["role"] != "system"):
        special(S), text("system\n" + default_system), special(E), text("\n")
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                special(S), text("user")
            text("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                special(E), text("\n")
        elif role == "assistant":
            special(S), text("assistant\n")
            body = content + _tool_calls_text(m["tool_calls"]) if m.get("tool_calls") else content
            if m.get("tool_calls") and not content:
                # Qwen renders "assistant" + "\n<tool_call>...": our header already holds that "\n".
                body = body[1:]
            text(body, assistant=True)
            special(E, assistant=True), text("\n")
        else:
            special(S), text(role + "\n" + content), special(E), text("\n")
    if add_generation_prompt:
        special(S), text("assistant\n" + generation_prefix)
    return parts


def render_text(parts: Sequence[Part]) -> str:
    """The rendered string (what ``transformers``' ``apply_chat_template(tokenize=False)`` returns)."""
    return "".join(p.text for p in parts)
