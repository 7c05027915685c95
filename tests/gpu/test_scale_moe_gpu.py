"""The Megatron trainer on a mixture-of-experts model across GPUs (issue 30): a random-init
Qwen3-MoE shape (Qwen3-30B-A3B's 128 experts, top-8 renormalised softmax router and attention
layout, depth and width cut) trained with expert parallelism, one `torchrun` per layout
(tests/gpu/scale_moe_worker.py, one process per GPU). Each layout's logprobs of a fixed probe
batch are compared with EP=1's on one GPU (bf16: a token whose top-8 experts nearly tie may
route differently under another reduction order, so the check is on the mean and a high
quantile, not the max); step time and peak memory per GPU are printed and written to
$AGENTRL_GPU_OUT/scale_moe_*.json. Needs 4 GPUs (nvidia-h100-x4 or nvidia-h200-x4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gpu_helpers import KIT, OUT, needs_gpus, run_scale_worker

pytestmark = needs_gpus(4, "needs 4 GPUs: run with scripts/gpu/run.sh on nvidia-h100-x4 / nvidia-h200-x4")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale_moe_worker import random_qwen3_moe  # noqa: E402


def run_layout(name: str, gpus: int, model: Path, megatron: dict, **opts) -> dict:
    return run_scale_worker(f"scale_moe_{name}", gpus, model, megatron, master_port=29555, **opts)


def compare_logprobs(a: dict, b: dict, label: str) -> dict:
    x = torch.tensor([v for row in a["probe_logprobs"] for v in row])
    y = torch.tensor([v for row in b["probe_logprobs"] for v in row])
    d = (x - y).abs()
    figures = {"mean_abs": d.mean().item(), "p99_abs": d.quantile(0.99).item(), "max_abs": d.max().item()}
    print(f"{label}: probe logprobs vs EP=1: mean |diff| {figures['mean_abs']:.4f}, p99 {figures['p99_abs']:.4f}, "
          f"max {figures['max_abs']:.4f}", flush=True)
    assert figures["mean_abs"] < 0.02 and figures["p99_abs"] < 0.2, figures
    return figures


@pytest.fixture(scope="module")
def models():
    return {shape: random_qwen3_moe(KIT / "models" / f"qwen3moe-{shape}-tinytok", shape, 40960)
            for shape in ("small", "a3b-cut")}


def test_moe_expert_parallel_layouts_match_ep1(models):
    """EP=4 and TP=2+SP x EP=2 on the small shape (16 experts) against EP=1 on one GPU."""
    small = models["small"]
    ep1 = run_layout("small_ep1", 1, small, {})
    figures = {}
    for name, megatron in (("small_ep4", {"expert_model_parallel_size": "4"}),
                           ("small_tp2_ep2", {"tensor_model_parallel_size": "2", "sequence_parallel": None,
                                              "expert_model_parallel_size": "2",
                                              "expert_tensor_parallel_size": "1"})):
        figures[name] = compare_logprobs(run_layout(name, 4, small, megatron), ep1, name)
    (OUT / "scale_moe_small_parity.json").write_text(json.dumps(figures, indent=1))


def test_moe_a3b_shape_ep4_step_time_and_memory(models):
    """The 128-expert top-8 shape: EP=1 (one GPU), EP=4, TP=2+SP x EP=2 (with the distributed
    optimizer); step time and peak memory, and EP=4's logprobs against EP=1's."""
    a3b = models["a3b-cut"]
    opts = dict(samples=32, length=1024, max_tokens=8192, steps=3)
    ep1 = run_layout("a3b_ep1", 1, a3b, {}, **opts)
    ep4 = run_layout("a3b_ep4", 4, a3b, {"expert_model_parallel_size": "4", "use_distributed_optimizer": None}, **opts)
    run_layout("a3b_tp2_ep2", 4, a3b, {"tensor_model_parallel_size": "2", "sequence_parallel": None,
                                       "expert_model_parallel_size": "2", "expert_tensor_parallel_size": "1",
                                       "use_distributed_optimizer": None}, **opts)
    compare_logprobs(ep4, ep1, "a3b_ep4")
