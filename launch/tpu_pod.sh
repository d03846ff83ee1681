#!/usr/bin/env bash
# Complementary RL on a Cloud TPU pod slice (e.g. v5p-64: 8 hosts x 4 chips). JAX is multi-controller: every
# host runs the same program. The recipe starts it itself, the same on a real slice and on the local stand-ins
# (tests/standins/gcloud): it asks gcloud for the slice's worker addresses, then starts `launch/train.py` on each
# worker i, detached, with --coordinator=<worker 0's address>:PORT --num_processes=N --process_id=i (JAX detects a
# pod by itself only on TPU hardware), its output in LOG_DIR/host<i>.log and its exit status in
# LOG_DIR/host<i>.exit. It then supervises: it polls the exit files through worker 0 every POLL_S seconds, and
# when one host fails it stops the others and prints that host's reason; it returns when every host has ended
# (DETACH=1 returns at once). Interrupting the supervisor leaves the run going: `logs`, `wait` and `stop` reach it.
#
#   launch/tpu_pod.sh setup  TPU_NAME ZONE              # the repo at this checkout's commit + venv with jax[tpu]
#   launch/tpu_pod.sh train  TPU_NAME ZONE CONFIG WORKDIR [--config.key=value ...]
#   launch/tpu_pod.sh wait   TPU_NAME ZONE WORKDIR      # supervise a started run until it ends
#   launch/tpu_pod.sh logs   TPU_NAME ZONE WORKDIR      # the last lines of every host's log
#   launch/tpu_pod.sh stop   TPU_NAME ZONE [WORKDIR]    # kill the run (of WORKDIR) on all hosts (frees the TPU)
#
# The commands of a paper table (meshes, models, flags) come from launch/reproduce.py --launcher=tpu_pod, which
# prints one `launch/tpu_pod.sh train ...` line per run and runs them in order with --execute.
# WORKDIR must be one directory every host sees (a Filestore/NFS mount or gcsfuse bucket): Orbax writes the
# checkpoint from all hosts, process 0 writes metrics, the experience store and plots.
# Env: REPO_URL (git remote to clone; default: this checkout's origin), REPO_DIR (default ~/comprl_jax),
#      LOG_DIR (default WORKDIR/logs: must be shared too, the supervisor reads it through worker 0),
#      COORDINATOR_PORT (default 8476), POLL_S (default 60), DETACH=1,
#      DRY_RUN=1 prints the gcloud commands instead of running them (for DRY_RUN_HOSTS, default "HOST0;HOST1").
set -euo pipefail

