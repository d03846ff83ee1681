"""ALFWorld (TextWorld household tasks) as a :class:`TextEnv`, on the PyPI ``alfworld==0.4.2`` PDDL games.

One game per episode, chosen by the reset seed (``seed % n`` indexes a fixed permutation of the split's sorted games,
so seeds ``0..n-1`` visit every game once and consecutive seeds mix task types). The game runs in TextWorld's PDDL
backend with the same wrapper chain as ``alfworld.agents.environment.AlfredTWEnv`` / ``textworld.gym``
(``AlfredDemangler`` without shuffling, ``AlfredInfos``, ``Filter``), built directly so that the env owns one game at
a time instead of a gym pool over all games.

Reward: +1 when the goal is reached (episode ends), −1 when ``max_turns`` runs out without it, 0 otherwise.
An unparsable reply or a command that is not admissible leaves the game untouched (ALFWorld's own answer to an
unknown command is "Nothing happens.") and is counted as invalid.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import numpy as np

from comprl_jax.envs import alfworld_data
from comprl_jax.envs.base import TextEnv

_BANNER_RE = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_GOAL_RE = re.compile(r"Your task is to:\s*(.+)")
# "eval" is the paper's held-out set, so configs can say split="eval" for every env.
SPLIT_ALIASES = {"eval": "valid_unseen"}
_PERMUTATION_SEED = 20240417  # fixed: the seed -> game map must never change between runs

SYSTEM_PROMPT = """You are an agent in a household (ALFWorld, a text version of the ALFRED simulator). Each episode \
gives you a task such as "put a clean mug in coffeemachine". You see what happens after each of your actions and the \
list of admissible actions. Reach the goal in as few actions as possible; you have at most {max_turns} actions.

Action set (objects and receptacles are named with their number, e.g. "mug 1", "countertop 2"):
  go to (receptacle) | open (receptacle) | close (receptacle) | take (object) from (receptacle)
  move (object) to (receptacle) | examine (something) | use (object) | heat (object) with (receptacle)
  clean (object) with (receptacle) | cool (object) with (receptacle) | slice (object) with (object)
  look | inventory | help

