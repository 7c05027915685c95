"""agentrl: an agentic environment gym plus RL trainer for LLMs.

Public API (everything else is internal):

    import agentrl

    @agentrl.register_env("my-env")
    class MyEnv(agentrl.Env):
        def reset(self, *, seed=None, options=None): ...
        def step(self, action): ...

    env = agentrl.make("my-env")
"""

from importlib.metadata import PackageNotFoundError, version as _installed

from agentrl.env import Action, ChatObservation, Env, GymTextEnv, TextSpace
from agentrl.errors import AgentRLError
from agentrl.registry import list_envs, make, register_env
from agentrl.types import Sample, SampleStatus

try:
    __version__ = _installed("agentrl")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "(not installed)"

__all__ = ["Action", "AgentRLError", "ChatObservation", "Env", "GymTextEnv", "Sample", "SampleStatus", "TextSpace",
           "list_envs", "make", "register_env"]
