"""The rollout phase of an `agentrl train` run against a bare client, stage by stage: where the
run's rollout seconds go that the bare client (bench/rollout_vs_bare.py: the same requests, the
same engine arguments, one aiohttp session) does not spend.

    python bench/rollout_breakdown.py --run RUN_DIR [--bare RUN_DIR/rollout_vs_bare.json] [--out FILE]
    python bench/rollout_breakdown.py --cpu [--iterations 3] [--keep DIR] [--out FILE]

--run: a finished run folder whose metrics.jsonl has the stage/* metrics (agentrl.metrics.
rollout_stage_metrics), and the rollout_vs_bare.py report on it (--bare; made here with the
run's engine when missing: `--replay-args` pass through). --cpu: a short `agentrl train` on the
CPU first (the embedded engine, a multi-turn env), then the replay, then the breakdown.

Per iteration, the run's rollout_s is split into parts that add up to it exactly:
- switch_in: the --colocate switch before the first request (trainer offload, engines resume);
- ramp: the rest of the time before the first /generate (the engines' probe, the batch source
  starting its groups);
- requests: first request to last reply; set against the bare client's replay seconds
  (median), whose difference is what our requests cost beyond the engine's own work: the
  event loop's synchronous work (stage/loop_busy_frac of it: templates, tokenizing, decoding,
  env construction), the critical trajectory's time between its own requests, slot waits,
  client and router;
- tail: from the last reply to the batch handed over (the last env steps, rewards);
- switch_out: the --colocate switch after it (engines release, trainer onload).
gap_s = rollout_s - bare_s; each part's share of the gap is printed. Per trajectory, the mean
seconds of every stage (STAGE_KEYS) are printed too. Writes a JSON (--out; default
RUN_DIR/rollout_breakdown.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import agentrl  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.metrics import STAGE_KEYS, read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
SWITCH_IN = ("colocate/offload_s", "colocate/resume_s")
SWITCH_OUT = ("colocate/release_s", "colocate/onload_s")

TALK_ENV = HERE / "talk_env.py"  # --cpu: episodes of 1 to 3 turns (registers "count-talk")


class BreakdownError(Exception):
    pass


def iteration_breakdown(row: dict, replay: dict) -> dict:
    """One iteration's parts (seconds) from its metrics row and its rollout_vs_bare.py entry."""
    if "stage/first_request_after_s" not in row:
        raise BreakdownError(f"iteration {row['rollout_id']}: its metrics row has no stage/* figures (a run made "
                             "before agentrl recorded them): run it again")
    rollout_s = row["rollout_s"]
    bare_s = statistics.median(replay["bare_s"])
    switch_in = sum(row.get(k, 0.0) for k in SWITCH_IN)
    switch_out = sum(row.get(k, 0.0) for k in SWITCH_OUT)
    before, after = row["stage/first_request_after_s"], row["stage/after_last_reply_s"]
    span = row["stage/requests_span_s"]
    parts = {"switch_in": min(switch_in, max(before, 0.0)), "switch_out": min(switch_out, max(after, 0.0))}
    parts["ramp"] = before - parts["switch_in"]
    parts["tail"] = after - parts["switch_out"]
    parts["requests_over_bare"] = span - bare_s
    gap = rollout_s - bare_s
    loop_s = row.get("stage/loop_busy_frac", 0.0) * span
    return {
        "rollout_id": row["rollout_id"], "rollout_s": rollout_s, "bare_s": bare_s, "gap_s": gap,
        "ratio": bare_s / rollout_s if rollout_s > 0 else None, "parts_s": parts,
        "parts_share_of_gap": {k: (v / gap if gap > 0 else None) for k, v in parts.items()},
        "requests_span_s": span, "requests": row.get("stage/requests"),
        # inside requests_over_bare: what our own code did on the event loop, and the last trajectory's own gaps
        "event_loop_busy_s": loop_s, "critical_between_requests_s": row.get("stage/critical_other_s"),
        "stage_means_s": {k[:-2]: row.get(f"stage/{k[:-2]}_s_mean") for k in STAGE_KEYS},
    }


