"""Fills training batches with useful groups.

Groups (one task x n samples) run as tasks. A group with an infrastructure failure in any
member is re-run whole (dropping one member would bias GRPO's baseline), up to
`max_group_retries`; a dynamic filter may drop finished groups (e.g. zero reward std);
`over_sampling` groups are kept in flight so filtered groups are replaced without a
stall. In async mode the producer keeps generating for the next batch while the caller
trains. Tasks launched but not yet handed out are part of the data position
(`pending_tasks()`), so a resumed run re-runs them instead of skipping them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Awaitable, Callable

from agentrl.data import PromptSource
from agentrl.types import Sample, SampleStatus

GroupFilter = Callable[[list[Sample]], tuple[bool, str]]


def nonzero_std_filter(samples: list[Sample]) -> tuple[bool, str]:
    """Built-in dynamic filter: a group whose rewards are all equal carries no GRPO signal."""
    rewards = [s.reward_value for s in samples if s.trainable]
    return (len(set(rewards)) > 1, "zero_std")


class RolloutProducer:
    def __init__(self, *, source: PromptSource, run_group: Callable[[dict, int, int], Awaitable[list[Sample]]],
                 over_sampling: int, group_filter: GroupFilter | None = None, max_group_retries: int = 2,
                 keep_generating: bool = False, first_group_id: int = 0, pending: list[dict] | None = None):
        self.source, self.run_group, self.over_sampling = source, run_group, over_sampling
        self.group_filter, self.max_group_retries = group_filter, max_group_retries
        self.keep_generating = keep_generating  # async mode: generate the next batch during training
        self.next_id = first_group_id  # group ids are unique across the run (and its resumes)
        self._requeued: list[dict] = list(pending or [])  # resumed: launched before the restart, never trained
        self._inflight: dict[asyncio.Task, tuple[dict, int, int]] = {}  # task -> (task dict, group id, attempt)
        self._ready: list[tuple[int, dict, list[Sample]]] = []  # (group id, task, samples)
        self.dropped: Counter[str] = Counter()
        self.retried = 0

    def _launch(self, task: dict, group_id: int, attempt: int) -> None:
        job = asyncio.create_task(self.run_group(task, group_id, attempt))
        self._inflight[job] = (task, group_id, attempt)

    def _top_up(self, target: int) -> None:
        while len(self._inflight) + len(self._ready) < target:
            task = self._requeued.pop(0) if self._requeued else self.source.next_batch(1)[0]
            self._launch(task, self.next_id, 0)
            self.next_id += 1

    def _collect(self, job: asyncio.Task) -> None:
        task, group_id, attempt = self._inflight.pop(job)
        samples = job.result()  # run_group never raises for env/engine failures: an exception here is a bug
        if any(s.status == SampleStatus.FAILED for s in samples):
            if attempt < self.max_group_retries:
                self.retried += 1
                self._launch(task, group_id, attempt + 1)
            else:
                self.dropped["failed"] += 1
            return
        if self.group_filter is not None:
            keep, reason = self.group_filter(samples)
            if not keep:
                self.dropped[reason] += 1
                return
        self._ready.append((group_id, task, samples))

    async def next_batch(self, n_groups: int, timeout_s: float = 24 * 3600) -> list[Sample]:
        """The next `n_groups` useful groups, flattened."""
        async def fill():
            while len(self._ready) < n_groups:
                self._top_up(max(n_groups, self.over_sampling))
                done, _ = await asyncio.wait(list(self._inflight), return_when=asyncio.FIRST_COMPLETED)
                for job in done:
                    self._collect(job)

        await asyncio.wait_for(fill(), timeout_s)
        batch, self._ready = self._ready[:n_groups], self._ready[n_groups:]
        batch.sort(key=lambda item: item[0])  # launch order, whatever order they finished in
        if self.keep_generating:
            self._top_up(max(n_groups, self.over_sampling))  # runs while the caller trains
        return [s for _, _, samples in batch for s in samples]

    def pending_tasks(self) -> list[dict]:
        """Tasks launched or finished but not yet handed out: re-run them after a restart."""
        return [t for _, t, _ in self._ready] + [t for t, _, _ in self._inflight.values()] + self._requeued

    async def requeue_inflight(self) -> None:
        """Stop the groups still running and re-run their tasks later (--colocate: the
        engines must be idle before they release their memory for training)."""
        jobs = dict(self._inflight)
        self._inflight.clear()
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        self._requeued[:0] = [task for task, _, _ in jobs.values()]

    async def aclose(self) -> None:
        for job in self._inflight:
            job.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        self._inflight.clear()

    def stats(self) -> dict[str, Any]:
        out = {f"dropped_{reason}": n for reason, n in self.dropped.items()}
        out["groups_retried"] = self.retried
        out["groups_in_flight"] = len(self._inflight)
        return out
