"""Runs groups (one prompt x n samples) as concurrent trajectories and returns Samples."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
import traceback
from typing import Any, Awaitable, Callable

from agentrl.env import Env
from agentrl.errors import AgentFault
from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
from agentrl.rollout.client import GenerateClient
from agentrl.rollout.control import RolloutControl
from agentrl.types import Sample, SampleStatus


@functools.lru_cache(maxsize=4096)  # the n members of a group ask in turn
def group_seed(run_seed: int, group_id: int) -> int:
    """Every member of a group resets its env with the same seed: the same starting state."""
    digest = hashlib.sha256(f"{run_seed}:{group_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class GroupRunner:
    """Plays the n trajectories of one group concurrently (bounded across all groups).

    `make_env(task_env_name)` builds a fresh env per trajectory and says its name;
    `settings_for(env)` gives the loop settings (the env may set max_turns); `reward_fn`,
    if given, replaces the env's reward of every trajectory that did not fail.
    `generate_fn` (slime's --custom-generate-function-path, agentrl.rollout.slime.GenerateHook)
    replaces the agent loop: it gets the env and the task, returns scored Samples (one or more).

    `cancel_siblings_on_failure` (training): once one member of a group fails, the others are
    cancelled and come back ABORTED (neither trained nor counted as failures): the producer
    re-runs or drops the whole group anyway, so a failed group costs the time of its first
    failure, not of its slowest member (a tool server that hangs at start: minutes)."""

    def __init__(self, *, make_env: Callable[[str | None], tuple[Env, str]], n_samples: int, renderer: Renderer,
                 client: GenerateClient, settings_for: Callable[[Env], LoopSettings], run_seed: int,
                 max_concurrency: int, reward_fn: Callable[[Sample], Awaitable] | None = None,
                 control: RolloutControl | None = None, on_done: Callable[[Sample], None] | None = None,
                 generate_fn: Callable[..., Awaitable[list[Sample]]] | None = None,
                 cancel_siblings_on_failure: bool = False):
        self.make_env, self.n_samples, self.renderer, self.client = make_env, n_samples, renderer, client
        self.settings_for, self.run_seed, self.reward_fn = settings_for, run_seed, reward_fn
        self.control, self.on_done, self.generate_fn = control, on_done, generate_fn
        self.cancel_siblings_on_failure = cancel_siblings_on_failure
        self.slots = asyncio.Semaphore(max_concurrency)

    async def run_group(self, task: dict[str, Any], group_id: int, attempt: int = 0) -> list[Sample]:
        members = [asyncio.ensure_future(self._one(task, group_id, k, attempt)) for k in range(self.n_samples)]
        try:
            failed = await self._first_failure(members) if self.cancel_siblings_on_failure else None
            if failed is None:
                runs = await asyncio.gather(*members)
            else:  # the members still running were cancelled: wait for their cleanup (env.aclose)
                await asyncio.wait(members)
                runs = [m.result() if not m.cancelled() else [self._aborted(task, group_id, k, attempt, failed)]
                        for k, m in enumerate(members)]
        except BaseException:  # cancelled from outside (requeue, shutdown) or a member raised: none outlives the group
            for m in members:
                m.cancel()
            await asyncio.gather(*members, return_exceptions=True)
            raise
        return [s for samples in runs for s in samples]  # a custom generate function may return several

    @staticmethod
    async def _first_failure(members: list[asyncio.Future]) -> Sample | None:
        """Waits for the members until one fails (then cancels the rest and returns its failed
        sample) or all are done (None). A member that raised ends the wait: the caller re-raises."""
        pending = set(members)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(m.exception() is not None for m in done):
                return None
            failed = next((s for m in done for s in m.result() if s.status == SampleStatus.FAILED), None)
            if failed is not None:
                for m in pending:
                    m.cancel()
                return failed
        return None

    def _aborted(self, task: dict, group_id: int, k: int, attempt: int, failed: Sample) -> Sample:
        return Sample(prompt_tokens=[], trajectory_id=self._trajectory_id(group_id, k, attempt), group_id=group_id,
                      env_name=failed.env_name or task.get("env") or "", status=SampleStatus.ABORTED,
                      metadata={"error": f"cancelled: trajectory {failed.trajectory_id} of its group failed",
                                "aborted": "sibling failed"})

    @staticmethod
    def _trajectory_id(group_id: int, k: int, attempt: int) -> str:
        return f"g{group_id}-s{k}" + (f"-a{attempt}" if attempt else "")

    async def _one(self, task: dict, group_id: int, k: int, attempt: int) -> list[Sample]:
        queued = time.perf_counter()
        async with self.slots:
            # the time queued for a --max-concurrency slot, and the env's construction (stage metrics)
            started = time.perf_counter()
            traj_id = self._trajectory_id(group_id, k, attempt)
            seed = group_seed(self.run_seed, group_id)
            try:
                env, env_name = self.make_env(task.get("env"))
            except Exception as exc:  # an env that cannot be built fails its trajectory, visibly
                samples = [Sample(prompt_tokens=[], trajectory_id=traj_id, group_id=group_id,
                                  env_name=task.get("env") or "", status=SampleStatus.FAILED,
                                  metadata={"error": f"building env: {exc!r}", "traceback": traceback.format_exc(),
                                            "failure_kind": f"building env: {type(exc).__name__}"})]
            else:
                if self.generate_fn is not None:
                    samples = await self.generate_fn(env, task, trajectory_id=traj_id, group_id=group_id, index=k,
                                                     seed=seed, env_name=env_name)
                else:
                    built = time.perf_counter()
                    sample = await run_trajectory(env, task, renderer=self.renderer, client=self.client,
                                                  settings=self.settings_for(env), trajectory_id=traj_id,
                                                  group_id=group_id, seed=seed, env_name=env_name,
                                                  control=self.control)
                    stages = sample.metadata.setdefault("stages", {})
                    stages |= {"slot_wait_s": started - queued, "build_env_s": built - started}
                    rewarded = time.perf_counter()
                    if self.reward_fn is not None and sample.status != SampleStatus.FAILED:
                        try:
                            sample.metadata["env_reward"] = sample.reward
                            sample.reward = await self.reward_fn(sample)
                        except AgentFault as exc:  # it ran past its time limit on this output: scored 0
                            sample.reward = 0.0
                            sample.metadata["agent_fault"] = f"{type(exc).__name__}: {exc}"
                        except Exception as exc:  # a broken reward function fails the trajectory, visibly
                            sample.status = SampleStatus.FAILED
                            sample.metadata["error"] = f"custom reward function: {exc!r}"
                            sample.metadata["traceback"] = traceback.format_exc()
                            sample.metadata["failure_kind"] = f"custom reward function (--custom-rm-path): {type(exc).__name__}"
                    stages["reward_s"] = time.perf_counter() - rewarded
                    samples = [sample]
            if self.on_done is not None:
                for sample in samples:
                    self.on_done(sample)
            return samples


async def generate_rollout(tasks: list[dict[str, Any]], *, rollout_id: int = 0, **runner_kwargs) -> list[Sample]:
    """One batch: every task as a group, all concurrently (tests and benchmarks use this)."""
    runner = GroupRunner(**runner_kwargs)
    groups = await asyncio.gather(*[runner.run_group(t, rollout_id * len(tasks) + g) for g, t in enumerate(tasks)])
    return [s for group in groups for s in group]
