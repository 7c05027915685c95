"""A user's env in one file: guess the secret number in a few turns.

    agentrl train --env my-env --env-module examples/custom_env/my_env.py

The prompt says the range; each turn the model names a number and hears "higher" or
"lower"; the reward is 1 for finding it, less the later it is found, 0 if never.
"""

import random
import re

import agentrl


@agentrl.register_env("my-env")
class GuessNumberEnv(agentrl.Env):
    """Find the secret number from higher/lower hints."""

    max_turns = 5
    default_config = {"rollout_max_response_len": 96, "rollout_max_tokens_per_turn": 16}

    def __init__(self, low: int = 1, high: int = 20):
        self.low, self.high = low, high

    @classmethod
    def dataset(cls, seed: int = 0, low: int = 1, high: int = 20, **_):
        rng = random.Random(seed)
        while True:
            yield {"prompt": f"I picked a number from {low} to {high}. Guess it: answer with one number.",
                   "label": rng.randint(low, high)}

    def reset(self, *, seed=None, options=None):
        options = options or {}
        self.secret = int(options.get("label") or random.Random(seed).randint(self.low, self.high))
        self.turn = 0
        return options.get("prompt") or f"Guess a number from {self.low} to {self.high}.", {}

    def step(self, action):
        self.turn += 1
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return "Please answer with a number.", 0.0, False, False, {"valid": False}
        guess = int(numbers[-1])
        if guess == self.secret:
            return [], 1.0 - 0.15 * (self.turn - 1), True, False, {"turns": self.turn}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, False, {"guess": guess}
