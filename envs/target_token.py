"""target-token: the prompt names a token; the reward is the share of response tokens
equal to it. Single turn, no tools: the smallest env that shows an RL run learning."""

from __future__ import annotations

import random
from typing import Iterator

from agentrl.env import Env
from agentrl.registry import register_env

# Short common words: one token in the default tokenizer and in real ones.
TARGETS = ("the", "and", "to", "of", "in", "is", "it", "on")


@register_env("target-token")
class TargetTokenEnv(Env):
    """Say the named token as often as possible: reward = share of response tokens equal to it."""

    description = "Say the named token as often as possible: reward = share of response tokens equal to it."
    max_turns = 1

    def __init__(self, targets: tuple[str, ...] | list[str] = TARGETS):
        self.targets = tuple(targets)
        self.target: str | None = None

    @classmethod
    def dataset(cls, targets=TARGETS, seed: int = 0, **_) -> Iterator[dict]:
        """An infinite seeded task generator."""
        rng = random.Random(seed)
        while True:
            word = rng.choice(tuple(targets))
            yield {"prompt": f"Repeat the word: {word}", "label": word}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        options = options or {}  # no task given: the target is drawn with the seeded np_random
        self.target = str(options.get("label") or self.targets[self.np_random.integers(len(self.targets))])
        return options.get("prompt") or f"Repeat the word: {self.target}", {}

    def step(self, action):
        texts = [t.strip() for t in getattr(action, "token_texts", ())]
        if not texts:  # a plain-text caller: fall back to whitespace words
            texts = action.split()
        reward = sum(t == self.target for t in texts) / len(texts) if texts else 0.0
        return [], reward, True, False, {"hits": sum(t == self.target for t in texts)}
