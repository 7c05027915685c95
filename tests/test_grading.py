"""agentrl.grading: graders bounded in wall time from any thread, off the event loop (issue 31)."""

import asyncio
import threading
import time

import pytest

from agentrl.grading import GraderPool, GradingError, GradingTimeout, call_reward_fn


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
                                                                      "custom_rm_timeout": 0.3})})
    reward_fn = build_reward_fn(cfg)

    async def go():
        assert await reward_fn("fine") == 0.75
        with pytest.raises(GradingTimeout, match="0.3 s limit"):
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
