#!/usr/bin/env bash
# On the lent GPU machine, from the project root (see build_kit.sh for the kit):
#   bash scripts/gpu/run.sh unpack          unpack the carried kit parts (a, b) into $AGENTRL_KIT
#   bash scripts/gpu/run.sh list            the scenarios (tests/gpu)
#   bash scripts/gpu/run.sh install         unpack and install agentrl only (scripts/gpu/parallel.sh calls it)
#   bash scripts/gpu/run.sh SCENARIO [...]  unpack what is carried, install agentrl from this tree as
#                                           a wheel, run `pytest tests/gpu -k SCENARIO` (a -k expression:
#                                           "colocated and megatron", "1_5b", "tool_envs", "fp8_rollout",
#                                           "opd_served", "cp2_32k": CP=2 at 32k tokens on 2 GPUs); each scenario's
#                                           figures and metrics go to $OUT (or $AGENTRL_GPU_OUT);
#                                           AGENTRL_NO_INSTALL=1: use the agentrl an earlier call installed
#                                           (scenarios run side by side on different GPUs install once)
#   bash scripts/gpu/run.sh "mtp_training and plain"   one GPU: MiMo's MTP layer trained colocated (issue 33);
#                                           "mtp_training and eagle": the same with SGLang's EAGLE draft on it
#   bash scripts/gpu/run.sh vlm_sglang      one GPU, ~3 min each: a random Qwen2-VL served by SGLang with images
#                                           (--multimodal-keys), trained by the PyTorch trainer and by the
#                                           Megatron one ("vlm_sglang and torch" / "vlm_sglang and megatron") (issue 33)
#   bash scripts/gpu/run.sh weight_sync_1p5b  one GPU, ~3 min: the 1.5B shape's colocated weight sync by
#                                           payload layout and bucket size (bench/weight_sync_bench.py)
#   AGENTRL_DEMOS_BESIDE="math-python code" bash scripts/gpu/run.sh SCENARIO   the SFT scenarios' demonstrations
#                                           made on the machine's CPUs beside a GPU scenario (tests/gpu/make_demos.py)
#   bash scripts/gpu/run.sh "1_5b_memory_flat and micro8"   the 1.5B colocated run, 8 samples a micro-batch;
#                                           "... and tokens32k": packed to 32k tokens; each prints its train-step MFU
# Performance scenarios (issue 34, tests/gpu/test_perf_gpu.py), each under 8 minutes:
#   bash scripts/gpu/run.sh "startup_1p5b and not prefill_graphs"   a 2-iteration 1.5B colocated run, twice (cold and warm caches; "... and prefill_graphs": with SGLang's prefill CUDA graphs)
#   bash scripts/gpu/run.sh rollout_phase_vs_bare   the rollout phase's ratio to a bare client, and its gap
#                                               part by part (bench/rollout_breakdown.py)
#   bash scripts/gpu/run.sh async_repeats       (2 GPUs) sync vs async repeated, median and spread;
#                                               AGENTRL_ASYNC_APPEND=1 on later calls adds repeats to one report
set -euo pipefail
# the call's clock for AGENTRL_GPU_BUDGET_S: unpacking part b and installing agentrl take ~30-60 s before
# pytest starts (a budget counted from there let `timeout 595` cut a run before its own stop, 2026-12-07)
export AGENTRL_CALL_STARTED=${AGENTRL_CALL_STARTED:-$(date +%s)}
repo=$(cd "$(dirname "$0")/../.." && pwd)
kit=${AGENTRL_KIT:-/root/agentrl-kit}; site=$kit/site
mkdir -p "$site"

