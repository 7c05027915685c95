"""agentrl.grading: graders bounded in wall time from any thread, off the event loop (issue 31)."""

import asyncio
import os
import subprocess
import threading
import time

import pytest

from agentrl import grading
from agentrl.grading import GraderPool, GradingError, GradingTimeout, call_reward_fn
from waiting import wait_until


@pytest.fixture(scope="module")
def pool():
    p = GraderPool(1)
    yield p
    p.close()


def test_a_call_past_its_limit_kills_its_worker_and_the_next_call_works(pool):
    assert pool.call("math:factorial", 5, timeout=30) == 120
    t0 = time.monotonic()
    with pytest.raises(GradingTimeout, match="past its 0.5 s limit"):
        pool.call("time:sleep", 30, timeout=0.5)
    assert time.monotonic() - t0 < 5
    # C code no signal interrupts (a 10^7-digit power), from a thread that is not the main one
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(
        GradingTimeout, pool.call, "builtins:pow", 10, 10 ** 8, timeout=1)))
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and errors
    assert pool.call("math:factorial", 6, timeout=30) == 720  # a fresh worker
    assert pool.timeouts == 2


def test_a_grader_that_raises_is_a_grading_error_and_a_dying_worker_the_answers_fault(pool):
    with pytest.raises(GradingError, match="ZeroDivisionError"):
        pool.call("operator:truediv", 1, 0, timeout=30)
    with pytest.raises(GradingTimeout, match="ended its worker"):
        pool.call("os:_exit", 3, timeout=30)
    assert pool.call("operator:add", "\ud800", "x", timeout=30) == "\ud800x"  # lone surrogates travel escaped


async def record_stalls(stalls: list[float], done: asyncio.Event) -> None:
    """How long each 20-ms sleep of the event loop took, until `done`: a grading that blocks the
    loop shows as a long one."""
    while not done.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.02)
        stalls.append(time.perf_counter() - t)


def test_acall_leaves_the_event_loop_free(pool):
    async def go():
        stalls, done = [], asyncio.Event()

        tick = asyncio.create_task(record_stalls(stalls, done))
        with pytest.raises(GradingTimeout):
            await pool.acall("time:sleep", 30, timeout=1.0)
        done.set()
        await tick
        return max(stalls)

    assert asyncio.run(go()) < 0.5


def test_custom_reward_functions_are_bounded():
    def hangs(args, sample):
        time.sleep(3600)

    async def ahangs(args, sample):
        await asyncio.sleep(3600)

    def fine(args, sample):
        return 0.25

    async def go():
        for rm in (hangs, ahangs):
            t0 = time.monotonic()
            with pytest.raises(GradingTimeout, match="custom reward function"):
                await call_reward_fn(rm, None, None, timeout=0.3)
            assert time.monotonic() - t0 < 2
        assert await call_reward_fn(fine, None, None, timeout=5) == 0.25
        with pytest.raises(KeyError):
            await call_reward_fn(lambda a, s: {}["x"], None, None, timeout=5)

    asyncio.run(go())


def test_an_async_reward_that_never_awaits_leaves_the_loop_free_and_the_next_call_works():
    """`async def rm` that computes without awaiting (what sympy in an async def does) blocked the
    rollout's loop for as long as it ran: now it blocks a reward loop of its own, is cut at its
    limit, and the next call gets a fresh loop."""
    async def computes(args, sample):
        time.sleep(4)  # no await: holds its loop
        return 1.0

    async def fine(args, sample):
        await asyncio.sleep(0)
        return 0.5

    async def go():
        stalls, done = [], asyncio.Event()
        tick = asyncio.create_task(record_stalls(stalls, done))
        t0 = time.monotonic()
        with pytest.raises(GradingTimeout, match="blocked its event loop"):
            await call_reward_fn(computes, None, None, timeout=0.5)
        elapsed = time.monotonic() - t0
        value = await call_reward_fn(fine, None, None, timeout=5)
        done.set()
        await tick
        return elapsed, value, max(stalls)

    elapsed, value, stall = asyncio.run(go())
    assert elapsed < 3.5 and stall < 0.3, (elapsed, stall)
    assert value == 0.5


