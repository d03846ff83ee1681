"""The warm models' skills on held-out material, frozen (issue 49 point 2): one JSON line, ``bench: "warm_start"``.

  python launch/bench/warm_start.py [--rule_seeds=0,1,2] [--episodes=128]

Per rule seed (a run's rules; the models never saw any), through the trainer of `configs/hidden_rule.py:warm`
(its rollout, constrained decoding, temperature and extractor call; `comprl_jax/warm/skills.py` says what each
condition is): the actor plays ``--episodes`` held-out episodes per condition, and the extractor (the full one and
the early one) writes ``--episodes`` distillations per condition. Thresholds (issue 49): actor_follow >= 0.9,
actor_no_lesson_success <= 0.2, actor_copies_other_family <= 0.2, actor_other_family_success <= 0.25,
actor_plays_failed_verb <= 0.05, extractor_right_after_success >= 0.8, extractor_false_claim_after_failure <= 0.05;
``thresholds_met`` says whether all hold. Figures are shares over all seeds' episodes, with their standard errors.

MiniHack Room-5x5 (``room_*``, no threshold): of the figures above only the actor's success without a lesson is
defined there (the corpus holds HiddenRule's families and verbs alone: no Room lesson has a family or a verb to
be right about). ``--room_tasks`` plays the fixed level that many times x group_size / 2 through the trainer of
`configs/minihack_room.py:warm` (its turn cap, constrained decoding and temperature), beside a uniform-random
policy on the same level and turns (`comprl_jax/envs/random_policy.py`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THRESHOLDS = {
    "actor_follow": (">=", 0.9),
    "actor_no_lesson_success": ("<=", 0.2),
    "actor_copies_other_family": ("<=", 0.2),
    "actor_other_family_success": ("<=", 0.25),
    "actor_plays_failed_verb": ("<=", 0.05),
    "extractor_right_after_success": (">=", 0.8),
    "extractor_false_claim_after_failure": ("<=", 0.05),
}


def trainer_for(rule_seed: int, workdir: str, extractor: str = "warm_extractor", models_dir: str = ""):
    from comprl_jax import config as config_lib
    from comprl_jax.loop.trainer import Trainer

    c = config_lib.load_file(os.path.join(REPO, "configs", "hidden_rule.py") + ":warm,static_online")
    with c.unlocked():
        c.seed = rule_seed  # the trainer passes it to HiddenRule as rule_seed
        c.extractor.model = extractor
        if models_dir:  # models written elsewhere (a fresh `make warm-start` into another folder)
            c.actor.model = os.path.join(models_dir, "actor")
            c.extractor.model = os.path.join(models_dir, extractor.removeprefix("warm_"))
    return Trainer(c, workdir)


def measure(rule_seeds, episodes: int, models_dir: str = "", log=print, room_tasks: int = 0) -> dict:
    from comprl_jax.warm import skills

    actor_rows, ext_rows, early_rows = [], [], []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for s in rule_seeds:
            rng = np.random.default_rng([s, 49, 2])
            k = skills.keys(1000 + s, 3)
            tr = trainer_for(s, os.path.join(tmp, f"a{s}"), models_dir=models_dir)
            try:
                actor_rows += skills.play_actor(tr, skills.actor_trials(s, episodes, rng), k[0])
                ext_rows += skills.write_lessons(tr, skills.extractor_trials(s, episodes, rng), k[1])
            finally:
                tr.close()
            if _has_early(models_dir):
                tr = trainer_for(s, os.path.join(tmp, f"e{s}"), "warm_extractor_early", models_dir)
                try:
                    early_rows += skills.write_lessons(tr, skills.extractor_trials(s, episodes, rng), k[2])
                finally:
                    tr.close()
            log(
                json.dumps({"bench": "warm_start_seed", "rule_seed": s, "wall_s": round(time.time() - t0, 1)})
            )
        room = room_figures(room_tasks, os.path.join(tmp, "room"), models_dir) if room_tasks else {}
    out = {"bench": "warm_start", "rule_seeds": list(rule_seeds), "episodes_per_condition_and_seed": episodes}
    out.update(skills.actor_figures(actor_rows))
    out.update(skills.extractor_figures(ext_rows))
    if early_rows:
        out.update(skills.extractor_figures(early_rows, "extractor_early"))
    out.update(room)
    for key in list(out):
        v = out[key]
        n_key = _n_of(key, out)
        if isinstance(v, float) and n_key:
            out[key] = round(v, 4)
            out[f"{key}_se"] = round(float(np.sqrt(max(v * (1 - v), 0.0) / n_key)), 4)
    out["thresholds_met"] = all(
        (out[k] >= t if op == ">=" else out[k] <= t) for k, (op, t) in THRESHOLDS.items()
    )
    out["failed_thresholds"] = [
        k for k, (op, t) in THRESHOLDS.items() if not (out[k] >= t if op == ">=" else out[k] <= t)
    ]
    out["wall_s"] = round(time.time() - t0, 1)
    return out


ROOM = "comprl/MiniHack-Room-5x5-v0"


def room_figures(tasks: int, workdir: str, models_dir: str = "") -> dict:
    """The warm actor on MiniHack Room-5x5 without a lesson, and the uniform-random floor at the same turns."""
    from comprl_jax import config as config_lib
    from comprl_jax.envs import random_policy, registry
    from comprl_jax.loop.trainer import Trainer

    c = config_lib.load_file(os.path.join(REPO, "configs", "minihack_room.py") + ":warm,static_online")
    with c.unlocked():
        c.env.tasks = (ROOM,)
        if models_dir:
            c.actor.model = os.path.join(models_dir, "actor")
            c.extractor.model = os.path.join(models_dir, "extractor")
    tr = Trainer(c, workdir)
    try:
        row = tr.evaluate(tasks, with_experience=False)[ROOM]
        turns = tr.limits[ROOM].max_turns
    finally:
        tr.close()
    env = registry.make(ROOM, max_turns=turns)
    try:
        rand = random_policy.play(env, 0, row["episodes"], turns, np.random.default_rng([49, 5]))
    finally:
        env.close()
    return {
        "room_actor_no_lesson_success": float(row["success"]),
        "room_actor_actions": float(row["actions"]),
        "room_random_success": float(np.mean(rand)),
        "room_episodes": int(row["episodes"]),
        "room_max_turns": int(turns),
    }


def _has_early(models_dir: str) -> bool:
    from comprl_jax.models import zoo

    folder = (
        os.path.join(models_dir, "extractor_early")
        if models_dir
        else os.path.join(zoo.WARM_DIR, "extractor_early")
    )
    return os.path.isfile(os.path.join(folder, "config.json"))


def _n_of(key: str, out: dict) -> int:
    """Episodes (distillations) behind a share, for its standard error; 0 for what is not a share."""
    per = out["episodes_per_condition_and_seed"] * len(out["rule_seeds"])
    if key.startswith("actor_"):
        for cond in ("follow", "no_lesson", "empty", "other_family", "failed"):
            if f"_{cond}" in key:
                return out.get(f"n_{cond}", 0)
        return 0
    if key in ("room_actor_no_lesson_success", "room_random_success"):
        return out["room_episodes"]
    if key.startswith("extractor") and not key.endswith("_n"):
        return 2 * per if key.endswith("right_after_success") else per
    return 0


_SEEDS = flags.DEFINE_list("rule_seeds", ["0", "1", "2"], "rule seeds (a run's rules each)")
_EPISODES = flags.DEFINE_integer("episodes", 128, "episodes (distillations) per condition and seed")
_MODELS = flags.DEFINE_string(
    "models", "", "a folder of actor/, extractor/, extractor_early/ (default: the shipped)"
)
_ROOM_TASKS = flags.DEFINE_integer(
    "room_tasks", 16, "MiniHack Room-5x5 plays of the fixed level (x group_size / 2 episodes; 0: skip Room)"
)


def main(argv):
    del argv
    seeds = [int(s) for s in _SEEDS.value]
    print(json.dumps(measure(seeds, _EPISODES.value, _MODELS.value, room_tasks=_ROOM_TASKS.value)))


if __name__ == "__main__":
    app.run(main)