Format: think inside <think>...</think>, then give exactly one admissible action inside <answer>...</answer>, e.g.
<think>The mug is probably on a countertop.</think><answer>go to countertop 1</answer>
A reply without <answer>...</answer> or with an action that is not admissible wastes a turn."""


def _normalize(command: str) -> str:
    return " ".join(command.lower().split()).rstrip(".")


def _make_textworld_env():
    # Imported lazily: textworld pulls in fast_downward and is only needed where the env actually runs.
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld.envs.wrappers import Filter, GenericEnvironment

    request = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "walkthrough"])
    env = GenericEnvironment(request)
    for wrapper in (AlfredDemangler, AlfredInfos, Filter):  # the textworld.gym / AlfredTWEnv eval chain
        env = wrapper(env)
    return env


class ALFWorldEnv(TextEnv):
    """ALFWorld household tasks.

    Args:
        split: "rl_train" (1,466 of the train games: the released code's training set), "train" (3,553 games),
            "valid_seen" (140), "valid_unseen" (134, the paper's held-out set; alias "eval"), "valid_train" (200).
        max_turns: actions per episode before truncation (SPEC: 40).
        data_dir: a folder with ``alfworld/json_2.1.1_game.tw-pddl.tar.xz`` (offline copy) or an ALFWORLD_DATA-style
            root with ``json_2.1.1/``; default ``$ALFWORLD_DATA`` or the shared data (see ``alfworld_data``).
        show_admissible: append the admissible actions to every observation (the actor has no other way to see them).
    """

    # Constrained decoding for tiny models (SPEC: "their actions always parse"): the admissible set changes every
    # turn, so the grammar is the action *syntax*; an admissible-but-wrong or inadmissible action is still
    # possible and is handled as an invalid action. ALFWorld commands are lowercase words and numbers ("go to cabinet 1").
    action_regex = r"<answer>[a-z0-9][a-z0-9 ]{0,59}</answer>"

    def __init__(
        self,
        split: str = "train",
        max_turns: int = 40,
        data_dir: str | os.PathLike | None = None,
        show_admissible: bool = True,
    ):
        super().__init__(max_turns)
        self.split = SPLIT_ALIASES.get(split, split)
        self.show_admissible = show_admissible
        self.root = alfworld_data.resolve_root(data_dir)
        self.games = alfworld_data.list_games(self.root, self.split)
        self._order = np.random.default_rng(_PERMUTATION_SEED).permutation(len(self.games))
        self._tw = None
        self._admissible: list[str] = []
        self._walkthrough: list[str] = []
        self._task: dict[str, Any] = {}

    # -- helpers -----------------------------------------------------------------------------------
    def game_for_seed(self, seed: int) -> str:
        """The game file path that ``reset(seed=seed)`` plays."""
        return str(self.games[int(self._order[int(seed) % len(self.games)])])

    def task_id_of(self, game_file: str) -> str:
        """``<split>/<task dir>/<trial>``, the key format of ``valid_traj_data_min.json``."""
        return "/".join(os.path.normpath(game_file).split(os.sep)[-4:-1])

    def expert_plan(self) -> list[str]:
        """The current game's stored walkthrough (a winning command sequence). Not for the actor's eyes."""
        return list(self._walkthrough)

    def _render(self, feedback: str) -> str:
        text = _BANNER_RE.sub("", feedback).strip()
        if self.show_admissible:
            text += "\nAdmissible actions: [" + ", ".join(self._admissible) + "]"
        return text

    def close(self) -> None:
        if self._tw is not None:
            self._tw.close()
            self._tw = None
        super().close()

    # -- TextEnv -----------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(max_turns=self.max_turns)

    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            seed = int(self.np_random.integers(len(self.games)))
        game = self.game_for_seed(seed)
        if self._tw is None:
            self._tw = _make_textworld_env()
        self._tw.load(game)
        feedback, tw_info = self._tw.reset()
        self._admissible = list(tw_info["admissible_commands"])
        self._walkthrough = list(tw_info.get("extra.walkthrough") or [])
        first = _BANNER_RE.sub("", feedback).strip()
        match = _GOAL_RE.search(first)
        goal = match.group(1).strip() if match else ""
        self._task = {
            "task_id": self.task_id_of(game),
            "goal": goal,
            "query": f"{goal}\n{first}",
            "gamefile": game,
        }
        info = dict(self._task, admissible_actions=list(self._admissible), success=False)
        return self._render(feedback), info

    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        command = _normalize(action) if action is not None else None
        invalid = command is None or command not in self._admissible
        won = False
        if command is None:
            feedback = "Invalid reply: give one admissible action inside <answer>...</answer>."
        elif invalid:
            feedback = "Nothing happens."  # what ALFWorld itself answers, without touching the game state
        else:
            feedback, _, _, tw_info = self._tw.step(command)
            won = bool(tw_info["won"])
            self._admissible = list(tw_info["admissible_commands"])
        last_turn = self._turn + 1 >= self.max_turns  # the base class truncates after this step
        reward = 1.0 if won else (-1.0 if last_turn else 0.0)
        info = dict(
            self._task, admissible_actions=list(self._admissible), success=won, invalid_action=invalid
        )
        return self._render(feedback), reward, won, info


def random_action(info: dict[str, Any], rng: np.random.Generator) -> str:
    """A uniformly random admissible action, formatted as an actor reply (for benchmarks and smoke tests)."""
    actions = info["admissible_actions"]
    return f"<answer>{actions[int(rng.integers(len(actions)))]}</answer>"


def bench_alfworld(
    num_steps: int = 100, split: str = "valid_unseen", seed: int = 0, max_turns: int = 40
) -> dict:
    """Sequential throughput of one ALFWorldEnv under a random admissible policy, resets included.

    Returns:
        {"env": "comprl/ALFWorld-v0", "steps": int, "episodes": int, "seconds": float, "steps_s": float,
         "reset_s_mean": float}
    """
    env = ALFWorldEnv(split=split, max_turns=max_turns)
    rng = np.random.default_rng(seed)
    steps, episodes, reset_time = 0, 0, 0.0
    start = time.perf_counter()
    while steps < num_steps:
        t0 = time.perf_counter()
        _, info = env.reset(seed=seed + episodes)
        reset_time += time.perf_counter() - t0
        episodes += 1
        done = False
        while not done and steps < num_steps:
            _, _, term, trunc, info = env.step(random_action(info, rng))
            steps += 1
            done = term or trunc
    seconds = time.perf_counter() - start
    return {
        "env": "comprl/ALFWorld-v0",
        "steps": steps,
        "episodes": episodes,
        "seconds": seconds,
        "steps_s": steps / seconds,
        "reset_s_mean": reset_time / episodes,
    }
