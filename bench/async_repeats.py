"""bench/async_vs_sync.py several times in one call: the equal-work speedup's median and spread,
and what moved between the repeats (issue 34: the same bench gave 2.68x, then 1.92x).

    python bench/async_repeats.py [--repeats 3] [--iterations 6] [--configs sync,async] [--out FILE]
    python bench/async_repeats.py --gpu --model DIR --deadline-s 450 [--repeats 3] [AGENTRL TRAIN FLAGS...]

Each repeat is one async_vs_sync.py call with `--configs` (sync first), `--iterations` and the
flags it does not know passed through (--gpu, --model, --sglang-*), under a share of
--deadline-s (the time left over the repeats left). Per configuration: every repeat's
equal-work speedup, the median, min, max and spread ((max - min) / median). Where the spread
comes from, from the repeats' own figures:
- which side moved: the coefficient of variation (stdev / mean) across repeats of the sync
  run's timed seconds and of each other configuration's;
- in which part: the same for their rollout wait (rollout_s), train_s and weight sync
  (sync_s) summed over the timed iterations;
- inside a run: each timed iteration's seconds, and the slowest one's share of the run's
  (a single slow iteration, e.g. a train step meeting a new sequence-length shape, moves a
  timed window of a few seconds a lot); each iteration's wait for its batch (rollout_s) and
  how many waited over WAITED_S (async: the batch's long episode was still out when the
  train step ended, so the loop waited for it).
Writes bench/results/async_repeats.json (--gpu: async_repeats_gpu.json) after every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
WAITED_S = 0.1  # an iteration whose batch was not ready when training ended (async: a long episode still out)


def cv(xs: list[float]) -> float | None:
    """stdev / mean; None below two values."""
    return statistics.stdev(xs) / statistics.mean(xs) if len(xs) >= 2 and statistics.mean(xs) else None


def spread(xs: list[float]) -> dict:
    if not xs:
        return {"values": [], "median": None, "min": None, "max": None, "spread": None}
    med = statistics.median(xs)
    return {"values": xs, "median": round(med, 3), "min": min(xs), "max": max(xs),
            "spread": round((max(xs) - min(xs)) / med, 3) if med else None}


def run_figures(result: dict, warmup: int) -> dict:
    """Per run of one async_vs_sync.py result: its timed seconds and their parts, and its iterations."""
    out = {}
    for name, run in result.get("runs", {}).items():
        target = run.get("at_target") or {}
        window = run.get("per_iteration", [])[warmup:target.get("iterations")]
        timed = [it["iteration_s"] for it in window]
        waits = [it.get("rollout_s", 0.0) for it in window]  # the loop waiting for its batch
        out[name] = {"seconds": target.get("seconds"), "rollout_s": target.get("rollout_s"),
                     "train_s": target.get("train_s"), "sync_s": target.get("sync_s"),
                     "timed_iteration_s": timed,
                     "slowest_share": round(max(timed) / sum(timed), 3) if timed else None,
                     "iteration_cv": round(cv(timed), 3) if cv(timed) is not None else None,
                     "batch_waits_s": [round(w, 3) for w in waits],
                     "iterations_waiting": sum(w > WAITED_S for w in waits),
                     "lag_hist": run.get("lag_hist"), "drops": run.get("metrics_drops"),
                     "outside_iterations_s": run.get("outside_iterations_s")}
    return out


def attribution(repeats: list[dict]) -> dict:
    """Across repeats, per run name: the CV of its timed seconds and of each part."""
    names = {n for r in repeats for n in r["runs"]}
    out = {}
    for n in sorted(names):
        figs = [r["runs"][n] for r in repeats if n in r["runs"] and r["runs"][n]["seconds"] is not None]
        out[n] = {key: (round(c, 3) if (c := cv([f[key] for f in figs if f[key] is not None])) is not None else None)
                  for key in ("seconds", "rollout_s", "train_s", "sync_s")}
        out[n]["mean_seconds"] = round(statistics.mean([f["seconds"] for f in figs]), 2) if figs else None
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, help="iterations of each sync run (async_vs_sync.py's default if not given)")
    p.add_argument("--configs", default="sync,async")
    p.add_argument("--deadline-s", type=float, help="the whole call's bound (each repeat gets its share)")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--append", action="store_true",
                   help="add to the repeats already in --out (calls of a few minutes each, one report)")
    args, passthrough = p.parse_known_args(argv)
    out = args.out or HERE / "results" / ("async_repeats_gpu.json" if args.gpu else "async_repeats.json")
    t0 = time.time()
    repeats: list[dict] = json.loads(out.read_text())["repeats"] if args.append and out.exists() else []
    first = len(repeats)
    report: dict = {}
    folder = Path(tempfile.mkdtemp(prefix="agentrl-async-repeats-"))
    for k in range(first, first + args.repeats):
        left = None
        if args.deadline_s:
            left = (args.deadline_s - (time.time() - t0)) / (first + args.repeats - k)
            if left < 60:
                print(f"repeat {k + 1}: {left:.0f} s left for it: stopping here", flush=True)
                break
        result_path = folder / f"repeat-{k}.json"
        cmd = [sys.executable, str(HERE / "async_vs_sync.py"), "--configs", args.configs, "--out", str(result_path),
               *(["--gpu"] if args.gpu else []), *(["--iterations", str(args.iterations)] if args.iterations else []),
               *(["--deadline-s", f"{left:.0f}"] if left else []), *passthrough]
        print(f"\n=== repeat {k + 1}/{first + args.repeats}: $ {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, timeout=(left + 120) if left else None)
        if not result_path.exists():
            print(f"repeat {k + 1}: no result (exit status {proc.returncode})", flush=True)
            continue
        result = json.loads(result_path.read_text())
        warmup = result.get("warmup_iterations", 1)
        speedups = {n: c.get("equal_work_speedup") for n, c in result.get("configs", {}).items() if n != "sync"}
        repeats.append({"repeat": k, "exit_status": proc.returncode, "speedups": speedups,
                        "headline": result.get("headline"), "runs": run_figures(result, warmup)})
        names = sorted({n for r in repeats for n in r["speedups"]})
        report = {
            "command": " ".join([sys.executable, *sys.argv]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "cpus": os.cpu_count(), "gpus": result.get("gpus"),
            "configs": args.configs, "iterations": args.iterations, "warmup_iterations": warmup,
            "speedup": {n: spread([r["speedups"][n] for r in repeats if r["speedups"].get(n) is not None])
                        for n in names},
            "variation_across_repeats": attribution(repeats), "repeats": repeats,
            "seconds": round(time.time() - t0, 1),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if not report:
        sys.exit("async_repeats: no repeat gave a result")
    print("\nequal-work speedup over repeats:")
    for n, s in report["speedup"].items():
        print(f"  {n}: median {s['median']}x, min {s['min']}, max {s['max']}, spread {s['spread']} ({s['values']})")
    print("what varied across repeats (stdev / mean):")
    for n, v in report["variation_across_repeats"].items():
        print(f"  {n}: timed seconds {v['seconds']} (mean {v['mean_seconds']} s); rollout wait {v['rollout_s']}, "
              f"train {v['train_s']}, weight sync {v['sync_s']}")
    for r in report["repeats"]:
        print(f"  repeat {r['repeat']}: " + "; ".join(
            f"{n} {f['seconds']} s (slowest iteration {f['slowest_share']} of it, iteration cv {f['iteration_cv']}, "
            f"{f['iterations_waiting']} of {len(f['timed_iteration_s'])} iterations waited for their batch)"
            for n, f in r["runs"].items()))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
