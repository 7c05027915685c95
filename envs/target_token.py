"""target-token: the prompt names one of eight words; the reward is the share of response tokens
equal to it. Single turn, no tools: the smallest env that shows an RL run learning a task.

A model that ignores the prompt and always says one word scores 1/8 on this reward, and a
run that collapses onto one word looks like learning. So the env gives two figures that tell
them apart: `chance_reward()`, the best reward of a prompt-ignoring policy (from the task
distribution; printed beside the reward), and per episode `above_chance`, the share of the
named word minus the mean share of the other seven (metric env/above_chance_mean): every
prompt-ignoring policy scores 0 on it on average, so only reading the prompt raises it."""

from __future__ import annotations

import random
from collections import Counter
from typing import Iterator

from agentrl.env import Env
from agentrl.registry import register_env

# Short common words: one token in the default tokenizer and in real ones.
TARGETS = ("the", "and", "to", "of", "in", "is", "it", "on")


def prompt(word: str, times: int = 8) -> str:
    """The word said several times: enough of the prompt for a small model to pick it up."""
    return "Repeat the word: " + " ".join([word] * times)


@register_env("target-token")
class TargetTokenEnv(Env):
    """Say the named word: reward = share of response tokens equal to it."""

    description = ("Say the named word: reward = share of response tokens equal to it "
                   "(env/above_chance_mean: minus the other words' mean share, 0 for a prompt-ignoring policy).")
    max_turns = 1
    # the prompt as plain text: the named word is its last token, right where the answer starts
    default_config = {"apply_chat_template": False}

    def __init__(self, targets: tuple[str, ...] | list[str] = TARGETS):
        self.targets = tuple(targets)
        self.target: str | None = None

    @classmethod
    def dataset(cls, targets=TARGETS, seed: int = 0, **_) -> Iterator[dict]:
        """An infinite seeded task generator."""
        rng = random.Random(seed)
        while True:
            word = rng.choice(tuple(targets))
            yield {"prompt": prompt(word), "label": word}

    @classmethod
    def chance_reward(cls, targets=TARGETS, **_) -> float:
        """The best mean reward of a policy that ignores the prompt: it says each word w with some
        share p_w whatever the target, and w is the target with probability q_w (its share of the
        dataset's draws), so it scores sum_w p_w q_w, at most max_w q_w (all on the likeliest word)."""
        counts = Counter(targets)
        return max(counts.values()) / sum(counts.values())

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        options = options or {}  # no task given: the target is drawn with the seeded np_random
        self.target = str(options.get("label") or self.targets[self.np_random.integers(len(self.targets))])
        return options.get("prompt") or prompt(self.target), {}

    # reset and step are a few microseconds of Python: run on the event loop, not in a worker
    # thread as a sync env's are (Env.areset/astep). On the GPU run, 256 of them queued for the
    # thread pool: the env stage took 0.2 s a trajectory, reset staggered the first requests, and
    # the threads held the GIL while the event loop read the engine's replies.
    async def areset(self, *, seed=None, options=None):
        return self.reset(seed=seed, options=options)

    async def astep(self, action):
        return self.step(action)

    def step(self, action):
        texts = getattr(action, "token_texts", ())
        if not texts:  # a plain-text caller: fall back to whitespace words
            texts = action.split()
        if not texts:
            return [], 0.0, True, False, {"hits": 0, "metrics": {"above_chance": 0.0}}
        others = [w for w in dict.fromkeys(self.targets) if w != self.target]
        share = dict.fromkeys([self.target, *others], 0)  # only these words' counts are read
        for text, n in Counter(texts).items():  # each distinct token's text stripped once, not each token's
            word = text.strip()
            if word in share:
                share[word] += n
        above = (share[self.target] - sum(share[w] for w in others) / max(len(others), 1)) / len(texts)
        return [], share[self.target] / len(texts), True, False, {"hits": share[self.target],
                                                                  "metrics": {"above_chance": above}}
