"""examples/openai_agent: the Agents SDK math agent runs its python tool through the gateway,
and `agentrl train` trains it end to end on the CPU (the tiny model, 2 iterations)."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ScriptedEngine, settings

from agentrl.registry import import_env_module, make
from agentrl.rollout.agent_loop import Renderer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_agent"
sys.path.insert(0, str(ROOT / "tests"))
from spine_helpers import agentrl_cli, run_env  # noqa: E402

pytestmark = pytest.mark.e2e  # starts engines, Ray or agentrl train


def test_the_example_agent_runs_its_python_tool(tokenizer, monkeypatch):
    from agentrl.gateway import AgentRunner

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    import_env_module(str(EXAMPLE / "agent.py"))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "So \\boxed{42}."])

    async def go():
        runner = AgentRunner(renderer=Renderer(tokenizer, True), client=engine, settings_for=lambda env: settings(1024))
        try:
            return await runner(make("openai-agent-math"), {"prompt": "6 times 7?", "label": "42"},
                                trajectory_id="g0-s0", group_id=0, index=0, seed=0, env_name="openai-agent-math")
        finally:
            await runner.aclose()

    samples = asyncio.run(go())
    assert len(samples) == 1 and samples[0].reward == 1.0, samples[0].metadata
    tool_result = [m for m in samples[0].messages if m["role"] == "tool"]
    assert len(tool_result) == 1 and tool_result[0]["content"].strip() == "42"  # the tool ran the model's code
    assert "42" in tokenizer.decode(engine.calls[1][0][len(engine.calls[0][0]):])  # and the model saw its output


def test_the_example_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    heldout = tmp_path / "heldout.jsonl"  # an eval set: the agent env plays evaluation too
    heldout.write_text("".join(json.dumps({"prompt": p, "label": str(a)}) + "\n" for p, a in [("2+2?", 4), ("3*3?", 9)]))
    proc = subprocess.run([agentrl_cli(), "train", "--config", str(EXAMPLE / "config.yaml"),
                           "--env-module", str(EXAMPLE / "agent.py"), "--num-rollout", "2",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                           "--rollout-max-response-len", "96", "--rollout-max-tokens-per-turn", "48",
                           "--eval-prompt-data", "heldout", str(heldout), "--eval-interval", "2",
                           "--n-samples-per-eval-prompt", "1", "--no-progress", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, env={**run_env(), "OPENAI_API_KEY": ""},
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert row["status_failed"] == 0 and row["env/gateway_requests_mean"] >= 1 and row["generated_tokens"] > 0
        assert "loss" in row
        # the trainer's logprobs of the recorded tokens are the engine's: the exact sampled tokens
        assert row["train_rollout_logprob_abs_diff"] < 1e-3
    assert "eval/heldout/reward_mean" in rows[-1]
    traj = [json.loads(line) for line in (out / "trajectories" / "rollout_00001.jsonl").read_text().splitlines()]
    assert len(traj) == 4 and all(sum(t["loss_mask"]) > 0 and "agent_fault" not in t["metadata"] for t in traj)