@pytest.mark.slow
def test_an_async_reward_keeps_its_client_and_state_between_calls():
    """A real async reward function: one aiohttp session to a remote reward model, made on the first
    call and reused by the next ones (all run on the one reward loop); its own request timeout stays
    its own error, not the agent's fault."""
    from aiohttp import ClientSession, ClientTimeout, web

    kept = {}

    async def remote_rm(args, sample):
        if "session" not in kept:
            kept["session"] = ClientSession()
        kept["calls"] = kept.get("calls", 0) + 1
        path = "/slow" if sample == "slow" else "/score"
        async with kept["session"].post(args + path, json={"text": sample}, timeout=ClientTimeout(total=0.5)) as r:
            return (await r.json())["score"]

    async def score(request):
        return web.json_response({"score": len((await request.json())["text"]) / 10})

    async def slow(request):
        await asyncio.sleep(5)
        return web.json_response({"score": 0})

    async def go():
        app = web.Application()
        app.add_routes([web.post("/score", score), web.post("/slow", slow)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            values = [await call_reward_fn(remote_rm, url, text, timeout=10) for text in ("abc", "abcdefgh")]
            with pytest.raises(TimeoutError) as own:
                await call_reward_fn(remote_rm, url, "slow", timeout=10)
            session = kept["session"]
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(session.close(), grading._reward_loop.loop))
            return values, own.value
        finally:
            await runner.cleanup()

    values, own = asyncio.run(go())
    assert values == [0.3, 0.8] and kept["calls"] == 3  # one session, its state kept
    assert not isinstance(own, GradingTimeout)


def test_past_the_blocked_loops_bound_an_async_reward_runs_in_a_killed_fork(monkeypatch):
    """A blocked loop's thread cannot be killed: once MAX_BLOCKED_LOOPS are left blocked, each call
    runs in a forked child (asyncio.run there), killed at its limit, its value still returned."""
    monkeypatch.setattr(grading, "MAX_BLOCKED_LOOPS", 1)
    parent = os.getpid()

    async def rm(args, sample):
        if sample == "block":
            time.sleep(6)
        await asyncio.sleep(0)
        return {"pid": os.getpid()}

    async def go():
        with pytest.raises(GradingTimeout, match="blocked its event loop"):
            await call_reward_fn(rm, None, "block", timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(GradingTimeout, match="ran past its 0.3 s limit"):
            await call_reward_fn(rm, None, "block", timeout=0.3)  # a fork this time: killed at the limit
        forked = time.monotonic() - t0
        return forked, await call_reward_fn(rm, None, "fine", timeout=30)

    forked, value = asyncio.run(go())
    assert forked < 3 and value["pid"] != parent, (forked, value)


@pytest.mark.slow
def test_math_grading_of_hostile_answers_is_bounded_and_off_the_loop():
    """\\boxed{10^{10}!} blocked the event loop 5.5 s, and ran > 25 s from a worker thread."""
    from agentrl.envs.math_env import MathEnv

    async def go():
        env = MathEnv()
        env.reset(options={"prompt": "x", "label": "12"})
        assert (await env.astep("\\boxed{12}"))[1] == 1.0
        stalls = []
        done = asyncio.Event()

        tick = asyncio.create_task(record_stalls(stalls, done))
        t0 = time.monotonic()
        async_reward = (await env.astep("\\boxed{10^{10}!}"))[1]
        sync_reward = (await asyncio.to_thread(env.step, "\\boxed{(10^{10})!}"))[1]  # a sync caller's thread
        elapsed = time.monotonic() - t0
        done.set()
        await tick
        return async_reward, sync_reward, elapsed, max(stalls)

    async_reward, sync_reward, elapsed, stall = asyncio.run(go())
    from agentrl.envs.math_env.grader import GRADE_TIMEOUT_S
    assert (async_reward, sync_reward) == (0.0, 0.0)
    assert elapsed < 2 * GRADE_TIMEOUT_S + 10 and stall < 0.5


def test_custom_rm_path_is_bounded_by_custom_rm_timeout(tmp_path):
    """--custom-rm-path as the trainer builds it: past --custom-rm-timeout it is the agent's fault."""
    from agentrl.build import build_reward_fn
    from agentrl.config import Config

    rm_file = tmp_path / "rm.py"
    rm_file.write_text("import time\n\ndef rm(args, sample):\n    if sample == 'hang':\n        time.sleep(3600)\n"
                       "    return 0.75\n")
    cfg = Config()
    cfg = cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"custom_rm_path": f"{rm_file}:rm",
                                                                      "custom_rm_timeout": 2.0})})
    reward_fn = build_reward_fn(cfg)

    async def go():
        assert await reward_fn("fine") == 0.75
        with pytest.raises(GradingTimeout, match="2 s limit"):
            await reward_fn("hang")

    asyncio.run(go())


