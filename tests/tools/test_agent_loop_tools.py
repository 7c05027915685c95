"""A ToolEnv driven by the real agent loop (scripted engine replies, the tiny model's chat
template): tool schemas reach the prompt, tool messages render as `tool` turns with loss
mask 0, and a tool server failing beyond its restart marks the trajectory FAILED."""
import asyncio

from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
from agentrl.rollout.client import GenerateResult
from agentrl.tools import ToolEnv
from agentrl.types import SampleStatus
from tools_fixtures import demo_command  # noqa: F401 (fixtures)


class ScriptedClient:
    def __init__(self, tokenizer, replies):
        self.tok, self.replies = tokenizer, list(replies)

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateResult(ids, [-0.5] * len(ids), "stop", len(input_ids), 0, "1")


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class CalcEnv(ToolEnv):
    function_tools = (multiply,)
    max_turns = 4

    async def final_answer(self, action):
        return [], float("42" in action), True, False, {}


def play(env, tokenizer, replies):
    settings = LoopSettings(max_response_len=2000, max_turns=4, sampling_params={"temperature": 1.0})
    return asyncio.run(run_trajectory(env, {"prompt": "What is 6 times 7?"}, renderer=Renderer(tokenizer),
                                      client=ScriptedClient(tokenizer, replies), settings=settings,
                                      trajectory_id="t", group_id=0, seed=0))


def test_tool_turns_through_the_agent_loop(tokenizer):
    replies = ['<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>',
               '<tool_call>{"name": "divide", "arguments": {}}</tool_call>', "It is 42."]
    s = play(CalcEnv(), tokenizer, replies)
    assert s.status == SampleStatus.COMPLETED and s.reward == 1.0 and s.num_turns == 3, s.metadata.get("error")
    prompt = tokenizer.decode(s.prompt_tokens)
    assert '"name": "multiply"' in prompt and "Multiply two integers." in prompt
    env_text = tokenizer.decode([t for t, m in zip(s.response_tokens, s.loss_mask) if not m])
    assert "<|im_start|>tool\n42<|im_end|>" in env_text
    assert "unknown tool 'divide'" in env_text
    assert [m["role"] for m in s.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert s.metadata["tool_calls"] == 2  # tool results shown to the model (the metrics' tool_calls_mean)


def test_a_broken_tool_server_fails_the_trajectory(tokenizer, demo_command):
    env = CalcEnv(mcp_servers=[f"demo={demo_command}"])
    s = play(env, tokenizer, ['<tool_call>{"name": "crash", "arguments": {}}</tool_call>'])
    assert s.status == SampleStatus.FAILED
    assert s.metadata["error"].startswith("ToolServerError: MCP server 'demo'") and "again after a restart" in s.metadata["error"]
    assert env.toolset is None  # aclose ran: servers stopped


def test_a_registered_parser_that_hangs_scores_the_trajectory_zero(tokenizer):
    """Through the agent loop: a user's parser that never returns on the model's reply is killed at
    its bound (a forked process), and the trajectory is COMPLETED with reward 0 and the reason, not
    FAILED (the policy cannot veto its group by making the parser hang)."""
    import time

    from agentrl.tools.parsers import _PARSERS, parse_hermes, register_parser

    @register_parser("test-loop-hangs", timeout=1.0)
    def hangs(text, tools):
        while "forever" in text:
            pass
        return parse_hermes(text, tools)

    try:
        t0 = time.monotonic()
        s = play(CalcEnv(tool_parser="test-loop-hangs"), tokenizer,
                 ['<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>', "forever 42"])
        elapsed = time.monotonic() - t0
    finally:
        _PARSERS.pop("test-loop-hangs")
    assert s.status == SampleStatus.COMPLETED and s.reward == 0.0, s.metadata
    assert "tool-call parser 'test-loop-hangs' ran past its 1 s limit" in s.metadata["agent_fault"]
    assert s.metadata["tool_calls"] == 1 and elapsed < 30  # the first reply was parsed (in its own process)
