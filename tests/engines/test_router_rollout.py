"""The real sglang-router in front of two embedded engines: multi-turn trajectories keep to
their engine (router_affinity 1.0) and hit its prefix cache on later turns; a worker killed
mid-rollout loses no trajectory, leaves the router's pool, and rejoins once restarted."""

import asyncio
import time

import pytest

from agentrl.config import RolloutConfig
from agentrl.engines.group import start_engines
from agentrl.env import Env
from agentrl.rollout.affinity import TurnLog, summarize
from agentrl.rollout.agent_loop import LoopSettings, Renderer
from agentrl.rollout.client import EngineClient
from agentrl.rollout.manager import generate_rollout
from agentrl.types import SampleStatus
from waiting import wait_until

pytestmark = pytest.mark.e2e  # its module fixture starts two engines and the router

PROMPT = "Count with me, one word per turn, and never stop before I say so: one two three four five"


class CountEnv(Env):
    """Talks for `turns` turns; every reply asks for more."""

    def __init__(self, turns: int):
        self.max_turns, self.t = turns, 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return [{"role": "user", "content": PROMPT}], {}

    def step(self, action):
        self.t += 1
        return [{"role": "user", "content": f"good, that was turn {self.t}; next"}], 0.0, self.t >= self.max_turns, \
            False, {}


class TimedTurnLog(TurnLog):
    """A TurnLog that also notes when each turn was recorded (the monitor's events are in time.time())."""

    def __init__(self):
        super().__init__()
        self.at: dict[str, list[float]] = {}

    def record(self, session_id, turn):
        super().record(session_id, turn)
        self.at.setdefault(session_id, []).append(time.time())


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    cfg = RolloutConfig(num_engines=2, engine_num_threads=1)
    g = start_engines(cfg, model_path=str(tiny_model), device="cpu", seed=0,
                      log_dir=tmp_path_factory.mktemp("router-logs"))
    yield g
    g.stop()


def rollout(group, tokenizer, *, turns: int, prompts: int, n: int, log: TurnLog, tokens_per_turn: int = 6,
            during=None):
    settings = LoopSettings(max_response_len=400, max_turns=turns, sampling_params={"temperature": 1.0},
                            max_tokens_per_turn=tokens_per_turn)

    async def go():
        async with EngineClient(group.url, turn_log=log) as client:
            job = asyncio.create_task(generate_rollout(
                [{"prompt": PROMPT}] * prompts, make_env=lambda name: (CountEnv(turns), "count"), n_samples=n,
                renderer=Renderer(tokenizer), client=client, settings_for=lambda env: settings, run_seed=0,
                max_concurrency=256))
            extra = await during(job) if during else None
            return await job, extra, client.retried

    return asyncio.run(go())


def test_router_passes_the_engine_header_through(group):
    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(group.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params":
                              {"max_new_tokens": 1}}, headers={"X-SMG-Routing-Key": "probe"}) as r:
                return r.status, r.headers.get("X-Agentrl-Engine")

    status, engine = asyncio.run(go())
    assert status == 200 and engine in group.engine_urls


def test_router_keeps_trajectories_on_one_engine_and_their_cache_warm(group, tokenizer):
    assert group.router is not None and group.url != group.engine_urls[0]
    log = TurnLog()
    samples, _, _ = rollout(group, tokenizer, turns=3, prompts=4, n=4, log=log)
    assert len(samples) == 16 and len({s.trajectory_id for s in samples}) == 16
    assert all(s.status == SampleStatus.COMPLETED and s.num_turns == 3 for s in samples), \
        [(s.status, s.metadata.get("error")) for s in samples]
    turns = log.pop([s.trajectory_id for s in samples])
    figures = summarize(turns.values())
    assert figures["router_affinity"] == 1.0
    assert figures["engines_used"] == 2  # the router spreads trajectories over both engines
    for s in samples:  # every later turn reused the KV of the turns before it, on its engine
        cached = s.metadata["cached_tokens"]
        assert cached[0] < len(s.prompt_tokens) and all(c > len(s.prompt_tokens) for c in cached[1:]), cached
    assert figures["prefix_cache_hit_rate"] > 0.4


def test_killed_worker_loses_no_trajectory_and_rejoins_when_restarted(group, tokenizer):
    log = TimedTurnLog()
    victim = group.engines[0]
    survivor = group.engines[1].url
    seen_at_kill: dict[str, int] = {}

    async def kill_midway(job):
        while sum(len(log.get(f"g{g}-s{k}")) for g in range(6) for k in range(4)) < 30:
            await asyncio.sleep(0.05)
        assert not job.done()
        for g in range(6):
            for k in range(4):
                seen_at_kill[f"g{g}-s{k}"] = len(log.get(f"g{g}-s{k}"))
        victim.server.kill()  # SIGKILL, as a crash
        return time.monotonic()

    samples, killed_at, retried = rollout(group, tokenizer, turns=8, prompts=6, n=4, log=log, tokens_per_turn=10,
                                          during=kill_midway)
    assert len(samples) == 24 and len({s.trajectory_id for s in samples}) == 24  # none lost, none duplicated
    assert all(s.status == SampleStatus.COMPLETED and s.num_turns == 8 for s in samples), \
        [(s.trajectory_id, s.status, s.metadata.get("error")) for s in samples if s.status != SampleStatus.COMPLETED]
    # The monitor restarts the victim at once; were it back in the router's pool before the
    # rollout ended, later turns could rightly go to it again: only turns before that count.
    rejoined = min((at for at, url, what in group.monitor.events
                    if url == victim.url and what.startswith("back in the pool")), default=float("inf"))
    moved = 0
    for s in samples:
        turns, times = log.get(s.trajectory_id), log.at[s.trajectory_id]
        assert len(turns) == 8
        after = [t for t, at in zip(turns, times) if at < rejoined][seen_at_kill[s.trajectory_id]:]
        # A reply the victim sent just before its kill can still be in flight (in the router or the
        # client's socket) and be recorded after the snapshot (the cause of this test's 1-in-4
        # flake): at most one such turn, the first, as a trajectory has one request in flight.
        late = int(bool(after) and after[0].engine == victim.url)
        assert all(t.engine == survivor for t in after[late:]), (s.trajectory_id, [t.engine for t in turns])
        moved += turns[0].engine == victim.url and bool(after)
    assert moved > 0  # some trajectories started on the killed engine and finished on the other one
    # the monitor polls on its own timer: on a loaded machine the rollout (carried on by the
    # survivor) can end before its next poll has seen the kill
    wait_until(lambda: (victim.url, "removed from the router") in [(url, what) for _, url, what in group.monitor.events],
               timeout_s=120, what=lambda: f"the monitor removing the killed engine ({group.monitor.events})")
    # the monitor restarts it (same port); it rejoins the pool holding the same weights
    wait_until(lambda: group.router.healthy_urls() == set(group.engine_urls), timeout_s=120, interval_s=0.5,
               what=lambda: f"the restarted engine rejoining the router ({group.monitor.events})")
    assert victim.state == "serving" and victim.server.restarts == 1
    log2 = TurnLog()
    again, _, _ = rollout(group, tokenizer, turns=2, prompts=4, n=4, log=log2)
    assert all(s.status == SampleStatus.COMPLETED for s in again)
    assert summarize(log2.pop([s.trajectory_id for s in again]).values())["engines_used"] == 2