def test_a_reward_function_past_its_limit_scores_the_sample_zero_not_failed(tokenizer):
    """The rollout's GroupRunner: an rm timeout (GradingTimeout, an AgentFault) is the agent's fault."""
    from test_agent_loop import CountEnv, ScriptedClient

    from agentrl.rollout.agent_loop import LoopSettings, Renderer
    from agentrl.rollout.manager import GroupRunner
    from agentrl.types import SampleStatus

    async def slow_rm(sample):
        await call_reward_fn(lambda: time.sleep(3600), timeout=0.2)

    runner = GroupRunner(make_env=lambda name: (CountEnv(), "count"), n_samples=1, renderer=Renderer(tokenizer),
                         client=ScriptedClient(tokenizer, ["yes"] * 3),
                         settings_for=lambda env: LoopSettings(200, 3, {"temperature": 1.0}), run_seed=0,
                         max_concurrency=1, reward_fn=slow_rm)
    [sample] = asyncio.run(runner.run_group({"prompt": "answer yes"}, 0))
    assert sample.status == SampleStatus.COMPLETED and sample.reward == 0.0
    assert sample.metadata["env_reward"] == 1.0 and "0.2 s limit" in sample.metadata["agent_fault"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("attack", ["sleeps", "spins", "allocates", "forks_a_sleeper"])
def test_a_sync_reward_function_is_killed_at_its_bound_and_the_loop_goes_on(tmp_path, attack):
    """A user's sync reward function (a closure: it runs in a process forked for the call) that
    sleeps, loops, allocates without end or leaves a child running is stopped within its bound:
    GradingTimeout, its process (and its child) gone, while the event loop ticks and another
    reward is computed meanwhile."""
    pids = tmp_path / "pids"

    def rm(args, sample):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        if sample == "fine":
            return {"score": 0.5}
        if attack == "sleeps":
            time.sleep(3600)
        elif attack == "spins":
            while True:
                pass
        elif attack == "allocates":
            hoard = []
            while True:
                hoard.append(bytes(64 << 20))  # calloc'd: address space, not touched pages
        else:
            child = subprocess.Popen(["sleep", "3600"])
            with open(pids, "a") as f:
                f.write(f"{child.pid}\n")
            time.sleep(3600)

    async def go():
        stalls, done = [], asyncio.Event()
        tick = asyncio.create_task(record_stalls(stalls, done))
        t0 = time.monotonic()
        bad = asyncio.create_task(call_reward_fn(rm, None, "hostile", timeout=limit))
        assert await call_reward_fn(rm, None, "fine", timeout=30) == {"score": 0.5}  # meanwhile
        with pytest.raises(GradingTimeout) as e:
            await bad
        elapsed = time.monotonic() - t0
        done.set()
        await tick
        return e.value, elapsed, max(stalls)

    # the memory bound, not the time limit, must stop the allocator: room for a loaded machine
    limit = 20.0 if attack == "allocates" else 2.0
    error, elapsed, stall = asyncio.run(go())
    assert elapsed < limit + 4 and stall < 0.5, (elapsed, stall)
    assert ("memory bound" if attack == "allocates" else "2 s limit") in str(error), error
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) >= 2 and all(pid != os.getpid() for pid in started)
    # the child's sleeper is reparented on its group's kill: give init a moment
    wait_until(lambda: all(_gone(pid) for pid in started), timeout_s=5, interval_s=0.1,
               what=lambda: f"the reward's processes ending ({[pid for pid in started if not _gone(pid)]} left)")


