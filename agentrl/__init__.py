"""agentrl: an agentic environment gym plus RL trainer for LLMs.

Public API (everything else is internal):

    import agentrl

    @agentrl.register_env("my-env")
    class MyEnv(agentrl.Env):
        def reset(self, *, seed=None, options=None): ...
        def step(self, action): ...

    env = agentrl.make("my-env")
"""

from agentrl.env import Action, Env, GymTextEnv
from agentrl.errors import AgentRLError
from agentrl.registry import list_envs, make, register_env
from agentrl.types import Sample, SampleStatus

__all__ = ["Action", "AgentRLError", "Env", "GymTextEnv", "Sample", "SampleStatus", "list_envs", "make",
           "register_env"]
