"""A user's sync reward function runs in a process forked from the trainer for each call
(agentrl.grading.call_in_fork). On a GPU machine the forking process holds a CUDA context,
GPU tensors and pinned host memory: the fork must stay cheap (the driver's mappings are not
copied), the closure's value must come back, and a hanging one must be killed in its bound.
Figures go to $AGENTRL_GPU_OUT/grading_fork.json. Needs torch with CUDA; no kit.

    bash scripts/gpu/run.sh grading_fork"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from agentrl.grading import GradingTimeout, call_in_fork, call_reward_fn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_grading_fork_with_a_cuda_context_and_pinned_memory():
    weights = torch.randn(256, 1 << 20, device="cuda")       # 1 GiB on the GPU
    pinned = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)  # 4 GiB pinned on the host
    pinned[:: 1 << 20] = 1
    scale = 0.5

    def rm(args, sample):  # a closure over the trainer's state, as a user's reward function is
        return {"score": scale * len(sample), "pid": os.getpid()}

    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        out = call_in_fork(rm, None, "abcd", timeout=60)
        times.append(time.perf_counter() - t0)
        assert out["score"] == 2.0 and out["pid"] != os.getpid()

    async def hang():
        t0 = time.monotonic()
        with pytest.raises(GradingTimeout):
            await call_reward_fn(lambda a, s: time.sleep(3600), None, None, timeout=2)
        return time.monotonic() - t0

    killed_after = asyncio.run(hang())
    torch.cuda.synchronize()
    assert float(weights.sum()) == float(weights.sum()) and int(pinned[0]) == 1  # the parent's CUDA is fine
    figures = {"device": torch.cuda.get_device_name(), "fork_call_median_s": statistics.median(times),
               "fork_call_max_s": max(times), "hanging_rm_killed_after_s": killed_after}
    out = Path(os.environ.get("AGENTRL_GPU_OUT", "/tmp/agentrl-gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "grading_fork.json").write_text(json.dumps(figures, indent=1))
    print("GRADING_FORK", json.dumps(figures))
    assert statistics.median(times) < 0.5 and killed_after < 10, figures
