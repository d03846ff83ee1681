"""Builds the paper's Table 1 layout and single-task / task-scaling summaries from run directories.

  python launch/make_tables.py --runs=runs/mt3,runs/mt3_baseline,runs/mt3_static,runs/mt3_exponly
Prints markdown; `--out=tables.md` also writes it; `--plot=curves.png` draws every run's success and actions per
episode on shared axes (baseline against Complementary RL, like the paper's Fig. 6-7).
"""

from absl import app, flags

from comprl_jax.tables import load_run, summary, table1

FLAGS = flags.DEFINE_list("runs", [], "run directories (written by launch/train.py + launch/evaluate.py)")
OUT = flags.DEFINE_string("out", "", "optional markdown output path")
PLOT = flags.DEFINE_string(
    "plot", "", "optional PNG: success and actions per episode of every run (Fig. 6-7)"
)


def main(argv):
    del argv
    if not FLAGS.value:
        raise app.UsageError("--runs=dir1,dir2,... is required")
    runs = [load_run(d) for d in FLAGS.value]
    text = "## Table 1 (multi-task)\n\n" + table1(runs) + "\n\n## Runs\n\n" + summary(runs) + "\n"
    print(text)
    if OUT.value:
        with open(OUT.value, "w") as f:
            f.write(text)
    if PLOT.value:
        import os

        from comprl_jax.metrics import plot_curves

        curves = {
            f"{r['method']} ({os.path.basename(os.path.normpath(r['dir']))})": os.path.join(
                r["dir"], "metrics.jsonl"
            )
            for r in runs
            if os.path.exists(os.path.join(r["dir"], "metrics.jsonl"))
        }
        print(f"plot: {plot_curves(curves, PLOT.value)}")


if __name__ == "__main__":
    app.run(main)
