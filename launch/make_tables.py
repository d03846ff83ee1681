"""The paper's tables from run directories: Table 1 (multi-task), single-task runs, other multi-task runs.

  python launch/make_tables.py --runs=runs/mt3,runs/mt3_s1,runs/mt3_baseline,runs/room,runs/room_baseline
  python launch/make_tables.py --runs='runs/*' --plot=curves.png --out=tables.md

Runs are grouped by (experiment, method, tasks, actor model); the seeds of a group are averaged (held-out success,
mean ± standard error, with the seed count) and printed beside the paper's numbers. Each run's table and group is
listed at the end, with what is missing (e.g. no eval.json yet). `--plot` draws the training curves of every group
on shared axes (baseline against Complementary RL, like the paper's Fig. 6-7), seeds as a mean ± s.e. band.
"""

import glob
import os
import sys

from absl import flags

# the repo root on sys.path: launch/common.py imports as launch.common
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import common as lu

RUNS = flags.DEFINE_list("runs", [], "run directories (globs allowed), written by launch/train.py")
OUT = flags.DEFINE_string("out", "", "optional markdown output path")
PLOT = flags.DEFINE_string("plot", "", "optional PNG: every group's training curves on shared axes")
SMOOTH = flags.DEFINE_integer("smooth", 5, "moving-average window of the plot, in logged points")


def _expand(patterns: list[str]) -> list[str]:
    out = []
    for p in patterns:
        hits = sorted(glob.glob(p)) if glob.has_magic(p) else [p]
        if not hits:
            raise lu.LaunchError(f"--runs pattern {p!r} matches nothing", "check the path")
        out += [h for h in hits if not glob.has_magic(p) or os.path.exists(os.path.join(h, "config.json"))]
    seen = set()  # a run named twice (a path and a glob) counts once
    return [d for d in out if not (os.path.realpath(d) in seen or seen.add(os.path.realpath(d)))]


def main(argv):
    del argv
    lu.configure_logging(lu.flag_verbosity())
    from launch.tables import group_runs, load_run, report

    if not RUNS.value:
        raise lu.LaunchError("--runs is required", "e.g. --runs=runs/mt3,runs/mt3_baseline (globs allowed)")
    runs = [load_run(d) for d in _expand(RUNS.value)]
    text = report(runs)
    print(text)
    if OUT.value:
        with open(OUT.value, "w") as f:
            f.write(text)
    if PLOT.value:
        from comprl_jax.runtime.metrics import plot_curves

        curves = {}
        for g in group_runs(runs):
            experiment, method, tasks, model = g["key"]
            paths = [
                os.path.join(r["dir"], "metrics.jsonl")
                for r in g["runs"]
                if os.path.exists(os.path.join(r["dir"], "metrics.jsonl"))
            ]
            if paths:
                curves[f"{experiment} / {method}"] = paths
        print(f"plot: {plot_curves(curves, PLOT.value, smooth=SMOOTH.value)}")


if __name__ == "__main__":
    lu.run(main)