def test_a_forked_reward_function_keeps_exceptions_and_says_what_cannot_come_back():
    async def go():
        with pytest.raises(KeyError):
            await call_reward_fn(lambda a, s: {}["x"], None, None, timeout=30)
        with pytest.raises(GradingError, match="cannot come back from its process"):
            await call_reward_fn(lambda a, s: (lambda: 0), None, None, timeout=30)
        with pytest.raises(GradingError, match="async def"):
            await call_reward_fn(lambda a, s: asyncio.sleep(0), None, None, timeout=30)
        with pytest.raises(GradingTimeout, match="signal 9"):
            await call_reward_fn(lambda a, s: os.kill(os.getpid(), 9), None, None, timeout=30)
    asyncio.run(go())


@pytest.mark.slow
def test_a_hanging_sync_reward_scores_its_trajectory_zero_and_the_group_goes_on(tokenizer):
    """Through the rollout's GroupRunner: of two trajectories, the one whose (sync, forked) reward
    function hangs scores 0 with the reason; the other is scored as usual."""
    from test_agent_loop import CountEnv, ScriptedClient

    from agentrl.rollout.agent_loop import LoopSettings, Renderer
    from agentrl.rollout.manager import GroupRunner
    from agentrl.types import SampleStatus

    calls = []

    def rm(sample, n):
        if n == 0:  # the first trajectory's reward hangs
            time.sleep(3600)
        return 0.75

    async def reward_fn(sample):
        calls.append(sample)
        return await call_reward_fn(rm, sample, len(calls) - 1, timeout=5.0)

    runner = GroupRunner(make_env=lambda name: (CountEnv(), "count"), n_samples=2, renderer=Renderer(tokenizer),
                         client=ScriptedClient(tokenizer, ["yes"] * 6),
                         settings_for=lambda env: LoopSettings(200, 3, {"temperature": 1.0}), run_seed=0,
                         max_concurrency=2, reward_fn=reward_fn)
    t0 = time.monotonic()
    samples = asyncio.run(runner.run_group({"prompt": "answer yes"}, 0))
    assert time.monotonic() - t0 < 30
    assert all(s.status == SampleStatus.COMPLETED for s in samples)
    rewards = sorted(s.reward for s in samples)
    assert rewards == [0.0, 0.75], [s.metadata.get("agent_fault") for s in samples]
    [hung] = [s for s in samples if s.reward == 0.0]
    assert "5 s limit" in hung.metadata["agent_fault"]


def test_a_forked_value_past_the_message_bound_is_the_outputs_fault():
    from agentrl.grading import MAX_MESSAGE_BYTES, call_in_fork
    with pytest.raises(GradingTimeout, match="returned more than"):
        call_in_fork(lambda: b"x" * (MAX_MESSAGE_BYTES + 1), timeout=60)
    assert call_in_fork(lambda: b"x" * 1000, timeout=60) == b"x" * 1000


@pytest.mark.slow
def test_a_hanging_fork_does_not_hold_another_calls_answer():
    """Forks from several threads at once: a hanging child forked while another call's pipe was
    open inherits its write end, so that call must not wait for EOF (CI lost a good reward so)."""
    from concurrent.futures import ThreadPoolExecutor

    from agentrl.grading import call_in_fork

    def hang():
        time.sleep(3600)

    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(call_in_fork, hang if i % 4 == 0 else (lambda i=i: i), timeout=3) for i in range(40)]
        t0 = time.monotonic()
        quick = [c.result() for i, c in enumerate(calls) if i % 4]
        for c in calls[::4]:
            with pytest.raises(GradingTimeout):
                c.result()
    assert quick == [i for i in range(40) if i % 4]
    assert time.monotonic() - t0 < 60
