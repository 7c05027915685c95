"""LoRA on a GPU: `agentrl train --lora-rank` learning with SGLang serving the adapters
(--lora-sync adapter: each iteration's adapter loaded by /load_lora_adapter, every request
naming it), and bench/lora_gpu.py's memory, step time and adapter-sync figures at 1.5B.
Figures: bench/results/lora_gpu.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import COLOCATE, OUT, SGLANG, agentrl_train, iters, needs_gpus, random_qwen2
from test_train_gpu import TARGET, check_learns_on_policy, handover_figures

pytestmark = needs_gpus()

REPO = Path(__file__).resolve().parents[2]
# LoRA's learning rate: 10x full fine-tuning's (the later --lr overrides TARGET's 1e-4)
LORA = ["--lora-rank", "32", "--lora-alpha", "64", "--target-modules", "all-linear", "--lora-sync", "adapter",
        "--lr", "1e-3"]


@pytest.mark.parametrize("trainer", ["megatron", "torch"])
def test_lora_learns_target_token(trainer):
    """A rank-32 adapter on every linear layer of the 135M shape learns target-token in 30
    colocated iterations; SGLang samples with the adapter (on policy: its logprobs equal the
    trainer's with the adapter applied); the sync moves only the adapter."""
    n = iters(30)
    run, rows = agentrl_train(f"lora_{trainer}", *TARGET, "--model", str(random_qwen2("135m")), "--trainer", trainer,
                              *SGLANG, *COLOCATE, *LORA, "--num-rollout", str(n), timeout_s=560)
    handover_figures(rows)
    print("weight sync MB per iteration:", [round(r.get("weight_sync_mb", 0), 2) for r in rows])
    check_learns_on_policy(run, rows, n)
    # the rank-32 adapter in bfloat16 is ~19 MB; full weights ~200 MB (float32 adapters, ~37 MB, fail)
    assert all(r["weight_sync_mb"] < 25 for r in rows), [r["weight_sync_mb"] for r in rows]


def test_lora_bench_1_5b():
    """bench/lora_gpu.py at 1.5B (PyTorch trainer): LoRA's trainer memory below full fine-tuning's,
    the adapter sync a small fraction of the merged one, and the engine's logprobs with the
    adapter equal the trainer's (bf16 tolerance)."""
    out = OUT / "lora_bench"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "lora_gpu.py"), "--out", str(out)], timeout=560)
    assert proc.returncode == 0
    result = json.loads((out / "lora_gpu.json").read_text())
    full, lora = result["train"]
    print(json.dumps(result, indent=1))
    assert lora["trainable_params"] < 0.05 * full["trainable_params"]
    assert lora["peak_allocated_gib"] < full["peak_allocated_gib"]
    adapter_mb = max(s["weight_sync_mb"] for s in result["sync"]["adapter"])
    assert adapter_mb < 0.1 * result["sync"]["merged_disk"][0]["weight_sync_mb"]
    assert max(p["max_abs_diff"] for p in result["sync"]["parity"]) < 0.1
