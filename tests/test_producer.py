"""The rollout producer in process, on a fake group runner (no engine, no env): dynamic-sampling
filters (dropped groups are replaced and counted, the batch still fills), over-sampling (groups
kept in flight, the spare ones used by the next batch), bounded whole-group retries, and a stop
(async generation ahead, a cancelled fill, --colocate's requeue, a run_group that raises) that
leaves no asyncio task pending, nothing logged as never retrieved or destroyed pending, and
the launched tasks in `pending_tasks()` for the resume."""

import asyncio
import gc
import logging

import pytest

from agentrl.data import PromptSource
from agentrl.rollout.producer import RolloutProducer, nonzero_std_filter
from agentrl.types import Sample, SampleStatus
from waiting import await_until

N = 2  # samples per group
ASYNCIO_NOISE = ("exception was never retrieved", "Task was destroyed but it is pending")


class FakeGroups:
    """run_group for the producer: group `g` (task "p{g}": the source hands tasks out in order)
    returns N samples with rewards `rewards(g)`, or a failed first member while `fails(g, attempt)`.
    With `gate`, every call waits for it; a group for which `hangs(g)` never returns. Records each
    call, how many run at once and how many finished their cleanup (cancelled ones included)."""

    def __init__(self, rewards=lambda g: [0.0, 1.0], fails=lambda g, attempt: False, gate: asyncio.Event | None = None,
                 hangs=lambda g: False):
        self.rewards, self.fails, self.gate, self.hangs = rewards, fails, gate, hangs
        self.calls: list[tuple[int, int, str]] = []  # (group id, attempt, prompt)
        self.returned: list[int] = []  # group ids whose call returned samples
        self.running = self.peak = self.cleaned = 0

    async def __call__(self, task: dict, group_id: int, attempt: int) -> list[Sample]:
        self.calls.append((group_id, attempt, task["prompt"]))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.hangs(group_id):
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            failed = self.fails(group_id, attempt)
            suffix = f"-a{attempt}" if attempt else ""
            samples = [Sample(prompt_tokens=[1], response_tokens=[2], loss_mask=[1], rollout_logprobs=[-1.0],
                              policy_versions=[0], reward=r, group_id=group_id, env_name="fake",
                              trajectory_id=f"g{group_id}-s{k}{suffix}",
                              status=SampleStatus.FAILED if failed and k == 0 else SampleStatus.COMPLETED,
                              metadata={"error": "ConnectionError: injected"} if failed and k == 0 else {})
                       for k, r in enumerate(self.rewards(group_id))]
            self.returned.append(group_id)
            return samples
        finally:
            self.running -= 1
            self.cleaned += 1


def make_producer(groups: FakeGroups, **kwargs) -> RolloutProducer:
    source = PromptSource([{"prompt": f"p{i}"} for i in range(1000)], shuffle=False)
    kwargs = {"over_sampling": 2, "retry_backoff_s": 0, "report": lambda text: None, **kwargs}
    return RolloutProducer(source=source, run_group=groups, **kwargs)


def wait_until(condition, timeout_s: float = 10.0):
    """Let the loop run until `condition()` holds (bounded)."""
    return await_until(condition, timeout_s=timeout_s, interval_s=0.001)


def run_clean(main, caplog) -> object:
    """asyncio.run(main()) that records what asyncio reports about abandoned tasks and futures
    (through the loop's exception handler and its logger, also from finalizers run by the
    garbage collection after the loop closed), and fails on any of it."""
    reported = []

    async def wrapper():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        return await main()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        result = asyncio.run(wrapper())
        gc.collect()
    reported += [r.getMessage() for r in caplog.records if any(n in r.getMessage() for n in ASYNCIO_NOISE)]
    assert reported == [], reported
    return result


def no_other_task() -> bool:
    return asyncio.all_tasks() == {asyncio.current_task()}


def group_ids(batch: list[Sample]) -> list[int]:
    return sorted({s.group_id for s in batch})


# -- dynamic-sampling filters ---------------------------------------------------------------

