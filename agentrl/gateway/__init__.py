"""An OpenAI-compatible endpoint that trains any agent program, recording the exact tokens.

`Gateway` serves /v1/chat/completions and /v1/models for many sessions; a `Session` turns
one trajectory's requests into Samples (session.py states the token rules); `agent_env`
makes an agent program an env that `agentrl train --env NAME` trains (`AgentRunner` plays
it). docs/agents.md is the guide.
"""

from agentrl.gateway.agent_env import AgentEnv, AgentResult, AgentRunner, agent_env
from agentrl.gateway.server import Gateway
from agentrl.gateway.session import Session

__all__ = ["AgentEnv", "AgentResult", "AgentRunner", "Gateway", "Session", "agent_env"]
