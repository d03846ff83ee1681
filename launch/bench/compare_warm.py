"""The paper's comparisons on the warm models, HiddenRule (issue 49 points 3-4). Pre-registered below; resumes by
arm; each finished run's figures land in ``notebooks/results/compare_warm/`` (committed with ``--commit``).

  python launch/bench/compare_warm.py [--commit]            # every arm x seed not yet in the results, then report
  python launch/bench/compare_warm.py --report               # the lines, table and plot from what is there
  python launch/bench/compare_warm.py --study=attempts3      # point 4: baseline vs complementary, attempts=3

PRE-REGISTRATION (written and committed before the first run of this comparison; nothing below changes after it)

Setting: `configs/hidden_rule.py:warm` (the shipped warm models; 8 tasks x 8 episodes a step, 4 guided + 4 free per
task; search & ask and the merge off, as the `warm` scale says), 30 steps, seeds 0, 1, 2 (rule seed = run seed).
Held-out evaluation at the end: 16 held-out tasks x 4 episodes = 64 episodes per mode (with / without experience)
per seed, on place names no training instance or corpus example has.

Arms (the config's method word) and extractors:
  baseline        outcome-only GRPO (no extractor)
  complementary   Complementary RL, the EARLY extractor (warm_extractor_early), which trains (CISPO)
  static_online   the same loop with the EARLY extractor frozen (the co-evolution pair with complementary)
  blank_exp       the loop with the guided block blanked, the full extractor (warm_extractor)
  self_distill    Complementary RL with self-distillation (coefficient 0.1), the full extractor

Primary statistic (decides issue 49): for `complementary`, held-out success with experience minus without, pooled
over the 3 seeds' episodes (192 per mode). Its standard error is the binomial one of a difference of two
proportions, sqrt(p1 (1 - p1) / n1 + p0 (1 - p0) / n0), beside the across-seed standard error of the per-seed
differences (3 values). An effect = the difference is at least 2 standard errors (the binomial one) above 0.
Expected: >= 0.3.

Secondary (reported for every arm, whichever way they come out): the free half's training success over the last
15 steps (the paper's "without experience"; compare_stat's statistic) and the guided half's, held-out success with
and without experience, actions per episode, bank size at the end, the extractor's mean reward, the share of
right lessons among those written after a success (a lesson names the episode's family and claims the verb that
opened it, `warm.corpus.lesson_is_right`) over the first and the second half of the steps, and the share of guided
episodes whose retrieved lesson states their family's rule as working, per half. Expected: the right-lesson share
rising under complementary and flat under static_online; the self_distill arm's free half above the baseline's.
What would count against the method: complementary's evaluation with experience not above without (the reading
or writing link broke: find which, measured), or complementary no better than static_online on right lessons.

SECOND PRE-REGISTRATION, `--study=v2` (written 2026-12-07 after `main` and before v2's first run; nothing of it
changes after that run). Why: `main` ran on the models of commit c4b3996, whose actor copied another family's lesson
0.755 of the time (its decision token sat at the mixture's base rate, 0.74), and at extractor lr 3e-4 the CISPO
update took the early extractor's right-lesson share from 0.36 to 0.09 in 30 steps (blank_exp's full extractor:
0.99 to 0.13); one exploratory run at 3e-5 (complementary, seed 0, `--set=extractor.lr=3e-5`) held it at 0.46 ->
0.47. v2 = `main`'s arms, extractors, seeds, steps, evaluation, statistics, expectations and counter-evidence, on
the models committed with this text (the actor after `actor_tune`) at the `:warm` scale's extractor lr 3e-5;
results in `notebooks/results/compare_warm/v2/`. Caveat known before the run, for both comparisons: the 4 held-out
episodes of a task share its instance and family and the 16 tasks repeat families (seed 0's draw: 10 families), so
the binomial standard error treats correlated episodes as independent; the across-seed one (3 seeds) does not.

Point 4 (`--study=attempts3`): `configs/hidden_rule.py:warm,attempts=3` (a wrong action resets the lock with
feedback, 3 tries), arms baseline and complementary (full extractor: the point is acting, not co-evolution),
seeds 0, 1, 2, 30 steps. Statistic: actions per success = total actions / successes over the held-out evaluation
(with experience for complementary, and without), and over the training episodes of the last 15 steps.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "notebooks", "results", "compare_warm")
STEPS = 30
SEEDS = (0, 1, 2)
# the five arms and their extractors (the co-evolution pair with the early one), the same in `main` and `v2`
MAIN_ARMS = {
    "baseline": "warm_extractor",
    "complementary": "warm_extractor_early",
    "static_online": "warm_extractor_early",
    "blank_exp": "warm_extractor",
    "self_distill": "warm_extractor",
}
STUDIES = {
    # `main` ran on the models of commit c4b3996 at the extractor lr of its day (3e-4, pinned here so that it
    # reproduces); `v2` on the models of its own pre-registration's commit, at the `:warm` scale's lr
    "main": {"variant": "warm", "overrides": ("extractor.lr=3e-4",), "arms": MAIN_ARMS},
    "v2": {"variant": "warm", "arms": MAIN_ARMS},
    "attempts3": {
        "variant": "warm,attempts=3",
        "arms": {"baseline": "warm_extractor", "complementary": "warm_extractor"},
    },
}


def arm_config(study: str, arm: str, seed: int, steps: int = STEPS, overrides: tuple[str, ...] = ()):
    """The arm's config; ``overrides`` (``key=value``, exploratory runs only, never the pre-registered ones) are
    cast to the type of the value they replace."""
    from comprl_jax import config as config_lib

    s = STUDIES[study]
    c = config_lib.load_file(os.path.join(REPO, "configs", "hidden_rule.py") + f":{s['variant']},{arm}")
    with c.unlocked():
        c.seed = seed
        c.train.steps = steps
        c.checkpoint.every = 5
        c.extractor.model = s["arms"][arm]
        for item in (*s.get("overrides", ()), *overrides):
            key, sep, value = item.partition("=")
            *path, leaf = key.split(".")
            node = c
            for part in path:
                node = node[part]
            if not sep or leaf not in node:
                raise ValueError(
                    f"--set {item!r}: give key=value with a key the config has (e.g. extractor.lr=3e-5)"
                )
            old = node[leaf]
            node[leaf] = (value.lower() in ("1", "true")) if isinstance(old, bool) else type(old)(value)
    return c


def _logging_trainer():
    """The trainer, plus one line per training episode (``episodes.jsonl``): its family, whether guided, the
    entries it was shown (read right after the rollout, before this step's distillation changes the bank), what
    it played and whether it won. A resumed run may log a step twice: readers keep the last."""
    from comprl_jax.envs.base import parse_answer
    from comprl_jax.loop.trainer import Trainer

    class LoggingTrainer(Trainer):
        def rollout(self, tasks, *, guided_ok, step, key):
            trajs, timing = super().rollout(tasks, guided_ok=guided_ok, step=step, key=key)
            with open(os.path.join(self.workdir, "episodes.jsonl"), "a") as f:
                for t in trajs:
                    row = {
                        "step": step,
                        "guided": t.spec.guided,
                        "goal": t.goal,
                        "entries": [self.track.entry_text(u) for u in t.spec.entry_uids]
                        if self.track
                        else [],
                        "played": [parse_answer(r) for _, r in t.transcript],
                        "success": bool(t.success),
                        "infra": bool(t.infra_failed),
                    }
                    f.write(json.dumps(row) + "\n")
            return trajs, timing

    return LoggingTrainer


def run_arm(
    study: str, arm: str, seed: int, root: str, steps: int = STEPS, overrides: tuple[str, ...] = ()
) -> dict:
    """Trains one arm x seed in ``root/<arm>_s<seed>`` (resuming), returns its figures."""
    from comprl_jax.loop import run as run_lib

    workdir = os.path.join(root, f"{arm}_s{seed}")
    t0 = time.time()
    trainer_cls = run_lib.Trainer
    run_lib.Trainer = _logging_trainer()
    try:
        run_lib.run(arm_config(study, arm, seed, steps, overrides), workdir, progress=False)
    finally:
        run_lib.Trainer = trainer_cls
    fig = run_figures(workdir, seed)
    fig.update(study=study, arm=arm, extractor=STUDIES[study]["arms"][arm], wall_s=round(time.time() - t0, 1))
    if overrides:
        fig["overrides"] = list(overrides)
    return fig


def _last_by_step(rows):
    by = {}
    for r in rows:
        by.setdefault(r["step"], []).append(r)
    return by


def run_figures(workdir: str, seed: int) -> dict:
    """One run's figures (see the pre-registration); reads metrics.jsonl, eval.json, episodes.jsonl, the op log."""
    from comprl_jax.envs import hidden_rule as hr
    from comprl_jax.runtime import metrics as mlib
    from comprl_jax.warm import corpus as C
    from launch import tables

    rules = hr.rules(seed)
    rows = mlib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    steps = sorted({int(r["step"]) for r in rows if "success" in r})
    half = math.ceil(len(steps) / 2)
    late = set(steps[half:])
    out: dict = {"seed": seed, "steps": len(steps)}
    out["free_second_half"] = tables.second_half_success(rows, "free")
    out["guided_second_half"] = tables.second_half_success(rows, "guided")
    out["free_first_half"] = tables.second_half_success(rows, "free", first_half=True)
    last = {int(r["step"]): r for r in rows}
    out["actions_second_half"] = _mean([last[s].get("actions_per_episode") for s in late])
    out["bank_size_end"] = last[steps[-1]].get("bank/size") if steps else None
    rewards = [r["extractor/reward_mean"] for r in rows if r.get("extractor/reward_mean") is not None]
    out["extractor_reward_mean"] = _mean(rewards)
    with open(os.path.join(workdir, "eval.json")) as f:
        ev = tables.normalize_eval(json.load(f))
    for mode in tables.MODES:
        for e in ev.get(mode, {}).values():
            out[f"eval_{mode}"] = e["success"]
            out[f"eval_{mode}_episodes"] = e["episodes"]
            out[f"eval_{mode}_actions"] = e.get("actions")
    # training episodes: the guided half's retrieved lesson, and actions per success over the last half
    eps_path = os.path.join(workdir, "episodes.jsonl")
    if os.path.exists(eps_path):
        by = _last_by_step(mlib.read_jsonl(eps_path))
        states, acts, wins = {0: [], 1: []}, 0, 0
        for s, batch in by.items():
            batch = (
                batch[-64:] if len(batch) > 64 else batch
            )  # (a resumed step logged twice: its last rollout)
            h = int(s in late)
            for e in batch:
                if e["infra"]:
                    continue
                fam = e["goal"].removeprefix("Open the ").split(" in the ")[0]
                if e["guided"]:
                    states[h].append(any(C.lesson_is_right(x, fam, rules[fam][0]) for x in e["entries"]))
                if h:
                    acts += len(e["played"])
                    wins += int(e["success"])
        out["guided_lesson_states_rule_first_half"] = _mean(states[0])
        out["guided_lesson_states_rule_second_half"] = _mean(states[1])
        out["train_actions_per_success_second_half"] = acts / wins if wins else None
    # the lessons the extractor wrote (op log of the last saved experience)
    exp = sorted(glob.glob(os.path.join(workdir, "experience", "*", "oplog.jsonl")), key=_step_of)
    if exp:
        right = {0: [], 1: []}
        for line in open(exp[-1]):
            op = json.loads(line)
            if (
                op.get("op") != "add"
                or op.get("kind", "distill") != "distill"
                or "Outcome: SUCCESS" not in op.get("prompt", "")
            ):
                continue
            fam = op["prompt"].split("Goal: Open the ", 1)[1].split(" in the ", 1)[0]
            h = int(int(op["step"]) >= (steps[half] if half < len(steps) else 1 << 30))
            right[h].append(C.lesson_is_right(op["text"], fam, rules[fam][0]))
        out["right_lessons_first_half"] = _mean(right[0])
        out["right_lessons_second_half"] = _mean(right[1])
        out["lessons_after_success"] = len(right[0]) + len(right[1])
    return out


def _step_of(path: str) -> int:
    return int(os.path.basename(os.path.dirname(path)))


def _mean(xs):
    xs = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else None


def results(study: str, where: str = RESULTS) -> dict[str, list[dict]]:
    """``{arm: [figures per seed]}`` recorded so far (under ``where/study``)."""
    out: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(where, study, "*.json"))):
        with open(path) as f:
            fig = json.load(f)
        out.setdefault(fig["arm"], []).append(fig)
    return out


