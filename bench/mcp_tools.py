"""MCP tool-call overhead and throughput.

    python bench/mcp_tools.py [--calls 300] [--trajectories 32] [--turns 10] [--sandbox local,docker]

Figures (each printed, all written to bench/results/mcp_tools.json):
  * per-call latency of a trivial tool (`echo`) called
      - directly (a Python function call), and as a ToolSet function tool (validation, result);
      - over MCP stdio to a host subprocess: the raw SDK session, and through ToolSet.call;
      - over MCP stdio to a server inside a sandbox (local: bubblewrap, docker: `docker exec -i`);
      - the built-in `python` tool (host) running `1 + 1`;
  * server start time (spawn + initialize + list tools), host and sandbox;
  * tool calls/s with N trajectories in flight, each with its own server (host subprocesses),
    each turn making 2 concurrent calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ECHO_SERVER = '''
from mcp.server.mcpserver import MCPServer
server = MCPServer("echo", log_level="WARNING")

@server.tool(structured_output=False)
def echo(text: str) -> str:
    """Return the text."""
    return text

if __name__ == "__main__":
    server.run()
'''


def echo(text: str) -> str:
    """Return the text."""
    return text


def stats(samples_s: list[float]) -> dict:
    xs = sorted(samples_s)
    return {"n": len(xs), "mean_us": statistics.fmean(xs) * 1e6, "p50_us": xs[len(xs) // 2] * 1e6,
            "p95_us": xs[int(len(xs) * 0.95)] * 1e6, "min_us": xs[0] * 1e6}


async def timed_calls(fn, n: int, warmup: int = 10) -> dict:
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return stats(out)


def show(label: str, s: dict) -> None:
    print(f"  {label:<46} p50 {s['p50_us']:>9.1f} us   p95 {s['p95_us']:>9.1f} us   mean {s['mean_us']:>9.1f} us")


async def bench_latency(n: int, server_file: str, sandboxes: list[str]) -> dict:
    from agentrl.tools import MCPServerSpec, ToolSet
    from agentrl.tools.spec import PYTHON, builtin_spec
    res: dict = {}

    # direct call
    t0 = time.perf_counter()
    reps = 100000
    for _ in range(reps):
        echo("hi")
    res["direct_call_us"] = (time.perf_counter() - t0) / reps * 1e6
    print(f"  {'direct Python function call':<46} {res['direct_call_us']:.3f} us")

    async with ToolSet(functions=[echo]) as ts:
        res["function_tool"] = await timed_calls(lambda: ts.call("echo", {"text": "hi"}), n)
    show("ToolSet function tool (thread, no MCP)", res["function_tool"])

    spec = MCPServerSpec("echo", command=[sys.executable, server_file])
    t0 = time.perf_counter()
    async with ToolSet([spec]) as ts:
        res["host_server_start_s"] = time.perf_counter() - t0
        session = ts.connections["echo"].session
        res["mcp_host_raw_sdk"] = await timed_calls(lambda: session.call_tool("echo", {"text": "hi"}), n)
        res["mcp_host_toolset"] = await timed_calls(lambda: ts.call("echo", {"text": "hi"}), n)
    show("MCP stdio, host subprocess (raw SDK session)", res["mcp_host_raw_sdk"])
    show("MCP stdio, host subprocess (ToolSet.call)", res["mcp_host_toolset"])
    print(f"  {'host server start (spawn+init+list)':<46} {res['host_server_start_s']:.2f} s")

    async with ToolSet([builtin_spec("python")]) as ts:
        res["python_tool_host"] = await timed_calls(lambda: ts.call("python", {"code": "1 + 1"}), n)
    show("built-in python tool `1 + 1` (host)", res["python_tool_host"])

    for backend in sandboxes:
        try:
            from agentrl.sandboxes import create, resolve_backend
            from agentrl.tools.spec import tool_sandbox_options
            resolve_backend(backend)
        except Exception as e:
            print(f"  sandbox {backend}: skipped ({e})")
            res[f"sandbox_{backend}"] = {"skipped": str(e)}
            continue
        mounts, env = tool_sandbox_options()
        try:
            async with create(backend, mounts=mounts, env=env) as sb:
                await sb.write_file("echo_server.py", ECHO_SERVER)
                spec = MCPServerSpec("echo", command=[PYTHON, "/work/echo_server.py"], in_sandbox=True)
                t0 = time.perf_counter()
                async with ToolSet([spec], sandbox=sb) as ts:
                    start = time.perf_counter() - t0
                    r = await timed_calls(lambda: ts.call("echo", {"text": "hi"}), n)
                async with ToolSet([builtin_spec("python")], sandbox=sb) as ts:
                    rp = await timed_calls(lambda: ts.call("python", {"code": "1 + 1"}), n)
        except Exception as e:
            print(f"  sandbox {backend}: failed ({type(e).__name__}: {e})")
            res[f"sandbox_{backend}"] = {"failed": f"{type(e).__name__}: {e}"}
            continue
        res[f"sandbox_{backend}"] = {"server_start_s": start, "mcp_toolset": r, "python_tool": rp}
        show(f"MCP stdio, inside {backend} sandbox (ToolSet.call)", r)
        show(f"built-in python tool `1 + 1` ({backend} sandbox)", rp)
        print(f"  {backend + ' sandbox server start':<46} {start:.2f} s")
    return res


async def bench_throughput(server_file: str, trajectories: int, turns: int) -> dict:
    """N trajectories, each its own server; every turn makes 2 concurrent calls."""
    from agentrl.tools import MCPServerSpec, ToolSet
    spec = MCPServerSpec("echo", command=[sys.executable, server_file])
    sets = [ToolSet([spec]) for _ in range(trajectories)]
    t0 = time.perf_counter()
    await asyncio.gather(*(s.start() for s in sets))
    start_all = time.perf_counter() - t0

    async def trajectory(ts: ToolSet) -> int:
        n = 0
        for turn in range(turns):
            results = await ts.call_many([("echo", {"text": f"t{turn}a"}), ("echo", {"text": f"t{turn}b"})])
            n += len(results)
            await asyncio.sleep(0)  # the model's turn would be here
        return n

    t0 = time.perf_counter()
    calls = sum(await asyncio.gather(*(trajectory(s) for s in sets)))
    elapsed = time.perf_counter() - t0
    await asyncio.gather(*(s.close() for s in sets))
    res = {"trajectories": trajectories, "turns": turns, "calls": calls, "elapsed_s": elapsed,
           "calls_per_s": calls / elapsed, "start_all_servers_s": start_all}
    print(f"  {trajectories} trajectories x {turns} turns x 2 calls: {calls} calls in {elapsed:.2f} s = "
          f"{res['calls_per_s']:.0f} calls/s; starting the {trajectories} servers took {start_all:.1f} s")
    return res


async def main_async(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as tmp:
        server_file = os.path.join(tmp, "echo_server.py")
        Path(server_file).write_text(ECHO_SERVER)
        print(f"per-call latency ({args.calls} sequential calls each):")
        latency = await bench_latency(args.calls, server_file, [s for s in args.sandbox.split(",") if s])
        print("throughput:")
        throughput = await bench_throughput(server_file, args.trajectories, args.turns)
    return {"latency": latency, "throughput": throughput}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--sandbox", default="local,docker", help="comma-separated backends to measure ('' for none)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "mcp_tools.json"))
    args = p.parse_args()
    import logging
    logging.basicConfig(level=logging.ERROR)
    load_before = os.getloadavg()
    res = asyncio.run(main_async(args))
    res["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                      "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]]}
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    res["args"] = vars(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