usage() { sed -n '2,25p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
cmd=$1 tpu=$2 zone=$3
shift 3
repo_dir=${REPO_DIR:-'~/comprl_jax'}
poll_s=${POLL_S:-60}

gc() {  # one gcloud call (printed instead under DRY_RUN)
  local args=(gcloud compute tpus tpu-vm "$@")
  if [[ ${DRY_RUN:-0} == 1 ]]; then printf '%q ' "${args[@]}"; echo; else "${args[@]}"; fi
}
on() {  # on WORKER (all, or an index) run COMMAND
  gc ssh "$tpu" --zone="$zone" --worker="$1" --command="$2"
}
hosts() {  # the slice's worker addresses, worker 0 first, one per line
  local ips
  if [[ ${DRY_RUN:-0} == 1 ]]; then ips=${DRY_RUN_HOSTS:-HOST0;HOST1}
  else ips=$(gcloud compute tpus tpu-vm describe "$tpu" --zone="$zone" --format='value(networkEndpoints[].ipAddress)')
  fi
  tr ';' '\n' <<<"$ips" | sed '/^$/d'
}
log_dir() { echo "${LOG_DIR:-$1/logs}"; }

supervise() {  # LOGS N WORKDIR: until every host's exit file is there; a failure stops the others
  local logs n=$2 workdir=$3 status failed code i
  logs=$(printf %q "$1")
  while true; do
    # one line per host: its exit status, or "-" while it runs
    if ! status=$(on 0 "for i in \$(seq 0 $((n - 1))); do cat $logs/host\$i.exit 2>/dev/null || echo -; done"); then
      echo "tpu_pod: could not reach worker 0 to poll the hosts; trying again in ${poll_s}s" >&2
      sleep "$poll_s"
      continue
    fi
    mapfile -t codes <<<"$status"
    failed=
    for i in "${!codes[@]}"; do
      code=${codes[$i]}
      if [[ $code != - && $code != 0 ]]; then failed=$i; break; fi
    done
    if [[ -n $failed ]]; then
      echo "tpu_pod: host $failed exited with ${codes[$failed]}; stopping the other hosts. Its log ends:" >&2
      on 0 "tail -n 40 $logs/host$failed.log" >&2 || true
      stop_all "$workdir"
      # every host's exit status is written before we return (a stopped host's is its signal's)
      on 0 "for i in \$(seq 0 $((n - 1))); do for t in \$(seq 60); do [ -e $logs/host\$i.exit ] && break; sleep 1; done; done" || true
      return "${codes[$failed]}"
    fi
    if [[ ! " ${codes[*]} " =~ " - " ]] && [[ ${#codes[@]} -eq $n ]]; then
      echo "tpu_pod: all $n hosts finished (logs: $logs)" >&2
      return 0
    fi
    sleep "$poll_s"
  done
}

stop_all() {  # [WORKDIR]: only that run's trainers (the stand-ins put every "host" on one machine)
  # the python process alone: not the remote shell that runs pkill, nor the bash that writes the exit status once
  # the trainer ends; TERM, then KILL after a grace
  local pat="^[^ ]*python[^ ]* launch/train[.]py"
  [[ $# -ge 1 ]] && pat="$pat .*--workdir=$1( |\$)"
  pat=$(printf %q "$pat")
  on all "pkill -f $pat; sleep ${STOP_GRACE_S:-5}; pkill -9 -f $pat; true"
}

case $cmd in
  setup)
    url=${REPO_URL:-$(git -C "$(dirname "$0")/.." remote get-url origin 2>/dev/null || true)}
    [[ -n $url ]] || { echo "set REPO_URL to a git remote every host can clone" >&2; exit 2; }
    commit=$(git -C "$(dirname "$0")/.." rev-parse HEAD)
    on all "set -e; [ -d $repo_dir ] || git clone -q $url $repo_dir; cd $repo_dir && git fetch -q origin && \
{ git checkout -q --detach $commit || { echo \"commit $commit is not on $url: push it first\" >&2; exit 1; }; } && \
python3 -m venv .venv && .venv/bin/pip install -q 'setuptools<81' && .venv/bin/pip install -q -e '.[tpu]'"
    ;;
  train)
    [[ $# -ge 2 ]] || usage
    config=$1 workdir=$2
    shift 2
    mapfile -t addr < <(hosts)
    n=${#addr[@]}
    [[ $n -ge 1 ]] || { echo "tpu_pod: gcloud lists no worker of $tpu in $zone" >&2; exit 1; }
    coordinator="${addr[0]}:${COORDINATOR_PORT:-8476}"
    logs=$(log_dir "$workdir")
    qlogs=$(printf %q "$logs")
    for i in "${!addr[@]}"; do
      argv=(.venv/bin/python launch/train.py "--coordinator=$coordinator" "--num_processes=$n" "--process_id=$i"
            "--config=$config" "--workdir=$workdir" "$@")
      run="$(printf '%q ' "${argv[@]}")> $qlogs/host$i.log 2>&1; echo \$? > $qlogs/host$i.exit"
      # detached: the run outlives this ssh session; its exit status lands beside its log
      # (only the nohup in the background: a backgrounded `a && b &` list would hold the ssh session's output open
      # until the run ends)
      start="cd $repo_dir && mkdir -p $qlogs && rm -f $qlogs/host$i.exit && \
{ nohup bash -c $(printf '%q' "$run") > /dev/null 2>&1 < /dev/null & }"
      if [[ ${DRY_RUN:-0} == 1 ]]; then on "$i" "$start"; else on "$i" "$start" & fi
    done
    wait
    echo "tpu_pod: started on $n hosts (coordinator $coordinator); logs in $logs" >&2
    [[ ${DETACH:-0} == 1 || ${DRY_RUN:-0} == 1 ]] && exit 0
    supervise "$logs" "$n" "$workdir"
    ;;
  wait)
    [[ $# -ge 1 ]] || usage
    mapfile -t addr < <(hosts)
    supervise "$(log_dir "$1")" "${#addr[@]}" "$1"
    ;;
  logs)
    [[ $# -ge 1 ]] || usage
    on 0 "tail -n 20 $(printf %q "$(log_dir "$1")")/host*.log"
    ;;
  stop)
    stop_all "$@"
    ;;
  *) usage ;;
esac
