"""The OpenAI-compatible gateway on a GPU: examples/openai_agent (an OpenAI Agents SDK agent with a
python tool, on math-python's problems) trained by `agentrl train` with SGLang behind
sglang-router, colocated, on a random-init 135M-shape Qwen2 (no download). Checked: every
iteration trains on the agents' sessions (none failed, no prefix break: the SDK sends back the
history it was given), and the logprobs SGLang gave for the recorded tokens match the trainer's
for the same tokens (the exact tokens, never re-tokenized). The Agents SDK comes from kit b
(build_kit.sh: openai-agents 0.4.2 on SGLang's openai 2.6.1). Iterations: AGENTRL_GPU_ITERS."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu_helpers import COLOCATE, SGLANG, agentrl_train, iters, needs_gpus, random_qwen2, trajectories

pytestmark = needs_gpus()

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"


def test_openai_agent_example_trains_with_sglang():
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed: rebuild kit b (build_kit.sh b)")
    n = iters(4)
    os.environ.pop("OPENAI_API_KEY", None)
    run, rows = agentrl_train(
        "openai_agent", "--config", str(EXAMPLE / "config.yaml"), "--env-module", str(EXAMPLE / "agent.py"),
        "--model", str(random_qwen2("135m")), "--device", "cuda", "--dtype", "bfloat16", *SGLANG, *COLOCATE,
        "--num-rollout", str(n), "--rollout-batch-size", "16", "--n-samples-per-prompt", "4",
        "--global-batch-size", "64", "--max-concurrency", "64", "--rollout-max-response-len", "512",
        "--rollout-max-tokens-per-turn", "128", timeout_s=560)
    keys = ("reward_mean", "response_len_mean", "env/gateway_requests_mean", "env/gateway_prefix_breaks_mean",
            "train_rollout_logprob_abs_diff", "rollout_s", "train_s", "tokens_per_s")
    for r in rows:
        print(f"iter {r['rollout_id']}: " + "  ".join(f"{k} {r[k]:.3f}" for k in keys if k in r))
    assert len(rows) == n
    for r in rows:
        assert r["status_failed"] == 0 and r["env/gateway_requests_mean"] >= 1
        assert r["env/gateway_prefix_breaks_mean"] == 0.0
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 0.05  # SGLang's logprobs of the recorded tokens
    last = trajectories(run, n - 1)
    assert len(last) == 64 and all(sum(t["loss_mask"]) > 0 for t in last)
    assert not [t["metadata"]["agent_fault"] for t in last if "agent_fault" in t["metadata"]
                and "timeout" in t["metadata"]["agent_fault"]]
