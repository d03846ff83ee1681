"""HiddenRule: a task family where experience can matter (issue 31).

Every task is one locked object to open. Objects come in *families*, a colour and a kind (``red door``,
``blue chest``, ...; ``families`` of the 4 x 4 = 16, in a fixed order), and the goal text names the family. Each
family has a hidden *rule*: the code of ``code_len`` actions (of the 8 verbs in :data:`ACTIONS`) that opens it,
drawn once from ``rule_seed`` and fixed for the run (the trainer passes the run's seed, see
``registry.EnvSpec.rule_seeded``). Nothing in the observation tells the rule. A wrong action spends one of the
task's ``attempts``; with the default 1 it ends the episode ("the lock jams").

Why it suits the question: a lesson from one solved instance ("a red door opens with knock") holds for every
instance of its family, new ones included, while an outcome-only policy must learn each family's rule into its
weights. Instances are a family plus a place name; training seeds (< 2^30) draw names from :data:`TRAIN_NAMES` and
evaluation seeds (>= 2^30, ``rollout.tasks.TaskSampler``) from :data:`EVAL_NAMES`, so held-out instances are new
names in the same families.

Reference successes (``code_len=1``): a uniform random policy ``1 - (7/8)^attempts`` (0.125 at the default), a
policy that knows the rules 1.0 (:func:`success_rates`; tests/test_envs_hidden_rule.py checks both by play).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from comprl_jax.envs.base import TextEnv, echo

ACTIONS = ("push", "pull", "knock", "kick", "lift", "slide", "turn", "press")
COLOURS = ("red", "blue", "green", "yellow")
KINDS = ("door", "gate", "chest", "hatch")
FAMILIES = tuple(f"{c} {k}" for k in KINDS for c in COLOURS)  # red door, blue door, ..., yellow hatch
# Place names: flavour that makes instances distinct; evaluation never sees a training name.
TRAIN_NAMES = (
    "cellar", "tower", "library", "chapel", "kitchen", "armoury", "garden", "stable",
    "vault", "attic", "forge", "mill", "harbour", "crypt", "gallery", "pantry",
    "barracks", "observatory", "greenhouse", "workshop", "treasury", "bakery", "tannery", "kennel",
)  # fmt: skip
EVAL_NAMES = ("lighthouse", "brewery", "courthouse", "granary", "boathouse", "infirmary", "orchard", "smithy")
EVAL_SEEDS_FROM = 1 << 30  # rollout.tasks.TaskSampler.TRAIN_SEED_SPACE


def rules(rule_seed: int, families: int = len(FAMILIES), code_len: int = 1) -> dict[str, tuple[str, ...]]:
    """The hidden code of each family for ``rule_seed``: family name -> ``code_len`` actions (deterministic)."""
    rng = np.random.default_rng([int(rule_seed), zlib.crc32(b"hidden-rule")])
    return {
        f: tuple(ACTIONS[i] for i in rng.integers(0, len(ACTIONS), size=code_len))
        for f in FAMILIES[:families]
    }


def instance(
    seed: int, families: int = len(FAMILIES), train_names: tuple[str, ...] = TRAIN_NAMES
) -> tuple[str, str]:
    """``(family, place name)`` of task ``seed``: training names (``train_names``) below :data:`EVAL_SEEDS_FROM`,
    held-out names from it on."""
    rng = np.random.default_rng([int(seed), zlib.crc32(b"hidden-rule-instance")])
    names = train_names if int(seed) < EVAL_SEEDS_FROM else EVAL_NAMES
    return FAMILIES[int(rng.integers(0, families))], names[int(rng.integers(0, len(names)))]


def success_rates(code_len: int = 1, attempts: int = 1) -> dict[str, float]:
    """Exact success of a uniform random policy (one code of ``8^code_len`` per try, a wrong action ends the try)
    and of a policy that knows the rules, for the env's ``code_len`` / ``attempts``."""
    p = (1.0 / len(ACTIONS)) ** code_len
    # a try of a multi-action code fails at its first wrong action; each try costs one attempt
    return {"uniform_random": 1.0 - (1.0 - p) ** attempts, "knows_rules": 1.0}


