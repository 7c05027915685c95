"""256 agent sessions at once through one gateway and the embedded engine, on a 2-core machine,
bounded in time: every session ends with its own tokens, none lost or mixed up."""

import asyncio
import time

from agentrl.gateway import AgentRunner, agent_env
from agentrl.registry import make
from agentrl.rollout.agent_loop import LoopSettings, Renderer
from agentrl.rollout.client import EngineClient
from agentrl.types import SampleStatus

SESSIONS = 256
BOUND_S = 240.0


@agent_env("test-gw-load")
async def two_turns(task, client):
    messages = [{"role": "user", "content": task["prompt"]}]
    for turn in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"go on {turn}"}]
    return 1.0


def test_256_concurrent_sessions(tokenizer, engine):
    settings = LoopSettings(max_response_len=128, max_turns=4, sampling_params={"temperature": 1.0})

    async def go():
        async with EngineClient(engine.url) as client:
            runner = AgentRunner(renderer=Renderer(tokenizer, True), client=client, settings_for=lambda env: settings)
            try:
                t0 = time.monotonic()
                runs = await asyncio.wait_for(asyncio.gather(*[
                    runner(make("test-gw-load"), {"prompt": f"task {k}"}, trajectory_id=f"g{k}-s0", group_id=k,
                           index=0, seed=k, env_name="test-gw-load") for k in range(SESSIONS)]), BOUND_S)
                return runs, time.monotonic() - t0, client.turn_log
            finally:
                await runner.aclose()

    runs, elapsed, _ = asyncio.run(go())
    print(f"{SESSIONS} sessions x 2 turns in {elapsed:.1f} s")
    assert len(runs) == SESSIONS
    for k, samples in enumerate(runs):
        assert len(samples) == 1, samples[0].metadata
        sample = samples[0]
        assert sample.status == SampleStatus.COMPLETED and sample.reward == 1.0, sample.metadata
        assert sample.num_turns == 2 and sample.trajectory_id == f"g{k}-s0"
        assert f"task {k}" in tokenizer.decode(sample.prompt_tokens)  # its own prompt, not another session's
        assert sample.metadata["env_metrics"]["gateway_prefix_breaks"] == 0.0
        sample.validate()
