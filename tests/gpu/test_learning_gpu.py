"""A real pretrained model learning the built-in envs on a GPU: SmolLM2-135M-Instruct (built
by `agentrl model get` from the GGUF the kit carries: build_kit.sh m, then carry .gpukit/m1
and .gpukit/m2 one call each), `agentrl train` with SGLang, colocated, evaluated on held-out
data before training and every few iterations. Figures: bench/results/learning.md.
Iterations: AGENTRL_GPU_ITERS; trainer: AGENTRL_GPU_TRAINER (default megatron)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gpu_helpers import COLOCATE, KIT, OUT, SGLANG, agentrl_train, mean, trajectories

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the GPU suite needs CUDA: run it with scripts/gpu/run.sh on a GPU machine")

TRAINER = os.environ.get("AGENTRL_GPU_TRAINER", "megatron")


def iters(default: int) -> int:
    return int(os.environ.get("AGENTRL_GPU_ITERS", default))


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from agentrl.model_get import get_model

    gguf = KIT / "smollm2.gguf"
    if not gguf.exists():
        pytest.skip("no SmolLM2 GGUF on this machine: build_kit.sh m, then carry .gpukit/m1 and .gpukit/m2")
    return get_model("smollm2-135m-instruct", KIT / "models" / "smollm2-135m-instruct", source=gguf)


def heldout_math(n: int = 200) -> Path:
    """Problems of the math env's generator under another seed, none of them in the training
    stream's first 50k (the run draws from seed 0)."""
    from agentrl.envs.math_env import generate

    seen = {t["prompt"] for t in generate(seed=0, n=50_000)}
    rows = [t for t in generate(seed=1, n=4 * n) if t["prompt"] not in seen][:n]
    path = OUT / "math_heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def real_model_run(name: str, model: Path, *args: str, n: int, timeout_s: float = 560):
    run, rows = agentrl_train(name, "--model", str(model), "--trainer", TRAINER, "--device", "cuda",
                              "--dtype", "bfloat16", *SGLANG, *COLOCATE, "--num-rollout", str(n), *args,
                              timeout_s=timeout_s)
    keys = ("reward_mean", "response_len_mean", "tool_calls_mean", "train_rollout_logprob_abs_diff", "rollout_s",
            "train_s", "iteration_s")
    for r in rows:
        evals = "  ".join(f"{k} {v:.3f}" for k, v in r.items() if k.startswith("eval") and k.endswith("reward_mean"))
        print(f"iter {r['rollout_id']}: " + "  ".join(f"{k} {r[k]:.3f}" for k in keys if k in r) + f"  {evals}")
    assert len(rows) == n
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 0.05  # on policy: engine vs trainer, bf16
    return run, rows


def test_smollm2_math_heldout_reward_rises(smollm2):
    """GRPO on the math env's word problems: the held-out reward after training is clearly
    above the starting model's (evaluated before iteration 0, same data, same sampling)."""
    n = iters(60)
    _, rows = real_model_run(
        "smollm2_math", smollm2, "--env", "math", "--lr", "5e-6", "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8", "--global-batch-size", "256", "--micro-batch-size", "16",
        "--rollout-max-response-len", "384", "--eval-interval", "10", "--eval-prompt-data", "heldout",
        str(heldout_math()), "--n-samples-per-eval-prompt", "2", n=n)
    before = rows[0]["eval_before_train/heldout/reward_mean"]
    after = rows[-1]["eval/heldout/reward_mean"]
    print(f"held-out reward: before training {before:.3f}, after {n} iterations {after:.3f}")
    assert after >= before + 0.05, (before, after)


def test_smollm2_math_python_calls_tools(smollm2):
    """math-python in local (bubblewrap) sandboxes: the model's tool calls run in sandboxes
    during training (tool results per episode > 0), reward trend printed."""
    n = iters(10)
    run, rows = real_model_run(
        "smollm2_math_python", smollm2, "--env", "math-python", "--sandbox", "local", "--lr", "5e-6",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
        "--micro-batch-size", "8", n=n)
    calls = [r["tool_calls_mean"] for r in rows]
    print(f"tool results per episode: {calls}; reward first 3 {mean(r['reward_mean'] for r in rows[:3]):.3f}, "
          f"last 3 {mean(r['reward_mean'] for r in rows[-3:]):.3f}")
    assert all(r["status_failed"] == 0 for r in rows)
    assert max(calls) > 0, calls
    ran = [t for t in trajectories(run, n - 1) if t["metadata"].get("tool_calls")]
    assert ran, "no trajectory of the last iteration ran a tool"
