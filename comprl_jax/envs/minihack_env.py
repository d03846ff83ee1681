"""MiniHack (real NetHack through NLE) as a text environment.

The actor sees the message line, the explored part of the map cropped to its bounding box, a legend of the
symbols present and (KeyRoom) the inventory; it answers with one named action (``north`` ... ``northwest``,
``pick up``, ``apply``, ...). Success is MiniHack's own ``TASK_SUCCESSFUL`` end status (reached the stairs).

Seeding: ``gymnasium``'s ``reset(seed=s)`` does not seed NetHack, so every reset calls
``env.unwrapped.seed(s, s, reseed=False)`` first; the K rollouts of a group given the same seed play the same
level, and the same actions then give the same observations (``reseed=False`` turns off NetHack's anti-TAS
reseeding). The NLE instance is built once and reused across resets (creating one costs a level compile).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from comprl_jax.envs import minihack_text as mt
from comprl_jax.envs.base import TextEnv, echo

_OBS_KEYS = ("chars", "screen_descriptions", "message", "inv_strs", "inv_letters", "blstats")

_GOALS = {
    "Room": "Reach the staircase down '>' in the room. Monsters and traps may be present in harder variants.",
    "MazeWalk": "Find your way through the maze to the staircase down '>'. Unexplored parts of the maze are blank.",
    "KeyRoom": (
        "Find the key '(' in the dark room and stand on it, 'pick up' the key, walk next to the locked door '+' of "
        "the small inner room, 'apply' the key to unlock and open it, then reach the staircase down '>' inside."
    ),
    "River": (
        "Reach the staircase down '>' on the far side of the river of water '}'. You cannot swim: push boulders '`' "
        "into the water (walk into them) to fill it and build a crossing."
    ),
}


def _end_message(success: bool, status: int, nle_env) -> str:
    """The message line of the final observation (NLE shows nothing once the game is over)."""
    if success:
        return "You reached the goal: the task is complete."
    try:
        name = nle_env.StepStatus(status).name.lower().replace("_", " ")
    except ValueError:
        name = f"end status {status}"
    return f"The game is over ({name}): the task failed."


def _family(env_name: str) -> str:
    for fam in _GOALS:
        if f"-{fam}-" in env_name:
            return fam
    raise ValueError(f"no MiniHack task family known for {env_name!r}; known: {sorted(_GOALS)}")


class MiniHackTextEnv(TextEnv):
    """A MiniHack level behind the text protocol of ``comprl_jax.envs.base``.

    Args:
      env_name: the MiniHack gymnasium id, e.g. ``"MiniHack-Room-Ultimate-5x5-v0"``.
      max_turns: episode truncation (SPEC: 30 for MiniHack).
      extra_actions: named actions to add to the level's own action set (e.g. ``("wait", "search")``).
      show_inventory: show the inventory; default only for KeyRoom, where the key matters.
    """

    def __init__(
        self,
        env_name: str,
        max_turns: int = 30,
        extra_actions: tuple[str, ...] = (),
        show_inventory: bool | None = None,
    ):
        super().__init__(max_turns)
        import gymnasium as gym
        import minihack  # noqa: F401  (registers the MiniHack ids with gymnasium)
        from nle import nethack

        self.env_name = env_name
        self.family = _family(env_name)
        kwargs: dict[str, Any] = {
            "observation_keys": _OBS_KEYS,
            "max_episode_steps": max(1000, 10 * max_turns),
        }
        if extra_actions:
            base = gym.spec(env_name).make(observation_keys=_OBS_KEYS).unwrapped
            codes = [int(a) for a in base.actions]
            base.close()
            for name in extra_actions:
                canon = mt.normalize_action(name)
                if canon is None:
                    raise ValueError(f"extra_actions: unknown action {name!r}; known: {mt.ACTION_NAMES}")
                if mt.ACTION_CODES[canon] not in codes:
                    codes.append(mt.ACTION_CODES[canon])
            by_code = {int(a): a for a in nethack.ACTIONS}
            kwargs["actions"] = tuple(by_code[c] for c in codes)
        self._env = gym.make(env_name, **kwargs)
        # Stepped directly, past gymnasium's wrappers (time limit, order enforcing, passive checker): our own
        # truncation (max_turns) always comes first, resets always precede steps, and the per-call wrapper
        # layers cost more than NetHack's own step.
        self._nle = self._env.unwrapped
        self._success_status = int(self._nle.StepStatus.TASK_SUCCESSFUL)
        code_to_index = {int(a): i for i, a in enumerate(self._nle.actions)}
        # Named actions this level accepts, in our canonical order, and their index in the NLE action tuple.
        self.actions = tuple(n for n in mt.ACTION_NAMES if mt.ACTION_CODES[n] in code_to_index)
        self._index = {n: code_to_index[mt.ACTION_CODES[n]] for n in self.actions}
        self.show_inventory = (self.family == "KeyRoom") if show_inventory is None else bool(show_inventory)
        self._bbox = None
        self._last_view: tuple = ("", [], None)
        self.seed_used: int | None = None

    # -- rendering -------------------------------------------------------------------------------
    def _render(self, obs: dict[str, np.ndarray]) -> str:
        chars = obs["chars"]
        self._bbox = mt.update_bbox(chars, self._bbox)
        col, row = int(obs["blstats"][0]), int(obs["blstats"][1])
        inv = mt.inventory_lines(obs["inv_strs"], obs["inv_letters"]) if self.show_inventory else None
        self._last_view = (
            mt.render_map(chars, self._bbox),
            mt.legend(chars, obs["screen_descriptions"], self._bbox, (row, col)),
            inv,
        )
        return mt.observation_text(mt.bytes_to_str(obs["message"]), *self._last_view)

    # -- TextEnv hooks ---------------------------------------------------------------------------
    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            seed = int(self.np_random.integers(0, 2**31 - 1))
        self.seed_used = int(seed)
        self._nle.seed(self.seed_used, self.seed_used, reseed=False)
        obs, _ = self._nle.reset()
        self._bbox = None
        text = self._render(obs)
        info = {
            "task_id": self.env_name,
            "goal": _GOALS[self.family],
            "query": text,
            "admissible_actions": list(self.actions),
            "seed": self.seed_used,
        }
        return text, info

    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        name = mt.normalize_action(action)
        if name not in self._index:
            # Invalid: the turn is spent (counted by the base class) but NetHack does not move.
            note = f"Invalid action{echo(action)}; valid actions: {', '.join(self.actions)}."
            text = mt.observation_text(note, *self._last_view)
            return text, 0.0, False, {"invalid_action": True, "success": False}
        obs, _, term, trunc, nle_info = self._nle.step(self._index[name])
        status = int(nle_info.get("end_status", 0))
        success = status == self._success_status
        if term and not np.any(obs["chars"]):
            # NLE blanks every observation array once the game is over (a NUL map of 21 x 79): keep the last
            # map and say how the episode ended, so the transcript the extractor distils ends on a readable line.
            text = mt.observation_text(_end_message(success, status, self._nle), *self._last_view)
        else:
            text = self._render(obs)
        info = {"invalid_action": False, "success": success, "end_status": status}
        # NLE's own truncation (step limit) cannot fire before ours; any other end (death) is a failed episode.
        return text, float(success), bool(term or trunc), info

    def system_prompt(self) -> str:
        return (
            f"You are playing MiniHack, a NetHack task ({self.env_name}). Task: {_GOALS[self.family]}\n"
            "Each observation shows the game message, the map you have seen so far (north is up, one character "
            "per square, you are '@'), a legend of the symbols on the map"
            + (" and your inventory" if self.show_inventory else "")
            + ".\nFirst think briefly inside <think>...</think>, then give exactly one action inside "
            "<answer>...</answer>, for example <answer>east</answer>.\n"
            f"Valid actions: {', '.join(self.actions)}."
        )

    def close(self):
        self._env.close()
