"""Issue 20: in training, once one member of a group fails its siblings are cancelled (ABORTED,
neither trained nor counted as failures), so a group whose tool servers hang at start costs
one fast failure's time, not the hang's."""

import asyncio
import time
from collections import Counter

import pytest

import agentrl
from agentrl.data import PromptSource
from agentrl.rollout.agent_loop import LoopSettings
from agentrl.rollout.manager import GroupRunner
from agentrl.rollout.producer import RolloutFailedError, RolloutProducer
from agentrl.types import SampleStatus
from waiting import await_until

N = 4


class OneFailsOthersHang(agentrl.Env):
    """Fault injection: the first member of each attempt to reset raises at once; the others
    wait `others_s` in reset (None: forever, as a tool server that never answers) then raise."""

    def __init__(self, resets: Counter, closed: list, others_s: float | None):
        self.resets, self.closed, self.others_s = resets, closed, others_s

    async def areset(self, *, seed=None, options=None):
        first = self.resets[seed] % N == 0  # members of one group share the seed; attempts follow each other
        self.resets[seed] += 1
        if first:
            raise RuntimeError("injected: tool server died")
        if self.others_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.others_s)
        raise RuntimeError("injected: slow failure")

    async def astep(self, action):
        raise AssertionError("never reached")

    async def aclose(self):
        self.closed.append(self)


def runner_for(cancel: bool, others_s: float | None):
    resets, closed = Counter(), []
    runner = GroupRunner(make_env=lambda name: (OneFailsOthersHang(resets, closed, others_s), "hangs"),
                         n_samples=N, renderer=None, client=None, run_seed=0, max_concurrency=64,
                         settings_for=lambda env: LoopSettings(max_response_len=8, max_turns=1, sampling_params={}),
                         cancel_siblings_on_failure=cancel)
    return runner, closed


def test_a_failed_member_cancels_its_hanging_siblings_and_the_run_stops_in_the_fast_failures_time():
    runner, closed = runner_for(cancel=True, others_s=None)
    source = PromptSource([{"prompt": f"p{i}"} for i in range(50)], shuffle=False)
    reports = []
    producer = RolloutProducer(source=source, run_group=runner.run_group, over_sampling=2, max_group_retries=1,
                               max_failed_groups=2, report=reports.append, retry_backoff_s=0)

    async def run():
        try:
            with pytest.raises(RolloutFailedError) as err:
                await asyncio.wait_for(producer.next_batch(2), 20)  # without the cancel: never (the others hang)
        finally:
            await producer.aclose()
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return str(err.value), left

    t0 = time.monotonic()
    message, left = asyncio.run(run())
    assert time.monotonic() - t0 < 10
    assert left == []  # no member outlives its group
    assert "2 groups in a row failed, each tried 2 times" in message and "tool server died" in message
    kept = producer.take_failed()
    failed = [s for s in kept if s.status == SampleStatus.FAILED]
    aborted = [s for s in kept if s.status == SampleStatus.ABORTED]
    # one failure per attempt; its siblings aborted, not counted as failures of their own
    assert len(failed) == sum(producer.failures.values()) and len(aborted) == (N - 1) * len(failed)
    assert all("tool server died" in s.metadata["error"] for s in failed)
    assert all(s.metadata["aborted"] == "sibling failed" and not s.trainable and s.metadata["attempt_failed"]
               for s in aborted)
    assert {s.trajectory_id for s in kept} >= {f"g0-s{k}" for k in range(N)} | {f"g0-s{k}-a1" for k in range(N)}
    made = sum(closed[0].resets.values())  # every env made is reset once
    # every env closed: the cancelled siblings', and those of a group the stop cut short (not kept)
    assert len(closed) == made >= len(kept)
    assert len(reports) == 1


@pytest.mark.parametrize("cancel", [True, False])
def test_without_the_cancel_a_group_waits_for_every_member(cancel):
    """Evaluation (no cancel) scores every member; training (cancel) returns at the first failure."""
    runner, closed = runner_for(cancel=cancel, others_s=0.5)

    async def run():
        t0 = time.monotonic()
        samples = await asyncio.wait_for(runner.run_group({"prompt": "p"}, 7), 10)
        return samples, time.monotonic() - t0

    samples, took = asyncio.run(run())
    assert [s.trajectory_id for s in samples] == [f"g7-s{k}" for k in range(N)]
    statuses = Counter(s.status for s in samples)
    if cancel:
        assert statuses == {SampleStatus.FAILED: 1, SampleStatus.ABORTED: N - 1} and took < 0.5
    else:
        assert statuses == {SampleStatus.FAILED: N} and took >= 0.5
    assert len(closed) == N


def test_a_group_cancelled_from_outside_takes_its_members_down():
    runner, closed = runner_for(cancel=True, others_s=None)

    async def run():
        runner.cancel_siblings_on_failure = False  # so the hanging members stay up until the group is cancelled
        job = asyncio.ensure_future(runner.run_group({"prompt": "p"}, 0))
        # the fast member failed and closed its env
        await await_until(lambda: len(closed) >= 1, timeout_s=10, what="the failed member's env closing")
        assert len(closed) == 1
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(job, 10)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run()) == []
    assert len(closed) == N
