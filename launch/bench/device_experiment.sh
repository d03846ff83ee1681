#!/usr/bin/env bash
# The warm models' comparison at a size the 2 CPU cores cannot afford (issue 49 point 6), for a GPU machine lent
# for a few minutes (the `device` tool; its `status` says at no cost whether this task has one). Offline: it runs on
# what the repository ships (the warm models) plus `.device/` carried beside the working tree (MiniLM in half
# precision: `python launch/bench/device_pack.py` first, then run this with carry=[".device"]), with the jax the GPU
# machine has. It prints the same `compare_warm` lines as launch/bench/compare_warm.py, for 5 seeds x 60 steps of
# the co-evolution pair (complementary vs static_online, the early extractor) and the baseline, within ~5 minutes.
#
#   bash launch/bench/device_experiment.sh [SEEDS="0 1 2 3 4"] [STEPS=60]
set -uo pipefail
SEEDS=${1:-"0 1 2 3 4"}
STEPS=${2:-60}
PY=${PY:-python3}
export COMPRL_MINILM=${COMPRL_MINILM:-$PWD/.device/minilm_f16}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp}
# preflight: what this machine's Python lacks is named, not discovered half-way through a run
missing=$("$PY" - <<'PY'
import importlib.util
need = ["jax", "flax", "optax", "orbax.checkpoint", "ml_collections", "absl", "safetensors", "tokenizers",
        "outlines_core", "gymnasium", "numpy", "tensorboardX", "matplotlib", "psutil", "rank_bm25", "rapidfuzz"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "{\"bench\": \"device_experiment\", \"error\": \"missing Python modules: $missing\"}"
  exit 3
fi
[ -f "$COMPRL_MINILM/config.json" ] || { echo "{\"bench\": \"device_experiment\", \"error\": \"no MiniLM at $COMPRL_MINILM: run launch/bench/device_pack.py and carry .device\"}"; exit 3; }
"$PY" -c "import jax; print({'bench': 'device_experiment', 'devices': [str(d) for d in jax.devices()]})"
start=$(date +%s)
# shellcheck disable=SC2086
"$PY" launch/bench/compare_warm.py --study=v2 --arms=baseline,complementary,static_online \
  --seeds="${SEEDS// /,}" --steps="$STEPS" --root="$OUT/compare_warm_device" --results="$OUT/compare_warm_results" \
  2>"$OUT/device_experiment.err" | grep '"bench"'
rc=${PIPESTATUS[0]}
echo "{\"bench\": \"device_experiment\", \"rc\": $rc, \"wall_s\": $(( $(date +%s) - start ))}"
[ -d "${OUT_DIR:-}" ] && cp -r "$OUT/compare_warm_results" "$OUT_DIR/" 2>/dev/null
exit $rc
