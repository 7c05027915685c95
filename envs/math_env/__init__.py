"""math: single-turn math problems graded by math_verify on the final ``\\boxed{}`` answer.

The built-in dataset is a seeded stream of arithmetic word problems (envs/math_env/problems.py);
any JSONL with a question and an answer works too:
``--prompt-data gsm8k.jsonl --input-key question --label-key answer``.
"""

from __future__ import annotations

from typing import Iterator

from agentrl.env import Env
from agentrl.envs.math_env.grader import agrade, grade, last_boxed, verify_answer
from agentrl.envs.math_env.problems import generate
from agentrl.registry import register_env

__all__ = ["MathEnv", "agrade", "grade", "last_boxed", "verify_answer", "generate", "instruct"]

INSTRUCTION = "Solve the problem step by step. Put the final answer (a number) in \\boxed{}."


def instruct(prompt, instruction: str = INSTRUCTION):
    """The task prompt with the answer-format instruction appended (once). A list of chat
    messages passes through unchanged: a formatted dataset owns its prompt."""
    if isinstance(prompt, list):
        return prompt
    prompt = str(prompt).strip()
    return prompt if "\\boxed" in prompt else f"{prompt}\n\n{instruction}"


@register_env("math")
class MathEnv(Env):
    """Single-turn math: answer in \\boxed{}, graded by math_verify against the label.

    kwargs: ``require_boxed`` (default True: no \\boxed{} scores 0; False grades the last line),
    ``format_reward`` (reward for a \\boxed{} answer that is wrong, default 0.0),
    ``n_problems`` (size of the built-in problem set; None: endless seeded stream)."""

    description = "Single-turn arithmetic word problems; \\boxed{} answer graded by math_verify."
    max_turns = 1
    needs_label = True  # graded against the task's label: data without one fails at start
    default_config = {"rollout_max_response_len": 512}

    def __init__(self, require_boxed: bool = True, format_reward: float = 0.0, n_problems: int | None = None):
        self.require_boxed = require_boxed
        self.format_reward = float(format_reward)
        self.label = None

    @classmethod
    def dataset(cls, seed: int = 0, n_problems: int | None = None, **_) -> Iterator[dict]:
        return generate(seed=seed, n=n_problems)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        options = options or {}
        if options.get("prompt") is None:  # no task given: a problem drawn with the seeded np_random
            options = self.seeded_task()
        self.label = options.get("label")
        if self.label is None:
            raise ValueError("math: the task has no label (the gold answer); set --label-key")
        return instruct(options["prompt"]), {}

    def step(self, action):
        return self._finish(*grade(str(action), self.label, require_boxed=self.require_boxed))

    async def astep(self, action):
        # graded in a worker process with a time bound; the event loop goes on meanwhile
        return self._finish(*await agrade(str(action), self.label, require_boxed=self.require_boxed))

    def _finish(self, reward: float, info: dict):
        if reward == 0.0 and info["answer"] is not None:
            reward = self.format_reward
        return [], reward, True, False, info
