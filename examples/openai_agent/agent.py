"""A tool-using math agent written with the OpenAI Agents SDK, trained by agentrl unchanged.

`solve` is plain Agents SDK code: an Agent with a `python` tool, run on one problem through
the OpenAI client it is given. Only the last line is agentrl's: it registers `solve` as the
agent env "openai-agent-math", with math-python's problems as tasks and the math env's
grader (math_verify on the last \\boxed{}) scoring the agent's final output.

    agentrl train --config examples/openai_agent/config.yaml
"""

from __future__ import annotations

import asyncio
import sys

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

INSTRUCTIONS = (
    "You solve math problems. You can run Python code with the `python` tool; print what you want to see. "
    "When you are done, reply without a tool call and put the final answer in \\boxed{}."
)
PYTHON_TIMEOUT_S = 10.0
MAX_OUTPUT_CHARS = 2000


@function_tool
async def python(code: str) -> str:
    """Run Python code and return what it printed (stdout and stderr)."""
    # A host subprocess in isolated mode, time-bounded: fine for this example's own policy on a
    # dev machine; an agent that runs untrusted code should run it in a sandbox.
    proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "-c", code, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), PYTHON_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return f"error: the code ran past {PYTHON_TIMEOUT_S:g} s"
    return out.decode(errors="replace")[-MAX_OUTPUT_CHARS:] or "(no output)"


async def solve(task: dict, client) -> str:
    """One problem, solved by an Agents SDK agent through `client` (an openai.AsyncOpenAI)."""
    set_tracing_disabled(True)  # offline: no trace upload to OpenAI
    agent = Agent(name="math", instructions=INSTRUCTIONS, tools=[python],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=384))
    result = await Runner.run(agent, task["prompt"], max_turns=6)
    return str(result.final_output)


# the one agentrl line: train `solve` as an env
from agentrl.envs.math_python import MathPythonEnv  # noqa: E402
from agentrl.gateway import agent_env  # noqa: E402

agent_env("openai-agent-math", grader="math", tasks=MathPythonEnv.dataset, max_turns=7, timeout_s=300,
          description="math-python's problems, solved by an OpenAI Agents SDK agent with a python tool")(solve)
