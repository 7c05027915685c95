"""Agent frameworks from PyPI, unchanged, train through the gateway: the OpenAI Agents SDK and
LangGraph with langchain-openai, each a tool-using agent with no line of agentrl in it. Offline:
no API key, tracing off (the Agents SDK would otherwise upload traces to OpenAI)."""

import asyncio

import pytest
from helpers import ScriptedEngine, settings

from agentrl.gateway import AgentRunner, agent_env
from agentrl.registry import make
from agentrl.rollout.agent_loop import Renderer
from agentrl.rollout.client import EngineClient
from agentrl.types import SampleStatus

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
ADDED: list[tuple[int, int]] = []  # the tool calls the frameworks ran


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    ADDED.clear()


@agent_env("test-gw-openai-agents", grader="math")
async def openai_agents_agent(task, client):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ADDED.append((a, b))
        return a + b

    agent = Agent(name="calculator", instructions="Use the add tool, then answer in \\boxed{}.", tools=[add],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, task["prompt"], max_turns=4)
    return result.final_output


@agent_env("test-gw-langgraph", grader="math")
async def langgraph_agent(task, client):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ADDED.append((a, b))
        return a + b

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    graph = create_react_agent(llm, [add], prompt="Use the add tool, then answer in \\boxed{}.")
    state = await graph.ainvoke({"messages": [("user", task["prompt"])]}, {"recursion_limit": 8})
    return state["messages"][-1].content


async def _play(tokenizer, engine, name, n=1):
    runner = AgentRunner(renderer=Renderer(tokenizer, True), client=engine,
                         settings_for=lambda env: settings(256))
    try:
        runs = await asyncio.gather(*[runner(make(name), {"prompt": "What is 1+2?", "label": "3"},
                                             trajectory_id=f"g0-s{k}", group_id=0, index=k, seed=0, env_name=name)
                                      for k in range(n)])
    finally:
        await runner.aclose()
    return [s for samples in runs for s in samples]


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("name", ["test-gw-openai-agents", "test-gw-langgraph"])
def test_framework_tool_agent_trains_on_exact_tokens(tokenizer, name):
    engine = ScriptedEngine(tokenizer, [CALL, "The sum is \\boxed{3}."])
    samples = asyncio.run(_play(tokenizer, engine, name))
    assert ADDED == [(1, 2)]  # the framework read the parsed tool call and ran its tool
    assert len(samples) == 1, [s.metadata.get("agent_fault") for s in samples]
    sample = samples[0]
    assert "agent_fault" not in sample.metadata and sample.reward == 1.0
    assert sample.metadata["env_metrics"]["gateway_prefix_breaks"] == 0.0
    # the framework sent back the history it was given: the second turn continues the first's tokens
    (first, _, _), (second, _, _) = engine.calls
    assert second[:len(first)] == first and sample.tokens[:len(second)] == second
    assert "3" in tokenizer.decode(second[len(first):])  # the tool's result, rendered after the call
    trained = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if m]
    assert trained == (tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
                       + tokenizer.encode("The sum is \\boxed{3}.", add_special_tokens=False)
                       + [tokenizer.eos_token_id])


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("name", ["test-gw-openai-agents", "test-gw-langgraph"])
def test_framework_agent_on_the_embedded_engine(tokenizer, engine, name):
    """The tiny model's replies (random text) end each agent's run at its first turn: a sample
    of the engine's own tokens and logprobs, scored by the grader."""

    async def go():
        async with EngineClient(engine.url) as client:
            return await _play(tokenizer, client, name, n=2)

    samples = asyncio.run(go())
    assert len(samples) == 2
    for sample in samples:
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), sample.metadata
        assert sample.num_trained_tokens > 0 and all(lp <= 0 for lp in sample.rollout_logprobs)
        sample.validate()
