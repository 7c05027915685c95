"""MiMo's multi-token-prediction (MTP) layers trained beside the policy (slime's
`--mtp-num-layers 1 --enable-mtp-training`, issue 33) on a GPU: a random MiMo of the 135M shape
(a Qwen2 plus one MTP layer, agentrl/hf_mimo.py), Megatron on cuda, SGLang colocated serving it.
Checked: the MTP loss (`mtp_loss`) falls as the policy learns target-token, the engine-vs-trainer
logprob gap stays at the bf16 level, and every iteration is on policy. The `eagle` case adds
SGLang's EAGLE speculative decoding over the model's own MTP layer (slime's
run-mimo-7B-rl-eagle.sh flags, recompute too) and prints the draft acceptance SGLang logs.

Run (one device call each): bash scripts/gpu/run.sh "mtp_training and plain"
                            bash scripts/gpu/run.sh "mtp_training and eagle"
"""

from __future__ import annotations

import json
import re

import pytest

from gpu_helpers import COLOCATE, KIT, OUT, SGLANG, SHAPES, agentrl_train, iters, mean, needs_gpus, random_model, \
    tiny_qwen2_config, trajectories

pytestmark = needs_gpus()

# what a MiMo checkpoint ships for its config (SGLang reads config.json with trust_remote_code)
CONFIGURATION_MIMO = '''from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(*args, **kwargs)
'''


def random_mimo():
    """A random-init MiMo, 135M shape, one MTP layer, bf16, the tiny tokenizer (cached)."""
    import torch

    from agentrl.hf_mimo import MiMoConfig, MiMoForCausalLM

    def config():
        base = tiny_qwen2_config(SHAPES["135m"]).to_dict()
        for key in ("model_type", "architectures", "transformers_version"):
            base.pop(key, None)
        return MiMoConfig(num_nextn_predict_layers=1, **base)

    out = random_model(KIT / "models" / "mimo-135m-tinytok", config,
                       build=lambda c: MiMoForCausalLM(c).to(torch.bfloat16))
    if not (out / "configuration_mimo.py").exists():
        (out / "configuration_mimo.py").write_text(CONFIGURATION_MIMO)
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(architectures=["MiMoForCausalLM"], auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


MTP = ["--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2"]
EAGLE = ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
         "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
         "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


@pytest.mark.parametrize("case", ["plain", "eagle"])
def test_mtp_training_colocated(case):
    n = iters(20)
    run, rows = agentrl_train(
        f"mtp_{case}", "--env", "target-token", "--device", "cuda", "--dtype", "bfloat16", "--lr", "1e-4",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
        "--model", str(random_mimo()), "--trainer", "megatron", *SGLANG, *COLOCATE, "--sglang-trust-remote-code",
        *MTP, *(EAGLE if case == "eagle" else []), "--num-rollout", str(n), timeout_s=580)
    assert len(rows) == n
    losses = [r["mtp_loss"] for r in rows]
    diffs = [r["train_rollout_logprob_abs_diff"] for r in rows]
    print("mtp_loss:", " ".join(f"{x:.3f}" for x in losses))
    print("engine-vs-trainer logprob |diff|:", " ".join(f"{x:.4f}" for x in diffs))
    print(f"reward: first 5 {mean(r['reward_mean'] for r in rows[:5]):.4f}, "
          f"last 5 {mean(r['reward_mean'] for r in rows[-5:]):.4f}")
    if case == "eagle":  # SGLang's decode log lines carry the draft's mean accepted length
        accepted = [float(m) for log in sorted(run.rglob("*.log")) + sorted(OUT.glob(f"mtp_{case}*.log"))
                    for m in re.findall(r"accept len: ([0-9.]+)", log.read_text(errors="replace"))]
        print(f"EAGLE draft accept len over {len(accepted)} decode log lines: "
              + (f"first {mean(accepted[:10]):.3f}, last {mean(accepted[-10:]):.3f}" if accepted else "none logged"))
    assert mean(losses[-5:]) < mean(losses[:5]), losses
    assert max(diffs) < 0.05, diffs  # bf16 level (SGLang vs the Megatron trainer on the same tokens)
    for i in (0, n - 1):
        assert {v for t in trajectories(run, i) for v in t["policy_versions"]} == {i}