unpack() {
  # each part's bytecode compiled as it lands, as pip does for a user: a first import that compiles
  # it (SGLang, Megatron, transformers) would be counted in the first run's start-up
  if [ -f "$repo/.gpukit/a/sglang.tar.xz" ] && [ ! -f "$kit/a.done" ]; then
    tar xJf "$repo/.gpukit/a/sglang.tar.xz" -C "$site"
    python3 -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true  # a file of another Python's syntax fails alone
    touch "$kit/a.done"
  fi
  if [ -f "$repo/.gpukit/b/ray.tar.xz" ] && [ ! -f "$kit/b.done" ]; then
    tar xJf "$repo/.gpukit/b/ray.tar.xz" -C "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$repo"/.gpukit/b/wheels/*.whl
    for deb in "$repo"/.gpukit/b/debs/*.deb; do [ -f "$deb" ] && dpkg -x "$deb" "$kit/root"; done
    python3 -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true  # what is compiled already is skipped
    touch "$kit/b.done"
  fi
  # the SFT scenarios' demonstrations, made on the CPU (build_kit.sh d)
  if [ -d "$repo/.gpukit/d" ]; then mkdir -p "$kit/demos" && cp "$repo"/.gpukit/d/demos_*.jsonl "$kit/demos/"; fi
  # the real model's GGUF comes in two halves (build_kit.sh m), one a call; the scenarios build it
  [ -f "$repo/.gpukit/m1/smollm2.gguf.part1" ] && cp "$repo/.gpukit/m1/smollm2.gguf.part1" "$kit/"
  if [ -f "$repo/.gpukit/m2/smollm2.gguf.part2" ] && [ -f "$kit/smollm2.gguf.part1" ]; then
    cat "$kit/smollm2.gguf.part1" "$repo/.gpukit/m2/smollm2.gguf.part2" > "$kit/smollm2.gguf"
  fi
  # zip files keep no exec bits: Ray's own programs
  [ -d "$site/ray/core/src" ] && find "$site/ray/core/src" -type f ! -name '*.py' -exec chmod +x {} +
  local missing=0
  for part in a b; do
    [ -f "$kit/$part.done" ] || { echo "kit part $part is not on this machine: carry .gpukit/$part (scripts/gpu/build_kit.sh)" >&2; missing=1; }
  done
  return $missing
}

environment() {
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$kit/root/usr/bin:$site/bin:$PATH
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_IS_FLASHINFER_AVAILABLE=false RAY_AUTH_MODE=disabled \
    RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
  local nvcc; nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
  if [ -n "$nvcc" ]; then export CUDA_HOME=$(dirname "$(dirname "$nvcc")"); export PATH=$CUDA_HOME/bin:$PATH; fi
  local sp crt; sp=$(python3 -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))')
  crt=$(dirname "$(find "$sp/nvidia" -name 'libcudart.so.13*' 2>/dev/null | head -1)" 2>/dev/null || true)
  if [ -n "$crt" ] && [ "$crt" != . ]; then export LD_LIBRARY_PATH=$crt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
}

install_agentrl() {  # this tree, as a wheel (not editable), over whatever an earlier call installed
  local tmp; tmp=$(mktemp -d)
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$tmp" "$repo" >/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$tmp"/agentrl-*.whl
  rm -rf "$tmp" "$repo/build" "$repo"/*.egg-info
}

case "${1:-}" in
  unpack) unpack || true ;;  # one part a call: the other may come next
  list) cd "$(mktemp -d)" && python3 -m pytest "$repo/tests/gpu" --collect-only -q -p no:cacheprovider --rootdir "$repo" | grep :: ;;
  install) unpack || exit 3; environment; install_agentrl ;;  # once, before scenarios run side by side
  "") echo "usage: run.sh unpack | list | SCENARIO [pytest args]" >&2; exit 2 ;;
  *)
    scenario=$1; shift
    unpack || exit 3  # the machine went back between calls: carry both parts again
    environment; [ -n "${AGENTRL_NO_INSTALL:-}" ] || install_agentrl
    export AGENTRL_GPU_OUT=${AGENTRL_GPU_OUT:-${OUT:-/root/agentrl-gpu-out}}; mkdir -p "$AGENTRL_GPU_OUT"
    # outside the tree: its agentrl/ folder must not shadow the installed package
    work=$(mktemp -d); cd "$work"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
    if [ -n "${AGENTRL_DEMOS_BESIDE:-}" ]; then
      # the SFT scenarios' demonstrations (CPU and sandboxes only) made beside a GPU scenario, into the kit
      # where sft_model looks, so a later call's SFT finds them; the call ends when both have
      python3 "$repo/tests/gpu/make_demos.py" "$kit/demos" $AGENTRL_DEMOS_BESIDE > "$AGENTRL_GPU_OUT/demos_beside.log" 2>&1 &
      demos=$!
      rc=0; python3 -m pytest "$repo/tests/gpu" -k "$scenario" -x -v -s -p no:cacheprovider --rootdir "$repo" "$@" || rc=$?
      wait "$demos" || { echo "demonstrations beside: failed (demos_beside.log)"; [ "$rc" = 0 ] && rc=1; }
      tail -n 4 "$AGENTRL_GPU_OUT/demos_beside.log"; exit "$rc"
    fi
    exec python3 -m pytest "$repo/tests/gpu" -k "$scenario" -x -v -s -p no:cacheprovider --rootdir "$repo" "$@"
    ;;
esac
