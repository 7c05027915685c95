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
`reset`/`step` in a worker thread so the event loop never blocks. An async-only env still
answers gymnasium's sync `reset`/`step`: they run the async ones on the env's own event loop.

Every env declares gymnasium spaces -- actions are text (`TextSpace`, a `gymnasium.spaces.Text`),
observations a string or chat messages (`ChatObservation`) -- and seeds `np_random` through
``super().reset(seed=seed)``, so ``gymnasium.utils.env_checker.check_env`` passes on it.
"""

from __future__ import annotations

import asyncio
import string
from typing import Any, Callable, Iterator

import gymnasium
from gymnasium import spaces

Message = dict[str, Any]

#: The turns an env without max_turns may take before its episode is cut ("truncated/safety_max_turns"):
#: an env that never says terminated would otherwise run until the token budget ends.
SAFETY_MAX_TURNS = 32
Observation = list[Message] | str


class Action(str):
    """The assistant's text for one turn (a plain `str` to envs that want text), carrying the
    sampled token ids; `token_texts` decodes each token on first use (most envs never ask)."""

    token_ids: tuple[int, ...] = ()
    _decode: Callable[[list[int]], str] | None = None
    _decode_each: Callable[[tuple[int, ...]], tuple[str, ...]] | None = None

    @classmethod
    def build(cls, text: str, token_ids: list[int], decode: Callable[[list[int]], str],
              decode_each: Callable[[tuple[int, ...]], tuple[str, ...]] | None = None) -> "Action":
        """`decode_each(ids)`: what `decode([t])` gives for each t, all at once (the agent loop's
        Renderer.token_texts: a table lookup, where a thousand decode calls took ~0.7 ms)."""
        action = cls(text)
        action.token_ids, action._decode, action._decode_each = tuple(token_ids), decode, decode_each
        return action

    @property
    def token_texts(self) -> tuple[str, ...]:
        if self._decode_each is not None:
            return tuple(self._decode_each(self.token_ids))
        return tuple(self._decode([t]) for t in self.token_ids) if self._decode else ()


class TextSpace(spaces.Text):
    """Any string of at most `max_length` characters, unicode included (gymnasium's `Text`
    accepts only its charset). `sample()` draws printable ASCII of at most `sample_length`."""

    def __init__(self, max_length: int = 1 << 20, *, sample_length: int = 64, seed=None):
        super().__init__(max_length, min_length=0, charset=string.printable, seed=seed)
        self.sample_length = min(sample_length, max_length)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask=None, probability=None) -> str:
        if mask is None and probability is None:  # short text: a megabyte string helps no check
            mask = (int(self.np_random.integers(self.min_length, self.sample_length + 1)), None)
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"


def observation_error(obs: Any) -> str | None:
    """Why `obs` is not an observation (a string or a list of non-assistant chat messages), or None."""
    if isinstance(obs, str):
        return None
    if not (isinstance(obs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in obs)):
        return f"an observation must be a string or a list of chat messages, got {type(obs).__name__}"
    if any(m["role"] == "assistant" for m in obs):
        return "an env observation may not contain assistant messages: the policy writes those"
    return None


class ChatObservation(spaces.Space):
    """The observation space of text envs: a string (one user message) or a list of chat
    messages ``{"role": ..., "content": ...}`` other than the assistant's."""

    def __init__(self, seed=None):
        super().__init__(seed=seed)
        self._text = TextSpace()

    def contains(self, x: Any) -> bool:
        return observation_error(x) is None

    def sample(self, mask=None, probability=None) -> list[Message]:
        return [{"role": "user", "content": self._text.sample()} for _ in range(self.np_random.integers(3))]

    def seed(self, seed=None) -> int:
        seed = super().seed(seed)
        self._text.seed(seed + 1)
        return seed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatObservation)

    def __repr__(self) -> str:
        return "ChatObservation()"


