"""The rollout phase's gap to a bare client (issue 34), on the CPU: agentrl's rollout path against a
bare aiohttp client, both driving one stand-in engine that answers like SGLang's /generate.

    python bench/rollout_gap.py [--trajectories 256] [--tokens 1024] [--delay 2.0] [--repeats 3]

The stand-in (a separate process) answers every /generate after `--delay` seconds with what
SGLang sends for `max_new_tokens` tokens under return_logprob: output_ids, text, and meta_info
with output_token_logprobs ([logprob, id, null] per token), finish_reason, prompt_tokens,
completion_tokens, cached_tokens, weight_version, e2e_latency. All replies of a batch sent at
once come back together, as on the GPU run (every trajectory exactly `--tokens` tokens).

- bare: one aiohttp session (no connection limit, orjson), every request at once, each reply
  read and its token count checked (bench/rollout_vs_bare.py's replay);
- agentrl: generate_rollout -> GroupRunner (groups of 8) -> run_trajectory -> EngineClient ->
  the target-token env (single turn, the GPU run's env, as `agentrl train` builds it);
- threaded_env: the same with target-token as it ran before 883d276 (reset and step in worker
  threads, every token decoded by a call of its own): the "before" of that fix, in the same run.

Per side (median of `--repeats`, interleaved): the requests span (first request sent to last
reply read), the whole call, the main thread's CPU seconds (the event loop's own work) and the
process's; for agentrl also the stage means (reset, env step, decode) and loop_busy_frac as
`agentrl train` records them. Prints a table and the ratio bare span / agentrl span.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson

try:
    import agentrl  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sglang_reply(input_ids: list[int], n: int, rid: str, vocab: int, seconds: float) -> dict:
    """What SGLang's /generate answers for `n` new tokens with return_logprob (ids drawn from `rid`)."""
    rng = random.Random(rid)
    ids = [rng.randrange(vocab) for _ in range(n)]
    return {"text": "w" * (4 * n), "output_ids": ids,
            "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": n},
                          "prompt_tokens": len(input_ids), "completion_tokens": n, "cached_tokens": 0,
                          "weight_version": "0", "e2e_latency": seconds,
                          "output_token_logprobs": [[-rng.random() * 5, t, None] for t in ids]}}


def _serve(port: int, delay_s: float, vocab: int) -> None:
    from aiohttp import web

    async def generate(request):
        t0 = time.perf_counter()
        body = await request.json(loads=orjson.loads)
        n = int(body["sampling_params"]["max_new_tokens"])
        await asyncio.sleep(delay_s - (time.perf_counter() - t0))
        reply = sglang_reply(body["input_ids"], n, body.get("rid") or str(len(body["input_ids"])), vocab, delay_s)
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", lambda r: web.Response(text="OK"))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


