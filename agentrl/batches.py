"""Where each iteration's batch comes from, behind one small protocol: agentrl's producer,
slime's rollout function (`--rollout-function-path`) or saved rollouts (`--debug-train-only`).
The loop asks for a batch and reads its figures; what happens around generation (the GPU
handover, saving a stopped iteration) stays with the source."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Protocol

import numpy as np

from agentrl.metrics import RunLog
from agentrl.rollout.affinity import affinity_metrics
from agentrl.rollout.client import EngineClient
from agentrl.rollout.producer import RolloutProducer
from agentrl.rollout.slime import RolloutHook
from agentrl.types import Sample, SampleStatus


class BatchSource(Protocol):
    async def next_batch(self, rollout_id: int, policy_version: int) -> list[Sample]:
        """The iteration's samples. Stopped (a signal, the failure bound), it saves what the
        iteration made (a metrics row marked partial, its trajectories) before it raises."""

    def metrics(self) -> dict:
        """Figures of the last batch beyond rollout_metrics (handover seconds, drops, retries)."""

    def take_failed(self) -> list[Sample]:
        """Failed attempts (retried or dropped groups) since the last call, saved beside the batch."""

    def checkpoint(self) -> dict:
        """RunState fields a checkpoint needs to resume the source ({}: nothing to add)."""


# handover(drain=None): --colocate's GPU handover around generation (agentrl.weight_update.colocated)
Handover = Callable[..., object]


class ProducerBatches:
    """agentrl's producer: groups over-sampled, filtered, retried, generated ahead with --async."""

    def __init__(self, producer: RolloutProducer, *, batch_size: int, client: EngineClient, handover: Handover,
                 runlog: RunLog):
        self.producer, self.batch_size, self.client, self.handover = producer, batch_size, client, handover
        self.runlog = runlog
        self.last_handover: dict = {}  # the last batch's handover figures (filled as the handover ends)
        self.last_affinity: dict = {}  # router_affinity, prefix_cache_hit_rate of the last batch (engines' replies)

    async def next_batch(self, rollout_id: int, policy_version: int) -> list[Sample]:
        t0 = time.perf_counter()
        try:
            async with self.handover(drain=self.producer.requeue_inflight) as self.last_handover:
                batch = await self.producer.next_batch(self.batch_size)
            self.last_affinity = affinity_metrics(batch, self.client.turn_log)
            return batch
        except BaseException:  # stopped (signal, failure bound): keep what this iteration made
            finished = self.producer.ready_samples()
            self.runlog.log(rollout_metrics(rollout_id, finished, time.perf_counter() - t0) | self.producer.stats()
                            | affinity_metrics(finished, self.client.turn_log) | {"partial": True})
            self.runlog.save_trajectories(rollout_id, finished + self.producer.take_failed())
            raise

    def metrics(self) -> dict:
        return (self.last_handover | self.last_affinity | self.producer.stats()
                | {"requests_retried": self.client.retried})

    def take_failed(self) -> list[Sample]:
        return self.producer.take_failed()

    def checkpoint(self) -> dict:
        return {"pending_tasks": self.producer.pending_tasks(), "next_group_id": self.producer.next_id}


class HookBatches(ProducerBatches):
    """slime's generate_rollout fills each batch in place of the producer (which stays idle:
    its figures and pending tasks are reported as with the producer)."""

    def __init__(self, hook: RolloutHook, producer: RolloutProducer, **kwargs):
        super().__init__(producer, **kwargs)
        self.hook = hook

    async def next_batch(self, rollout_id: int, policy_version: int) -> list[Sample]:
        t0 = time.perf_counter()
        try:
            async with self.handover() as self.last_handover:
                batch = await self.hook.next_batch(rollout_id, policy_version)
            self.last_affinity = affinity_metrics(batch, self.client.turn_log)  # turns made through agentrl's client
            return batch
        except BaseException:  # stopped (signal, the failure bound): keep what the function returned, if it did
            self.runlog.log(rollout_metrics(rollout_id, self.hook.last_batch, time.perf_counter() - t0)
                            | {"partial": True})
            self.runlog.save_trajectories(rollout_id, self.hook.last_batch)
            raise

    def metrics(self) -> dict:
        return super().metrics() | self.hook.metrics


class ReplayBatches:
    """--debug-train-only: the saved rollouts of a run, one per iteration, round and round."""

    def __init__(self, rollouts: list[list[Sample]]):
        self.rollouts = rollouts

    async def next_batch(self, rollout_id: int, policy_version: int) -> list[Sample]:
        return self.rollouts[rollout_id % len(self.rollouts)]

    def metrics(self) -> dict:
        return {}

    def take_failed(self) -> list[Sample]:
        return []

    def checkpoint(self) -> dict:
        return {}


def generation_span(samples: list[Sample]) -> float | None:
    """Seconds from the first /generate request of `samples` to their last reply (the epoch stamps
    each rollout path records per trajectory: metadata["stages"] first_request_at, last_reply_at),
    or None where none are recorded."""
    stamps = [s.metadata["stages"] for s in samples
              if {"first_request_at", "last_reply_at"} <= s.metadata.get("stages", {}).keys()]
    if not stamps:
        return None
    return max(t["last_reply_at"] for t in stamps) - min(t["first_request_at"] for t in stamps)


def rollout_metrics(rollout_id: int, samples: list[Sample], seconds: float) -> dict:
    """The batch's figures. `seconds`: how long the loop waited for it (rollout_s). tokens_per_s
    divides the generated tokens by the span of the requests that made them (generation_span_s),
    not by that wait: under --async the batch was made during the previous training step, and
    the wait can be near zero; without recorded stamps, by the wait."""
    ok = [s for s in samples if s.status != SampleStatus.FAILED]
    generated = sum(s.num_trained_tokens for s in samples)
    rewards = [s.reward_value for s in ok] or [0.0]
    status = {f"status_{st.value}": sum(s.status == st for s in samples) for st in SampleStatus}
    truncations = Counter(s.metadata.get("truncation") for s in samples if s.status == SampleStatus.TRUNCATED)
    status |= {f"truncated/{reason}": n for reason, n in sorted(truncations.items(), key=str)}
    env_counts = [s.metadata.get("env_metrics") or {} for s in ok]  # an env's own counts (info["metrics"])
    status |= {f"env/{name}_mean": float(np.mean([c.get(name, 0.0) for c in env_counts]))
               for name in sorted({name for c in env_counts for name in c})}
    gen_s = [t.generate_s for s in samples for t in s.turn_timings]
    env_s = [t.env_s for s in samples for t in s.turn_timings]
    span = generation_span(samples)
    over = span if span is not None else seconds
    return {
        "rollout_id": rollout_id,
        "reward_mean": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        "response_len_mean": float(np.mean([s.response_length for s in ok])) if ok else 0.0,
        "turns_mean": float(np.mean([s.num_turns for s in ok])) if ok else 0.0,
        "tool_calls_mean": float(np.mean([s.metadata.get("tool_calls", 0) for s in ok])) if ok else 0.0,
        "num_samples": len(samples),
        **status,
        "rollout_s": seconds,
        "generate_s_mean": float(np.mean(gen_s)) if gen_s else 0.0,
        "env_s_mean": float(np.mean(env_s)) if env_s else 0.0,
        "generated_tokens": generated,
        "generation_span_s": over,
        "tokens_per_s": generated / over if over > 0 else 0.0,
    }
