"""Engines SIGKILLed mid-rollout during `agentrl train` (two embedded engines behind the
router, CPU): kills, restarts, time to rejoin, samples completed / lost / duplicated,
retried requests and groups, and samples/s with and without kills on the same run.

    python bench/engine_kill.py [--iterations 40] [--kills 3]

Each kill lands 0.3 s into a rollout, once the previous victim is back in the pool,
alternating between the engines. Writes bench/results/engine_kill.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, N = 4, 4

# The env and the process probes are the engine-kill test's own (one definition of the scenario).
sys.path.insert(0, str(ROOT / "tests" / "engines"))
from test_engine_kill import ENV, engine_pids, events  # noqa: E402


def run(work: Path, model: Path, *, iterations: int, kills: int) -> dict:
    out = work / f"run-{kills}"
    argv = [str(Path(sys.executable).parent / "agentrl"), "train", "--env", "count-long", "--env-module",
            str(work / "count_env.py"), "--model", str(model), "--num-engines", "2", "--engine-num-threads", "1",
            "--num-rollout", str(iterations), "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
            "--global-batch-size", str(BATCH * N), "--rollout-max-response-len", "120",
            "--rollout-max-tokens-per-turn", "12", "--save-interval", "1000", "--no-progress", "--output-dir", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    rows = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
    back = lambda: sum(e["event"].startswith("back in the pool") for e in events(out))  # noqa: E731

    def wait_for(cond, timeout_s=300):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None and not cond():
            time.sleep(0.05)

    killed_at = []
    try:
        for i in range(kills):
            wait_for(lambda: back() == i and rows() > (killed_at[-1] if killed_at else 0))
            if proc.poll() is not None:
                break
            k = rows()
            time.sleep(0.3)
            pids = sorted(engine_pids(model).items(), key=lambda kv: kv[1])
            os.kill(pids[i % len(pids)][0], signal.SIGKILL)
            killed_at.append(k)
        _, stderr = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    if proc.returncode != 0:
        raise SystemExit(f"agentrl train failed:\n{stderr[-3000:]}")
    table = [json.loads(line) for line in metrics.read_text().splitlines()]
    samples = [json.loads(line) for i in range(iterations)
               for line in (out / "trajectories" / f"rollout_{i:05d}.jsonl").read_text().splitlines()]
    keys = [(s["group_id"], s["trajectory_id"].split("-")[1]) for s in samples]
    expected = {(g, f"s{k}") for g in range(iterations * BATCH) for k in range(N)}
    stale = sum(1 for i in range(iterations) for s in samples[i * BATCH * N:(i + 1) * BATCH * N]
                if any(v >= 0 and v != i for v in s["policy_versions"]))
    ev = events(out)
    exits = {}
    rejoin = []
    for e in ev:
        if e["event"] == "process exited":
            exits[e["engine"]] = e["time"]
        elif e["event"].startswith("back in the pool") and e["engine"] in exits:
            rejoin.append(e["time"] - exits.pop(e["engine"]))
    loop_s = sum(r["iteration_s"] for r in table)
    return {
        "kills": len(killed_at), "killed_at_iteration": killed_at,
        "restarts": sum(e["event"].startswith("restarted") for e in ev),
        "rejoined": len(rejoin), "time_to_rejoin_s": [round(t, 1) for t in rejoin],
        "samples_expected": len(expected), "samples_completed": sum(s["status"] != "failed" for s in samples),
        "samples_lost": len(expected - set(keys)), "samples_duplicated": len(keys) - len(set(keys)),
        "samples_with_stale_tokens": stale,
        "requests_retried": table[-1].get("requests_retried", 0),
        "groups_retried": table[-1].get("groups_retried", 0),
        "samples_per_s": round(len(samples) / loop_s, 2), "loop_s": round(loop_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from agentrl.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="agentrl-engine-kill-") as tmp:
        work = Path(tmp)
        model = work / "model"  # our own copy: its path tells our engines from anyone else's
        shutil.copytree(build_tiny_model(), model)
        (work / "count_env.py").write_text(textwrap.dedent(ENV))
        base = run(work, model, iterations=args.iterations, kills=0)
        killed = run(work, model, iterations=args.iterations, kills=args.kills)
    result = {"iterations": args.iterations, "samples_per_iteration": BATCH * N, "cpus": os.cpu_count(),
              "without_kills": base, "with_kills": killed}
    print(json.dumps(result, indent=1))
    results = ROOT / "bench" / "results"
    (results / "engine_kill.json").write_text(json.dumps(result, indent=1) + "\n")
    k = killed
    lines = [
        "# Engine kills during training",
        "",
        f"`python bench/engine_kill.py --iterations {args.iterations} --kills {args.kills}`: `agentrl train`, two "
        f"embedded engines behind sglang-router, each an actor-owned process; {BATCH} prompts x {N} samples x 4 "
        f"turns per iteration; a SIGKILL 0.3 s into a rollout, once the previous victim is back, alternating "
        f"engines. {os.cpu_count()}-core CPU machine.",
        "",
        "| figure | without kills | with kills |",
        "|---|---|---|",
    ]
    for key in ("kills", "restarts", "rejoined", "time_to_rejoin_s", "samples_expected", "samples_completed",
                "samples_lost", "samples_duplicated", "samples_with_stale_tokens", "requests_retried",
                "groups_retried", "samples_per_s", "loop_s"):
        lines.append(f"| {key} | {base[key]} | {k[key]} |")
    ratio = k["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else 0
    lines += ["", f"Throughput with kills: {ratio:.2f}x the run without (one engine serves while the other "
              "restarts; the restart is the engine process's start: Python, torch, the model)."]
    (results / "engine_kill.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
