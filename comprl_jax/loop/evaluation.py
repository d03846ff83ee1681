"""Held-out evaluation (SPEC §8): binary success rate on tasks the actor never trained on, per env and split.

Which tasks are held out is a property of each env (:mod:`comprl_jax.envs.registry`):

* split envs (ALFWorld, WebShop) play their held-out splits through pools built with ``split=``: ALFWorld
  ``valid_unseen`` (the paper's 134 games; label = the env id) and ``valid_seen`` (label ``<env id>@valid_seen``),
  WebShop's 500 ``eval`` goals. Task ``i`` is seed ``i``, i.e. the first ``n`` games / goals of the split's fixed
  order, all distinct: the whole split with ``train.eval_full_splits`` (the paper's figures; the registry knows
  each split's size), else ``min(train.eval_tasks, size)``.
* seeded envs play seeds from the evaluation range ``[2^30, 2^31)``, disjoint from every training seed;
* a fixed-level env (MiniHack Room-5x5) has no held-out task: it is evaluated on its one level and the split says
  so.

Each task is played ``group_size / 2`` times, all with retrieved experience (``with_exp``) or all without
(``without_exp``), sampled with the training sampling settings (the paper's: SPEC §9's actor T 0.99, top-p 0.99,
top-k 100). Evaluation changes nothing in the run: retrieval is read-only, search & ask answers are not training
samples, and its PRNG keys are its own.

A result row: ``{"env_id", "split", "tasks", "success", "episodes", "infra_failed", "mean_reward", "score",
"actions"}``; ``tasks`` distinct held-out tasks were played; ``success`` (binary), ``mean_reward`` (the RL outcome:
1 or the env's failure reward), ``score`` (the env's own episode reward: WebShop's graded attribute / option /
price match, SPEC §10; elsewhere the success reward) and ``actions`` (env actions per episode, SPEC §8; search & ask
turns are not actions) are over the ``episodes`` that did not fail for infrastructure reasons (``infra_failed`` of
them did: an env raised, hung or its worker died). Where the registry says ``infra_counts_as_failure`` (SWE-Lite:
a policy could learn to crash the env on the tasks it cannot solve), ``success`` is over every episode played,
an infra-failed one counting as a failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from comprl_jax.envs import registry
from comprl_jax.rollout.episodes import EpisodeSpec, Trajectory, outcome
from comprl_jax.rollout.pools import Pools
from comprl_jax.rollout.rollout_config import EnvConfig
from comprl_jax.rollout.tasks import Task, TaskSampler

SEEDED_SPLIT = "held-out seeds"


def splits_of(env_id: str, requested: str = "eval") -> tuple[str | None, ...]:
    """The splits evaluation plays for ``env_id`` (``None``: no split argument; see the module docstring)."""
    return registry.eval_splits(env_id, requested)


def split_name(env_id: str, split: str | None) -> str:
    if split is not None:
        return split
    return registry.FIXED_SPLIT if registry.spec(env_id).levels == "fixed" else SEEDED_SPLIT


def label(env_id: str, split: str | None, requested: str = "eval") -> str:
    """The env id for its primary held-out figure, ``<env id>@<split>`` for the others."""
    primary = splits_of(env_id, requested)[0]
    return env_id if split == primary else f"{env_id}@{split}"


def eval_tasks(
    env_id: str, index: int, split: str | None, n: int, seed: int, full: bool = False
) -> list[Task]:
    """``n`` held-out tasks of ``env_id`` on ``split`` (``index``: its position in the mixture); a split env plays
    each task at most once (``full``: all of them, whatever ``n``)."""
    if split is not None:
        size = registry.eval_size(env_id, split)
        if size is not None:
            n = size if full else min(n, size)
        return [Task(env_id, i, index) for i in range(n)]
    sampler = TaskSampler((env_id,), n, seed)
    return [Task(env_id, t.seed, index) for t in sampler.eval_tasks(n)]


@dataclasses.dataclass(frozen=True)
class Player:
    """What evaluation needs from the loop, as functions (it never sees the trainer).

    Attributes:
      specs: ``(tasks, guided) -> [EpisodeSpec]``: the episodes of ``tasks`` (``group_size / 2`` each) as
        evaluation plays them (every one guided, or none).
      play: ``(specs, pools, key) -> [Trajectory]``: plays them read-only (no retrieval statistics, no training
        samples; search & ask answered from keys derived from ``key``).
      pools: ``split -> Pools``: env pools on a held-out split (``None``: the seeded / fixed-level envs).
    """

    specs: Callable[[Sequence[Task], bool], list[EpisodeSpec]]
    play: Callable[[list[EpisodeSpec], Pools, jax.Array], list[Trajectory]]
    pools: Callable[[str | None], Pools]


def evaluate(
    env: EnvConfig,
    player: Player,
    n_per_task: int,
    guided: bool,
    *,
    seed: int,
    per_call: int,
    full_splits: bool,
) -> dict[str, dict]:
    """Plays the held-out tasks of every env of the run's ``env`` section (``guided``: with retrieved experience);
    returns ``{label: row}``.

    Args:
      seed: the run's seed (the held-out tasks and the evaluation's PRNG stream derive from it).
      per_call: episodes played at once (the training pools' slots: tasks per step x K/2).
      full_splits: split envs play their whole held-out split (``train.eval_full_splits``).
    """
    out: dict[str, dict] = {}
    key = jax.random.key(seed + 12345 + (1 if guided else 0))
    for index, env_id in enumerate(env.tasks):
        for split in splits_of(env_id, env.eval_split):
            pools = player.pools(split)
            tasks = eval_tasks(env_id, index, split, n_per_task, seed, full_splits)
            trajs = []
            for i in range(0, len(tasks), per_call):
                key, sub = jax.random.split(key)
                trajs += player.play(player.specs(tasks[i : i + per_call], guided), pools, sub)
            ok = [t for t in trajs if not t.infra_failed]
            # where the agent can make the env fail (SWE), a failed episode is a failure, not a skipped task
            scored = trajs if registry.spec(env_id).infra_counts_as_failure else ok
            out[label(env_id, split, env.eval_split)] = {
                "env_id": env_id,
                "split": split_name(env_id, split),
                "tasks": len(tasks),
                "success": _mean([bool(t.success) and not t.infra_failed for t in scored]),
                "episodes": len(ok),
                "infra_failed": len(trajs) - len(ok),
                "mean_reward": _mean([outcome(t) for t in ok]),
                "score": _mean([t.reward for t in ok]),
                "actions": _mean([t.turns for t in ok]),
            }
    return out


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")
