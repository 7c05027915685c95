"""Performance in the loop (issue 34), each scenario printing its figure with its breakdown:

- startup_1p5b: a short 1.5B colocated `agentrl train` (Megatron, SGLang), twice in one call (the
  first may meet a cold Triton cache, the second does not), its start-up and stop steps from
  run.json (Ray, placement, SGLang's weights / KV pool / prefill and decode CUDA graphs / warm-up,
  the trainer rank's process, imports and build, the driver's data set-up, the first rollout request,
  the final checkpoint, engines, trainer and Ray stopped) and the command's wall time. Goals
  (reported, not asserted): the first rollout request <= 75 s after the command, the stop
  <= 20 s plus the final checkpoint's write.
- async_repeats: bench/async_repeats.py --gpu (two GPUs): sync and async several times in one
  call, the equal-work speedup's median and spread, and what varied; calls with
  AGENTRL_ASYNC_APPEND=1 add repeats to the same report.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from gpu_helpers import COLOCATE, OUT, SGLANG, agentrl_train, random_qwen2, stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the GPU suite needs CUDA: run it with scripts/gpu/run.sh on a GPU machine")

REPO = Path(__file__).resolve().parents[2]
FIRST_REQUEST_GOAL_S, STOP_GOAL_S = 75.0, 20.0


@pytest.mark.parametrize("attempt", ["first", "again", "prefill_graphs"])
def test_startup_1p5b(attempt):
    """`first`: the machine's Triton cache may be cold (SGLang's triton attention kernels compiled
    while it starts: run.json's triton_cache_kernels says); `again`, in the same call, starts with
    them cached; `prefill_graphs` (its own call: `startup_1p5b and prefill_graphs`) captures SGLang
    0.5.15's prefill CUDA graphs, SGLang's default that agentrl turns off (23 s of the start on an
    H200 for the same rollout tok/s, 2026-12-03), the rollout's tok/s printed beside, to weigh them."""
    extra = ["--sglang-cuda-graph-backend-prefill", "breakable"] if attempt == "prefill_graphs" else []
    model = random_qwen2("1.5b")  # built (or found) before the clock starts: not part of a run's start-up
    save = Path(tempfile.mkdtemp(prefix="agentrl-startup-"))  # the final checkpoint (GBs) outside OUT
    name = f"startup_1p5b_{attempt}"
    t0 = time.time()
    try:
        run, rows = agentrl_train(name, "--env", "target-token", "--device", "cuda", "--dtype", "bfloat16",
                                  "--model", str(model), "--trainer", "megatron", *SGLANG, *COLOCATE,
                                  "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size",
                                  "256", "--rollout-max-response-len", "1024", "--rollout-ignore-eos",
                                  "--micro-batch-size", "8", "--num-rollout", os.environ.get("AGENTRL_GPU_ITERS", "2"),
                                  "--save", str(save), *extra, timeout_s=450)
    finally:
        shutil.rmtree(save, ignore_errors=True)
    wall = time.time() - t0
    facts = json.loads((run / "run.json").read_text())
    start, stop = facts["startup"], facts["stop"]
    shutil.copy2(run / "run.json", OUT / f"{name}.run.json")
    print(json.dumps({"startup": start, "stop": stop, "first_train_step_s": facts.get("first_train_step_s"),
                      "first_weight_sync_s": facts.get("first_weight_sync_s"),
                      "triton_cache_kernels": facts.get("triton_cache_kernels")}, indent=1))
    first = start["first_rollout_request"]
    checkpoint = stop["final_checkpoint"]  # [start, end], seconds since the command started
    stop_s = wall - checkpoint[0]  # from the last iteration's checkpoint to the command's exit
    rest = stop_s - (checkpoint[1] - checkpoint[0])
    kernels = facts.get("triton_cache_kernels") or {}
    compiled = (kernels.get("engines_ready") or 0) - (kernels.get("before_engines") or 0)
    print(f"{attempt}: command wall {wall:.1f} s ({len(rows)} iterations): first rollout request at {first:.1f} s "
          f"(goal <= {FIRST_REQUEST_GOAL_S:.0f}: {'met' if first <= FIRST_REQUEST_GOAL_S else 'not met'}); Triton "
          f"kernels compiled while the engines started: {compiled}; stop {stop_s:.1f} s: the final checkpoint "
          f"{checkpoint[1] - checkpoint[0]:.1f} s, the rest {rest:.1f} s (goal <= "
          f"{STOP_GOAL_S:.0f}: {'met' if rest <= STOP_GOAL_S else 'not met'}); rollout tok/s by iteration "
          f"{[round(r.get('tokens_per_s', 0)) for r in rows]}", flush=True)
    for key in ("ray", "placement", "engines", "data_env", "trainer/build", "first_iteration_done"):
        assert key in start, (key, start)
    if not any(k.endswith("/cuda_graphs") for k in start):  # SGLang's own steps, read from its log
        print("note: no SGLang start-up steps found in logs/sglang-0.log (its log lines changed?): "
              "see agentrl.metrics.SGLANG_STEPS", flush=True)
    for key in ("final_checkpoint", "engines", "trainer", "ray"):
        assert key in stop, (key, stop)
    assert 0 < first < start["first_iteration_done"]


def test_async_repeats_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the device tool's nvidia-h100-x2 or nvidia-h200-x2)")
    out = OUT / "async_repeats_gpu.json"
    append = bool(os.environ.get("AGENTRL_ASYNC_APPEND"))
    if not append:
        out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "async_repeats.py"), "--gpu", "--out", str(out),
           "--repeats", os.environ.get("AGENTRL_ASYNC_REPEATS", "3"), "--iterations",
           os.environ.get("AGENTRL_ASYNC_ITERS", "6"), "--deadline-s", os.environ.get("AGENTRL_ASYNC_DEADLINE_S", "420"),
           *(["--append"] if append else []), "--model", str(random_qwen2("135m")), *SGLANG]
    print("$", " ".join(cmd), flush=True)
    returncode = stream(cmd, OUT / "async_repeats_gpu.log")
    assert out.exists(), f"no report (exit status {returncode})"
    result = json.loads(out.read_text())
    print(json.dumps({"speedup": result["speedup"], "variation": result["variation_across_repeats"]}, indent=1))
    assert returncode == 0
    assert all(s["values"] and min(s["values"]) > 0 for s in result["speedup"].values()), result["speedup"]
