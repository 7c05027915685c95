"""Rollout-stack overhead: turns/s of agentrl's agent loop against an engine that answers
instantly, versus a bare aiohttp loop making the same /generate calls.

    python bench/rollout_overhead.py [--trajectories 256] [--turns 4] [--concurrency 256] [--repeats 10]

The engine is a separate process that answers every /generate at once with a fixed reply,
so the figures measure the client side. Both sides run in this process, one after the
other (interleaved, `--repeats` times each, a full garbage collection before each run), with
the same concurrency and connection limit, and send the same requests: the same input ids,
sampling params, rid and routing key (checked before timing).

- bare: an aiohttp session posting /generate and reading the reply, turn after turn; the
  env's tokens are known in advance and appended as they are.
- agentrl: generate_rollout -> GroupRunner (groups of 8) -> run_trajectory -> EngineClient,
  against an env that answers "ok, go on" and ends after `--turns`. Per turn it also parses
  the reply into token ids and logprobs, appends them to the Sample (loss mask, logprobs,
  policy version), decodes them, steps the env, renders the whole conversation with the chat
  template (the drift check), tokenizes the new suffix, and records the turn for the
  affinity metrics; per trajectory it builds the env, renders the prompt and validates the
  Sample.

Prints both rates (best and median of the runs), the client's CPU time per turn (the
process's own: what another process's load on a shared machine changes least) and their
ratios; writes bench/results/rollout_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import aiohttp

MAX_LEN = 100_000  # the response budget: max_new_tokens is what is left of it


def _serve(port: int, reply_ids: list[int]) -> None:
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        return web.json_response({
            "text": "", "output_ids": reply_ids,
            "meta_info": {"id": "x", "finish_reason": {"type": "stop"}, "prompt_tokens": len(body["input_ids"]),
                          "completion_tokens": len(reply_ids), "cached_tokens": 0, "weight_version": "0",
                          "output_token_logprobs": [[-0.1, t, None] for t in reply_ids]},
        })

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", lambda r: web.Response(text="OK"))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_stand_in(serve, *args) -> tuple[multiprocessing.Process, str]:
    """`serve(port, *args)` (a stand-in engine) in a spawned process, once it answers /health:
    (the process, its URL)."""
    from agentrl.engines.launch import free_port, http_ok

    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, *args), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not http_ok(url + "/health", timeout=1):
        if time.monotonic() > deadline or not server.is_alive():
            server.kill()
            raise RuntimeError("the stand-in engine did not start")
        time.sleep(0.1)
    return server, url


async def bare_loop(url: str, prompt: list[int], env_ids: list[int], trajectories: int, turns: int,
                    concurrency: int) -> tuple[float, list[int]]:
    """The same /generate calls as the agent loop makes (input ids, sampling params, rid,
    routing key), with nothing else: the env's tokens are known in advance."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(i):
            async with gate:
                ids = list(prompt)
                for turn in range(turns):
                    budget = MAX_LEN - (len(ids) - len(prompt))
                    async with session.post(url + "/generate", json={
                            "input_ids": ids, "return_logprob": True, "rid": f"g{i // 8}-s{i % 8}-t{turn}-0",
                            "sampling_params": {"temperature": 1.0, "max_new_tokens": budget}},
                            headers={"X-SMG-Routing-Key": f"g{i // 8}-s{i % 8}"}) as r:
                        body = await r.json()
                    ids += body["output_ids"]
                    if turn + 1 < turns:
                        ids += env_ids
                return ids

        t0 = time.perf_counter()
        done = await asyncio.gather(*[one(i) for i in range(trajectories)])
        return trajectories * turns / (time.perf_counter() - t0), done[0]


