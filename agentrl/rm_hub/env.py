"""The `slime` env: what slime's default rollout does, as an agentrl env. The prompt as the
data row gives it (no instruction added), one response, and the reward from `--rm-type` or
`--custom-rm-path` (which replace the env's own reward of 0, as they do for every env).
A slime launch script selects it (agentrl/slime_args.py)."""

from __future__ import annotations

from agentrl.env import Env
from agentrl.registry import register_env


@register_env("slime")
class SlimeEnv(Env):
    """Single turn on --prompt-data rows, scored by --rm-type / --custom-rm-path (slime's rm_hub)."""

    description = "slime's default rollout: the row's prompt, one response, scored by --rm-type / --custom-rm-path."
    max_turns = 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        prompt = (options or {}).get("prompt")
        if prompt is None:
            raise ValueError("slime env: the task has no prompt; give --prompt-data (with --input-key)")
        return prompt, {}

    def step(self, action):
        return [], 0.0, True, False, {}