def print_report(report: dict) -> None:
    print(f"\nrollout phase vs the bare client, stage by stage ({report['run']})")
    print("iteration  rollout s  bare s  ratio |  switch_in  ramp  requests-bare  tail  switch_out | "
          "event loop busy  critical gaps")
    for it in report["iterations"]:
        p = it["parts_s"]
        print(f"{it['rollout_id']:>9}  {it['rollout_s']:>9.3f}  {it['bare_s']:>6.3f}  {it['ratio']:>5.3f} | "
              f"{p['switch_in']:>9.3f}  {p['ramp']:>4.3f}  {p['requests_over_bare']:>13.3f}  {p['tail']:>4.3f}  "
              f"{p['switch_out']:>10.3f} | {it['event_loop_busy_s']:>15.3f}  {it['critical_between_requests_s']:>13.3f}")
    print("\nper trajectory, mean seconds in each stage:")
    for it in report["iterations"]:
        print(f"  iteration {it['rollout_id']}: " + "  ".join(f"{k} {v:.4f}" for k, v in it["stage_means_s"].items()
                                                       if v is not None))
    s = report["summary"]
    if s:
        print(f"\nmedian over iterations >= 1: ratio {s['ratio']:.3f}; the gap {s['gap_s']:.3f} s is "
              + ", ".join(f"{k} {v:.3f} s ({100 * v / s['gap_s']:.0f}%)" if s["gap_s"] > 0 else f"{k} {v:.3f} s"
                          for k, v in s["parts_s"].items()))


def summarize(iterations: list[dict]) -> dict | None:
    later = [it for it in iterations if it["rollout_id"] >= 1] or iterations
    if not later:
        return None
    med = statistics.median
    return {"iterations": [it["rollout_id"] for it in later], "ratio": med([it["ratio"] for it in later]),
            "gap_s": med([it["gap_s"] for it in later]),
            "parts_s": {k: med([it["parts_s"][k] for it in later]) for k in later[0]["parts_s"]}}


def breakdown(run: Path, bare: Path) -> dict:
    rows = {r["rollout_id"]: r for r in read_metrics(run / "metrics.jsonl")}
    replay = json.loads(bare.read_text())
    its = [iteration_breakdown(rows[it["rollout_id"]], it)
           for it in sorted(replay["iterations"], key=lambda it: it["rollout_id"])]
    return {"run": str(run), "bare_report": str(bare), "machine": replay.get("machine") or platform.node(),
            "engine": replay.get("engine"), "command": " ".join(sys.argv), "iterations": its,
            "summary": summarize(its)}


def cpu_run(folder: Path, iterations: int) -> Path:
    """A short multi-turn `agentrl train` on the CPU (the embedded engine) in `folder`."""
    run = folder / "run"
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "--env-module", str(TALK_ENV), "--env", "count-talk",
           "--num-rollout", str(iterations), "--rollout-batch-size", "16", "--n-samples-per-prompt", "4",
           "--global-batch-size", "64", "--rollout-max-response-len", "96", "--rollout-max-tokens-per-turn", "16",
           "--rollout-ignore-eos", "--no-progress", "--output-dir", str(run)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=900)
    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a finished run folder")
    p.add_argument("--bare", type=Path, help="its rollout_vs_bare.py report (default RUN/rollout_vs_bare.json)")
    p.add_argument("--replay-args", default="--repeats 3", help="for rollout_vs_bare.py when the report is missing")
    p.add_argument("--cpu", action="store_true", help="a short CPU run first (embedded engine), then the replay")
    p.add_argument("--iterations", type=int, default=3, help="--cpu: iterations of the run")
    p.add_argument("--keep", type=Path, help="--cpu: the run's folder (default: a temporary one)")
    p.add_argument("--out", type=Path, help="JSON report (default RUN/rollout_breakdown.json)")
    args = p.parse_args(argv)
    if args.cpu == bool(args.run):
        p.error("give --run RUN_DIR or --cpu")
    t0 = time.time()
    if args.cpu:
        folder = args.keep or Path(tempfile.mkdtemp(prefix="agentrl-breakdown-"))
        folder.mkdir(parents=True, exist_ok=True)
        args.run = cpu_run(folder, args.iterations)
    bare = args.bare or args.run / "rollout_vs_bare.json"
    if not bare.exists():
        cmd = [sys.executable, str(HERE / "rollout_vs_bare.py"), "--run", str(args.run), "--out", str(bare),
               *shlex.split(args.replay_args)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=1800)
    report = breakdown(args.run, bare)
    report |= {"seconds": round(time.time() - t0, 1), "cpus": os.cpu_count()}
    out = args.out or args.run / "rollout_breakdown.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_report(report)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    try:
        main()
    except BreakdownError as exc:
        sys.exit(f"rollout_breakdown: {exc}")
