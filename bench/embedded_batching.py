"""The embedded engine's batching under the arrival patterns rollouts make: requests that come
together, staggered, and multi-turn trajectories whose next turn arrives while others decode.

    python bench/embedded_batching.py [--model DIR] [--repeat 3]

Starts one engine process (`python -m agentrl.engines.embedded`, the default tiny model on the
CPU, torch's default threads), as `agentrl train` does, and times each scenario over HTTP:

- 8 at once x 200 tokens, 32 at once x 100 tokens;
- 16 staggered: one request every 50 ms, 100 tokens each;
- multi-turn: 8 trajectories of 4 turns of 50 tokens, each turn sent when the previous answers;
- the latency of a 5-token request sent while a 2,000-token one decodes (with static batches it
  waited for the long one to end).

Sampling at temperature 1 with ignore_eos, so every request makes its full length. Prints the
best of --repeat runs of each and writes bench/results/embedded_batching.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


async def scenarios(url: str, repeat: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async def gen(i: int, n: int, delay: float = 0.0) -> dict:
            await asyncio.sleep(delay)
            async with s.post(url + "/generate", json={
                    "input_ids": [5 + i, 6, 7, 8],
                    "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}) as r:
                body = await r.json()
                assert r.status == 200 and len(body["output_ids"]) == n, body
                return body

        async def trajectory(i: int) -> None:
            for _ in range(4):
                await gen(i, 50)

        async def short_during_long() -> float:
            long = asyncio.create_task(gen(0, 2000))
            await asyncio.sleep(0.5)  # the long one is decoding
            t = time.perf_counter()
            await gen(1, 5)
            latency = time.perf_counter() - t
            await long
            return latency

        cases = {
            "8_at_once_x200_s": lambda: asyncio.gather(*[gen(i, 200) for i in range(8)]),
            "32_at_once_x100_s": lambda: asyncio.gather(*[gen(i, 100) for i in range(32)]),
            "16_staggered_50ms_x100_s": lambda: asyncio.gather(*[gen(i, 100, i * 0.05) for i in range(16)]),
            "multi_turn_8x4x50_s": lambda: asyncio.gather(*[trajectory(i) for i in range(8)]),
        }
        await gen(0, 5)  # warm-up
        out = {}
        for name, case in cases.items():
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                await case()
                times.append(time.perf_counter() - t)
            out[name] = round(min(times), 3)
            print(f"{name}: {out[name]:.2f} (best of {repeat})", flush=True)
        out["short_during_long_latency_s"] = round(min([await short_during_long() for _ in range(repeat)]), 3)
        print(f"short_during_long_latency_s: {out['short_during_long_latency_s']:.3f} (best of {repeat})")
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the built-in tiny model)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from agentrl.models import build_tiny_model
        args.model = str(build_tiny_model())
    from agentrl.engines.launch import launch_embedded_engine

    with tempfile.TemporaryDirectory() as logs:
        engine = launch_embedded_engine(args.model, log_dir=Path(logs))
        try:
            results = asyncio.run(scenarios(engine.url, args.repeat))
        finally:
            engine.stop()
    path = ROOT / "bench" / "results" / "embedded_batching.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
