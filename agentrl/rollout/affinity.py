"""Session affinity and prefix-cache figures of a rollout, from the engines' replies.

Which engine served a turn: every reply of agentrl's engines names it in the response
header `X-Agentrl-Engine` (the embedded engine also in `meta_info.engine_id`; SGLang
servers launched by agentrl get the header from agentrl.engines.sglang_server), and
sglang-router passes the header through. Engines attached with --rollout-engine-urls that
were not started by agentrl do not name themselves: their turns count as unknown and the
affinity figure is left out rather than guessed.

Each EngineClient records every /generate it completes in its own TurnLog (`client.turn_log`),
keyed by the routing key (the trajectory id). `affinity_metrics(samples, log)` reads and
forgets the trajectories of one rollout:

- router_affinity: the share of turns after the first that were served by the engine that
  served the trajectory's first turn (1.0: every trajectory stayed on its engine);
- prefix_cache_hit_rate: prompt tokens whose KV the engine reused (cached_tokens) over
  all prompt tokens sent, over every /generate of the rollout.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    engine: str | None  # None: the engine did not say
    prompt_tokens: int
    cached_tokens: int


class TurnLog:
    """Per-trajectory list of the /generate calls the client completed (bounded: the oldest
    trajectories are forgotten past `max_sessions`)."""

    def __init__(self, max_sessions: int = 200_000):
        self.max_sessions = max_sessions
        self._turns: OrderedDict[str, list[Turn]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, session_id: str, turn: Turn) -> None:
        with self._lock:
            self._turns.setdefault(session_id, []).append(turn)
            while len(self._turns) > self.max_sessions:
                self._turns.popitem(last=False)

    def get(self, session_id: str) -> list[Turn]:
        with self._lock:
            return list(self._turns.get(session_id, []))

    def pop(self, session_ids) -> dict[str, list[Turn]]:
        with self._lock:
            return {sid: self._turns.pop(sid) for sid in session_ids if sid in self._turns}


def affinity_metrics(samples, log: TurnLog) -> dict[str, float]:
    """router_affinity and prefix_cache_hit_rate of these samples' trajectories (keys with no
    data are left out)."""
    turns = log.pop([s.trajectory_id for s in samples])
    return summarize(turns.values())


def summarize(trajectories) -> dict[str, float]:
    later = same = 0
    prompt = cached = 0
    engines: set[str] = set()
    for traj in trajectories:
        for t in traj:
            prompt += t.prompt_tokens
            cached += t.cached_tokens
            if t.engine is not None:
                engines.add(t.engine)
        if traj and all(t.engine is not None for t in traj):
            first = traj[0].engine
            later += len(traj) - 1
            same += sum(t.engine == first for t in traj[1:])
    out: dict[str, float] = {}
    if later:
        out["router_affinity"] = same / later
    if prompt:
        out["prefix_cache_hit_rate"] = cached / prompt
    if engines:
        out["engines_used"] = float(len(engines))
    return out
