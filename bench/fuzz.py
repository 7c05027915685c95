"""The long fuzz run of issue 31 ("the policy is an adversary"): every target of
tests/fuzz/fuzz_targets.py (built-in envs, tool-call parsers, graders, the MCP client against
a host server, the files/python/bash tool servers' argument handling) fed random and hostile
strings for N minutes in all, with fresh random seeds (the suite's short run is derandomized).

    python bench/fuzz.py --minutes 10 [--targets parser-hermes,env-math] [--seed 1]

The minutes are shared round-robin between the targets, in rounds of `--batch` examples per
target, until the time is spent. A failure is shrunk by hypothesis and recorded (the target
keeps running with the next seed). Writes bench/results/fuzz.md: what ran (targets, examples,
seconds, machine, date) and what it found.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

from fuzz_targets import FACTORIES, FuzzFailure, run_target, target  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fuzz.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time for all targets together (default 10)")
    parser.add_argument("--targets", default=",".join(FACTORIES), help="comma-separated target names (default all)")
    parser.add_argument("--batch", type=int, default=25, help="examples per target per round (default 25)")
    parser.add_argument("--seed", type=int, default=None, help="first seed (default random)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"report file (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in FACTORIES]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(FACTORIES)}")

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
    stats = {n: {"examples": 0, "seconds": 0.0, "rounds": 0, "failures": []} for n in names}
    started = time.monotonic()
    deadline = started + args.minutes * 60
    round_no = 0
    while time.monotonic() < deadline:
        for name in names:
            if time.monotonic() >= deadline:
                break
            t = target(name)
            if round_no:  # the known attacks ran in the first round; later rounds are all fresh examples
                t.examples = []
            run_seed = seed + round_no * 1000 + names.index(name)
            t0 = time.monotonic()
            try:
                run_target(t, max_examples=args.batch, derandomize=False, seed=run_seed)
            except FuzzFailure as e:
                stats[name]["failures"].append(f"seed {run_seed}: {e}")
                print(f"FOUND {name} (seed {run_seed}): {str(e)[:300]}", flush=True)
            took = time.monotonic() - t0
            s = stats[name]
            s["examples"] += args.batch
            s["seconds"] += took
            s["rounds"] += 1
            print(f"round {round_no} {name}: {args.batch} examples in {took:.1f} s", flush=True)
        round_no += 1
    elapsed = time.monotonic() - started
    write_report(args.out, stats, seed, elapsed, args)
    found = sum(len(s["failures"]) for s in stats.values())
    print(f"{sum(s['examples'] for s in stats.values())} examples in {elapsed / 60:.1f} min, {found} failure(s); "
          f"report: {args.out}")
    return 1 if found else 0


def write_report(out: Path, stats: dict, seed: int, elapsed: float, args) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Fuzzing the model-output paths (issue 31)",
        "",
        f"Command: `python bench/fuzz.py --minutes {args.minutes:g} --batch {args.batch} --seed {seed}`"
        + (f" `--targets {args.targets}`" if args.targets != ",".join(FACTORIES) else ""),
        f"Run: {now}, {elapsed / 60:.1f} min, {platform.node() or '?'} ({os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}), hypothesis with fresh seeds from {seed}.",
        "",
        "Property of every target: whatever the model writes ends as a result (an error observation, or the "
        "episode scored 0 with a reason) within a time bound, never an exception; see "
        "tests/fuzz/fuzz_targets.py for each target's check and the hostile strings.",
        "",
        "| target | examples | seconds | failures |",
        "|---|---:|---:|---:|",
    ]
    for name, s in stats.items():
        lines.append(f"| {name} | {s['examples']} | {s['seconds']:.0f} | {len(s['failures'])} |")
    lines += ["", "## Found", ""]
    found = [(n, f) for n, s in stats.items() for f in s["failures"]]
    if not found:
        lines.append("Nothing: no target raised or ran past its bound.")
    for name, failure in found:
        lines += [f"- **{name}**, {failure.splitlines()[0]}", "", "  ```", *("  " + x for x in failure.splitlines()[1:]),
                  "  ```"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
