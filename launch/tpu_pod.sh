#!/usr/bin/env bash
# Complementary RL on a Cloud TPU pod slice (e.g. v5p-64: 8 hosts x 4 chips). JAX is multi-controller: every
# host runs the same program; `launch/train.py --distributed` calls jax.distributed.initialize(), which finds
# the coordinator, the process count and this host's id from the TPU metadata, then builds the meshes over all
# chips (config keys mesh.data / mesh.fsdp / mesh.tensor, mesh.placement, mesh.actor_fraction).
#
#   launch/tpu_pod.sh setup  TPU_NAME ZONE              # clone/update the repo + venv with jax[tpu] on all hosts
#   launch/tpu_pod.sh train  TPU_NAME ZONE CONFIG WORKDIR [--config.key=value ...]
#   launch/tpu_pod.sh stop   TPU_NAME ZONE              # kill a run on all hosts (frees the TPU)
#
# Example (the paper's Table 1 run, plain FSDP over the 32 chips; see WORKSPACE.md "Memory plans"):
#   launch/tpu_pod.sh train my-v5p-64 us-east5-a configs/minihack_room.py /mnt/shared/runs/room \
#       --config.mesh.data=1 --config.mesh.fsdp=-1 \
#       --config.actor.model=/mnt/shared/models/Qwen2.5-7B-Instruct \
#       --config.extractor.model=/mnt/shared/models/Qwen3-4B-Thinking-2507
# WORKDIR must be one directory every host sees (a Filestore/NFS mount or gcsfuse bucket): Orbax writes the
# checkpoint from all hosts, process 0 writes metrics, the experience store and plots.
# Env: REPO_URL (git remote to clone; default: this checkout's origin), REPO_DIR (default ~/comprl_jax),
#      DRY_RUN=1 prints the gcloud command instead of running it.
set -euo pipefail

usage() { sed -n '2,20p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
cmd=$1 tpu=$2 zone=$3
shift 3
repo_dir=${REPO_DIR:-'~/comprl_jax'}

remote() {  # run $1 on every host of the slice
  local args=(gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="$1")
  if [[ ${DRY_RUN:-0} == 1 ]]; then printf '%q ' "${args[@]}"; echo; else "${args[@]}"; fi
}

case $cmd in
  setup)
    url=${REPO_URL:-$(git -C "$(dirname "$0")/.." remote get-url origin 2>/dev/null || true)}
    [[ -n $url ]] || { echo "set REPO_URL to a git remote every host can clone" >&2; exit 2; }
    remote "set -e; [ -d $repo_dir ] || git clone $url $repo_dir; cd $repo_dir && git pull --ff-only && \
python3 -m venv .venv && .venv/bin/pip install -q 'setuptools<81' && .venv/bin/pip install -q -e '.[tpu]'"
    ;;
  train)
    [[ $# -ge 2 ]] || usage
    config=$1 workdir=$2
    shift 2
    extra=$(printf '%q ' "$@")
    remote "cd $repo_dir && .venv/bin/python launch/train.py --distributed --config=$config --workdir=$workdir $extra"
    ;;
  stop)
    remote "pkill -f 'launch/train.py' || true"
    ;;
  *) usage ;;
esac
