"""math-python (ReTool-like): the math env's problems, solved with a `python` tool.

The model may call the `python` MCP tool (a persistent interpreter, per trajectory, in a
sandbox) any number of times with hermes tool calls (``<tool_call>{"name": "python",
"arguments": {"code": "..."}}</tool_call>``), then answers without a tool call; the last
``\\boxed{}`` of that final message is graded by math_verify against the label.
"""

from __future__ import annotations

from typing import Iterator

from agentrl.envs.math_env import agrade, generate
from agentrl.registry import register_env
from agentrl.tools.env import ToolEnv

SYSTEM_PROMPT = (
    "You solve math problems. You can run Python code with the `python` tool: the interpreter keeps its "
    "variables between calls, and the value of the last expression is shown. Use it to compute and check. "
    "When you are done, reply without a tool call and put the final answer in \\boxed{}."
)


@register_env("math-python")
class MathPythonEnv(ToolEnv):
    """Math with a python tool (ReTool-like): tool calls, then a final \\boxed{} answer graded by math_verify.

    kwargs: ``sandbox`` (where the python tool runs: "auto" | "docker" | "local"; None runs it as
    a plain host process, for trusted tests only), ``max_turns`` (6), ``tool_timeout`` (s per call),
    ``require_boxed`` (True), ``n_problems`` (size of the built-in set; None: endless)."""

    description = "Arithmetic word problems with a sandboxed python tool; \\boxed{} answer graded by math_verify."
    builtin_tools = ("python",)
    sandbox = "auto"
    sandbox_limits = {"memory_mb": 1024, "cpus": 1.0}
    max_turns = 6
    needs_label = True  # graded against the task's label: data without one fails at start
    tool_timeout = 30.0
    max_tool_output = 4000
    system_prompt = SYSTEM_PROMPT
    default_config = {"rollout_max_response_len": 1024, "rollout_max_tokens_per_turn": 384}

    def __init__(self, sandbox: str | None = "auto", max_turns: int | None = None, tool_timeout: float | None = None,
                 require_boxed: bool = True, n_problems: int | None = None, system_prompt: str | None = None,
                 **tool_env_kwargs):
        super().__init__(tool_timeout=tool_timeout, system_prompt=system_prompt, **tool_env_kwargs)
        self.sandbox = sandbox
        if max_turns is not None:
            self.max_turns = int(max_turns)
        self.require_boxed = require_boxed
        self.tool_calls = 0

    @classmethod
    def dataset(cls, seed: int = 0, n_problems: int | None = None, **_) -> Iterator[dict]:
        return generate(seed=seed, n=n_problems)

    async def setup(self, task):
        if task.get("label") is None:
            raise ValueError("math-python: the task has no label (the gold answer); set --label-key")
        self.tool_calls = 0

    def initial_messages(self, task):
        prompt = task.get("prompt", "")
        if isinstance(prompt, str) and "\\boxed" not in prompt:
            task = {**task, "prompt": f"{prompt.strip()}\n\nPut the final answer in \\boxed{{}}."}
        return super().initial_messages(task)

    async def astep(self, action):
        obs, reward, terminated, truncated, info = await super().astep(action)
        self.tool_calls += info.get("tool_calls", 0)
        return obs, reward, terminated, truncated, info

    async def final_answer(self, action):
        reward, info = await agrade(str(action), self.task["label"], require_boxed=self.require_boxed)
        return [], reward, True, False, {**info, "tool_calls": self.tool_calls}
