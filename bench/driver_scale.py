"""Scale of one rollout driver: thousands of concurrent multi-turn trajectories in one process.

    python bench/driver_scale.py [--in-flight 256 1000 2000] [--engine-latency 0 1.0] [--gc default tuned]

The production path: RolloutProducer -> GroupRunner -> agent loop -> EngineClient (default
settings), groups of 8 trajectories of a tiny env whose episodes last 2 to 6 turns (drawn per
group), the built-in tiny tokenizer and chat template. The engine is another process that
answers every /generate with a fixed reply after `--engine-latency` seconds on average
(uniform over 0.5-1.5x, asyncio.sleep: no CPU) and reports the time its handler took in
meta_info["e2e_latency"] (SGLang's field). Each (latency, gc, in-flight) runs in a fresh
process: the producer keeps that many trajectories running (a finished group is replaced at
once), the start (2 s + 8 engine latencies) is skipped, then for `--seconds`:

- turns/s: /generate calls started per second;
- added latency per turn: from the start of a turn's /generate to the start of the next
  turn's (or the end of the trajectory) -- reply parsing, Sample bookkeeping, the env's
  step, the chat template and tokenization, and every wait for the event loop or a
  connection -- minus the engine's own e2e_latency for that request; p50 and p99;
- memory per trajectory: RSS growth over the process before the rollout started,
  divided by the in-flight count (the peak seen during the measured window);
- the driver's and the engine's share of the window on a CPU and waiting for one
  (/proc/PID/schedstat): a large wait share means other work on the machine held them back;
- garbage collection: its CPU share, the collections of any generation and the longest one,
  and full collections (each stops the event loop).

`--gc default` runs with Python's GC thresholds; `tuned` calls
agentrl.rollout.gc_tuning.tune_gc_for_rollouts() first. The stand-in engine always runs tuned:
its own collection pauses would otherwise count as the driver's latency.

With an instant engine (latency 0) the driver is saturated: turns/s is its ceiling. The
producer starts groups one per turn of the event loop, so the trajectories in flight settle
where the driver keeps up (in_flight_mean, far below the target); had they all started, the
latency would follow Little's law (in flight / turns/s) and grow with the in-flight count.
With a paced engine (1 s stands for generation time) the offered load is in-flight/latency
turns/s and the added latency is what the driver itself adds at that load.
Writes bench/results/driver_scale.json.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import gc
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TURNS = (2, 6)  # each group's episodes last 2 to 6 turns (4 on average): finishing trajectories do not come in waves
N_SAMPLES = 8


def _serve(port: int, reply_ids: list[int], latency_s: float) -> None:
    from aiohttp import web

    from agentrl.rollout.gc_tuning import tune_gc_for_rollouts

    tune_gc_for_rollouts()  # the stand-in's own collection pauses would count as the driver's latency

    async def generate(request):
        t0 = time.perf_counter()
        body = await request.json()
        if latency_s:  # spread over 0.5-1.5x: a fixed latency would keep every trajectory in lockstep
            await asyncio.sleep(latency_s * random.uniform(0.5, 1.5))
        return web.json_response({
            "text": "", "output_ids": reply_ids,
            "meta_info": {"id": body.get("rid", "x"), "finish_reason": {"type": "stop"},
                          "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(reply_ids),
                          "cached_tokens": 0, "weight_version": "0", "e2e_latency": time.perf_counter() - t0,
                          "output_token_logprobs": [[-0.1, t, None] for t in reply_ids]},
        })

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", lambda r: web.Response(text="OK"))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


def _schedstat(pid: int | str = "self") -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread."""
    on_cpu, waiting, _ = open(f"/proc/{pid}/schedstat").read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