class HiddenRuleEnv(TextEnv):
    """One locked object per episode; ``actions`` are the 8 verbs. See the module docstring."""

    actions = ACTIONS

    def __init__(
        self,
        families: int = len(FAMILIES),
        code_len: int = 1,
        attempts: int = 1,
        rule_seed: int = 0,
        max_turns: int = 30,
        train_names: tuple[str, ...] = TRAIN_NAMES,
    ):
        """``train_names``: place names of training instances (the warm-start corpus draws other ones besides,
        ``warm/corpus.py``); held-out instances always use :data:`EVAL_NAMES`, which no training name may be."""
        if not 1 <= families <= len(FAMILIES):
            raise ValueError(f"HiddenRule: families must be in [1, {len(FAMILIES)}], got {families}")
        if code_len < 1 or attempts < 1:
            raise ValueError(f"HiddenRule: code_len and attempts must be >= 1, got {code_len}, {attempts}")
        super().__init__(max_turns)
        self.families, self.code_len, self.attempts = int(families), int(code_len), int(attempts)
        if set(train_names) & set(EVAL_NAMES) or not train_names:
            raise ValueError(
                f"HiddenRule: train_names must be non-empty and hold no held-out name {EVAL_NAMES}"
            )
        self.train_names = tuple(train_names)
        self.rule_seed = int(rule_seed)
        self.rules = rules(self.rule_seed, self.families, self.code_len)
        self.family, self.name = FAMILIES[0], TRAIN_NAMES[0]
        self._progress = 0  # actions of the code entered so far in this try
        self._left = self.attempts

    def rule(self, family: str) -> tuple[str, ...]:
        """The hidden code of ``family`` (for oracles and tests; never shown to the agent)."""
        return self.rules[family]

    def _obs(self, message: str) -> str:
        lock = "open" if self._progress >= self.code_len else "locked"
        return f"{message}\nYou are in the {self.name}. Before you is a {self.family}. It is {lock}."

    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            seed = int(self.np_random.integers(0, EVAL_SEEDS_FROM))
        self.family, self.name = instance(int(seed), self.families, self.train_names)
        self._progress, self._left = 0, self.attempts
        goal = f"Open the {self.family} in the {self.name}."
        text = self._obs("A new room.")
        info = {
            "task_id": "HiddenRule",
            "goal": goal,
            "query": goal,
            "family": self.family,
            "admissible_actions": list(ACTIONS),
            "seed": int(seed),
        }
        return text, info

    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        verb = (action or "").strip().lower()
        if verb not in ACTIONS:
            return (
                self._obs(f"Invalid action{echo(action)}; valid actions: {', '.join(ACTIONS)}."),
                0.0,
                False,
                {"invalid_action": True, "family": self.family},
            )
        code = self.rules[self.family]
        info: dict[str, Any] = {"invalid_action": False, "family": self.family}
        if verb == code[self._progress]:
            self._progress += 1
            if self._progress == self.code_len:
                info["success"] = True
                return self._obs(f"You {verb} the {self.family}. It opens!"), 1.0, True, info
            return self._obs(f"You {verb} the {self.family}. Something clicks."), 0.0, False, info
        self._progress, self._left = 0, self._left - 1
        if self._left == 0:
            return self._obs(f"You {verb} the {self.family}. The lock jams for good."), 0.0, True, info
        return self._obs(f"You {verb} the {self.family}. Nothing happens."), 0.0, False, info

    def system_prompt(self) -> str:
        colours, kinds = ", ".join(COLOURS), ", ".join(KINDS)
        tries = "A wrong action jams the lock and ends the episode." if self.attempts == 1 else (
            f"A wrong action resets the lock and uses one of your {self.attempts} tries."
        )  # fmt: skip
        code = "one action" if self.code_len == 1 else f"a sequence of {self.code_len} actions"
        return (
            f"You must open a locked object. Objects are a {kinds} coloured {colours}. Each kind and colour of object "
            f"opens with its own secret {code}, the same for every object of that kind and colour; nothing you "
            f"see tells which. {tries}\n"
            "First think briefly inside <think>...</think>, then give exactly one action inside <answer>...</answer>, "
            f"for example <answer>{ACTIONS[0]}</answer>.\nValid actions: {', '.join(ACTIONS)}."
        )
