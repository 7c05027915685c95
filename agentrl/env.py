"""The env API: gymnasium's, for text agents.

    obs, info = env.reset(seed=None, options={"prompt": ..., "label": ..., "metadata": ...})
    obs, reward, terminated, truncated, info = env.step("assistant text of one turn")

An observation is a list of chat messages ``{"role": ..., "content": ...}`` to append to
the conversation, or a plain string (one user message). `terminated` means the task
ended (answer given); `truncated` means a limit cut it off. `reset`'s observation holds
the messages that start the conversation (the prompt). ``info["tools"]`` from reset, if
present, is the list of tool JSON schemas given to the chat template.

Envs that wait on tools or sandboxes define ``async def areset`` / ``async def astep``
with the same shapes; the agent loop awaits them when present, and runs a sync env's
`reset`/`step` in a worker thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

import gymnasium

Message = dict[str, Any]
Observation = list[Message] | str


class Action(str):
    """The assistant's text for one turn (a plain `str` to envs that want text), carrying the
    sampled token ids; `token_texts` decodes each token on first use (most envs never ask)."""

    token_ids: tuple[int, ...] = ()
    _decode: Callable[[list[int]], str] | None = None

    @classmethod
    def build(cls, text: str, token_ids: list[int], decode: Callable[[list[int]], str]) -> "Action":
        action = cls(text)
        action.token_ids, action._decode = tuple(token_ids), decode
        return action

    @property
    def token_texts(self) -> tuple[str, ...]:
        return tuple(self._decode([t]) for t in self.token_ids) if self._decode else ()


class Env(gymnasium.Env):
    """Base class of text envs. Subclass and implement `reset`/`step` (or `areset`/`astep`)."""

    #: One line shown by `agentrl envs list`.
    description: str = ""
    #: Turn limit the agent loop enforces (an episode past it ends truncated).
    max_turns: int = 1
    #: Name of the tool-call parser for model output (see agentrl.tool_parsers), if tools are used.
    tool_parser: str | None = None
    #: Stop strings: generation of a turn ends when its text ends with one (SGLang's `stop`),
    #: e.g. ["</search>", "</answer>"] so the env answers right after the tag.
    stop: list[str] = []
    #: Config values this env runs best with (flat config keys); the YAML file and flags override them.
    default_config: dict[str, Any] = {}

    # -- sync API (gymnasium) ----------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict]:
        raise NotImplementedError(f"{type(self).__name__} defines neither reset nor areset")

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict]:
        raise NotImplementedError(f"{type(self).__name__} defines neither step nor astep")

    # -- async API: the agent loop calls these -----------------------------------------------
    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return await asyncio.to_thread(lambda: self.reset(seed=seed, options=options))

    async def astep(self, action: str):
        return await asyncio.to_thread(self.step, action)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    # -- data --------------------------------------------------------------------------------
    @classmethod
    def dataset(cls, **kwargs) -> Iterator[dict[str, Any]] | None:
        """Rows for training when no --prompt-data is given: dicts with "prompt", "label",
        "metadata". May be infinite (a seeded task generator). None: the env has none."""
        return None


def as_messages(obs: Observation) -> list[Message]:
    """Normalize an observation to a list of chat messages."""
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, list) and all(isinstance(m, dict) and "role" in m for m in obs):
        for m in obs:
            if m["role"] == "assistant":
                raise TypeError("an env observation may not contain assistant messages: the policy writes those")
        return obs
    raise TypeError(f"an observation must be a string or a list of chat messages, got {type(obs).__name__}")


class GymTextEnv(Env):
    """Wraps a plain gymnasium env whose observations and actions are strings."""

    def __init__(self, env: gymnasium.Env, max_turns: int = 8):
        self.env = env
        self.max_turns = max_turns
        self.description = f"wrapped gymnasium env {env.spec.id if env.spec else type(env).__name__}"

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        return str(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return str(obs), float(reward), bool(terminated), bool(truncated), info

    def close(self):
        self.env.close()