def test_groups_the_filter_drops_are_replaced_counted_and_never_handed_out(caplog):
    # every third group has equal rewards (no GRPO signal): nonzero_std drops it
    groups = FakeGroups(rewards=lambda g: [1.0, 1.0] if g % 3 == 0 else [0.0, 1.0])
    producer = make_producer(groups, over_sampling=4, group_filter=nonzero_std_filter)

    async def main():
        batches = [await asyncio.wait_for(producer.next_batch(4), 30) for _ in range(3)]
        pending = {t["prompt"] for t in producer.pending_tasks()}
        await producer.aclose()
        return batches, pending

    batches, pending = run_clean(main, caplog)
    for batch in batches:  # full batches of useful groups, in launch order
        assert len(batch) == 4 * N and len(group_ids(batch)) == 4
        assert all(g % 3 for g in group_ids(batch)) and [s.group_id for s in batch] == sorted(s.group_id for s in batch)
    handed = [g for b in batches for g in group_ids(b)]
    assert len(handed) == len(set(handed)) == 12
    # each zero-std group that came back (and was not still waiting to be collected) was dropped, once
    collected_flat = [g for g in groups.returned if g % 3 == 0 and f"p{g}" not in pending]
    assert len(collected_flat) >= 4 and producer.dropped == {"zero_std": len(collected_flat)}
    assert producer.stats()["dropped_zero_std"] == len(collected_flat)
    assert f"groups dropped zero_std {len(collected_flat)}" in producer.status()


def test_a_custom_filter_sees_one_whole_group_and_its_reason_is_counted(caplog):
    seen = []

    def keep_one_in_four(samples):
        seen.append((len({s.group_id for s in samples}), len(samples)))
        return samples[0].group_id % 4 == 3, "unlucky"

    groups = FakeGroups()
    producer = make_producer(groups, over_sampling=2, group_filter=keep_one_in_four)

    async def main():
        batch = await asyncio.wait_for(producer.next_batch(3), 30)
        await producer.aclose()
        return batch

    batch = run_clean(main, caplog)
    assert group_ids(batch) == [3, 7, 11] and len(batch) == 3 * N  # filled, however many were dropped
    assert seen and all(x == (1, N) for x in seen)  # each call: one whole group
    assert producer.dropped["unlucky"] == 9 and producer.stats()["dropped_unlucky"] == 9


# -- over-sampling --------------------------------------------------------------------------

@pytest.mark.parametrize("over_sampling", [2, 6])
def test_over_sampling_keeps_that_many_groups_in_flight_and_the_next_batch_uses_the_spares(caplog, over_sampling):
    gate = asyncio.Event()
    groups = FakeGroups(gate=gate)
    producer = make_producer(groups, over_sampling=over_sampling)

    async def main():
        first = asyncio.ensure_future(producer.next_batch(2))
        await wait_until(lambda: len(groups.calls) >= over_sampling)
        for _ in range(20):  # give the producer every chance to launch more than it should
            await asyncio.sleep(0)
        launched_before = (len(groups.calls), groups.running)
        gate.set()
        batch1 = await asyncio.wait_for(first, 30)
        await wait_until(lambda: len(groups.returned) == over_sampling)  # the spares finish too
        batch2 = await asyncio.wait_for(producer.next_batch(2), 30)
        launched_after = len(groups.calls)
        await producer.aclose()
        return launched_before, batch1, batch2, launched_after

    (calls, running), batch1, batch2, launched_after = run_clean(main, caplog)
    assert calls == running == over_sampling and groups.peak == over_sampling
    assert len(batch1) == len(batch2) == 2 * N and not set(group_ids(batch1)) & set(group_ids(batch2))
    if over_sampling == 6:  # the second batch came from the first one's spares
        assert set(group_ids(batch2)) <= set(range(6))
    else:
        assert set(group_ids(batch2)) == {2, 3}
    assert launched_after - 4 <= over_sampling  # never more than over_sampling groups launched and not handed out


# -- paced starts --------------------------------------------------------------------------

