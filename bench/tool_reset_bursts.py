"""A tool env's reset in rollout-shaped bursts: every iteration starts a batch of trajectories at
once, each taking a sandbox from the run's pool and starting its tool servers (the code env's
python, bash and files: one MCP server, about a second of CPU to start), then grading in a second
sandbox of the same pool that is destroyed after. On a GPU host this reset was 10-11 s of a
20-s code-env iteration (1x H200, 2026-12-03, 64 trajectories, 16 cores) with warm sandboxes.

    python bench/tool_reset_bursts.py [--bursts 3] [--trajectories 8] [--max-active 16]

Runs the same bursts twice in one call: the tool servers started at reset (the pool seen as a
plain get/release pool), then started by the pool ahead of each trajectory (SandboxPool.keep_ready,
what ToolEnv asks for). Prints the reset time per burst (mean, max) for both; writes
bench/results/tool_reset_bursts.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from agentrl.sandboxes import SandboxPool
from agentrl.tools import ToolEnv
from agentrl.tools.spec import tool_sandbox_options


class CodeTools(ToolEnv):
    builtin_tools = ("python", "bash", "files")


class PlainPool:
    """The pool without keep_ready: each reset starts its own tool servers (the old path)."""

    def __init__(self, pool: SandboxPool):
        self.get, self.release = pool.get, pool.release


async def trajectory(pool, env_pool, rng: random.Random) -> float:
    env = CodeTools(sandbox=env_pool)
    t0 = time.perf_counter()
    await env.areset(options={"prompt": "write solution.py"})
    reset_s = time.perf_counter() - t0
    try:
        await asyncio.sleep(rng.uniform(1.0, 3.0))  # the model's turns
    finally:
        await env.aclose()
    sb = await pool.get()  # the grader's sandbox: tainted after, destroyed and replaced
    try:
        await sb.exec("python3 -c 'print(2)'")
        sb.taint("it ran a solution for grading")
    finally:
        await pool.release(sb)
    return reset_s


async def run(ready: bool, args) -> list[dict]:
    mounts, env = tool_sandbox_options()
    pool = await SandboxPool(args.backend, warm=4, max_active=args.max_active, mounts=mounts, env=env).start()
    rng, rows = random.Random(0), []
    try:
        for burst in range(args.bursts):
            t0 = time.perf_counter()
            resets = await asyncio.gather(*[trajectory(pool, pool if ready else PlainPool(pool), rng)
                                            for _ in range(args.trajectories)])
            m = pool.metrics()
            row = {"burst": burst, "wall_s": round(time.perf_counter() - t0, 2),
                   "reset_s_mean": round(statistics.fmean(resets), 3), "reset_s_max": round(max(resets), 3),
                   "ready_taken": m["ready_taken"], "ready_wasted": m["ready_wasted"], "sandboxes_created": m["created"]}
            rows.append(row)
            print(f"{'ready ahead' if ready else 'at reset   '}  burst {burst}: reset mean {row['reset_s_mean']:.2f} s, "
                  f"max {row['reset_s_max']:.2f} s, burst {row['wall_s']:.1f} s, tool servers taken ready so far "
                  f"{row['ready_taken']}, wasted {row['ready_wasted']}", flush=True)
            await asyncio.sleep(args.pause)  # the train step and weight sync between iterations
    finally:
        await pool.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--max-active", type=int, default=16)
    p.add_argument("--pause", type=float, default=1.5, help="seconds between bursts (the train step)")
    p.add_argument("--backend", default="local")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "tool_reset_bursts.json"))
    args = p.parse_args()
    out = {"machine": f"{platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
           "args": vars(args), "at_reset": asyncio.run(run(False, args)), "ready_ahead": asyncio.run(run(True, args))}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
