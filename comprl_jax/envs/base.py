"""The text-environment protocol every environment in ``comprl_jax.envs`` follows.

An environment is a ``gymnasium.Env`` whose observations and actions are text (``spaces.Text``):

* ``reset(seed=s) -> (obs_text, info)`` with ``info`` holding at least
  ``task_id`` (str), ``goal`` (str), ``query`` (str: the retrieval query of SPEC §5) and, where the env
  has them, ``admissible_actions`` (list[str]).
* ``step(reply_text) -> (obs_text, reward, terminated, truncated, info)``; ``reply_text`` is the actor's whole
  reply: the env parses the action out of it (``<answer>…</answer>``). ``info`` holds ``success`` (bool),
  ``invalid_action`` (bool, this step), ``num_invalid`` (int, this episode), ``turn`` (int) and ``action``
  (the parsed action or None). An unparsable / invalid action never raises, and neither does a reply that is not
  a ``str`` (``bytes``, ``int``, ``None``...): it is an invalid action. Messages that quote an invalid action cut it
  to ``ECHO_CHARS`` characters (:func:`echo`), so a 10,000-character reply does not flood the next observation.
  Observations are valid Unicode (:func:`valid_text`: no lone surrogate reaches a tokenizer).
* ``step`` before the first ``reset`` or after the episode ended raises ``RuntimeError`` ("call reset() first"):
  that is a bug in the caller, not an action of the agent.
* ``system_prompt() -> str``: states the task, the action format and the action set.
* Truncation after ``max_turns`` steps (config).

The same seed and actions must give identical observation sequences (tested for every env).
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
from gymnasium import spaces

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_TEXT = 1 << 16
ECHO_CHARS = 40  # an invalid action is quoted back to the agent cut to this many characters

# A printable-ish charset for spaces.Text; observations are free text, so the space is only descriptive.
_CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def text_space(max_length: int = MAX_TEXT) -> spaces.Text:
    return spaces.Text(max_length=max_length, min_length=0, charset=_CHARSET)


def parse_answer(reply: str) -> str | None:
    """Returns the stripped text inside the *last* ``<answer>…</answer>`` of ``reply``, or None.

    The last one wins because reasoning in ``<think>`` may quote the format before the real answer.
    """
    found = ANSWER_RE.findall(reply or "")
    if not found:
        return None
    action = found[-1].strip()
    return action or None


def valid_text(text: str) -> str:
    """``text`` as valid Unicode: a lone surrogate (a file name's undecodable bytes as Python reads them, or a
    model's ``"\\ud800"`` echoed back) becomes ``?``, so no tokenizer downstream sees one (issue 50 point 3)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def echo(action: str | None, limit: int = ECHO_CHARS) -> str:
    """``action`` quoted for an invalid-action message (``" 'go nrth'"``), cut to ``limit`` characters; ``""`` for
    None. ``repr`` keeps newlines and quotes of untrusted text on one visible line."""
    if action is None:
        return ""
    cut = action if len(action) <= limit else action[:limit] + "..."
    return " " + repr(cut)


class TextEnv(gym.Env):
    """Base class: bookkeeping for turns, invalid actions and truncation. Subclasses implement
    ``_reset(seed) -> (obs, info)``, ``_step(action: str | None) -> (obs, reward, terminated, info)`` and
    ``system_prompt()``."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_turns: int):
        if max_turns <= 0:
            raise ValueError(f"max_turns must be positive, got {max_turns}")
        self.max_turns = int(max_turns)
        self.observation_space = text_space()
        self.action_space = text_space()
        self._turn = 0
        self._num_invalid = 0
        self._done = False
        self._needs_reset = True  # no episode yet: step() must not run on an empty state

    # -- to implement ------------------------------------------------------------------------------
    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        """``action`` is the parsed action (None when unparsable). Returns (obs, reward, terminated, info);
        ``info`` must carry ``success`` and ``invalid_action``."""
        raise NotImplementedError

    def system_prompt(self) -> str:
        raise NotImplementedError

    def parse_action(self, reply: str) -> str | None:
        return parse_answer(reply)

    # -- gymnasium API -----------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._turn = 0
        self._num_invalid = 0
        self._done = False
        self._needs_reset = True  # stays set if _reset raises half-way
        obs, info = self._reset(seed)
        obs = valid_text(obs)
        for key in ("task_id", "goal", "query"):
            if key not in info:
                raise KeyError(f"{type(self).__name__}._reset must put {key!r} in info")
        info.setdefault("success", False)
        info["turn"] = 0
        info["num_invalid"] = 0
        self._needs_reset = False
        return obs, info

    def step(self, action: str):
        if self._needs_reset:
            raise RuntimeError(f"{type(self).__name__}.step called before reset(); call reset() first")
        if self._done:
            raise RuntimeError(
                f"{type(self).__name__}.step called after the episode ended; call reset() first"
            )
        # A reply that is not text (bytes, a number, None) is the agent's invalid action, never a crash.
        parsed = self.parse_action(action) if isinstance(action, str) else None
        obs, reward, terminated, info = self._step(parsed)
        obs = valid_text(obs)
        self._turn += 1
        invalid = bool(info.get("invalid_action", parsed is None))
        info["invalid_action"] = invalid
        self._num_invalid += int(invalid)
        info["num_invalid"] = self._num_invalid
        info["turn"] = self._turn
        info["action"] = parsed
        info.setdefault("success", False)
        truncated = (not terminated) and self._turn >= self.max_turns
        self._done = bool(terminated or truncated)
        return obs, float(reward), bool(terminated), bool(truncated), info
