#!/usr/bin/env bash
# The paper's comparison at CPU scale (issue 19, WORKSPACE "Baseline vs Complementary RL on 2 CPU cores"):
# outcome-only baseline, Complementary RL and the blank-experience control arm, 3 seeds each, the same number of
# steps (so the same number of episodes and env steps per step), seed-major so a cut-short sweep stays balanced.
#
#   bash launch/bench/compare_cpu.sh [ROOT=runs/compare_cpu] [STEPS=12] [SEEDS="0 1 2"]
#   -> ROOT/<method>_s<seed>/{metrics.jsonl,eval.json,...}, then ROOT/table.md and ROOT/curves.png (make_tables)
# Environment: CONFIG (default configs/minihack_room.py:cpu), ARMS (default "baseline complementary blank_exp"),
# EXTRA (more --config.KEY=VALUE flags for every run). Issue 31's HiddenRule comparison (WORKSPACE "HiddenRule"):
#   CONFIG=configs/hidden_rule.py:cpu ARMS="baseline complementary blank_exp static_online" \
#     bash launch/bench/compare_cpu.sh runs/compare_hidden_rule 100
#
# Pre-registered statistic (fixed before the runs): per run, the training success of the free half (episodes
# without experience; every episode for the baseline) averaged over the second half of the steps; per arm the mean
# +- standard error over seeds. Secondary: held-out eval success at the end, without and with experience.
# Floor: a uniform-random policy on the same training and eval levels (launch/bench/random_reference.py).
set -euo pipefail
ROOT=${1:-runs/compare_cpu}
STEPS=${2:-12}
SEEDS=${3:-"0 1 2"}
PY=${PY:-.venv/bin/python}
CONFIG=${CONFIG:-configs/minihack_room.py:cpu}
ARMS=${ARMS:-"baseline complementary blank_exp"}
EXTRA=${EXTRA:-}
mkdir -p "$ROOT"
for seed in $SEEDS; do
  for method in $ARMS; do
    dir="$ROOT/${method}_s${seed}"
    start=$(date +%s)
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    "$PY" launch/train.py --config="$CONFIG","$method" --workdir="$dir" \
      --config.seed="$seed" --config.train.steps="$STEPS" --config.checkpoint.every="$STEPS" $EXTRA \
      > "$dir.log" 2>&1
    echo "{\"run\": \"$dir\", \"wall_s\": $(( $(date +%s) - start ))}" | tee -a "$ROOT/walls.jsonl"
  done
done
"$PY" launch/bench/random_reference.py --config="$CONFIG" --seeds="${SEEDS// /,}" \
  --steps="$STEPS" | grep '"bench"' > "$ROOT/random.jsonl"
"$PY" launch/make_tables.py --runs="$ROOT/*" --out="$ROOT/table.md" --plot="$ROOT/curves.png"
"$PY" launch/bench/compare_stat.py --root="$ROOT"