def test_groups_launched_together_start_one_per_turn_of_the_event_loop_in_launch_order(caplog):
    """A batch's groups launched at once must not all start (and start their trajectories) in one
    turn of the loop: that turn would hold back every running trajectory's reply for tens of ms."""
    turn = 0  # turns of the event loop so far
    started: list[tuple[int, int]] = []  # (group id, the turn it started in)

    class Recording(FakeGroups):
        async def __call__(self, task, group_id, attempt):
            started.append((group_id, turn))
            return await super().__call__(task, group_id, attempt)

    producer = make_producer(Recording(), over_sampling=16)

    async def main():
        async def count_turns():
            nonlocal turn
            while True:
                turn += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(count_turns())
        batch = await asyncio.wait_for(producer.next_batch(16), 30)
        ticker.cancel()
        await producer.aclose()
        return batch

    batch = run_clean(main, caplog)
    assert group_ids(batch) == list(range(16))
    first = sorted(started)[:16]
    assert [g for g, _ in first] == list(range(16))
    turns = [t for _, t in first]
    assert all(a < b for a, b in zip(turns, turns[1:])), turns  # each in a later turn than the one before


# -- bounded retries ------------------------------------------------------------------------

@pytest.mark.parametrize("retries", [0, 2])
def test_a_failed_group_is_rerun_whole_at_most_max_group_retries_times(caplog, retries):
    # group 0 fails its first `retries` attempts (the last allowed one succeeds); group 1 always fails
    groups = FakeGroups(fails=lambda g, attempt: g == 1 or (g == 0 and attempt < retries))
    reports = []
    producer = make_producer(groups, max_group_retries=retries, report=reports.append)

    async def main():
        batch = await asyncio.wait_for(producer.next_batch(2), 30)
        await producer.aclose()
        return batch

    batch = run_clean(main, caplog)
    # exactly: group 0 and group 1 each tried retries + 1 times (same task, same group id), then
    # group 2 launched in place of the dropped group 1, once
    expected = sorted([(0, a, "p0") for a in range(retries + 1)] + [(1, a, "p1") for a in range(retries + 1)]
                      + [(2, 0, "p2")])
    assert sorted(groups.calls) == expected
    assert group_ids(batch) == [0, 2] and all(s.status == SampleStatus.COMPLETED for s in batch)
    suffix = f"-a{retries}" if retries else ""
    assert {s.trajectory_id for s in batch if s.group_id == 0} == {f"g0-s{k}{suffix}" for k in range(N)}
    assert producer.dropped == {"failed": 1} and producer.retried == 2 * retries
    kept = producer.take_failed()  # every failed attempt, whole (the failed member and its sibling)
    assert len(kept) == (2 * retries + 1) * N and all(s.metadata["attempt_failed"] for s in kept)
    assert producer.stats()["trajectories_failed"] == 2 * retries + 1
    assert len(reports) == 1 and "first failure of its kind" in reports[0]


def test_a_retry_waits_longer_each_time_up_to_30_s(caplog, monkeypatch):
    # group 0 fails its first 6 attempts: the retries wait retry_backoff_s doubled each time, capped at 30 s,
    # each shortened by up to the policy's jitter
    groups = FakeGroups(fails=lambda g, attempt: g == 0 and attempt < 6)
    producer = make_producer(groups, over_sampling=1, max_group_retries=6, retry_backoff_s=1.5)
    waits = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *args, **kwargs):
        if delay:
            waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)

    async def main():
        batch = await asyncio.wait_for(producer.next_batch(1), 30)
        await producer.aclose()
        return batch

    assert group_ids(run_clean(main, caplog)) == [0] and producer.retried == 6
    jitter = producer.retry.jitter
    assert len(waits) == 6 and all((1 - jitter) * d <= w <= d for w, d in zip(waits, [1.5, 3.0, 6.0, 12.0, 24.0, 30.0]))


# -- stopping -------------------------------------------------------------------------------