async def agentrl_loop(url: str, tokenizer, trajectories: int, turns: int, concurrency: int):
    """The production path: generate_rollout -> GroupRunner -> run_trajectory -> EngineClient."""
    import agentrl
    from agentrl.rollout.agent_loop import LoopSettings, Renderer
    from agentrl.rollout.client import EngineClient
    from agentrl.rollout.manager import generate_rollout

    class Echo(agentrl.Env):
        async def areset(self, *, seed=None, options=None):
            self.turn = 0
            return options["prompt"], {}

        async def astep(self, action):
            self.turn += 1
            return "ok, go on", 0.0, self.turn == turns, False, {}

    settings = LoopSettings(max_response_len=MAX_LEN, max_turns=turns, sampling_params={"temperature": 1.0})
    async with EngineClient(url, max_connections=concurrency) as client:
        t0 = time.perf_counter()
        samples = await generate_rollout(
            [{"prompt": "benchmark prompt"}] * (trajectories // 8), make_env=lambda name: (Echo(), "echo"),
            n_samples=8, renderer=Renderer(tokenizer), client=client, settings_for=lambda env: settings,
            rollout_id=0, run_seed=0, max_concurrency=concurrency)
        seconds = time.perf_counter() - t0
    assert all(s.num_turns == turns and s.status.value == "completed" for s in samples), samples[0].metadata
    client.turn_log.pop([s.trajectory_id for s in samples])  # as the metrics do after each batch
    return sum(s.num_turns for s in samples) / seconds, samples[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from agentrl.models import build_tiny_model, load_tokenizer

    tokenizer = load_tokenizer(build_tiny_model())
    reply = tokenizer.encode("yes, that is the answer") + [tokenizer.eos_token_id]
    server, url = start_stand_in(_serve, reply)
    # a first run of each (not timed): the agent loop's tokens tell the bare loop what to send
    _, sample = asyncio.run(agentrl_loop(url, tokenizer, 8, args.turns, args.concurrency))
    n_env = (sample.response_length - args.turns * len(reply)) // max(args.turns - 1, 1)
    env_ids = sample.response_tokens[len(reply):len(reply) + n_env]
    _, ids = asyncio.run(bare_loop(url, sample.prompt_tokens, env_ids, 8, args.turns, args.concurrency))
    assert ids == sample.tokens, "the bare loop must send what the agent loop sends"
    def timed(coro) -> tuple[float, float]:  # (turns/s, client CPU microseconds per turn)
        gc.collect()  # each run starts with no garbage from the last (a full collection here takes ~0.1 s)
        cpu = time.process_time()
        rate = asyncio.run(coro)[0]
        return rate, (time.process_time() - cpu) / (args.trajectories * args.turns) * 1e6

    bare, ours = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        bare.append(timed(bare_loop(url, sample.prompt_tokens, env_ids, args.trajectories, args.turns,
                                    args.concurrency)))
        ours.append(timed(agentrl_loop(url, tokenizer, args.trajectories, args.turns, args.concurrency)))
    server.kill()
    rate = {name: (max(r for r, _ in runs), statistics.median(r for r, _ in runs))
            for name, runs in (("bare", bare), ("agentrl", ours))}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in (("bare", bare), ("agentrl", ours))}
    result = {"trajectories": args.trajectories, "turns": args.turns, "concurrency": args.concurrency,
              "repeats": args.repeats, "bare_aiohttp_turns_per_s": round(rate["bare"][0], 1),
              "agentrl_turns_per_s": round(rate["agentrl"][0], 1),
              "agentrl_over_bare": round(rate["agentrl"][0] / rate["bare"][0], 3),
              "agentrl_over_bare_median": round(rate["agentrl"][1] / rate["bare"][1], 3),
              "bare_cpu_us_per_turn": round(cpu["bare"], 1), "agentrl_cpu_us_per_turn": round(cpu["agentrl"], 1),
              "agentrl_over_bare_cpu": round(cpu["bare"] / cpu["agentrl"], 3),
              "load_average": round(os.getloadavg()[0], 2)}
    for name, runs in (("bare aiohttp loop", bare), ("agentrl agent loop", ours)):
        key = "bare" if name.startswith("bare") else "agentrl"
        print(f"{name + ':':20s} {rate[key][0]:6.0f} turns/s best, {rate[key][1]:6.0f} median, "
              f"{cpu[key]:5.0f} us CPU/turn median   (runs: {', '.join(f'{r:.0f}' for r, _ in runs)})")
    print(f"ratio agentrl / bare: {result['agentrl_over_bare']:.2f} (best runs), "
          f"{result['agentrl_over_bare_median']:.2f} (medians), {result['agentrl_over_bare_cpu']:.2f} (CPU per turn)")
    out = Path(__file__).parent / "results" / "rollout_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
