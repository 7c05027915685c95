"""examples/command_agent: a plain-program code agent runs in its trajectory's sandbox, fixes
its solution after the import error it sees, and the code env's hidden tests grade the file it
left; `agentrl train` trains it end to end on the CPU (the tiny model, 2 iterations)."""

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
EXAMPLE = ROOT / "examples" / "command_agent"
sys.path.insert(0, str(ROOT / "tests"))
from spine_helpers import agentrl_cli, run_env  # noqa: E402

pytestmark = pytest.mark.e2e  # sandboxes, and agentrl train

TASK = {"prompt": "Return the sum of a and b.", "label": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
        "metadata": {"entry_point": "add"}}


def test_the_example_agent_fixes_its_solution_and_is_graded_in_its_sandbox(tokenizer):
    from agentrl.gateway import AgentRunner
    from agentrl.sandboxes import resolve_backend

    try:
        resolve_backend("local")
    except Exception as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    import_env_module(str(EXAMPLE / "agent_env.py"))
    engine = ScriptedEngine(tokenizer, ["```python\ndef add(a, b)\n    return a + b\n```",
                                        "Fixed:\n```python\ndef add(a, b):\n    return a + b\n```"])

    async def go():
        runner = AgentRunner(renderer=Renderer(tokenizer, True), client=engine, settings_for=lambda env: settings(1024))
        try:
            return await runner(make("code-command-agent", sandbox="local"), dict(TASK), trajectory_id="g0-s0",
                                group_id=0, index=0, seed=0, env_name="code-command-agent")
        finally:
            await runner.aclose()

    samples = asyncio.run(go())
    assert len(samples) == 1 and "agent_fault" not in samples[0].metadata, samples[0].metadata
    sample = samples[0]
    assert sample.reward == 1.0 and sample.metadata["agent_output"] == "solution.py written"
    assert sample.metadata["env_metrics"]["gateway_prefix_breaks"] == 0.0 and len(engine.calls) == 2
    # the second request carried the import error the agent saw in its sandbox
    assert "SyntaxError" in tokenizer.decode(engine.calls[1][0][len(engine.calls[0][0]):])
    assert "Define `add` in solution.py" in sample.messages[1]["content"]  # the code env's prompt (AGENTRL_MESSAGES)


def test_the_example_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", "--config", str(EXAMPLE / "config.yaml"),
                           "--env-module", str(EXAMPLE / "agent_env.py"), "--num-rollout", "2", "--sandbox", "local",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                           "--rollout-max-response-len", "96", "--rollout-max-tokens-per-turn", "32",
                           "--no-progress", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, env=run_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert row["status_failed"] == 0 and row["env/gateway_requests_mean"] >= 1 and row["generated_tokens"] > 0
        assert row["train_rollout_logprob_abs_diff"] < 1e-3  # the trainer's logprobs of the engine's own tokens
    traj = [json.loads(line) for line in (out / "trajectories" / "rollout_00001.jsonl").read_text().splitlines()]
    assert len(traj) == 4 and all(sum(t["loss_mask"]) > 0 and t["metadata"]["sandbox"] == "local" for t in traj)
