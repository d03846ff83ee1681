"""A uniform-random policy on the very levels a run trained and was evaluated on: the floor its success is read against.

  python launch/bench/random_reference.py --config=configs/minihack_room.py:cpu --seeds=0,1,2 --steps=12

For each seed, the run's training tasks step by step (the same :class:`~comprl_jax.rollout.tasks.TaskSampler` the trainer
draws from, ``group_size`` episodes per task) and its held-out eval tasks (``train.eval_tasks`` x group_size / 2
episodes, as :mod:`comprl_jax.loop.evaluation` plays them), each episode ``env.max_turns`` actions drawn uniformly from
the env's action set. One JSON line per seed: ``bench: "random_reference"``, ``env``, ``seed``, ``per_step``
(success per step), ``second_half`` (the mean over steps >= ceil(steps / 2), the statistic of
launch/bench/compare_cpu.sh), ``first_half`` (the steps before), ``eval`` and ``eval_episodes``. An actor's context can end an episode earlier than
``env.max_turns`` (``rollout.max_context``); the random policy is never cut short, so this floor is generous.
"""

from __future__ import annotations

import json
import math

import numpy as np
from absl import app, flags

from comprl_jax import config as config_lib
from comprl_jax.envs import registry
from comprl_jax.envs.random_policy import play
from comprl_jax.rollout.tasks import TaskSampler

_CONFIG = flags.DEFINE_string("config", "configs/minihack_room.py:cpu", "config file[:variant]")
_SEEDS = flags.DEFINE_string("seeds", "0,1,2", "comma-separated run seeds")
_STEPS = flags.DEFINE_integer("steps", 12, "training steps of the runs")


def main(argv):
    del argv
    c = config_lib.load_file(_CONFIG.value)
    (env_id,) = c.env.tasks
    K, turns = c.rollout.group_size, registry.capped(env_id, c.env.max_turns, 1, 1).max_turns
    for seed in [int(s) for s in _SEEDS.value.split(",")]:
        # the run's own env: HiddenRule draws its rules from the run's seed (registry.run_kwargs)
        env = registry.make(env_id, max_turns=turns, **registry.run_kwargs(env_id, seed))
        rng = np.random.default_rng([seed, 4242])
        sampler = TaskSampler(c.env.tasks, c.rollout.tasks_per_step, seed)
        per_step = []
        for _ in range(_STEPS.value):
            wins = [w for t in sampler.next() for w in play(env, t.seed, K, turns, rng)]
            per_step.append(float(np.mean(wins)))
        cut = math.ceil(len(per_step) / 2)
        ev_tasks = TaskSampler((env_id,), c.train.eval_tasks, seed).eval_tasks(c.train.eval_tasks)
        ev = [w for t in ev_tasks for w in play(env, t.seed, K // 2, turns, rng)]
        print(
            json.dumps(
                {
                    "bench": "random_reference",
                    "env": env_id,
                    "seed": seed,
                    "max_turns": turns,
                    "per_step": [round(x, 4) for x in per_step],
                    "first_half": float(np.mean(per_step[:cut])),
                    "second_half": float(np.mean(per_step[cut:])),
                    "eval": float(np.mean(ev)),
                    "eval_episodes": len(ev),
                }
            ),
            flush=True,
        )
        env.close()


if __name__ == "__main__":
    app.run(main)
