"""`delta_sync`: --weight-sync-mode delta (slime's --update-weight-mode delta) against real SGLang,
engines apart from the trainer: every iteration the trainer publishes the changed bytes, agentrl's
SGLang wrapper applies them to the host's local checkpoint (POST /agentrl/apply_weight_delta) and
SGLang reloads it with its stock /update_weights_from_disk. Checked: the engine's logprobs of its
own samples match the trainer's after every sync (and the probe check after each sync but the
last), each iteration is sampled by its policy version, and every version is smaller than the
checkpoint.

One GPU: the PyTorch trainer on the CPU and SGLang on the GPU (agentrl's placement puts a trainer
that is not colocated on GPUs of its own; the delta path needs no GPU on the trainer's side).
Two GPUs (the device tool's nvidia-h200-x2): the Megatron trainer on GPU 0, SGLang on GPU 1.

    bash scripts/gpu/run.sh delta_sync
"""

from __future__ import annotations

import json

import pytest
import torch

from gpu_helpers import KIT, SGLANG, agentrl_train, iters, needs_gpus, random_model, tiny_qwen2_config, trajectories

pytestmark = needs_gpus()

# small enough for a CPU trainer, real SGLang kernels (head_dim 64)
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("where", ["cpu_trainer", "two_gpus"])
def test_delta_sync_keeps_sglang_on_policy(where):
    if where == "two_gpus" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the device tool's nvidia-h200-x2)")
    model = random_model(KIT / "models" / "qwen2-delta-tinytok", lambda: tiny_qwen2_config(SHAPE))
    n = iters(4)
    trainer = ["--device", "cpu", "--trainer", "torch"] if where == "cpu_trainer" else \
        ["--device", "cuda", "--trainer", "megatron"]
    run, rows = agentrl_train(
        f"delta_sync_{where}", "--env", "target-token", "--model", str(model), *trainer, "--dtype", "bfloat16",
        *SGLANG, "--sglang-mem-fraction-static", "0.3", "--weight-sync-mode", "delta", "--weight-delta-encoding",
        "xor", "--weight-delta-checksum", "xxh3-128", "--weight-check-interval", "1", "--lr", "1e-4",
        "--entropy-coef", "0.01",  # every step moves the weights, even at reward 0 (iteration 0 often is)
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--num-rollout", str(n), timeout_s=560)
    full_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    for r in rows:
        print(f"iter {r['rollout_id']}: density {r['weight_sync_delta_density']:.3f}, published "
              f"{r['weight_sync_delta_mb']:.2f} MB of {full_mb:.2f} MB in {r['weight_sync_publish_s']:.2f} s, apply "
              f"{r['weight_sync_apply_s']:.2f} s, load {r['weight_sync_load_s']:.2f} s, logprob diff "
              f"{r['train_rollout_logprob_abs_diff']:.4f}, probe {r.get('weight_check/mean_abs_diff')}", flush=True)
    assert len(rows) == n
    for r in rows:
        assert "weight_sync_failed" not in r, r
        assert 0 < r["weight_sync_delta_density"] <= 1 and r["weight_sync_delta_mb"] < full_mb, r
        assert r["train_rollout_logprob_abs_diff"] < 0.05, r  # SGLang (bf16) vs the trainer on the same tokens
    for r in rows[1:]:  # the probe the engine sampled after the previous iteration's sync, checked here
        assert r["weight_check/mean_abs_diff"] < 0.05, r
    for i in range(n):  # iteration i sampled by policy version i: each delta reached the engine
        assert {v for t in trajectories(run, i) for v in t["policy_versions"]} == {i}
    state = json.loads((run / "weight_delta_local" / ".agentrl_delta.json").read_text())
    assert state["version"] == n and not state.get("applying"), state
    assert sorted(p.name for p in (run / "weight_delta").glob("weight_v*"))[-1] == f"weight_v{n:06d}"
