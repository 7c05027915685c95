"""Fills training batches with useful groups.

Groups (one task x n samples) run as tasks. A group with an infrastructure failure in any
member is re-run whole (dropping one member would bias GRPO's baseline), up to
`max_group_retries`; a dynamic filter may drop finished groups (e.g. zero reward std);
`over_sampling` groups are kept in flight so filtered groups are replaced without a
stall. In async mode the producer keeps generating for the next batch while the caller
trains.

Failures are bounded and visible: the first failure of each kind is reported (with its
traceback) as it happens, every failed attempt is kept for the trajectory files, and
`max_failed_groups` groups dropped in a row (no useful group between them) stop the run
with the first failure's traceback: a hopeless run ends in minutes, not a day. Tasks launched but not yet handed out are part of the data position
(`pending_tasks()`), so a resumed run re-runs them instead of skipping them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter, deque
from typing import Any, Awaitable, Callable

from agentrl.data import PromptSource
from agentrl.errors import AgentRLError
from agentrl.http import RetryPolicy
from agentrl.types import Sample, SampleStatus

log = logging.getLogger("agentrl.rollout")
GroupFilter = Callable[[list[Sample]], tuple[bool, str]]


def nonzero_std_filter(samples: list[Sample]) -> tuple[bool, str]:
    """Built-in dynamic filter: a group whose rewards are all equal carries no GRPO signal."""
    rewards = [s.reward_value for s in samples if s.trainable]
    return (len(set(rewards)) > 1, "zero_std")


class RolloutFailedError(AgentRLError):
    """Groups keep failing: the run cannot fill a batch."""


def failure_kind(sample: Sample) -> str:
    """What failed, without the per-trajectory details: "env 'code': TimeoutError",
    "custom reward function: KeyError"."""
    kind = sample.metadata.get("failure_kind")
    if not kind:
        error = str(sample.metadata.get("error", "unknown error"))
        found = re.match(r"(.*?\b\w*(?:Error|Exception|Timeout|Interrupt|Exit)\b)", error)
        kind = found.group(1) if found else error[:80]
    return f"env {sample.env_name!r}: {kind}" if sample.env_name else kind


def describe_failure(sample: Sample) -> str:
    tb = sample.metadata.get("traceback")
    return (f"trajectory {sample.trajectory_id} ({failure_kind(sample)}): {sample.metadata.get('error')}"
            + (f"\n{tb.rstrip()}" if tb else ""))


class RolloutProducer:
    def __init__(self, *, source: PromptSource, run_group: Callable[[dict, int, int], Awaitable[list[Sample]]],
                 over_sampling: int, group_filter: GroupFilter | None = None, max_group_retries: int = 2,
                 keep_generating: bool = False, first_group_id: int = 0, pending: list[dict] | None = None,
                 max_failed_groups: int | None = 8, report: Callable[[str], None] | None = None,
                 retry_backoff_s: float = 1.0):
        self.source, self.run_group, self.over_sampling = source, run_group, over_sampling
        self.group_filter = group_filter
        # a retry waits (1 s, 2 s, 4 s, ... 30 s, jittered): an overloaded machine or service gets room to
        # recover. A failed group is re-launched beside the running ones, not awaited in a loop: the
        # policy gives the bound and the waits (_collect, _attempt)
        self.retry = RetryPolicy(attempts=max_group_retries + 1, backoff_s=min(retry_backoff_s, 30.0),
                                 max_backoff_s=30.0)
        self.keep_generating = keep_generating  # async mode: generate the next batch during training
        self.next_id = first_group_id  # group ids are unique across the run (and its resumes)
        self._requeued: list[dict] = list(pending or [])  # resumed: launched before the restart, never trained
        self._inflight: dict[asyncio.Task, tuple[dict, int, int]] = {}  # task -> (task dict, group id, attempt)
        self._done: deque[asyncio.Task] = deque()  # finished jobs, in the order they finished, not yet collected
        self._wakeup: asyncio.Future | None = None  # set when a job finishes
        self._starting = asyncio.Lock()  # paces group starts (_attempt)
        self._ready: list[tuple[int, dict, list[Sample]]] = []  # (group id, task, samples)
        self.max_failed_groups = max_failed_groups  # dropped in a row before the run stops; None: never
        self.report = report or log.warning  # the first failure of each kind, as it happens
        self.dropped: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # failed trajectories by kind
        self.retried = 0
        self.failed_in_row = 0
        self.target = 0  # groups the current batch needs
        self.first_failure: str | None = None
        self.failed_samples: list[Sample] = []  # failed attempts since the last take_failed(): saved, not trained

    def _launch(self, task: dict, group_id: int, attempt: int) -> None:
        job = asyncio.create_task(self._attempt(task, group_id, attempt))
        self._inflight[job] = (task, group_id, attempt)
        job.add_done_callback(self._finished)

    def _finished(self, job: asyncio.Task) -> None:
        # a callback per job, not asyncio.wait over all of them per wake-up: that costs O(groups in flight)
        # for every group that finishes (1 ms each at 2,000 groups of one)
        self._done.append(job)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _attempt(self, task: dict, group_id: int, attempt: int) -> list[Sample]:
        if attempt:
            await asyncio.sleep(self.retry.delay(attempt))
        # one group starts per turn of the event loop, in launch order: a batch's groups launched
        # at once would start all their trajectories in one turn (250 at 2,000 in flight: 7-23 ms
        # in which no reply of the running ones is read; bench/driver_scale.py)
        async with self._starting:
            await asyncio.sleep(0)
        return await self.run_group(task, group_id, attempt)

    def _top_up(self, target: int) -> None:
        while len(self._inflight) + len(self._ready) < target:
            task = self._requeued.pop(0) if self._requeued else self.source.next_batch(1)[0]
            self._launch(task, self.next_id, 0)
            self.next_id += 1

    def _collect(self, job: asyncio.Task) -> None:
        task, group_id, attempt = self._inflight.pop(job)
        samples = job.result()  # run_group never raises for env/engine failures: an exception here is a bug
        failed = [s for s in samples if s.status == SampleStatus.FAILED]
        if failed:
            self._note_failures(failed)
            for s in samples:  # the whole attempt: its failed members and the ones it takes down (not trained)
                s.metadata["attempt_failed"] = True
            self.failed_samples += samples
            if attempt + 1 < self.retry.attempts:
                self.retried += 1
                self._launch(task, group_id, attempt + 1)
                return
            self.dropped["failed"] += 1
            self.failed_in_row += 1
            if self.max_failed_groups is not None and self.failed_in_row >= self.max_failed_groups:
                raise RolloutFailedError(
                    f"{self.failed_in_row} groups in a row failed, each tried {self.retry.attempts} times "
                    f"({self._failure_summary()}); stopping (--max-failed-groups {self.max_failed_groups}). "
                    f"The first failure: {self.first_failure}")
            return
        self.failed_in_row = 0
        self.source.observe(task, [s.reward_value for s in samples if s.trainable])
        if self.group_filter is not None:
            keep, reason = self.group_filter(samples)
            if not keep:
                self.dropped[reason] += 1
                return
        self._ready.append((group_id, task, samples))

    def _note_failures(self, failed: list[Sample]) -> None:
        for sample in failed:
            kind = failure_kind(sample)
            if not self.failures[kind]:
                text = describe_failure(sample)
                self.first_failure = self.first_failure or text
                self.report(f"first failure of its kind: {text}")
            self.failures[kind] += 1

    def _failure_summary(self) -> str:
        return ", ".join(f"{n} x {kind}" for kind, n in self.failures.most_common(3))

    def status(self) -> str:
        """For the progress line: groups ready of the batch's target, and what went wrong."""
        parts = [f"groups {len(self._ready)}/{self.target} ready"]
        if self.failures:
            parts.append(f"failed trajectories {sum(self.failures.values())} ({self._failure_summary()})")
        if self.retried:
            parts.append(f"groups retried {self.retried}")
        if self.dropped:
            parts.append("groups dropped " + ", ".join(f"{reason} {n}" for reason, n in self.dropped.items()))
        return "; ".join(parts)

    def ready_samples(self) -> list[Sample]:
        """Groups finished but not yet handed out (a stopped run writes them)."""
        return [s for _, _, samples in self._ready for s in samples]

    def take_failed(self) -> list[Sample]:
        """Failed attempts since the last call (their tracebacks in metadata), for the trajectory files."""
        out, self.failed_samples = self.failed_samples, []
        return out

    async def next_batch(self, n_groups: int, timeout_s: float = 24 * 3600) -> list[Sample]:
        """The next `n_groups` useful groups, flattened."""
        self.target = n_groups

        async def fill():
            while len(self._ready) < n_groups:
                self._top_up(max(n_groups, self.over_sampling))
                if not self._done:
                    self._wakeup = asyncio.get_running_loop().create_future()
                    await self._wakeup
                while self._done:  # one at a time: if _collect raises, the rest stay for the next call
                    job = self._done.popleft()
                    if job in self._inflight:  # not one requeue_inflight or aclose took back
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
        self._done.clear()

    def stats(self) -> dict[str, Any]:
        out = {f"dropped_{reason}": n for reason, n in self.dropped.items()}
        out["groups_retried"] = self.retried
        out["trajectories_failed"] = sum(self.failures.values())
        out["groups_in_flight"] = len(self._inflight)
        return out
