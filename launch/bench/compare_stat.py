"""The pre-registered statistic of launch/bench/compare_cpu.sh (issue 19), one JSON line per arm, then a table.

  python launch/bench/compare_stat.py --root=runs/compare_cpu

Per run (``ROOT/<method>_s<seed>``): training success of the free half (every episode for the baseline) and of the
guided half, each averaged over the second half of the logged steps (:func:`launch.tables.second_half_success`),
the first-half figure beside it, and the held-out eval at the end, without and with experience. Per arm: mean ±
standard error over seeds. Differences against the baseline are printed with their combined standard error.
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

_ROOT = flags.DEFINE_string("root", "runs/compare_cpu", "sweep directory written by compare_cpu.sh")
_RANDOM = flags.DEFINE_string(
    "random",
    "",
    "JSON lines of launch/bench/random_reference.py on the same levels (default ROOT/random.jsonl)",
)


def run_figures(run_dir: str) -> dict:
    rows = mlib.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    run = tables.load_run(run_dir)
    by_step = sorted({int(r["step"]) for r in rows if "success" in r})
    out = {
        "run": run["name"],
        "method": run["method"],
        "seed": run["seed"],
        "steps": len(by_step),
        "free_second_half": tables.second_half_success(rows, "free"),
        "guided_second_half": tables.second_half_success(rows, "guided"),
        "free_first_half": tables.second_half_success(rows, "free", first_half=True),
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


def main(argv):
    del argv
    runs = [
        run_figures(d)
        for d in sorted(glob.glob(os.path.join(_ROOT.value, "*_s*")))
        if os.path.isdir(d) and os.path.exists(os.path.join(d, "metrics.jsonl"))
    ]
    for r in runs:
        print(json.dumps({"bench": "compare_cpu_run", **r}))
    arms = {}
    for r in runs:
        arms.setdefault(r["method"], []).append(r)
    random_path = _RANDOM.value or os.path.join(_ROOT.value, "random.jsonl")
    if os.path.exists(random_path):  # the uniform-random floor on the same training and eval levels
        arms["uniform_random"] = [
            {
                "seed": r["seed"],
                "free_second_half": r["second_half"],
                "eval_without_exp": r["eval"],
                "free_first_half": r["first_half"],
            }
            for r in mlib.read_jsonl(random_path)
            if r.get("bench") == "random_reference"
        ]
    fields = (
        "free_first_half",
        "free_second_half",
        "guided_second_half",
        "eval_without_exp",
        "eval_with_exp",
        "wall_s",
    )
    summary = {}
    for method, rs in arms.items():
        summary[method] = {f: tables.mean_se([r.get(f) for r in rs]) for f in fields}
        print(
            json.dumps(
                {
                    "bench": "compare_cpu",
                    "method": method,
                    "seeds": [r["seed"] for r in rs],
                    **summary[method],
                }
            )
        )
    base = summary.get("baseline")
    lines = ["| arm | seeds | " + " | ".join(fields) + " |", "|---" * (len(fields) + 2) + "|"]
    for method, s in summary.items():
        cells = [tables._cell(s[f]) for f in fields]
        lines.append(f"| {method} | {len(arms[method])} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if base and base["free_second_half"]:
        for method, s in summary.items():
            if method == "baseline" or not s["free_second_half"]:
                continue
            (m1, e1, _), (m0, e0, _) = s["free_second_half"], base["free_second_half"]
            # one seed per arm has no standard error: se and z are null (json.dumps would write NaN, not JSON)
            se = math.sqrt(e1**2 + e0**2) if e1 is not None and e0 is not None else None
            z = (m1 - m0) / se if se else None
            print(
                json.dumps(
                    {
                        "bench": "compare_cpu_diff",
                        "method": method,
                        "vs": "baseline",
                        "free_second_half_diff": m1 - m0,
                        "se": se,
                        "z": z,
                    }
                )
            )


if __name__ == "__main__":
    app.run(main)
