"""The paper's result tables (SPEC §11) built from run directories, our numbers beside the paper's.

A run directory holds ``config.json`` (written by the trainer: experiment, method, env.tasks) and ``eval.json``
(written by evaluation: ``{"with_exp": {env_id: score}, "without_exp": {env_id: score}}``). Missing pieces show
as "-" rather than failing, so a table can be built while runs are still going.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from comprl_jax.config import TASKS3

# SPEC §11, Table 1 (multi-task; success for MiniHack Room / WebShop, reward for ALFWorld).
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
_LABELS = {
    ("baseline", None): "Baseline",
    ("static_online", "with_exp"): "Static Online Exp. (eval with exp.)",
    ("static_online", "without_exp"): "Static Online Exp. (eval without exp.)",
    ("exp_only", None): "Exp. Only",
    ("complementary", "with_exp"): "Complementary RL (eval with exp.)",
    ("complementary", "without_exp"): "Complementary RL (eval without exp.)",
}


def load_run(run_dir: str) -> dict:
    """``{"dir", "method", "experiment", "tasks", "eval"}`` of one run; raises naming the missing file."""
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(
            f"{cfg_path} not found: is {run_dir!r} a run directory written by launch/train.py?"
        )
    with open(cfg_path) as f:
        cfg = json.load(f)
    ev_path = os.path.join(run_dir, "eval.json")
    ev = {}
    if os.path.exists(ev_path):
        with open(ev_path) as f:
            ev = json.load(f)
    return {
        "dir": run_dir,
        "method": cfg.get("method"),
        "experiment": cfg.get("experiment"),
        "tasks": tuple(cfg.get("env", {}).get("tasks", ())),
        "eval": ev,
    }


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table1(runs: Sequence[dict]) -> str:
    """Markdown Table 1: one row per (method, eval mode), ours / paper per task and the average."""
    head = "| method | " + " | ".join(e.split("/")[-1] for e in TABLE1_ENVS) + " | avg |"
    lines = [head, "|" + "---|" * (len(TABLE1_ENVS) + 2)]
    by_method = {r["method"]: r for r in runs}
    for (method, mode), paper in PAPER_TABLE1.items():
        run = by_method.get(method)
        ours = [None] * len(TABLE1_ENVS)
        if run and run["eval"]:
            section = run["eval"].get(mode or "with_exp") or run["eval"].get("without_exp") or {}
            ours = [section.get(e) for e in TABLE1_ENVS]
        avg_ours = sum(ours) / len(ours) if all(o is not None for o in ours) else None
        cells = [f"{_fmt(o)} / {p:.2f}" for o, p in zip(ours, paper[:-1], strict=True)]
        lines.append(
            f"| {_LABELS[(method, mode)]} | " + " | ".join(cells) + f" | {_fmt(avg_ours)} / {paper[-1]:.2f} |"
        )
    return "\n".join(lines) + "\n\n(cells: ours / paper)"


def summary(runs: Sequence[dict]) -> str:
    """Single-task and task-scaling summary: one row per run, mean score with and without experience."""
    lines = ["| run | experiment | method | tasks | with exp. | without exp. |", "|---|---|---|---|---|---|"]

    def mean(run, mode):
        vals = [v for v in (run["eval"].get(mode) or {}).values() if v is not None]
        return sum(vals) / len(vals) if vals else None

    for r in runs:
        lines.append(
            f"| {os.path.basename(os.path.normpath(r['dir']))} | {r['experiment']} | {r['method']} | "
            f"{len(r['tasks'])} | {_fmt(mean(r, 'with_exp'))} | {_fmt(mean(r, 'without_exp'))} |"
        )
    return "\n".join(lines)
