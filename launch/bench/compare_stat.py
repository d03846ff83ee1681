"""The pre-registered statistic of launch/bench/compare_cpu.sh (issues 19, 31), one JSON line per arm, then a table.

  python launch/bench/compare_stat.py --root=runs/compare_cpu

Per run (``ROOT/<method>_s<seed>``): training success of the free half (every episode for the baseline) and of the
guided half, each averaged over the second half of the logged steps (:func:`launch.tables.second_half_success`),
the first-half figure beside it, and the held-out eval at the end, without and with experience. Per arm: mean ±
standard error over seeds, one line per arm: ``{"bench": "compare", "env", "arm", "seeds", "statistic", "mean",
"se", "secondary": {name: [mean, se, n]}}``; then a markdown table, then each arm's difference from the baseline
with its combined standard error (``bench: "compare_diff"``).
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys

from absl import app, flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from comprl_jax.runtime import metrics as mlib
from launch import tables


def second_half_mean(rows, key: str) -> float | None:
    """Mean of ``key`` over the second half of the logged steps (the window of the statistic)."""
    by_step = {int(r["step"]): r for r in rows if "step" in r and key in r}
    steps = sorted(by_step)[math.ceil(len(by_step) / 2) :]
    vals = [float(by_step[s][key]) for s in steps if by_step[s][key] is not None]
    return sum(vals) / len(vals) if vals else None


def run_figures(run_dir: str) -> dict:
    rows = mlib.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    run = tables.load_run(run_dir)
    by_step = sorted({int(r["step"]) for r in rows if "success" in r})
    out = {
        "run": run["name"],
        "env": run["tasks"][0] if len(run["tasks"]) == 1 else "+".join(run["tasks"]),
        "method": run["method"],
        "seed": run["seed"],
        "steps": len(by_step),
        "free_second_half": tables.second_half_success(rows, "free"),
        "guided_second_half": tables.second_half_success(rows, "guided"),
        "free_first_half": tables.second_half_success(rows, "free", first_half=True),
        "actions_second_half": second_half_mean(rows, "actions_per_episode"),
    }
    for mode in tables.MODES:
        sec = run["eval"].get(mode, {})
        for label, e in sec.items():
            out[f"eval_{mode}"] = e["success"]
            out[f"eval_{mode}_episodes"] = e["episodes"]
            out["eval_label"] = label
    walls = os.path.join(os.path.dirname(run_dir), "walls.jsonl")
    if os.path.exists(walls):
        for w in mlib.read_jsonl(walls):
            if os.path.basename(w["run"]) == run["name"]:
                out["wall_s"] = w["wall_s"]
    return out


FIELDS = (
    "free_first_half",
    "free_second_half",
    "guided_second_half",
    "eval_without_exp",
    "eval_with_exp",
    "actions_second_half",
    "wall_s",
)
STATISTIC = "free_second_half"  # the pre-registered one (compare_cpu.sh's header)


def collect(root: str, random_path: str = "") -> dict[str, list[dict]]:
    """``{arm: [run figures, one per seed]}`` of the runs under ``root`` (``<method>_s<seed>``), plus
    ``"uniform_random"`` from ``random_path`` (default ``root/random.jsonl``) where that file exists."""
    runs = [
        run_figures(d)
        for d in sorted(glob.glob(os.path.join(root, "*_s*")))
        if os.path.isdir(d) and os.path.exists(os.path.join(d, "metrics.jsonl"))
    ]
    if not runs:
        raise SystemExit(f"no run directories with metrics.jsonl under --root={root!r}")
    arms: dict[str, list[dict]] = {}
    for r in runs:
        arms.setdefault(r["method"], []).append(r)
    random_path = random_path or os.path.join(root, "random.jsonl")
    if os.path.exists(random_path):  # the uniform-random floor on the same training and eval levels
        arms["uniform_random"] = [
            {
                "seed": r["seed"],
                "env": r.get("env"),
                "free_second_half": r["second_half"],
                "eval_without_exp": r["eval"],
                "free_first_half": r["first_half"],
            }
            for r in mlib.read_jsonl(random_path)
            if r.get("bench") == "random_reference"
        ]
    return arms


def arm_lines(arms: dict[str, list[dict]]) -> list[dict]:
    """One ``bench: "compare"`` record per arm: the pre-registered statistic's mean and standard error over seeds
    (``se`` None for one seed), the secondary figures as ``{name: [mean, se, n]}``."""
    out = []
    for arm, rs in arms.items():
        stat = tables.mean_se([r.get(STATISTIC) for r in rs])
        envs = sorted({e for r in rs for e in ([r["env"]] if r.get("env") else [])})
        out.append(
            {
                "bench": "compare",
                "env": envs[0] if len(envs) == 1 else envs,
                "arm": arm,
                "seeds": [r["seed"] for r in rs],
                "statistic": STATISTIC,
                "mean": None if stat is None else stat[0],
                "se": None if stat is None else stat[1],
                "secondary": {
                    f: (list(v) if (v := tables.mean_se([r.get(f) for r in rs])) else None)
                    for f in FIELDS
                    if f != STATISTIC
                },
            }
        )
    return out


def diff_lines(lines: list[dict]) -> list[dict]:
    """Each arm's statistic minus the baseline's, with the combined standard error and z (None with one seed)."""
    base = next((x for x in lines if x["arm"] == "baseline"), None)
    if base is None or base["mean"] is None:
        return []
    out = []
    for x in lines:
        if x["arm"] == "baseline" or x["mean"] is None:
            continue
        # one seed per arm has no standard error: se and z are null (json.dumps would write NaN, not JSON)
        se = (
            math.sqrt(x["se"] ** 2 + base["se"] ** 2)
            if x["se"] is not None and base["se"] is not None
            else None
        )
        diff = x["mean"] - base["mean"]
        out.append(
            {
                "bench": "compare_diff",
                "env": x["env"],
                "arm": x["arm"],
                "vs": "baseline",
                "statistic": STATISTIC,
                "diff": diff,
                "se": se,
                "z": diff / se if se else None,
            }
        )
    return out


def main(argv):
    del argv
    arms = collect(_ROOT.value, _RANDOM.value)
    for rs in arms.values():
        for r in rs:
            if "run" in r:
                print(json.dumps({"bench": "compare_run", **r}))
    lines = arm_lines(arms)
    for x in lines:
        print(json.dumps(x))
    table = ["| arm | seeds | " + " | ".join(FIELDS) + " |", "|---" * (len(FIELDS) + 2) + "|"]
    for arm, rs in arms.items():
        cells = [tables._cell(tables.mean_se([r.get(f) for r in rs])) for f in FIELDS]
        table.append(f"| {arm} | {len(rs)} | " + " | ".join(cells) + " |")
    print("\n".join(table))
    for x in diff_lines(lines):
        print(json.dumps(x))


if __name__ == "__main__":
    # flags defined here, not at import: tests load this module beside launch/reproduce.py, which has --root too
    _ROOT = flags.DEFINE_string("root", "runs/compare_cpu", "sweep directory written by compare_cpu.sh")
    _RANDOM = flags.DEFINE_string(
        "random",
        "",
        "JSON lines of launch/bench/random_reference.py on the same levels (default ROOT/random.jsonl)",
    )
    app.run(main)
