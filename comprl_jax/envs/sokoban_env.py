"""Sokoban as a text environment, on rooms from gym-sokoban's reverse-play generator.

Room generation is the real thing: ``gym_sokoban.envs.room_utils.generate_room`` (a random-walk topology, boxes
put on targets, then pulled away by reverse play, so every room is solvable). That code draws from the global
``random`` / ``np.random`` state and keeps its search state in module globals, so generation runs under a lock,
seeded from the episode seed, and restores both global RNG states afterwards. ``room_utils.py`` is loaded on its
own (not through the ``gym_sokoban`` package, whose ``__init__`` imports the old ``gym`` and ``pkg_resources``).

Moves and pushes are played on our own grid state (simple and exact): walking into a wall, or pushing a box into
a wall or another box, is a valid move that changes nothing. Success = every box on a target.
"""

from __future__ import annotations

import importlib.util
import os
import random
import threading
from typing import Any

import numpy as np

from comprl_jax.envs.base import TextEnv, echo

_GEN_LOCK = threading.Lock()
_ROOM_UTILS = None

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_ALIASES = {
    "north": "up",
    "south": "down",
    "west": "left",
    "east": "right",
    "u": "up",
    "d": "down",
    "l": "left",
}
_ALIASES |= {"r": "right", "move up": "up", "move down": "down", "move left": "left", "move right": "right"}
LEGEND = (
    "#: wall",
    "_: floor",
    "O: target",
    "X: box",
    "*: box on a target",
    "P: you (the player)",
    "+: you standing on a target",
)


def _room_utils():
    """gym-sokoban's ``room_utils`` module, loaded from its file without running the package ``__init__``."""
    global _ROOM_UTILS
    if _ROOM_UTILS is None:
        pkg = importlib.util.find_spec("gym_sokoban")
        if pkg is None or not pkg.submodule_search_locations:
            raise ImportError("gym-sokoban is not installed (pip install gym-sokoban==0.0.6)")
        path = os.path.join(list(pkg.submodule_search_locations)[0], "envs", "room_utils.py")
        spec = importlib.util.spec_from_file_location("_comprl_gym_sokoban_room_utils", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _ROOM_UTILS = module
    return _ROOM_UTILS


def generate(seed: int, dim: int = 6, num_boxes: int = 2, max_attempts: int = 50):
    """A solvable room for ``seed``: (walls [dim, dim] bool, targets set, boxes set, player (r, c)).

    Deterministic in ``seed``; the global ``random`` / ``np.random`` states are left as they were.
    Rooms the generator gives up on (its "score == 0" case) are retried with the next derived seed.
    """
    ru = _room_utils()
    num_steps = int(1.7 * (dim + dim))  # gym-sokoban's SokobanEnv default for the random-walk length
    with _GEN_LOCK:
        py_state, np_state = random.getstate(), np.random.get_state()  # noqa: NPY002 - the generator uses the legacy global RNG
        try:
            for attempt in range(max_attempts):
                random.seed(f"sokoban-{seed}-{attempt}")
                np.random.seed((int(seed) * 1_000_003 + attempt) % (2**32))  # noqa: NPY002
                try:
                    fixed, state, _ = ru.generate_room(
                        dim=(dim, dim), num_steps=num_steps, num_boxes=num_boxes
                    )
                except (RuntimeWarning, RuntimeError):
                    continue
                boxes = {
                    tuple(map(int, p)) for p in zip(*np.nonzero((state == 3) | (state == 4)), strict=True)
                }
                targets = {tuple(map(int, p)) for p in zip(*np.nonzero(fixed == 2), strict=True)}
                if len(boxes) != num_boxes or len(targets) != num_boxes or boxes <= targets:
                    continue  # already solved, or a degenerate room: draw another
                (pr,), (pc,) = np.nonzero(state == 5)
                return fixed == 0, targets, boxes, (int(pr), int(pc))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)  # noqa: NPY002
    raise RuntimeError(
        f"Sokoban generator failed {max_attempts} times for seed {seed} (dim={dim}, boxes={num_boxes})"
    )


