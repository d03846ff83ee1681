"""The warm models' skills on held-out material, frozen (issue 49 point 2): one JSON line, ``bench: "warm_start"``.

  python launch/bench/warm_start.py [--rule_seeds=0,1,2] [--episodes=128]

Per rule seed (a run's rules; the models never saw any), through the trainer of `configs/hidden_rule.py:warm`
(its rollout, constrained decoding, temperature and extractor call; `comprl_jax/warm/skills.py` says what each
condition is): the actor plays ``--episodes`` held-out episodes per condition, and the extractor (the full one and
the early one) writes ``--episodes`` distillations per condition. Thresholds (issue 49): actor_follow >= 0.9,
actor_no_lesson_success <= 0.2, actor_copies_other_family <= 0.2, actor_other_family_success <= 0.25,
actor_plays_failed_verb <= 0.05, extractor_right_after_success >= 0.8, extractor_false_claim_after_failure <= 0.05;
``thresholds_met`` says whether all hold. Figures are shares over all seeds' episodes, with their standard errors.
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


def measure(rule_seeds, episodes: int, models_dir: str = "", log=print) -> dict:
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
    out = {"bench": "warm_start", "rule_seeds": list(rule_seeds), "episodes_per_condition_and_seed": episodes}
    out.update(skills.actor_figures(actor_rows))
    out.update(skills.extractor_figures(ext_rows))
    if early_rows:
        out.update(skills.extractor_figures(early_rows, "extractor_early"))
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
    if key.startswith("extractor") and not key.endswith("_n"):
        return 2 * per if key.endswith("right_after_success") else per
    return 0


_SEEDS = flags.DEFINE_list("rule_seeds", ["0", "1", "2"], "rule seeds (a run's rules each)")
_EPISODES = flags.DEFINE_integer("episodes", 128, "episodes (distillations) per condition and seed")
_MODELS = flags.DEFINE_string(
    "models", "", "a folder of actor/, extractor/, extractor_early/ (default: the shipped)"
)


def main(argv):
    del argv
    print(json.dumps(measure([int(s) for s in _SEEDS.value], _EPISODES.value, _MODELS.value)))


if __name__ == "__main__":
    app.run(main)