def primary(figs: list[dict]) -> dict:
    """The pre-registered statistic for one arm's runs: pooled with-minus-without held-out success."""
    n1 = sum(f["eval_with_exp_episodes"] for f in figs)
    n0 = sum(f["eval_without_exp_episodes"] for f in figs)
    p1 = sum(f["eval_with_exp"] * f["eval_with_exp_episodes"] for f in figs) / n1
    p0 = sum(f["eval_without_exp"] * f["eval_without_exp_episodes"] for f in figs) / n0
    se = math.sqrt(p1 * (1 - p1) / n1 + p0 * (1 - p0) / n0)
    diffs = [f["eval_with_exp"] - f["eval_without_exp"] for f in figs]
    se_seeds = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else None
    d = p1 - p0
    return {
        "with_exp": p1, "without_exp": p0, "n_with": n1, "n_without": n0, "diff": d, "se": se,
        "z": d / se if se > 0 else None, "se_across_seeds": se_seeds, "per_seed_diffs": diffs,
        "effect": bool(se > 0 and d >= 2 * se),
    }  # fmt: skip


FIELDS = (
    "free_first_half", "free_second_half", "guided_second_half", "eval_without_exp", "eval_with_exp",
    "actions_second_half", "train_actions_per_success_second_half", "eval_with_exp_actions",
    "eval_without_exp_actions", "bank_size_end", "extractor_reward_mean", "right_lessons_first_half",
    "right_lessons_second_half", "guided_lesson_states_rule_first_half", "guided_lesson_states_rule_second_half",
)  # fmt: skip