def render_grid(walls: np.ndarray, targets: set, boxes: set, player: tuple[int, int]) -> str:
    """The room as rows of the symbols in ``LEGEND``."""
    rows = []
    for r in range(walls.shape[0]):
        row = []
        for c in range(walls.shape[1]):
            p, t = (r, c), (r, c) in targets
            if walls[r, c]:
                row.append("#")
            elif p == player:
                row.append("+" if t else "P")
            elif p in boxes:
                row.append("*" if t else "X")
            else:
                row.append("O" if t else "_")
        rows.append("".join(row))
    return "\n".join(rows)


def normalize_action(text: str | None) -> str | None:
    if text is None:
        return None
    t = " ".join(text.lower().replace(".", " ").split())
    t = _ALIASES.get(t, t)
    return t if t in MOVES else None


class SokobanTextEnv(TextEnv):
    """Sokoban ``dim`` x ``dim`` (walls included) with ``num_boxes`` boxes; actions up / down / left / right."""

    actions = tuple(MOVES)  # the static action set (constrained decoding, prompts)

    def __init__(self, dim: int = 6, num_boxes: int = 2, max_turns: int = 30):
        super().__init__(max_turns)
        self.dim, self.num_boxes = int(dim), int(num_boxes)
        self.task_id = f"Sokoban-{self.dim}x{self.dim}-{self.num_boxes}"
        self.walls = np.zeros((self.dim, self.dim), bool)
        self.targets: set = set()
        self.boxes: set = set()
        self.player = (0, 0)

    def _obs(self, message: str) -> str:
        on = len(self.boxes & self.targets)
        grid = render_grid(self.walls, self.targets, self.boxes, self.player)
        return (
            f"Message: {message}\nMap:\n{grid}\nLegend:\n"
            + "\n".join(LEGEND)
            + f"\nBoxes on targets: {on}/{len(self.boxes)}"
        )

    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            seed = int(self.np_random.integers(0, 2**31 - 1))
        self.walls, self.targets, self.boxes, self.player = generate(int(seed), self.dim, self.num_boxes)
        text = self._obs("New room.")
        goal = "Push every box (X) onto a target (O)."
        info = {
            "task_id": self.task_id,
            "goal": goal,
            "query": text,
            "admissible_actions": list(MOVES),
            "seed": seed,
        }
        return text, info

    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        name = normalize_action(action)
        if name is None:
            return (
                self._obs(f"Invalid action{echo(action)}; valid actions: {', '.join(MOVES)}."),
                0.0,
                False,
                {"invalid_action": True},
            )
        dr, dc = MOVES[name]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if self.walls[nxt]:
            message = "You bump into a wall."
        elif nxt in self.boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if self.walls[beyond] or beyond in self.boxes:
                message = "The box does not move."
            else:
                self.boxes = (self.boxes - {nxt}) | {beyond}
                self.player = nxt
                message = "You push the box onto a target." if beyond in self.targets else "You push the box."
        else:
            self.player = nxt
            message = f"You move {name}."
        success = self.boxes <= self.targets
        info = {
            "invalid_action": False,
            "success": success,
            "boxes_on_target": len(self.boxes & self.targets),
        }
        return self._obs(message), float(success), success, info

    def system_prompt(self) -> str:
        return (
            f"You are playing Sokoban in a {self.dim}x{self.dim} room with {self.num_boxes} boxes. Task: push every "
            "box onto a target. You push a box by walking into it; it moves one square the same way if that square "
            "is free. You cannot pull boxes, and a box pushed into a corner is stuck for good.\n"
            "Each observation shows a message, the map (row 1 at the top) and a legend: "
            + ", ".join(LEGEND)
            + ".\n"
            "First think briefly inside <think>...</think>, then give exactly one action inside <answer>...</answer>, "
            "for example <answer>left</answer>.\nValid actions: up, down, left, right."
        )