def test_an_async_stop_while_generating_ahead_leaves_nothing_pending_and_the_tasks_for_the_resume(caplog):
    groups = FakeGroups(hangs=lambda g: g >= 3)  # the groups generated ahead hang while the caller trains
    producer = make_producer(groups, over_sampling=3, keep_generating=True)

    async def main():
        batch = await asyncio.wait_for(producer.next_batch(2), 30)
        await wait_until(lambda: groups.running == 2)
        pending = producer.pending_tasks()  # what a checkpoint now records
        handed = {f"p{g}" for g in group_ids(batch)}
        await producer.aclose()  # stopped (a signal) while training: what train's exit stack runs
        return batch, pending, handed, no_other_task(), producer.stats()["groups_in_flight"]

    batch, pending, handed, alone, in_flight = run_clean(main, caplog)
    assert len(batch) == 2 * N and alone and in_flight == 0
    assert groups.running == 0 and groups.cleaned == len(groups.calls)  # every group's cleanup ran
    launched = {prompt for _, _, prompt in groups.calls}
    assert [t["prompt"] for t in pending] and {t["prompt"] for t in pending} == launched - handed

    # the resume re-runs exactly those tasks first, under new group ids
    again = FakeGroups()
    resumed = make_producer(again, over_sampling=3, pending=pending, first_group_id=producer.next_id)

    async def resume():
        batch = await asyncio.wait_for(resumed.next_batch(len(pending)), 30)
        await resumed.aclose()
        return batch

    batch = run_clean(resume, caplog)
    assert [p for _, _, p in again.calls[:len(pending)]] == [t["prompt"] for t in pending]
    assert min(group_ids(batch)) >= producer.next_id


def test_a_fill_cancelled_midway_and_closed_leaves_nothing_pending(caplog):
    groups = FakeGroups(gate=asyncio.Event())  # never opens: every group hangs
    producer = make_producer(groups, over_sampling=4)

    async def main():
        fill = asyncio.ensure_future(producer.next_batch(2))
        await wait_until(lambda: groups.running == 4)
        fill.cancel()  # a signal arrives mid-rollout
        with pytest.raises(asyncio.CancelledError):
            await fill
        still = (groups.running, len(producer.pending_tasks()))
        await producer.aclose()
        return still, no_other_task()

    (running, pending), alone = run_clean(main, caplog)
    assert running == pending == 4  # the groups outlived the cancelled fill (the run's data position holds them)
    assert alone and groups.running == 0 and groups.cleaned == 4


def test_requeue_stops_the_groups_in_flight_and_the_next_batch_reruns_their_tasks(caplog):
    gate = asyncio.Event()
    groups = FakeGroups(gate=gate)
    producer = make_producer(groups, over_sampling=3)

    async def main():
        first = asyncio.ensure_future(producer.next_batch(3))
        await wait_until(lambda: groups.running == 3)
        first.cancel()  # --colocate: the handover drains the engines
        with pytest.raises(asyncio.CancelledError):
            await first
        await producer.requeue_inflight()
        alone = no_other_task()
        requeued = [t["prompt"] for t in producer.pending_tasks()]
        gate.set()
        batch = await asyncio.wait_for(producer.next_batch(3), 30)
        await producer.aclose()
        return alone, requeued, batch

    alone, requeued, batch = run_clean(main, caplog)
    assert alone and requeued == ["p0", "p1", "p2"] and groups.cleaned == len(groups.calls)
    assert [p for _, _, p in groups.calls[3:6]] == ["p0", "p1", "p2"]  # re-run, not skipped
    assert len(batch) == 3 * N and group_ids(batch) == [3, 4, 5]


def test_a_run_group_that_raises_stops_the_batch_and_close_retrieves_every_exception(caplog):
    async def buggy(task, group_id, attempt):
        await asyncio.sleep(0)
        raise RuntimeError(f"bug in group {group_id}")  # all of them, finishing in the same step

    producer = RolloutProducer(source=PromptSource([{"prompt": "p"}] * 10, shuffle=False), run_group=buggy,
                               over_sampling=3, report=lambda text: None)

    async def main():
        with pytest.raises(RuntimeError, match="bug in group"):
            await asyncio.wait_for(producer.next_batch(2), 30)
        await producer.aclose()  # the groups that raised but were not collected: retrieved here
        return no_other_task()

    assert run_clean(main, caplog)