async def bare(url: str, requests: list[tuple[str, list[int]]], sampling: dict, tokens: int) -> dict:
    """Every request at once from one session: (first request to last reply) seconds."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     json_serialize=lambda v: orjson.dumps(v).decode()) as session:
        sent = []

        async def one(tid: str, ids: list[int]) -> None:
            sent.append(time.perf_counter())
            payload = {"input_ids": ids, "return_logprob": True, "rid": f"{tid}-t0-0",
                       "sampling_params": {**sampling, "max_new_tokens": tokens}}
            async with session.post(url + "/generate", json=payload, headers={"X-SMG-Routing-Key": tid}) as resp:
                meta = (await resp.json(loads=orjson.loads, content_type=None))["meta_info"]
            assert meta["completion_tokens"] == tokens == len(meta["output_token_logprobs"])

        t0 = time.perf_counter()
        await asyncio.gather(*[one(tid, ids) for tid, ids in requests])
        span = time.perf_counter() - t0
    return {"span_s": span, "call_s": span, "sends_spread_s": max(sent) - min(sent)}


def threaded_target_token():
    """target-token as it ran before 883d276: reset and step in worker threads (Env.areset/astep,
    as every sync env's), each token's text from a decode call of its own."""
    from agentrl.env import Action, Env
    from agentrl.registry import make

    class Threaded(type(make("target-token"))):
        areset, astep = Env.areset, Env.astep

        def step(self, action):
            old = Action(action)  # no decode_each: token_texts decodes token by token
            old.token_ids, old._decode = action.token_ids, action._decode
            return super().step(old)

    return Threaded()


async def ours(url: str, tokenizer, groups: int, n: int, tokens: int, sampling: dict, threaded: bool = False):
    """`agentrl train`'s rollout path with the target-token env (`threaded`: as it ran before,
    threaded_target_token): (figures, samples)."""
    from agentrl.metrics import rollout_stage_metrics
    from agentrl.registry import make
    from agentrl.rollout.agent_loop import LoopSettings, Renderer
    from agentrl.rollout.client import EngineClient
    from agentrl.rollout.manager import generate_rollout
    tt = sys.modules[type(make("target-token")).__module__]

    settings = LoopSettings(max_response_len=tokens, max_turns=1, sampling_params=sampling,
                            apply_chat_template=False)
    tasks = [{"prompt": tt.prompt(tt.TARGETS[g % 8]), "label": tt.TARGETS[g % 8]} for g in range(groups)]
    async with EngineClient(url) as client:
        start = time.time()
        t0 = time.perf_counter()
        new_env = threaded_target_token if threaded else (lambda: make("target-token"))
        samples = await generate_rollout(tasks, make_env=lambda name: (new_env(), "target-token"), n_samples=n,
                                         renderer=Renderer(tokenizer, apply_chat_template=False), client=client,
                                         settings_for=lambda env: settings, rollout_id=0, run_seed=0,
                                         max_concurrency=groups * n)
        call = time.perf_counter() - t0
        end = time.time()
    bad = [s for s in samples if s.status.value != "completed" or s.num_trained_tokens != tokens]
    assert not bad, bad[0].metadata
    m = rollout_stage_metrics(samples, start, end)
    sent = [s.metadata["stages"]["first_request_at"] for s in samples]
    return {"span_s": m["stage/requests_span_s"], "call_s": call, "first_request_after_s": m["stage/first_request_after_s"],
            "after_last_reply_s": m["stage/after_last_reply_s"], "sends_spread_s": max(sent) - min(sent),
            "loop_busy_frac": m["stage/loop_busy_frac"],
            **{k: m[f"stage/{k}_s_mean"] for k in ("reset", "env", "decode", "generate")}}, samples


def timed(coro) -> dict:
    gc.collect()  # each run starts with no garbage from the last
    main_cpu, cpu = time.thread_time(), time.process_time()
    out = asyncio.run(coro)
    figures = out[0] if isinstance(out, tuple) else out
    return {**figures, "main_thread_cpu_s": time.thread_time() - main_cpu, "process_cpu_s": time.process_time() - cpu}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=int, default=256, help="a multiple of 8 (groups of 8)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens each trajectory generates")
    p.add_argument("--delay", type=float, default=2.0, help="seconds the stand-in takes per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="JSON report (default: none)")
    args = p.parse_args(argv)
    if args.trajectories % 8 or args.trajectories < 8:
        p.error("--trajectories must be a positive multiple of 8")

    from agentrl.models import build_tiny_model, load_tokenizer
    from agentrl.rollout.gc_tuning import tune_gc_for_rollouts
    from rollout_overhead import start_stand_in  # bench/ (the script's folder) is on sys.path

    tokenizer = load_tokenizer(build_tiny_model())
    tune_gc_for_rollouts()  # as `agentrl train` does once it has started
    server, url = start_stand_in(_serve, args.delay, len(tokenizer))
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    try:
        # a first (untimed) run of ours gives the requests the bare client sends: the same input ids and ids
        _, samples = asyncio.run(ours(url, tokenizer, args.trajectories // 8, 8, args.tokens, sampling))
        requests = [(s.trajectory_id, s.prompt_tokens) for s in samples]
        runs = {"bare": [], "agentrl": [], "threaded_env": []}
        for _ in range(args.repeats):  # interleaved: drift in the machine's load hits all alike
            runs["bare"].append(timed(bare(url, requests, sampling, args.tokens)))
            runs["agentrl"].append(timed(ours(url, tokenizer, args.trajectories // 8, 8, args.tokens, sampling)))
            runs["threaded_env"].append(timed(ours(url, tokenizer, args.trajectories // 8, 8, args.tokens, sampling,
                                                   threaded=True)))
    finally:
        server.kill()
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    over = {side: {k: med[side][k] - med["bare"][k] for k in ("span_s", "call_s", "main_thread_cpu_s")}
            for side in ("agentrl", "threaded_env")}
    report = {"command": " ".join([sys.executable, *sys.argv]), "trajectories": args.trajectories,
              "tokens": args.tokens, "delay_s": args.delay, "repeats": args.repeats,
              "machine": {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "load_average_1m": round(os.getloadavg()[0], 2)},
              "median": med, "agentrl_over_bare_s": over,
              "ratio_span": {side: med["bare"]["span_s"] / med[side]["span_s"] for side in ("agentrl", "threaded_env")},
              "runs": runs}
    print(f"{args.trajectories} trajectories x {args.tokens} tokens, stand-in delay {args.delay} s, "
          f"{args.repeats} runs each (median); {os.cpu_count()} CPUs, load {report['machine']['load_average_1m']}")
    print(f"{'':12s} {'span s':>8s} {'call s':>8s} {'over delay':>10s} {'sends ms':>9s} {'main CPU s':>10s} "
          f"{'proc CPU s':>10s}")
    for side in ("bare", "agentrl", "threaded_env"):
        m = med[side]
        print(f"{side:12s} {m['span_s']:8.3f} {m['call_s']:8.3f} {m['span_s'] - args.delay:10.3f} "
              f"{m['sends_spread_s'] * 1e3:9.1f} {m['main_thread_cpu_s']:10.3f} {m['process_cpu_s']:10.3f}")
    print("(span: first request to last reply; sends: first to last request sent; main CPU: the event "
          "loop's thread; proc CPU: with worker threads)")
    print("(threaded_env: target-token's reset and step in worker threads, its tokens decoded one by one, "
          "as before 883d276)")
    for side in ("agentrl", "threaded_env"):
        a = med[side]
        print(f"{side} stages (mean per trajectory): reset {a['reset'] * 1e3:.2f} ms, env {a['env'] * 1e3:.2f} ms, "
              f"decode {a['decode'] * 1e3:.2f} ms, generate {a['generate']:.3f} s; loop_busy_frac "
              f"{a['loop_busy_frac']:.3f}; first request after {a['first_request_after_s'] * 1e3:.1f} ms, "
              f"after last reply {a['after_last_reply_s'] * 1e3:.1f} ms")
        print(f"  span over bare: {over[side]['span_s']:.3f} s; ratio bare/{side} span: {report['ratio_span'][side]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