def report(study: str, plot: bool = True, where: str = RESULTS) -> list[dict]:
    from launch import tables

    arms = results(study, where)
    lines = []
    for arm, figs in arms.items():
        line = {"bench": "compare_warm", "study": study, "arm": arm, "seeds": sorted(f["seed"] for f in figs)}
        for k in FIELDS:
            got = tables.mean_se([f.get(k) for f in figs])
            line[k] = (
                None
                if got is None
                else [round(got[0], 4), None if got[1] is None else round(got[1], 4), got[2]]
            )
        if all(f.get("eval_with_exp") is not None for f in figs):
            line["primary"] = primary(figs)
        if study == "attempts3":
            line["eval_actions_per_success"] = _actions_per_success(figs)
        lines.append(line)
        print(json.dumps(line))
    if plot and arms:
        runs = sorted(glob.glob(os.path.join(where, study, "*_s*", "metrics.jsonl")))
        if runs:
            from comprl_jax.runtime.metrics import plot_curves

            out = os.path.join(REPO, "notebooks", "figures", f"compare_warm_{study}.png")
            if where != RESULTS:  # (another sweep's curves, e.g. a device run's, go beside its results)
                out = os.path.join(where, f"compare_warm_{study}.png")
            plot_curves({os.path.basename(os.path.dirname(p)): p for p in runs}, out)
            print(json.dumps({"bench": "compare_warm_plot", "path": out}))
    return lines


