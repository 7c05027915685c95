"""Write examples/sft/math_python_sft.jsonl: conversations that teach math-python's tool format.

    python examples/sft/make_data.py [--n 48] [--seed 7] [--out examples/sft/math_python_sft.jsonl]

Each row is what the math-python env itself produces, played with a scripted policy: the env's
system prompt, tool schemas and user message (from `reset`), an assistant turn calling the
`python` tool in Hermes format, the tool's real output (the env runs the code), and a final
assistant turn with the `\\boxed{}` answer, which the env grades: only rows scored 1 are kept.
The tool runs on the host (sandbox=None): the code is this script's own, not a model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

from agentrl.envs.math_env import generate
from agentrl.registry import make

# Per problem kind: the variable names of the problem's integers (in the order they appear) and
# the expression of the answer.
PROGRAMS = {
    "shopping": ("count, price, paid", "paid - count * price"),
    "groups": ("containers, per_container, given_away", "containers * per_container - given_away"),
    "sharing": ("total, friends, kept", "(total - kept) // friends"),
    "speed": ("speed, hours, walked", "speed * hours + walked"),
    "ages": ("age, older_by, years", "age + older_by + years"),
    "rectangle": ("length, width, beds, side", "length * width - beds * side * side"),
    "savings": ("saved, weekly, weeks, spent", "saved + weekly * weeks - spent"),
    "percent": ("total, percent", "total - total * percent // 100"),
}


def program(task: dict) -> str:
    names, expr = PROGRAMS[task["metadata"]["kind"]]
    numbers = re.findall(r"\d+", task["prompt"])[:len(names.split(","))]
    return f"{names} = {', '.join(numbers)}\n{expr}"


def tool_call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


async def conversation(task: dict) -> dict | None:
    env = make("math-python", sandbox=None)
    try:
        messages, info = await env.areset(seed=0, options=task)
        call = f"I will compute it with Python.\n{tool_call(program(task))}"
        messages.append({"role": "assistant", "content": call})
        obs, *_ = await env.astep(call)
        messages += obs
        result = obs[0]["content"].strip()
        final = f"The result is {result}, so the answer is \\boxed{{{result}}}."
        messages.append({"role": "assistant", "content": final})
        _, reward, terminated, *_ = await env.astep(final)
        return {"messages": messages, "tools": info["tools"]} if terminated and reward == 1.0 else None
    finally:
        await env.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).with_name("math_python_sft.jsonl")))
    args = parser.parse_args()
    rows = []
    for task in generate(seed=args.seed):
        row = await conversation(task)
        if row is not None:
            rows.append(row)
        if len(rows) == args.n:
            break
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} conversations to {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