class Env(gymnasium.Env):
    """Base class of text envs. Subclass and implement `reset`/`step` (or `areset`/`astep`)."""

    #: One line shown by `agentrl envs list`.
    description: str = ""
    #: Turn limit the agent loop enforces (an episode past it ends truncated "max_turns").
    #: None: the episode runs until `step` says terminated (or the token budget ends), as in
    #: gymnasium, up to a safety limit of SAFETY_MAX_TURNS turns that the console and metrics report.
    max_turns: int | None = None
    #: Name of the tool-call parser for model output (see agentrl.tool_parsers), if tools are used.
    tool_parser: str | None = None
    #: Stop strings: generation of a turn ends when its text ends with one (SGLang's `stop`),
    #: e.g. ["</search>", "</answer>"] so the env answers right after the tag.
    stop: list[str] = []
    #: Config values this env runs best with (flat config keys); the YAML file and flags override them.
    default_config: dict[str, Any] = {}
    #: gymnasium's spaces: text actions, string-or-chat-messages observations.
    action_space: spaces.Space = TextSpace()
    observation_space: spaces.Space = ChatObservation()

    # -- sync API (gymnasium) ----------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict]:
        """A subclass's `reset` calls this first (``super().reset(seed=seed)``) to seed `np_random`;
        an async-only env is reset through its `areset` on the env's own event loop."""
        cls = type(self)
        if cls.reset is not Env.reset:  # super().reset(seed=seed) from a subclass: gymnasium seeds np_random
            return super().reset(seed=seed, options=options)
        if cls.areset is Env.areset:
            raise NotImplementedError(f"{cls.__name__} defines neither reset nor areset")
        return self._run_sync(self.areset(seed=seed, options=options), "reset")

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict]:
        if type(self).astep is Env.astep:
            raise NotImplementedError(f"{type(self).__name__} defines neither step nor astep")
        return self._run_sync(self.astep(action), "step")

    def close(self) -> None:
        """Closes an async env through `aclose` on its own loop (a sync env overrides `close`)."""
        cls = type(self)
        if cls.aclose is not Env.aclose and cls.areset is not Env.areset:
            self._run_sync(self.aclose(), "close")
        loop, self._sync_loop = self.__dict__.get("_sync_loop"), None
        if loop is not None:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _run_sync(self, coro, method: str):
        """Run an async method for a sync caller, on this env's own loop: what `areset` starts
        (tool servers, connections) lives on that loop, so `step` must run there too."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(f"{type(self).__name__}.{method}() was called inside a running event loop: "
                               f"await a{method}() there instead")
        loop = self.__dict__.get("_sync_loop")
        if loop is None:
            loop = self._sync_loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)

    # -- async API: the agent loop calls these -----------------------------------------------
    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return await asyncio.to_thread(lambda: self.reset(seed=seed, options=options))

    async def astep(self, action: str):
        return await asyncio.to_thread(self.step, action)

    async def atruncated(self, reason: str) -> float | dict | None:
        """The reward for the work of an episode that a limit of the agent loop cut off (`reason`:
        "max_turns", "max_response_len", "max_context_len", ...), added to what its steps gave.
        None, the default: nothing more (an unfinished answer is worth nothing). An env whose
        work lies in its state rather than in a final answer returns it here: the code env grades
        the file the agent wrote, as SWE-style envs grade the repository at the turn limit."""
        return None

    async def aclose(self) -> None:
        if type(self).close is Env.close and self.__dict__.get("_sync_loop") is None:
            return  # Env.close would do nothing: no worker thread for it (one per trajectory)
        await asyncio.to_thread(self.close)

    # -- data --------------------------------------------------------------------------------
    #: `dataset`'s kwargs for `seeded_task` (an env built with data=... sets them)
    dataset_kwargs: dict[str, Any] = {}

    @classmethod
    def dataset(cls, **kwargs) -> Iterator[dict[str, Any]] | None:
        """Rows for training when no --prompt-data is given: dicts with "prompt", "label",
        "metadata". May be infinite (a seeded task generator). None: the env has none, and each
        episode is made from its seed alone (``reset(seed=..., options=None)``)."""
        return None

    @classmethod
    def chance_reward(cls, **kwargs) -> float | None:
        """The best mean reward of a policy that ignores the prompt, from the task distribution
        (the env's kwargs given): printed beside the reward, so a run that learned one answer
        for every prompt is not read as learning the task. None: not known."""
        return None

    def seeded_task(self) -> dict[str, Any]:
        """The task of a reset given none: the first row of `dataset` for a seed drawn with the
        (seeded) `np_random`, so ``reset(seed=s)`` is reproducible and ``reset()`` goes on from it.
        {} for an env without a dataset: its episode comes from the seed alone."""
        rows = self.dataset(seed=int(self.np_random.integers(2**31)), **self.dataset_kwargs)
        return {} if rows is None else dict(next(iter(rows)))


def as_messages(obs: Observation) -> list[Message]:
    """Normalize an observation to a list of chat messages."""
    error = observation_error(obs)
    if error:
        raise TypeError(error)
    return [{"role": "user", "content": obs}] if isinstance(obs, str) else obs


class GymTextEnv(gymnasium.Wrapper, Env):
    """Wraps a plain gymnasium env whose observations and actions are text (`spaces.Text`) for
    agentrl: a real `gymnasium.Wrapper` (spaces, spec, `np_random` and `unwrapped` are the
    wrapped env's) that is also an `agentrl.Env` (turn limit, description, async API)."""

    def __init__(self, env: gymnasium.Env, max_turns: int = 8):
        super().__init__(env)
        for kind in ("observation", "action"):
            space = getattr(env, f"{kind}_space", None)
            if space is None:  # undeclared: any text
                setattr(self, f"{kind}_space", TextSpace())
            elif not isinstance(space, spaces.Text):
                raise TypeError(f"GymTextEnv wraps envs with text {kind}s: {type(env).__name__}.{kind}_space is "
                                f"{space!r}, not a gymnasium.spaces.Text")
        self.max_turns = max_turns
        self.description = f"wrapped gymnasium env {env.spec.id if env.spec else type(env).__name__}"