async def _drive(url: str, engine_pid: int, gc_mode: str, in_flight: int, latency_s: float, warmup_s: float,
                 seconds: float) -> dict:
    import random

    import agentrl
    from agentrl.data import PromptSource
    from agentrl.models import build_tiny_model, load_tokenizer
    from agentrl.rollout.agent_loop import LoopSettings, Renderer
    from agentrl.rollout.client import EngineClient
    from agentrl.rollout.manager import GroupRunner
    from agentrl.rollout.producer import RolloutProducer

    class Countdown(agentrl.Env):
        """A tiny multi-turn env: the task's number of turns, then the episode ends."""
        max_turns = TURNS[1]

        async def areset(self, *, seed=None, options=None):
            self.turn, self.turns = 0, options["metadata"]["turns"]
            return options["prompt"], {}

        async def astep(self, action):
            self.turn += 1
            return f"{self.turns - self.turn} turns left, go on", 1.0, self.turn == self.turns, False, {}

    class TimedClient(EngineClient):
        """The real client; it also times each turn: from the start of its /generate to the
        start of the trajectory's next one (or its end), minus the engine's own e2e_latency."""

        def __init__(self, url: str, window: tuple[float, float]):
            super().__init__(url)
            self.window = window
            self.last: dict[str, tuple[str, float]] = {}  # trajectory id -> (rid, start) of its current turn
            self.engine_s: dict[str, float] = {}  # rid -> the engine's e2e_latency
            self.added = array.array("d")  # seconds, turns that started in the window
            self.turns = 0  # /generate calls started in the window

        def close_turn(self, trajectory_id: str, now: float) -> None:
            if (last := self.last.pop(trajectory_id, None)) is not None:
                rid, start = last
                engine = self.engine_s.pop(rid)
                if self.window[0] <= start < self.window[1]:
                    self.added.append(now - start - engine)

        async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
            now = time.perf_counter()
            self.close_turn(session_id, now)
            self.last[session_id] = (rid, now)
            self.turns += self.window[0] <= now < self.window[1]
            return await super().generate(input_ids, sampling_params, session_id=session_id, rid=rid,
                                          lora_path=lora_path)

        async def _post(self, path, payload, headers=None, retry=None):
            body, engine = await super()._post(path, payload, headers, retry)
            if path == "/generate":
                self.engine_s[payload["rid"]] = body["meta_info"]["e2e_latency"]
            return body, engine

    tokenizer = load_tokenizer(build_tiny_model())
    settings = LoopSettings(max_response_len=4096, max_turns=TURNS[1], sampling_params={"temperature": 1.0})
    t0 = time.perf_counter()
    window = (t0 + warmup_s, t0 + warmup_s + seconds)
    client = TimedClient(url, window)
    running = [0]  # trajectories started and not done

    def make_env(name):
        running[0] += 1
        return Countdown(), "countdown"

    def done(sample):
        running[0] -= 1
        client.close_turn(sample.trajectory_id, time.perf_counter())

    runner = GroupRunner(make_env=make_env, n_samples=N_SAMPLES, renderer=Renderer(tokenizer), client=client,
                         settings_for=lambda env: settings, run_seed=0, max_concurrency=in_flight, on_done=done)

    def tasks():
        rng = random.Random(0)
        while True:
            yield {"prompt": "count down with me", "metadata": {"turns": rng.randint(*TURNS)}}

    source = PromptSource(generator=tasks)
    groups = in_flight // N_SAMPLES
    # a quarter more groups than run at once: a group whose members have all finished but one
    # holds few slots, and the spare groups' trajectories take the others
    producer = RolloutProducer(source=source, run_group=runner.run_group, over_sampling=groups + groups // 4,
                               keep_generating=True)
    rss0 = peak = _rss()
    seen_running = []
    sched = []  # (wall, driver's schedstat, engine's schedstat) at the window's start and end

    async def watch():  # RSS and trajectories running, twice a second in the window
        nonlocal peak
        while True:
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            if window[0] <= now < window[1]:
                peak = max(peak, _rss())
                seen_running.append(running[0])
                sched[1:] = [(now, _schedstat(), _schedstat(engine_pid))]
                sched[:1] = sched[:1] or sched[1:]

    pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection in the window: the loop stops
    gc_cpu = [0.0]  # CPU seconds of all collections in the window

    def on_gc(phase, info, started=[0.0, 0.0]):
        if phase == "start":
            started[:] = time.perf_counter(), time.process_time()
        elif window[0] <= started[0] < window[1]:
            gc_cpu[0] += time.process_time() - started[1]
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    if gc_mode == "tuned":
        from agentrl.rollout.gc_tuning import tune_gc_for_rollouts

        tune_gc_for_rollouts()
    gc.callbacks.append(on_gc)
    watcher = asyncio.create_task(watch())
    tail = window[1] + 1.0 + 2 * latency_s  # the window's last turns end
    while time.perf_counter() < tail:
        samples = await producer.next_batch(max(1, groups // 8))  # the rest stays in flight
        assert all(s.status.value == "completed" and s.num_turns == s.metadata["turns"] for s in samples), \
            samples[0].metadata
        client.turn_log.pop([s.trajectory_id for s in samples])  # as the metrics do after each batch
    watcher.cancel()
    await producer.aclose()
    await client.close()
    added = sorted(client.added)
    full_gc = [pause for generation, pause in pauses if generation == 2]
    return {"gc": gc_mode, "in_flight": in_flight, "in_flight_mean": round(statistics.mean(seen_running)),
            "turns_per_s": round(client.turns / seconds, 1),
            "added_latency_ms_p50": round(1000 * statistics.median(added), 2),
            "added_latency_ms_p99": round(1000 * added[int(0.99 * (len(added) - 1))], 2),
            "added_latency_ms_p999": round(1000 * added[int(0.999 * (len(added) - 1))], 2),
            "added_latency_ms_max": round(1000 * added[-1], 2),
            "collections_per_s": round(len(pauses) / seconds, 2),
            "collection_ms_max": round(1000 * max((p for _, p in pauses), default=0.0), 1),
            "rss_per_trajectory_kb": round((peak - rss0) / in_flight / 1024, 1),
            "gc_cpu_share": round(gc_cpu[0] / seconds, 3), "full_gc_per_s": round(len(full_gc) / seconds, 2),
            "full_gc_ms_mean": round(1000 * statistics.mean(full_gc), 1) if full_gc else 0.0,
            **_shares(sched)}


def _shares(sched: list) -> dict:
    """Each process's share of the window spent on a CPU and spent waiting for one (the
    machine's other load): a driver near 1.0 on-CPU is saturated; a large wait share means
    the machine was busy, not the driver."""
    (t0, d0, e0), (t1, d1, e1) = sched[0], sched[-1]
    return {f"{who}_{what}_share": round((b[i] - a[i]) / (t1 - t0), 2)
            for who, a, b in (("driver", d0, d1), ("engine", e0, e1)) for i, what in enumerate(("cpu", "wait"))}


def _drive_in_process(*args) -> dict:
    return asyncio.run(_drive(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[256, 1000, 2000])
    parser.add_argument("--engine-latency", type=float, nargs="+", default=[0.0, 1.0],
                        help="seconds the engine waits before each answer, on average (0: instant)")
    parser.add_argument("--gc", nargs="+", choices=["default", "tuned"], default=["default", "tuned"],
                        help="Python's GC thresholds, or agentrl.rollout.gc_tuning's")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    parser.add_argument("--warmup", type=float, default=None, help="skipped start (default: 2 s + 8 engine latencies)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "driver_scale.json"))
    args = parser.parse_args()

    from agentrl.models import build_tiny_model, load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rollout_overhead import start_stand_in

    tokenizer = load_tokenizer(build_tiny_model())
    reply = tokenizer.encode("yes, that is the answer") + [tokenizer.eos_token_id]
    runs = []
    for latency in args.engine_latency:
        server, url = start_stand_in(_serve, reply, latency)
        warmup = args.warmup if args.warmup is not None else 2.0 + 8 * latency  # the first wave has ended
        for gc_mode in args.gc:
            for n in args.in_flight:
                load = os.getloadavg()[0]
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:  # fresh
                    run = pool.submit(_drive_in_process, url, server.pid, gc_mode, n, latency, warmup,
                                      args.seconds).result()
                run = {"engine_latency_s": latency, **run, "load_average": round(load, 2)}
                print(json.dumps(run), flush=True)
                runs.append(run)
        server.kill()
    by = {(r["engine_latency_s"], r["gc"], r["in_flight"]): r for r in runs}
    lo, hi = min(args.in_flight), max(args.in_flight)
    ratios = {f"p99_{hi}_over_p99_{lo}_latency_{lat}_gc_{mode}": round(
        by[lat, mode, hi]["added_latency_ms_p99"] / by[lat, mode, lo]["added_latency_ms_p99"], 2)
        for lat in args.engine_latency for mode in args.gc}
    result = {"cpus": os.cpu_count(), "turns_per_trajectory": f"{TURNS[0]} to {TURNS[1]}",
              "samples_per_group": N_SAMPLES,
              "seconds": args.seconds, "runs": runs, **ratios}
    print(json.dumps(ratios))
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
