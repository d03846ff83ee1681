"""The paper's result tables (SPEC §11) built from run directories, our numbers beside the paper's.

A run directory holds ``config.json`` (written by the trainer: experiment, method, seed, env.tasks, actor.model)
and ``eval.json`` (held-out evaluation)::

    {"without_exp": {LABEL: {"env_id", "split", "tasks", "success", "episodes", "infra_failed", "mean_reward",
                             "score", "actions"}, ...},
     "with_exp": {...}}           # only for runs with experience

LABEL is the env id, or ``"<env_id>@<split>"`` for a second held-out figure (ALFWorld ``valid_seen``).
``success`` is the binary success rate over ``episodes`` (infrastructure failures are left out of the
denominator and counted in ``infra_failed``). Older runs wrote ``{mode: {env_id: score}}``; they are read too.

Runs are grouped by (experiment, method, tasks, actor model): seeds of one group are averaged (mean ± standard
error, with their count). Table 1 takes the ``multitask3`` groups, the single-task table the one-task groups, and
the multi-task table every other group. Missing pieces show as "-", so tables can be built while runs go on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from comprl_jax.config import TASKS3

# SPEC §11, Table 1 (multi-task): "success / reward at the end of training". Which column is which: ALFWorld's
# reward is binary (+1 / -1, SPEC §10), so its figure in [0, 1] is the success rate; WebShop's is the graded
# attribute / option / price match that the WebShop literature reports as its "score" beside success (its paper
# figures, 0.81-0.87, sit where RL'd 7B models' scores do, above their success rates); MiniHack Room reports
# success. Our cells follow: success, score, success (TABLE1_METRIC); eval_table shows both for every env.
TABLE1_METRIC = {
    "comprl/MiniHack-Room-Ultimate-5x5-v0": "success",
    "comprl/WebShop-v0": "score",
    "comprl/ALFWorld-v0": "success",
}
PAPER_TABLE1 = {
    # The last value is the paper's printed average (its rounding, not ours).
    ("baseline", None): (0.68, 0.81, 0.72, 0.75),
    ("static_online", "with_exp"): (0.41, 0.67, 0.69, 0.59),
    ("static_online", "without_exp"): (0.39, 0.59, 0.64, 0.54),
    ("exp_only", None): (0.49, 0.37, 0.13, 0.33),
    ("complementary", "with_exp"): (0.78, 0.87, 0.82, 0.82),
    ("complementary", "without_exp"): (0.75, 0.84, 0.74, 0.78),
}
TABLE1_ENVS = TASKS3
TABLE1_EXPERIMENT = "multitask3"
_LABELS = {
    ("baseline", None): "Baseline",
    ("static_online", "with_exp"): "Static Online Exp. (eval with exp.)",
    ("static_online", "without_exp"): "Static Online Exp. (eval without exp.)",
    ("exp_only", None): "Exp. Only",
    ("complementary", "with_exp"): "Complementary RL (eval with exp.)",
    ("complementary", "without_exp"): "Complementary RL (eval without exp.)",
}
# SPEC §11: single task, Complementary RL over the baseline (curves only in the paper): about 1.3x.
PAPER_SINGLE_RATIO = {"comprl/MiniHack-Room-Ultimate-5x5-v0": 1.3, "comprl/ALFWorld-v0": 1.3}
# SPEC §11: task scaling, Complementary RL over the baseline with 3 and 6 tasks.
PAPER_SCALING_GAIN = {3: "+6.6%", 6: "+8.1%"}
MODES = ("with_exp", "without_exp")


# -- reading runs --------------------------------------------------------------------------------------
def normalize_eval(ev: Mapping[str, Any] | None) -> dict[str, dict[str, dict[str, Any]]]:
    """eval.json in the current format: ``{mode: {label: {"env_id", "split", "success", "episodes",
    "infra_failed", "mean_reward"}}}``. The old ``{mode: {env_id: score}}`` form becomes entries whose
    ``success`` is the recorded score and whose counts are None (``"old_format": True``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode, section in (ev or {}).items():
        if mode not in MODES or not isinstance(section, Mapping):
            continue
        out[mode] = {}
        for label, v in section.items():
            if isinstance(v, Mapping):
                env_id, _, split = label.partition("@")
                out[mode][label] = {
                    "env_id": v.get("env_id", env_id),
                    "split": v.get("split", split or None),
                    "tasks": v.get("tasks"),  # absent in runs before issue 28, as score and actions
                    "success": v.get("success"),
                    "episodes": v.get("episodes"),
                    "infra_failed": v.get("infra_failed"),
                    "mean_reward": v.get("mean_reward"),
                    "score": v.get("score"),
                    "actions": v.get("actions"),
                }
            else:
                out[mode][label] = {
                    "env_id": label,
                    "split": None,
                    "success": None if v is None else float(v),
                    "episodes": None,
                    "infra_failed": None,
                    "mean_reward": None,
                    "old_format": True,
                }
    return out


def load_run(run_dir: str) -> dict:
    """``{"dir", "name", "method", "experiment", "seed", "model", "tasks", "eval", "old_format"}`` of one run;
    raises naming the missing file."""
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(
            f"{cfg_path} not found: is {run_dir!r} a run directory written by launch/train.py?"
        )
    with open(cfg_path) as f:
        cfg = json.load(f)
    ev_path = os.path.join(run_dir, "eval.json")
    raw = None
    if os.path.exists(ev_path):
        with open(ev_path) as f:
            raw = json.load(f)
    ev = normalize_eval(raw)
    return {
        "dir": run_dir,
        "name": os.path.basename(os.path.normpath(run_dir)),
        "method": cfg.get("method"),
        "experiment": cfg.get("experiment"),
        "seed": cfg.get("seed"),
        "model": (cfg.get("actor") or {}).get("model"),
        "tasks": tuple(cfg.get("env", {}).get("tasks", ())),
        "eval": ev,
        "has_eval": raw is not None,
        "old_format": any(e.get("old_format") for s in ev.values() for e in s.values()),
    }


# -- numbers -------------------------------------------------------------------------------------------
def mean_se(values: Sequence[float]) -> tuple[float, float | None, int] | None:
    """``(mean, standard error, n)``; the error is None for one value; None for no values.
    Standard error = sample standard deviation (n - 1) / sqrt(n)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    n = len(vals)
    mean = sum(vals) / n
    if n == 1:
        return mean, None, 1
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return mean, math.sqrt(var / n), n


def second_half_success(
    rows: Sequence[Mapping[str, Any]], half: str = "free", first_half: bool = False
) -> float | None:
    """Mean per-step training success of one half over the second half of a run's steps (issue 19's
    pre-registered statistic). ``rows``: metrics.jsonl records with ``step``; ``half``: ``"free"`` (episodes
    without experience; a run without halves, the baseline, counts every episode as free) or ``"guided"``
    (None for a run without a guided half). Steps ``>= ceil(n / 2)`` of the ``n`` logged steps count: 12 steps ->
    steps 6..11 (``first_half=True``: the steps before that window instead, to read a trend against). Rows without
    that step's success (eval-only rows) are skipped."""
    by_step = {}
    for r in rows:
        if "step" in r and "success" in r:
            by_step[int(r["step"])] = r  # a resumed run logs a step again: the last record wins
    if not by_step:
        return None
    steps = sorted(by_step)
    cut = math.ceil(len(steps) / 2)
    tail = (steps[:cut] if first_half else steps[cut:]) or steps
    key = f"success/{half}"
    if half == "guided" and not any(key in by_step[s] for s in tail):
        return None
    vals = [by_step[s].get(key, by_step[s]["success"]) for s in tail]
    vals = [float(v) for v in vals if v is not None and not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else None


def _int(x) -> int | None:
    return None if x is None else int(x)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cell(stats) -> str:
    """``0.62 ± 0.05 (3)``: mean ± standard error over the seeds (their count); one seed: ``0.62 (1)``."""
    if stats is None:
        return "-"
    mean, se, n = stats
    return f"{mean:.2f} ± {se:.2f} ({n})" if se is not None else f"{mean:.2f} ({n})"


def _metric(run: dict, mode: str | None, label: str, metric: str = "success") -> float | None:
    """A run's success (or another ``metric`` of the eval row) on ``label`` for an eval mode (None = with
    experience if the run has it, else without)."""
    ev = run["eval"]
    section = ev.get(mode) if mode else (ev.get("with_exp") or ev.get("without_exp"))
    entry = (section or {}).get(label)
    return None if entry is None else entry.get(metric)


# -- grouping ------------------------------------------------------------------------------------------
def group_key(run: dict) -> tuple:
    return run["experiment"], run["method"], run["tasks"], run["model"]


def group_runs(runs: Sequence[dict]) -> list[dict]:
    """Runs of one (experiment, method, tasks, actor model), in first-seen order: ``{"key", "runs"}``.
    Tasks split ``task_scaling`` by mixture; the model keeps ``:tiny`` and real-model runs apart."""
    groups: dict[tuple, dict] = {}
    for r in runs:
        groups.setdefault(group_key(r), {"key": group_key(r), "runs": []})["runs"].append(r)
    return list(groups.values())


def placement(group: dict) -> str:
    """Which table a group goes to: ``"table1"``, ``"single"`` or ``"multi"``."""
    experiment, _, tasks, _ = group["key"]
    if experiment == TABLE1_EXPERIMENT:
        return "table1"
    return "single" if len(tasks) == 1 else "multi"


def _baseline_of(group: dict, groups: Sequence[dict]) -> dict | None:
    """The baseline group of the same experiment, tasks and model."""
    e, _, t, m = group["key"]
    return next((b for b in groups if b["key"] == (e, "baseline", t, m)), None)


def _group_label(group: dict, models: set) -> str:
    experiment, method, tasks, model = group["key"]
    return f"{method} [{model}]" if len(models) > 1 else str(method)


# -- tables --------------------------------------------------------------------------------------------
def table1(runs: Sequence[dict]) -> str:
    """Markdown Table 1: one row per (method, eval mode) and model; success per task and the average over the
    three tasks, ``ours / paper``; ours = mean ± standard error over seeds (count)."""
    groups = [g for g in group_runs(runs) if placement(g) == "table1"]
    models = {g["key"][3] for g in groups}
    head = "| method | " + " | ".join(e.split("/")[-1] for e in TABLE1_ENVS) + " | avg |"
    lines = [head, "|" + "---|" * (len(TABLE1_ENVS) + 2)]
    for (method, mode), paper in PAPER_TABLE1.items():
        matching = [g for g in groups if g["key"][1] == method] or [None]
        for g in matching:
            rs = g["runs"] if g else []
            cells = [mean_se([_metric(r, mode, e, TABLE1_METRIC[e]) for r in rs]) for e in TABLE1_ENVS]
            per_run_avg = []
            for r in rs:
                vals = [_metric(r, mode, e, TABLE1_METRIC[e]) for e in TABLE1_ENVS]
                if all(v is not None for v in vals):
                    per_run_avg.append(sum(vals) / len(vals))
            label = _LABELS[(method, mode)] + (f" [{g['key'][3]}]" if g and len(models) > 1 else "")
            body = " | ".join(f"{_cell(c)} / {p:.2f}" for c, p in zip(cells, paper[:-1], strict=True))
            lines.append(f"| {label} | {body} | {_cell(mean_se(per_run_avg))} / {paper[-1]:.2f} |")
    return (
        "\n".join(lines)
        + "\n\n(cells: ours / paper; ours = held-out success (WebShop: score, the graded reward), mean ± "
        "standard error over seeds (seed count))"
    )


def single_task_table(runs: Sequence[dict]) -> str:
    """One-task runs: success per method and eval mode, beside the baseline of the same experiment
    (ratio ours / the paper's ≈1.3x where SPEC §11 gives one)."""
    groups = [g for g in group_runs(runs) if placement(g) == "single"]
    models = {g["key"][3] for g in groups}
    lines = [
        "| experiment | env | method | eval | success | episodes | infra failed | x baseline (ours / paper) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        experiment, method, tasks, model = g["key"]
        base = _baseline_of(g, groups)
        labels = list(dict.fromkeys(lab for r in g["runs"] for s in r["eval"].values() for lab in s))
        modes = [m for m in MODES if any(m in r["eval"] for r in g["runs"])] or ["-"]
        for mode in modes:
            for label in labels or list(tasks):
                stats = mean_se([_metric(r, mode, label) for r in g["runs"]])
                entries = [r["eval"].get(mode, {}).get(label) or {} for r in g["runs"]]
                eps = [e.get("episodes") for e in entries if e.get("episodes") is not None]
                infra = [e.get("infra_failed") for e in entries if e.get("infra_failed") is not None]
                ratio = "-"
                if base and method != "baseline" and stats:
                    b = mean_se([_metric(r, "without_exp", label) for r in base["runs"]])
                    ratio = f"{stats[0] / b[0]:.2f}" if b and b[0] > 0 else "-"
                paper = PAPER_SINGLE_RATIO.get(label) if method == "complementary" else None
                lines.append(
                    f"| {experiment} | {label.split('/')[-1]} | {_group_label(g, models)} | "
                    f"{mode.replace('_exp', ' exp.').replace('_', ' ')} | {_cell(stats)} | "
                    f"{sum(eps) if eps else '-'} | {sum(infra) if infra else '-'} | "
                    f"{ratio} / {f'≈{paper:.1f}' if paper else '-'} |"
                )
    return "\n".join(lines)


def multi_task_table(runs: Sequence[dict]) -> str:
    """Multi-task runs other than Table 1 (task scaling, extractor capacity): success averaged over the tasks,
    and the relative gain over the baseline of the same experiment and tasks (paper: +6.6% / +8.1%)."""
    groups = [g for g in group_runs(runs) if placement(g) == "multi"]
    models = {g["key"][3] for g in groups}
    lines = [
        "| experiment | tasks | method | eval | success (mean over tasks) | vs baseline (ours / paper) |",
        "|---|---|---|---|---|---|",
    ]

    def per_run(rs, mode, tasks):
        out = []
        for r in rs:
            vals = [_metric(r, mode, e) for e in tasks]
            if all(v is not None for v in vals):
                out.append(sum(vals) / len(vals))
        return out

    for g in groups:
        experiment, method, tasks, model = g["key"]
        base = _baseline_of(g, groups)
        modes = [m for m in MODES if any(m in r["eval"] for r in g["runs"])] or ["-"]
        for mode in modes:
            stats = mean_se(per_run(g["runs"], mode, tasks))
            gain = "-"
            if base and method != "baseline" and stats:
                b = mean_se(per_run(base["runs"], "without_exp", tasks))
                gain = f"{100 * (stats[0] / b[0] - 1):+.1f}%" if b and b[0] > 0 else "-"
            paper = PAPER_SCALING_GAIN.get(len(tasks), "-") if method == "complementary" else "-"
            if experiment not in ("task_scaling", "multitask6"):
                paper = "-"
            lines.append(
                f"| {experiment} | {len(tasks)} | {_group_label(g, models)} | "
                f"{mode.replace('_exp', ' exp.').replace('_', ' ')} | {_cell(stats)} | {gain} / {paper} |"
            )
    return "\n".join(lines)


def placements(runs: Sequence[dict]) -> str:
    """Which run went where: one line per run (its table, group and seed, and what is missing)."""
    names = {"table1": "Table 1", "single": "single-task table", "multi": "multi-task table"}
    out = []
    for g in group_runs(runs):
        experiment, method, tasks, model = g["key"]
        seeds = [r["seed"] for r in g["runs"]]
        for r in g["runs"]:
            notes = []
            if not r["has_eval"]:
                notes.append(f"no eval.json yet: launch/evaluate.py --workdir={r['dir']}")
            elif r["old_format"]:
                notes.append(
                    "old eval.json format (scores as recorded; re-run launch/evaluate.py for success)"
                )
            else:
                eps = sum(e.get("episodes") or 0 for s in r["eval"].values() for e in s.values())
                infra = sum(e.get("infra_failed") or 0 for s in r["eval"].values() for e in s.values())
                notes.append(f"{eps} eval episodes, {infra} infra failures")
            if seeds.count(r["seed"]) > 1:
                notes.append(f"seed {r['seed']} appears {seeds.count(r['seed'])} times in this group")
            out.append(
                f"- {r['dir']} -> {names[placement(g)]}: {experiment} / {method} ({len(tasks)} task"
                f"{'s' if len(tasks) != 1 else ''}, {model}), seed {r['seed']}, "
                f"{len(g['runs'])} run{'s' if len(g['runs']) != 1 else ''} in the group; " + "; ".join(notes)
            )
    return "\n".join(out)


def report(runs: Sequence[dict]) -> str:
    """The markdown make_tables prints: the tables that have runs, then where every run went."""
    kinds = {placement(g) for g in group_runs(runs)}
    parts = []
    if "table1" in kinds:
        parts.append("## Table 1 (multi-task: MiniHack Room, WebShop, ALFWorld)\n\n" + table1(runs))
    if "single" in kinds:
        parts.append("## Single-task runs\n\n" + single_task_table(runs))
    if "multi" in kinds:
        parts.append(
            "## Other multi-task runs (task scaling, extractor capacity)\n\n" + multi_task_table(runs)
        )
    parts.append("## Runs (where each one went)\n\n" + placements(runs))
    return "\n\n".join(parts) + "\n"


# -- the eval line -------------------------------------------------------------------------------------
def eval_table(ev: Mapping[str, Any]) -> str:
    """Held-out evaluation as a small aligned table: one row per env (label) and its split, success / score /
    actions per episode / distinct tasks / episodes / infra failures, with and without experience."""
    ev = normalize_eval(ev)
    modes = [m for m in ("with_exp", "without_exp") if m in ev]
    labels = list(dict.fromkeys(lab for m in modes for lab in ev[m]))
    if not labels:
        return "held-out eval: no episodes"
    splits = {
        lab: next((ev[m][lab]["split"] for m in modes if lab in ev[m] and ev[m][lab]["split"]), None)
        for lab in labels
    }
    titles = {"with_exp": "with experience", "without_exp": "without experience"}
    sub = ("success", "score", "actions", "tasks", "episodes", "infra")
    widths = (7, 5, 7, 5, 8, 5)
    group_w = sum(widths) + 2 * (len(widths) - 1)
    env_w = max(len("held-out eval"), *(len(lab) for lab in labels))
    split_w = max([len("split")] + [len(v) for v in splits.values() if v]) if any(splits.values()) else 0

    def num(x, w, fmt):
        return f"{'-' if x is None else format(x, fmt):>{w}}"

    def left(env, split):
        return f"{env:<{env_w}}" + (f" | {split:<{split_w}}" if split_w else "")

    lines = [
        left("held-out eval", "") + "".join(f" | {titles[m]:^{group_w}}" for m in modes),
        left("env", "split")
        + " | ".join(
            [""] + ["  ".join(f"{s:>{w}}" for s, w in zip(sub, widths, strict=True)) for _ in modes]
        ),
    ]
    for lab in labels:
        row = left(lab, splits[lab] or "-")
        for m in modes:
            e = ev[m].get(lab, {})
            row += " | " + "  ".join(
                (
                    num(e.get("success"), widths[0], ".3f"),
                    num(e.get("score"), widths[1], ".3f"),
                    num(e.get("actions"), widths[2], ".1f"),
                    num(_int(e.get("tasks")), widths[3], "d"),
                    num(_int(e.get("episodes")), widths[4], "d"),
                    num(_int(e.get("infra_failed")), widths[5], "d"),
                )
            )
        lines.append(row)
    return "\n".join(line.rstrip() for line in lines)
