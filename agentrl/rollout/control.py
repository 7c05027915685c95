"""A gate the agent loops pass before every /generate: closed while weights change, so no
request reaches an engine mid-update (and, with partial rollouts, aborted generations
resume only under the new weights)."""

from __future__ import annotations

import asyncio


class RolloutControl:
    def __init__(self, wait_timeout_s: float = 3600.0):
        self._open = asyncio.Event()
        self._open.set()
        self.wait_timeout_s = wait_timeout_s
        self.partial_rollout = False  # resume aborted generations instead of ending the trajectory
        self.policy_version = 0  # the engines' weights (set at each sync), for code that cannot ask them
        self.lora_adapter: str | None = None  # --lora-sync adapter: the adapter every request names (set at each sync)

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        if self._open.is_set():  # open (nearly always): no task, no trip through the event loop per request
            return
        await asyncio.wait_for(self._open.wait(), self.wait_timeout_s)
