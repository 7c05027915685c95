"""Rollout-stack overhead: turns/s of agentrl's agent loop against an engine that answers
instantly, versus a bare aiohttp loop making the same /generate calls.

    python bench/rollout_overhead.py [--trajectories 256] [--turns 4] [--concurrency 256]

The engine is a separate process that answers every /generate at once with a fixed reply,
so the figures measure the client side: chat-template rendering, tokenization, Sample
bookkeeping, env calls and HTTP. Prints both rates and their ratio; writes
bench/results/rollout_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from pathlib import Path

import aiohttp


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


async def bare_loop(url: str, prompt: list[int], reply: list[int], trajectories: int, turns: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(i):
            async with gate:
                ids = list(prompt)
                for _ in range(turns):
                    async with session.post(url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                                                     "sampling_params": {"max_new_tokens": 8}},
                                            headers={"X-SMG-Routing-Key": f"t{i}"}) as r:
                        body = await r.json()
                    ids += body["output_ids"] + reply[:4]  # stand-in for the env's tokens

        t0 = time.perf_counter()
        await asyncio.gather(*[one(i) for i in range(trajectories)])
        return trajectories * turns / (time.perf_counter() - t0)


async def agentrl_loop(url: str, tokenizer, trajectories: int, turns: int, concurrency: int):
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

    settings = LoopSettings(max_response_len=100_000, max_turns=turns, sampling_params={"temperature": 1.0})
    async with EngineClient(url, max_connections=concurrency) as client:
        t0 = time.perf_counter()
        samples = await generate_rollout(
            [{"prompt": "benchmark prompt"}] * (trajectories // 8), make_env=lambda name: (Echo(), "echo"),
            n_samples=8, renderer=Renderer(tokenizer), client=client, settings_for=lambda env: settings,
            rollout_id=0, run_seed=0, max_concurrency=concurrency)
        seconds = time.perf_counter() - t0
    assert all(s.num_turns == turns and s.status.value == "completed" for s in samples), samples[0].metadata
    return sum(s.num_turns for s in samples) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from agentrl.engines.launch import free_port
    from agentrl.models import build_tiny_model, load_tokenizer

    tokenizer = load_tokenizer(build_tiny_model())
    reply = tokenizer.encode("yes, that is the answer") + [tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "benchmark prompt"}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port, reply), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    bare, ours = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        bare.append(asyncio.run(bare_loop(url, prompt, reply, args.trajectories, args.turns, args.concurrency)))
        ours.append(asyncio.run(agentrl_loop(url, tokenizer, args.trajectories, args.turns, args.concurrency)))
    server.terminate()
    bare_best, ours_best = max(bare), max(ours)
    result = {"trajectories": args.trajectories, "turns": args.turns, "concurrency": args.concurrency,
              "bare_aiohttp_turns_per_s": round(bare_best, 1), "agentrl_turns_per_s": round(ours_best, 1),
              "agentrl_over_bare": round(ours_best / bare_best, 3)}
    print(f"bare aiohttp loop:  {bare_best:8.0f} turns/s   (runs: {', '.join(f'{x:.0f}' for x in bare)})")
    print(f"agentrl agent loop: {ours_best:8.0f} turns/s   (runs: {', '.join(f'{x:.0f}' for x in ours)})")
    print(f"ratio agentrl / bare: {ours_best / bare_best:.2f}")
    out = Path(__file__).parent / "results" / "rollout_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
