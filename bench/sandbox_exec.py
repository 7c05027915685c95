"""Sandbox exec latency: warm docker / local sandboxes vs a bare `python3 -c pass` on the host.

    python bench/sandbox_exec.py [--n 200] [--backends docker,local]

Measures, per backend: exec latency p50/p99 and sequential execs/s of `python3 -c pass`
(and of `true`) in a warm sandbox, interleaved with the same bare subprocess on the host
(so both see the same machine load; the ratio is taken from these pairs), sandbox start (create+start) and close time, and
SandboxPool acquire time (warm pool, reset between trajectories). The goal: warm python
exec p50 within 1.5x of the bare host subprocess. Prints a table and writes
bench/results/sandbox_exec.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agentrl.sandboxes import SandboxPool, create
from agentrl.sandboxes.docker_backend import engine_available
from agentrl.sandboxes.local_backend import local_available

# the same interpreter the local sandbox runs, and the docker base image's (Debian 3.11)
PY = ["/usr/bin/python3", "-c", "pass"]


def stats(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"n": len(s), "p50_ms": 1e3 * statistics.median(s),
            "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
            "mean_ms": 1e3 * statistics.fmean(s), "per_s": len(s) / sum(s)}


def bare(n: int) -> dict:
    for _ in range(5):
        subprocess.run(PY, check=True)
    out = {}
    for name, argv in (("python", PY), ("true", ["true"])):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            ts.append(time.perf_counter() - t0)
        out[name] = stats(ts)
    return out


async def sandbox_bench(backend: str, n: int) -> dict:
    out: dict = {}
    starts, closes = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        sb = await create(backend)
        starts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await sb.close()
        closes.append(time.perf_counter() - t0)
    out["start"], out["close"] = stats(starts), stats(closes)
    async with create(backend) as sb:
        for _ in range(10):
            await sb.exec(PY)
        for name, argv in (("python", PY), ("true", ["true"])):
            ts, bare_ts = [], []
            for _ in range(n):  # interleaved with the bare subprocess: same load for both
                t0 = time.perf_counter()
                r = await sb.exec(argv)
                ts.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r
                t0 = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True)
                bare_ts.append(time.perf_counter() - t0)
            out[name], out[f"bare_{name}_interleaved"] = stats(ts), stats(bare_ts)
    async with SandboxPool(backend, warm=4, max_active=4) as pool:
        ts = []
        for i in range(max(20, n // 5)):
            t0 = time.perf_counter()
            sb = await pool.get(group_id=f"g{i // 4}", setup_files={"task.txt": "x" * 1000})
            ts.append(time.perf_counter() - t0)
            await sb.exec("echo dirt > dirt")
            await pool.release(sb)
        out["pool_acquire"] = stats(ts)
        out["pool_metrics"] = pool.metrics()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--backends", default="docker,local")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox_exec.json"))
    args = ap.parse_args()
    res = {"host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0]},
           "bare": bare(args.n), "backends": {}}
    for backend in args.backends.split(","):
        ok, why = engine_available() if backend == "docker" else local_available()
        if not ok:
            print(f"{backend}: skipped ({why})")
            res["backends"][backend] = {"skipped": why}
            continue
        res["backends"][backend] = asyncio.run(sandbox_bench(backend, args.n))
    b = res["bare"]["python"]["p50_ms"]
    print(f"{'':24}{'p50 ms':>9}{'p99 ms':>9}{'exec/s':>9}{'x bare':>8}")
    print(f"{'bare python -c pass':24}{b:9.1f}{res['bare']['python']['p99_ms']:9.1f}"
          f"{res['bare']['python']['per_s']:9.1f}{1:8.2f}")
    print(f"{'bare true':24}{res['bare']['true']['p50_ms']:9.1f}{res['bare']['true']['p99_ms']:9.1f}"
          f"{res['bare']['true']['per_s']:9.1f}")
    for backend, r in res["backends"].items():
        if "skipped" in r:
            continue
        r["python_vs_bare_p50"] = r["python"]["p50_ms"] / r["bare_python_interleaved"]["p50_ms"]
        for key in ("python", "true", "pool_acquire", "start", "close"):
            x = r[key]
            ratio = f"{r['python_vs_bare_p50']:8.2f}" if key == "python" else ""
            print(f"{backend + ' ' + key:24}{x['p50_ms']:9.1f}{x['p99_ms']:9.1f}{x['per_s']:9.1f}{ratio}")
        bi = r["bare_python_interleaved"]
        print(f"{'  bare, interleaved':24}{bi['p50_ms']:9.1f}{bi['p99_ms']:9.1f}{bi['per_s']:9.1f}")
        verdict = "meets" if r["python_vs_bare_p50"] <= 1.5 else "MISSES"
        print(f"  -> {backend}: warm python exec p50 = {r['python_vs_bare_p50']:.2f}x bare ({verdict} the 1.5x goal)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
