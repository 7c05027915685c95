"""Samples/s of synchronous vs asynchronous training on the same budget, with a long-tail
distribution of episode lengths.

    python bench/async_vs_sync.py [--iterations 8]

The env ends most episodes after one turn, some after 4 and a few after 12 (16 tokens a
turn), so a synchronous batch waits for its slowest trajectory. The async run overlaps
generation with training (--async) and keeps extra groups in flight
(--over-sampling-batch-size), so a batch is made of the first groups to finish and the
stragglers go on into the next batch (bounded by --max-staleness). Both runs train the same
number of samples with the default tiny model; samples/s = trained samples / summed
iteration wall time (start-up excluded). Writes bench/results/async_vs_sync.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ENV = textwrap.dedent('''
    import random
    import agentrl

    @agentrl.register_env("long-tail")
    class LongTail(agentrl.Env):
        """Episode length (turns) is long-tailed: 80% 1 turn, 15% 4 turns, 5% 12 turns."""
        max_turns = 12

        @classmethod
        def dataset(cls, seed=0, **kw):
            rng = random.Random(seed)
            while True:
                yield {"prompt": f"keep talking {rng.randint(0, 10**6)}"}

        def reset(self, *, seed=None, options=None):
            rng = random.Random(seed)
            u = rng.random()
            self.turns, self.t = (1 if u < 0.8 else 4 if u < 0.95 else 12), 0
            return options["prompt"], {}

        def step(self, action):
            self.t += 1
            done = self.t >= self.turns
            return "go on", (len(action) % 5) / 4 if done else 0.0, done, False, {}
''')


def run(out: Path, env_file: Path, iterations: int, extra: list[str]) -> dict:
    args = [str(Path(sys.executable).parent / "agentrl"), "train", "--env", "long-tail", "--env-module", str(env_file),
            "--num-rollout", str(iterations), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
            "--global-batch-size", "32", "--rollout-max-response-len", "1000", "--rollout-max-tokens-per-turn", "16",
            "--no-progress", "--output-dir", str(out), *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = sum(r["num_samples"] - r.get("stale_dropped", 0) for r in rows)
    seconds = sum(r["iteration_s"] for r in rows)
    return {"samples_trained": trained, "seconds": round(seconds, 2), "samples_per_s": round(trained / seconds, 2),
            "turns_mean": round(sum(r["turns_mean"] for r in rows) / len(rows), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "long_tail.py"
        env_file.write_text(ENV)
        sync = run(Path(tmp) / "sync", env_file, args.iterations, [])
        asyn = run(Path(tmp) / "async", env_file, args.iterations,
                   ["--async", "--over-sampling-batch-size", "16", "--max-staleness", "2"])
    ratio = asyn["samples_per_s"] / sync["samples_per_s"]
    print(f"sync : {sync['samples_per_s']:7.2f} samples/s  ({sync['samples_trained']} samples in {sync['seconds']} s)")
    print(f"async: {asyn['samples_per_s']:7.2f} samples/s  ({asyn['samples_trained']} samples in {asyn['seconds']} s)")
    print(f"async / sync: {ratio:.2f}x   (mean turns per trained sample: sync {sync['turns_mean']}, "
          f"async {asyn['turns_mean']}: async batches favour the groups that finish first)")
    out = Path(__file__).parent / "results" / "async_vs_sync.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"sync": sync, "async": asyn, "async_over_sync": round(ratio, 3)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