def _actions_per_success(figs) -> dict:
    out = {}
    for mode in ("with_exp", "without_exp"):
        acts = wins = 0.0
        for f in figs:
            if f.get(f"eval_{mode}") is None:
                continue
            n = f[f"eval_{mode}_episodes"]
            acts += f[f"eval_{mode}_actions"] * n
            wins += f[f"eval_{mode}"] * n
        if wins:
            out[mode] = round(acts / wins, 3)
    return out


def record(study: str, fig: dict, workdir: str, commit: bool, where: str = RESULTS) -> None:
    """Writes one run's figures and metrics into the results folder (and commits them)."""
    import shutil

    d = os.path.join(where, study)
    os.makedirs(os.path.join(d, f"{fig['arm']}_s{fig['seed']}"), exist_ok=True)
    path = os.path.join(d, f"{fig['arm']}_s{fig['seed']}.json")
    with open(path, "w") as f:
        json.dump(fig, f, indent=1)
    for name in ("metrics.jsonl", "eval.json", "config.json"):
        shutil.copyfile(os.path.join(workdir, name), os.path.join(d, f"{fig['arm']}_s{fig['seed']}", name))
    if commit:
        subprocess.run(["git", "add", d], cwd=REPO, check=True)
        msg = f"compare_warm {study}: {fig['arm']} seed {fig['seed']} (eval with / without exp {fig.get('eval_with_exp')} / {fig.get('eval_without_exp')})"
        subprocess.run(["git", "commit", "-q", "-m", msg, "--", d], cwd=REPO, check=False)


