"""--colocate: engines and trainer take turns on the same GPUs.

Rollout: the trainer's state goes to host memory, the engines get back what they released.
Training: the rollout's leftovers are stopped, the engines release their KV cache, the
trainer comes back. SGLang is strict about the order, and its scheduler process dies
(taking the engine with it) when it is broken:
- resuming a memory tag that is not released (KeyError in `offload_tags.remove`): so the
  engines' released tags are tracked here and only those are resumed; nothing before the
  first release, and nothing on an engine that restarted since (it holds all its memory);
- releasing while a request runs (it asserts the scheduler is fully idle): so in-flight
  requests are aborted and the engines polled (/get_load) until idle before the release;
- generating while the KV cache is released (including /health's one-token generation:
  engines are started with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false).
The engines keep their weights: the weight sync writes into them while the KV cache is out.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import tenacity

from agentrl.errors import EngineError

if TYPE_CHECKING:
    from agentrl.rollout.client import EngineClient

RELEASED_TAGS = ("kv_cache",)  # the big one; weights stay (a sync writes into them during training)
IDLE_TIMEOUT_S = 60.0


class EngineMemory:
    """Which memory tags each engine has released, so a resume names exactly those."""

    def __init__(self) -> None:
        self.released: dict[str, tuple[str, ...]] = {}

    async def release(self, clients: list["EngineClient"]) -> None:
        await asyncio.gather(*[c.post("/release_memory_occupation", {"tags": list(RELEASED_TAGS)}) for c in clients])
        for c in clients:
            self.released[c.base_url] = RELEASED_TAGS

    async def resume(self, clients: list["EngineClient"]) -> None:
        held = [(c, self.released.pop(c.base_url)) for c in clients if c.base_url in self.released]
        await asyncio.gather(*[c.post("/resume_memory_occupation", {"tags": list(tags)}) for c, tags in held])

    def forget(self, url: str) -> None:
        """A restarted engine starts with all its memory: nothing of it is released."""
        self.released.pop(url, None)


async def wait_idle(clients: list["EngineClient"], timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until no engine has a request running or waiting (SGLang's /get_load)."""
    async def busy_engines() -> dict[str, int]:  # url -> requests running or waiting, for the busy ones
        loads = await asyncio.gather(*[c.get("/get_load") for c in clients])
        busy = {c.base_url: sum(int(r.get("num_reqs", 0)) for r in load or [])
                for c, load in zip(clients, loads)}
        return {url: n for url, n in busy.items() if n}

    busy = await tenacity.AsyncRetrying(retry=tenacity.retry_if_result(bool), stop=tenacity.stop_after_delay(timeout_s),
                                        wait=tenacity.wait_fixed(0.05),
                                        retry_error_callback=lambda state: state.outcome.result())(busy_engines)
    if busy:
        raise EngineError(f"engines still running requests {timeout_s:.0f} s after an abort: {busy}; "
                          "their memory cannot be released for training (--colocate)")
