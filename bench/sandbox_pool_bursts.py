"""A rollout's sandbox demand comes in bursts: every iteration starts as many trajectories as the
batch holds, each acquiring a sandbox, running its tools, releasing it. This bench replays that
shape against one SandboxPool (local backend by default) and prints, per burst, its wall time,
the sandboxes made and reused, and the acquire latency.

    python bench/sandbox_pool_bursts.py [--bursts 3] [--trajectories 32] [--max-active 16] [--backend local] [--grade]

What it shows: after the first burst, whether the pool hands out kept (reset) sandboxes or makes
them again, `max_creating` at a time (the code env's GPU run, 2026-12-03: ~60 made an iteration,
~6 s of every episode's reset). Writes bench/results/sandbox_pool_bursts.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import time
from pathlib import Path

from agentrl.sandboxes import SandboxPool


async def trajectory(pool: SandboxPool, rng: random.Random, grade: bool) -> float:
    t0 = time.perf_counter()
    async with pool.acquire() as sb:
        waited = time.perf_counter() - t0
        await sb.exec("echo work > f && python3 -c 'print(1)'")
        await asyncio.sleep(rng.uniform(0.2, 3.0))  # the model's turns: trajectories end apart
    if grade:  # the code env's grader: a sandbox of the same pool, tainted after (destroyed, replaced)
        sb = await pool.get()
        try:
            await sb.exec("python3 -c 'print(2)'")
            sb.taint("it ran a solution for grading")
        finally:
            await pool.release(sb)
    return waited


async def main(args) -> dict:
    rng = random.Random(0)
    rows = []
    async with SandboxPool(args.backend, warm=4, max_active=args.max_active, acquire_timeout_s=300) as pool:
        for burst in range(args.bursts):
            before = pool.metrics()
            t0 = time.perf_counter()
            waits = await asyncio.gather(*[trajectory(pool, rng, args.grade) for _ in range(args.trajectories)])
            after = pool.metrics()
            rows.append({"burst": burst, "wall_s": round(time.perf_counter() - t0, 3),
                         "created": after["created"] - before["created"], "reused": after["reused"] - before["reused"],
                         "acquire_s_mean": round(sum(waits) / len(waits), 4), "acquire_s_max": round(max(waits), 4),
                         "warm_after": after["warm"]})
            print(rows[-1], flush=True)
            await asyncio.sleep(0.5)  # the train step between rollouts
    return {"backend": args.backend, "trajectories": args.trajectories, "max_active": args.max_active, "grade": args.grade,
            "machine": f"{platform.machine()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "bursts": rows}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--max-active", type=int, default=16)
    p.add_argument("--backend", default="local")
    p.add_argument("--grade", action="store_true", help="each trajectory then grades in a tainted sandbox (code env)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox_pool_bursts.json"))
    a = p.parse_args()
    result = asyncio.run(main(a))
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