def define_flags() -> None:
    """The command line (defined only when run as a script: importing this module defines no absl flag, so a
    test process that also loads launch/demo.py or plan_memory.py sees no duplicate ``--steps``/``--study``)."""
    flags.DEFINE_enum("study", "main", list(STUDIES), "which comparison")
    flags.DEFINE_string("root", "/tmp/compare_warm", "run directories (not kept: the results folder is)")
    flags.DEFINE_boolean("report", False, "only report what the results folder holds")
    flags.DEFINE_boolean("commit", False, "git-commit each run's results as it finishes")
    flags.DEFINE_list("arms", [], "only these arms (default: the study's)")
    flags.DEFINE_list("seeds", [str(s) for s in SEEDS], "seeds")
    flags.DEFINE_integer("steps", STEPS, "training steps per run (the pre-registered comparison: 30)")
    flags.DEFINE_string("results", RESULTS, "where each finished run's figures go")
    flags.DEFINE_list(
        "set",
        [],
        "exploratory config overrides key=value (need their own --results and --root: never the "
        "pre-registered comparison's)",
    )


def main(argv):
    del argv
    F = flags.FLAGS
    study = F.study
    where = F.results
    overrides = tuple(F.set)
    default_root = F["root"].default
    if overrides and (os.path.abspath(where) == os.path.abspath(RESULTS) or F.root == default_root):
        raise app.UsageError(
            "--set runs are exploratory: give them their own --results and --root (the pre-registered "
            f"comparison's results live in {RESULTS}, its runs in {default_root})"
        )
    if not F.report:
        done = {(a, f["seed"]) for a, fs in results(study, where).items() for f in fs}
        arms = F.arms or list(STUDIES[study]["arms"])
        for seed in [int(s) for s in F.seeds]:  # seed-major: a cut-short sweep stays balanced
            for arm in arms:
                if (arm, seed) in done:
                    continue
                root = os.path.join(F.root, study)
                fig = run_arm(study, arm, seed, root, F.steps, overrides)
                record(study, fig, os.path.join(root, f"{arm}_s{seed}"), F.commit, where)
                print(json.dumps({"bench": "compare_warm_run", **fig}), flush=True)
    report(study, where=where)


if __name__ == "__main__":
    define_flags()
    app.run(main)
