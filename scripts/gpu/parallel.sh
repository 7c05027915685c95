#!/usr/bin/env bash
# Several GPU scenarios side by side in one device call, each on GPUs of its own (a 4-GPU machine
# counts its held time once, whatever runs on it: four one-GPU scenarios at once cost what one does).
#   bash scripts/gpu/parallel.sh "SCENARIO" "SCENARIO=2" ...
# SCENARIO is run.sh's -k expression; "=N" gives it N GPUs (default 1), taken in order from the
# machine's. Each runs `scripts/gpu/run.sh SCENARIO` with CUDA_VISIBLE_DEVICES set, its figures under
# $OUT/pN/ and its console in $OUT/pN.log; agentrl is installed once first. Prints each scenario's
# result and the tail of its log; exits non-zero if any failed. Carry the kit parts as run.sh says.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/root/agentrl-gpu-out}; mkdir -p "$out"
[ $# -gt 0 ] || { echo "usage: parallel.sh SCENARIO[=GPUS] ..." >&2; exit 2; }
total=$(nvidia-smi --list-gpus | wc -l)
next=0; names=(); gpu_sets=()
for spec in "$@"; do  # every scenario's GPUs first: nothing starts if they do not all fit
  name=${spec%=*}; n=1; [ "$name" != "$spec" ] && n=${spec##*=}
  if [ $((next + n)) -gt "$total" ]; then
    echo "parallel.sh: '$name' needs $n GPU(s), only $((total - next)) left of $total" >&2; exit 2
  fi
  names+=("$name"); gpu_sets+=("$(seq -s, "$next" $((next + n - 1)))"); next=$((next + n))
done
bash "$repo/scripts/gpu/run.sh" install || exit 3
pids=()
for i in "${!names[@]}"; do
  mkdir -p "$out/p$i"
  echo "p$i: ${names[$i]} on GPU(s) ${gpu_sets[$i]}"
  CUDA_VISIBLE_DEVICES=${gpu_sets[$i]} AGENTRL_NO_INSTALL=1 AGENTRL_GPU_OUT="$out/p$i" \
    bash "$repo/scripts/gpu/run.sh" "${names[$i]}" > "$out/p$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then status=passed; else status="FAILED (exit $?)"; failed=1; fi
  echo "=== p$i: ${names[$i]}: $status"
  grep -v -e Warning -e warnings.warn "$out/p$i.log" | tail -n "${PARALLEL_TAIL:-25}"
done
exit $failed
