"""Synchronous vs asynchronous training on equal work: the same tasks, the same per-task
episode lengths, the same episode-length distribution of the samples trained.

    python bench/async_vs_sync.py [--iterations 12] [--configs sync,async,...] [--keep DIR]
    python bench/async_vs_sync.py --gpu --model DIR [AGENTRL TRAIN FLAGS...]     (two GPUs; see below)

The env's tasks have long-tailed lengths: in every block of 20 consecutive tasks, 16 end
after 1 turn, 3 after 4 and 1 after 12 (a seeded shuffle inside the block). A turn is always
16 tokens (--rollout-ignore-eos). The length is a function of the prompt alone (its task
index), not of the reset seed, and the k-th group launched gets the k-th task in every run.

Each configuration trains 8 groups x 4 samples per iteration with the default tiny model on
the CPU (engine and trainer share the machine's cores). From the trajectories each run
saves, the bench recomputes what was trained: the batch less the samples --max-staleness
drops (checked against metrics.jsonl's stale_dropped). Timings are summed iteration_s
(start-up excluded) without iteration 0 (--warmup), whose first training step sets itself up; its
samples count as trained. Per run:

- at_target: the first iterations that trained as many samples as the sync run: the trained
  samples' turns histogram and mean, which is "equal work" when the mean is within
  MEAN_TOLERANCE and the histogram within TV_TOLERANCE (total variation) of the sync run's;
  wall time and samples/s.
- cover_sync_tasks: the first iterations that trained every task the sync run trained (and
  maybe more): an upper bound on the time the sync run's work took.
- drops and staleness as metrics.jsonl reports them, and each trained sample's lag (policy
  versions between its oldest token's and the one it was trained at).

A configuration's equal-work speedup is the sync time over its at_target time when its
trained turns match, else over its cover_sync_tasks time (a lower bound). The sync run also
gives rollout_s and train_s (+ weight_sync_s) per iteration and the ideal overlap speedup
sum(iteration_s) / sum(max(rollout_s, train_s + weight_sync_s)): the most that hiding one
behind the other can give. Configurations that keep groups in flight across iterations
(over-sampling) run twice the iterations, so that their stragglers can finish. sync and
async run a second time at the end (--repeat): the machine is shared, their times are
averaged.

Two failures are retried once with the next --seed (the runs' work does not depend on it):
--partial-rollout runs can stop with a TemplateDriftError (a generation resumed after a
weight update is decoded in pieces: a character split across the pieces does not re-render
the same), and a run whose engine served another agentrl run too is thrown away (see
contamination()). Every run uses one --seed, by default drawn from the process id.
Writes bench/results/async_vs_sync.json, rewritten after every run.

--gpu: the same env and analysis where rollout and training have devices of their own, which
the CPU cannot give (there the engine and the trainer share the same cores). Every run is
`agentrl train --device cuda --dtype bfloat16 --trainer megatron --rollout-engine sglang` on two
GPUs without --colocate: the trainer on one, one SGLang engine on the other, weights over NCCL.
Flags the bench does not know pass through to every run: --model DIR and the SGLang flags (the
GPU kit's: --sglang-attention-backend triton --sglang-sampling-backend pytorch
--sglang-grammar-backend none). Its defaults differ: 20 groups x 8 samples per iteration (a
batch of 20 consecutive tasks is one BLOCK, so every sync batch waits for one 12-turn episode),
10 iterations (each run starts its own SGLang engine, about a minute: three runs fit one
10-minute device call), configurations sync, async, async+over40 (over-sampling at twice the
batch, as async+over16 is on the CPU), no repeats (the machine is not shared), 2 untimed
iterations (the first steps compile kernels), and the results go to
bench/results/async_vs_sync_gpu.json.
--deadline-s bounds the whole bench: each run gets the time left (then SIGTERM), and one that
the left time cannot even start (the sync run's start-up and shut-down) is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

ENV = textwrap.dedent('''
    import random
    import agentrl

    BLOCK = [1] * 16 + [4] * 3 + [12]  # per 20 tasks: 80% 1 turn, 15% 4 turns, 5% 12 turns


    def task_turns(index: int) -> int:
        """Episode length of task `index`: a seeded shuffle of BLOCK per block of 20 tasks."""
        block = list(BLOCK)
        random.Random(f"block-{index // len(BLOCK)}").shuffle(block)
        return block[index % len(BLOCK)]


    @agentrl.register_env("long-tail")
    class LongTail(agentrl.Env):
        """Episode length (turns) is a function of the prompt (its task index), not of the seed."""
        max_turns = 12

        @classmethod
        def dataset(cls, seed=0, **kw):
            index = 0
            while True:
                yield {"prompt": f"keep talking, task {index}"}
                index += 1

        def reset(self, *, seed=None, options=None):
            prompt = options["prompt"]
            self.turns, self.t = task_turns(int(prompt.rsplit(" ", 1)[1])), 0
            return prompt, {}

        def step(self, action):
            self.t += 1
            done = self.t >= self.turns
            return "go on", (len(action) % 5) / 4 if done else 0.0, done, False, {}
''')

BATCH_GROUPS, GROUP_SIZE = 8, 4  # --gpu: 20 x 8 (GPU_DEFAULTS)
WARMUP = 1  # iterations left out of every timing (the first training step sets itself up); --gpu: 2
MEAN_TOLERANCE = 0.02  # relative difference of the trained samples' mean turns that still counts as equal work
TV_TOLERANCE = 0.02  # total variation distance between the trained turns histograms that still counts
ATTEMPTS = 2  # a failed run is tried once more with the next --seed (see above)

# name -> (extra flags of `agentrl train`, iterations as a multiple of --iterations)
CONFIGS = {
    "sync": ([], 1),
    "async": (["--async"], 1),
    "async+partial": (["--async", "--partial-rollout"], 1),
    "async+over16": (["--async", "--over-sampling-batch-size", "16"], 2),
    "async+over16+partial": (["--async", "--over-sampling-batch-size", "16", "--partial-rollout"], 2),
    "async+over16+stale2": (["--async", "--over-sampling-batch-size", "16", "--max-staleness", "2"], 2),
    # --gpu's batch of 20 groups: over-sampling at twice the batch, as over16 is for the CPU's 8
    "async+over40": (["--async", "--over-sampling-batch-size", "40"], 2),
    "async+over40+partial": (["--async", "--over-sampling-batch-size", "40", "--partial-rollout"], 2),
}
CPU_CONFIGS = ["sync", "async", "async+partial", "async+over16", "async+over16+partial", "async+over16+stale2"]
# Rollout and training on GPUs of their own: one SGLang engine (one GPU left by the trainer's one,
# no --colocate) and Megatron; --model and the SGLang flags come from the command line.
GPU_FLAGS = ["--device", "cuda", "--dtype", "bfloat16", "--trainer", "megatron", "--rollout-engine", "sglang"]
GPU_DEFAULTS = dict(iterations=10, batch_groups=20, group_size=8, configs="sync,async,async+over40", repeat="",
                    warmup=2, out=Path(__file__).parent / "results" / "async_vs_sync_gpu.json")
CPU_DEFAULTS = dict(iterations=12, batch_groups=BATCH_GROUPS, group_size=GROUP_SIZE, configs=",".join(CPU_CONFIGS),
                    repeat="sync,async", warmup=WARMUP,
                    out=Path(__file__).parent / "results" / "async_vs_sync.json")


def train(out: Path, env_file: Path, iterations: int, extra: list[str], seed: int, *, batch_groups: int,
          group_size: int, timeout_s: float) -> str | None:
    """One `agentrl train` run; None, or the last line of its error. Its console goes to OUT.log
    (the last lines are printed when it fails: an unattended GPU run has nothing else to show)."""
    # `python -m agentrl.cli` rather than the script beside sys.executable: the GPU kit installs
    # agentrl into a --target folder, whose scripts are not there
    args = [sys.executable, "-m", "agentrl.cli", "train", "--env", "long-tail", "--env-module", str(env_file),
            "--num-rollout", str(iterations), "--rollout-batch-size", str(batch_groups),
            "--n-samples-per-prompt", str(group_size), "--global-batch-size", str(batch_groups * group_size),
            "--rollout-max-response-len", "1000", "--rollout-max-tokens-per-turn", "16", "--rollout-ignore-eos",
            "--seed", str(seed), "--no-progress", "--output-dir", str(out), *extra]
    log, late = out.with_name(out.name + ".log"), False
    with open(log, "w") as console, subprocess.Popen(args, stdout=console, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # SIGTERM first: agentrl then stops its engines and Ray
            proc.terminate()
            try:
                _, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            stderr, late = stderr + f"\nstopped after {timeout_s:.0f} s (--deadline-s)", True
        console.write(stderr)
    if proc.returncode or late:
        print(f"--- {log.name}, last lines:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]),
              flush=True)
        return (stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1][:400]
    return None


def read_run(out: Path, staleness: int | None) -> dict:
    """Per iteration: its times and the samples it trained (task, turns, lag), from metrics.jsonl
    and the saved trajectories."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    iterations, not_trained = [], Counter()
    for row in rows:
        version = row["policy_version"] - 1  # metrics.jsonl logs the version after the step; it trained this one
        path = out / "trajectories" / f"rollout_{row['rollout_id']:05d}.jsonl"
        trained, stale = [], 0
        for s in map(json.loads, path.read_text().splitlines()):
            if s["metadata"].get("attempt_failed"):
                not_trained["failed_attempt"] += 1
                continue
            versions = [v for v in s["policy_versions"] if v >= 0]
            lag = version - min(versions) if versions else 0
            if staleness is not None and lag > staleness:
                stale += 1
            elif s["status"] in ("failed", "aborted"):
                not_trained[s["status"]] += 1
            else:
                task = int(re.search(r"task (\d+)", s["prompt_text"]).group(1))
                trained.append((task, s["num_turns"], lag))
        assert stale == row.get("stale_dropped", 0), \
            f"iteration {row['rollout_id']}: {stale} stale samples, metrics.jsonl says {row.get('stale_dropped')}"
        not_trained["stale"] += stale
        iterations.append({"trained": trained, "iteration_s": row["iteration_s"], "rollout_s": row["rollout_s"],
                           "train_s": row["train_s"], "sync_s": row.get("weight_sync_s", 0.0),
                           "turn_s": row.get("generate_s_mean", 0.0),
                           "batch_turns_mean": row["turns_mean"], "batch_samples": row["num_samples"]})
    drops = {k: sum(r.get(k, 0) for r in rows) for k in sorted(set().union(*rows))
             if k.startswith("dropped_") or k in ("stale_dropped", "groups_retried", "trajectories_failed",
                                                  "status_aborted", "status_failed")}
    facts = json.loads((out / "run.json").read_text())
    return {"iterations": iterations, "not_trained": dict(not_trained), "metrics_drops": drops,
            "groups_in_flight_at_end": rows[-1].get("groups_in_flight"),
            # where trainer and engines ran, and the weight syncs made over NCCL (--gpu: every one)
            "placement": facts.get("placement"), "weight_syncs_nccl": sum(r.get("weight_sync_nccl") == 1.0 for r in rows)}


def histogram(samples: list[tuple]) -> dict[int, int]:
    return dict(sorted(Counter(turns for _, turns, _ in samples).items()))


def mean_turns(samples: list[tuple]) -> float:
    return sum(turns for _, turns, _ in samples) / max(len(samples), 1)


def tv_distance(a: dict, b: dict) -> float:
    na, nb = sum(a.values()) or 1, sum(b.values()) or 1
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def summarize(run: dict, *, target: int, reference: dict | None, sync_tasks: set[int], warmup: int) -> dict:
    """at_target: the first iterations that trained `target` samples (the sync run's, iteration 0
    included); their trained turns against the sync run's; their time and samples/s without
    the first `warmup` iterations. cover_sync_tasks: the first iterations that trained every task the sync run
    trained, timed the same way."""
    its = run["iterations"]
    samples, k = [], len(its)
    for i, it in enumerate(its):
        samples += it["trained"]
        if len(samples) >= target:
            k = i + 1
            break
    window = its[warmup:k]
    seconds = sum(it["iteration_s"] for it in window)
    timed_samples = sum(len(it["trained"]) for it in window)
    hist = histogram(samples)
    at_target = {"reached": len(samples) >= target, "iterations": k, "samples": len(samples),
                 "timed_samples": timed_samples, "seconds": round(seconds, 2),
                 "samples_per_s": round(timed_samples / seconds, 2), "turns_hist": hist,
                 "turns_mean": round(mean_turns(samples), 3),
                 "batches_with_12_turns": sum(any(t == 12 for _, t, _ in it["trained"]) for it in its[:k]),
                 **{k_: round(sum(it[k_] for it in window), 2) for k_ in ("rollout_s", "train_s", "sync_s")}}
    if reference is not None:
        tv = tv_distance(hist, reference["turns_hist"])
        mean_diff = abs(at_target["turns_mean"] - reference["turns_mean"]) / reference["turns_mean"]
        at_target |= {"tv_distance": round(tv, 4), "mean_rel_diff": round(mean_diff, 4),
                      "equal_work": at_target["reached"] and tv <= TV_TOLERANCE and mean_diff <= MEAN_TOLERANCE}
    done, cover = set(), None
    for i, it in enumerate(its):
        done |= {task for task, _, _ in it["trained"]}
        if sync_tasks <= done:
            upto = its[:i + 1]
            cover = {"iterations": i + 1, "seconds": round(sum(x["iteration_s"] for x in upto[warmup:]), 2),
                     "samples": sum(len(x["trained"]) for x in upto),
                     "turns_mean": round(mean_turns([s for x in upto for s in x["trained"]]), 3)}
            break
    all_trained = [s for it in its for s in it["trained"]]
    return {
        "at_target": at_target,
        "cover_sync_tasks": cover,
        "iterations_run": len(its),
        "all_iterations": {"samples": len(all_trained), "turns_hist": histogram(all_trained),
                           "turns_mean": round(mean_turns(all_trained), 3),
                           "batch_turns_mean": round(sum(it["batch_turns_mean"] * it["batch_samples"] for it in its)
                                                     / sum(it["batch_samples"] for it in its), 3)},
        "lag_hist": dict(sorted(Counter(lag for _, _, lag in all_trained).items())),
        "not_trained": run["not_trained"], "metrics_drops": run["metrics_drops"],
        "groups_in_flight_at_end": run["groups_in_flight_at_end"],
        "placement": run["placement"], "weight_syncs_nccl": run["weight_syncs_nccl"],
        "per_iteration": [{"trained": len(it["trained"]), "turns_max": max((t for _, t, _ in it["trained"]), default=0),
                           **{k_: round(it[k_], 3) for k_ in ("iteration_s", "rollout_s", "train_s", "sync_s")}}
                          for it in its],
    }


def overlap_bound(run: dict, warmup: int) -> dict:
    """From the sync run: what overlapping rollout with training could give at best."""
    timed = run["iterations"][warmup:]
    total = sum(it["iteration_s"] for it in timed)
    best = sum(max(it["rollout_s"], it["train_s"] + it["sync_s"]) for it in timed)
    return {"rollout_s": round(sum(it["rollout_s"] for it in timed), 2),
            "train_s": round(sum(it["train_s"] for it in timed), 2),
            "weight_sync_s": round(sum(it["sync_s"] for it in timed), 2),
            "iteration_s": round(total, 2), "ideal_overlap_speedup": round(total / best, 3),
            "turn_s_mean": round(sum(it["turn_s"] for it in timed) / len(timed), 3)}  # one generation call


def contamination(out: Path, iterations: int) -> str | None:
    """Why a run's engine was not its own alone, or None: a restart, or weight updates the run
    did not push (then its samples carry versions it never trained). Concurrent agentrl runs
    with the same --seed pick the same engine port (agentrl.engines.launch.free_port draws from
    the `random` module that --seed seeds) and can end up sharing one engine."""
    events = out / "logs" / "engine_events.jsonl"
    if events.exists() and events.read_text().strip():
        return "engine events: " + "; ".join(json.loads(x)["event"] for x in events.read_text().splitlines())[:300]
    log = out / "logs" / "engine.log"
    if not log.exists():  # SGLang (--gpu): no such log line, and runs there are never concurrent
        return None
    updates = log.read_text().count("weights updated")
    if updates != iterations:
        return f"the engine got {updates} weight updates for {iterations} iterations"
    return None


def base(name: str) -> str:
    return name.split("#")[0]


def analyze(runs: dict, names: list[str]) -> tuple[dict, dict]:
    """Per configuration run so far: its runs' mean times against the sync runs' mean; the headline."""
    ok = {n: r for n, r in runs.items() if "at_target" in r}
    sync_seconds = [r["at_target"]["seconds"] for n, r in ok.items() if base(n) == "sync"]
    sync_mean = sum(sync_seconds) / len(sync_seconds)
    configs = {}
    for name in dict.fromkeys(base(n) for n in names if n in runs):
        mine = [r for n, r in ok.items() if base(n) == name]
        if not mine:
            configs[name] = {"failed": [f for n, r in runs.items() if base(n) == name for f in r["failed_attempts"]]}
            continue
        seconds = [r["at_target"]["seconds"] for r in mine]
        covers = [r["cover_sync_tasks"]["seconds"] for r in mine if r["cover_sync_tasks"]]
        c = configs[name] = {
            "at_target_seconds": seconds, "samples": mine[0]["at_target"]["samples"],
            "samples_per_s": round(sum(r["at_target"]["samples_per_s"] for r in mine) / len(mine), 2),
            "turns_mean": mine[0]["at_target"]["turns_mean"],
            # summed over the timed iterations: rollout_s is what the loop waited for its batch
            **{k: round(sum(r["at_target"][k] for r in mine) / len(mine), 2)
               for k in ("rollout_s", "train_s", "sync_s")},
            "equal_work": all(r["at_target"].get("equal_work", True) for r in mine),
            "speedup_at_target": round(sync_mean / (sum(seconds) / len(seconds)), 3),
            "speedup_cover_sync_tasks": round(sync_mean / (sum(covers) / len(covers)), 3) if len(covers) == len(mine)
            else None}
        # equal work: at the target when the trained turns match; else, a lower bound, until all of sync's tasks trained
        c["equal_work_speedup"] = c["speedup_at_target"] if c["equal_work"] else c["speedup_cover_sync_tasks"]
    bound = runs["sync"]["overlap_bound"]
    rivals = {n: c for n, c in configs.items() if n != "sync" and c.get("equal_work_speedup")}
    best = max(rivals, key=lambda n: rivals[n]["equal_work_speedup"], default=None)
    headline = {"best": best, "equal_work_speedup": rivals[best]["equal_work_speedup"] if best else None,
                "measured_as": None if best is None else "at_target" if rivals[best]["equal_work"]
                else "cover_sync_tasks (a lower bound: it trained more than the sync run)",
                "sync_seconds": sync_seconds, "best_seconds": rivals[best]["at_target_seconds"] if best else None,
                "sync_samples_per_s": configs["sync"]["samples_per_s"],
                "best_samples_per_s": rivals[best]["samples_per_s"] if best else None,
                "ideal_overlap_speedup": bound["ideal_overlap_speedup"], "goal": 2.0}
    return configs, headline


def gpu_names() -> list[str]:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Flags the bench does not know pass through to every `agentrl train`.")
    parser.add_argument("--gpu", action="store_true",
                        help="rollout and training on two GPUs (SGLang, Megatron; see the docstring); give --model DIR")
    parser.add_argument("--iterations", type=int, help="iterations of the sync run (default 12; --gpu 10)")
    parser.add_argument("--configs", help=f"comma-separated, sync first: {', '.join(CONFIGS)} "
                                          f"(default: {CPU_DEFAULTS['configs']}; --gpu: {GPU_DEFAULTS['configs']})")
    parser.add_argument("--repeat", help="configurations run a second time at the end (their times are averaged); "
                                         "'' for none (default: sync,async; --gpu: none)")
    parser.add_argument("--batch-groups", type=int, help="groups per iteration (default 8; --gpu 20)")
    parser.add_argument("--group-size", type=int, help="samples per group (default 4; --gpu 8)")
    parser.add_argument("--warmup", type=int, help="first iterations left out of the timings (default 1; --gpu 2)")
    parser.add_argument("--deadline-s", type=float, help="seconds the whole bench may take (default: no bound)")
    parser.add_argument("--seed", type=int, default=None,
                        help="--seed of every run (default: from the process id; see contamination())")
    parser.add_argument("--keep", type=Path, help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="results (default: bench/results/async_vs_sync.json; "
                                                 "--gpu: bench/results/async_vs_sync_gpu.json)")
    args, passthrough = parser.parse_known_args()
    for key, value in (GPU_DEFAULTS if args.gpu else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = args.configs.split(",") + [f"{n}#2" for n in args.repeat.split(",") if n]
    if names[0] != "sync" or any(base(n) not in CONFIGS for n in names):
        parser.error(f"--configs: sync first, then any of {', '.join(CONFIGS)}")
    common = (GPU_FLAGS if args.gpu else []) + passthrough
    seed = args.seed if args.seed is not None else 10_000 + os.getpid() % 50_000
    deadline = time.monotonic() + (args.deadline_s if args.deadline_s is not None else 10 * 24 * 3600)
    runs, started, min_left = {}, time.time(), 0.0

    def write() -> tuple[dict, dict]:  # after every run: a bench stopped later still leaves its figures
        configs, headline = analyze(runs, names) if "at_target" in runs.get("sync", {}) else ({}, {})
        args.out.parent.mkdir(exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "bench/async_vs_sync.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)), "cpus": os.cpu_count(),
            **({"gpus": gpu_names(), "train_flags": common} if args.gpu else {}),
            "batch": {"groups": args.batch_groups, "group_size": args.group_size, "tokens_per_turn": 16},
            "tolerance": {"mean_rel": MEAN_TOLERANCE, "tv": TV_TOLERANCE}, "warmup_iterations": args.warmup,
            "headline": headline, "configs": configs, "runs": runs}, indent=1) + "\n")
        return configs, headline

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        env_file = root / "long_tail.py"
        env_file.write_text(ENV)
        reference, target, sync_tasks = None, 0, set()
        for name in names:
            flags, scale = CONFIGS[base(name)]
            staleness = int(flags[flags.index("--max-staleness") + 1]) if "--max-staleness" in flags else None
            failures = []
            for attempt in range(ATTEMPTS):
                left = deadline - time.monotonic()
                if left < max(min_left, 1):  # it could not even start and stop in the time left
                    error = f"not run: {left:.0f} s left of --deadline-s" + (
                        f", the sync run spent {min_left - 30:.0f} s outside its iterations" if min_left else "")
                    failures.append({"seed": None, "error": error})
                    break
                out = root / f"{name}-{attempt}"
                load, t0 = os.getloadavg()[0], time.perf_counter()
                error = train(out, env_file, args.iterations * scale, common + flags, seed=seed + attempt,
                              batch_groups=args.batch_groups, group_size=args.group_size, timeout_s=left)
                error = error or contamination(out, args.iterations * scale)
                if error is None:
                    break
                failures.append({"seed": seed + attempt, "error": error})
                print(f"{name}: run failed (seed {seed + attempt}): {error}", flush=True)
            if error is not None:
                runs[name] = {"flags": flags, "failed_attempts": failures}
                if name == "sync":  # nothing to compare with
                    write()
                    sys.exit(f"the sync run failed: {error}")
                write()
                continue
            run = read_run(out, staleness)
            if name == "sync":
                target = sum(len(it["trained"]) for it in run["iterations"])
                sync_tasks = {task for it in run["iterations"] for task, _, _ in it["trained"]}
            wall = time.perf_counter() - t0
            r = runs[name] = {"flags": flags, "seed": seed + len(failures), "failed_attempts": failures,
                              "run_wall_s": round(wall, 1),
                              # start-up and shut-down (engines, Ray, the trainer, the last checkpoint)
                              "outside_iterations_s": round(wall - sum(it["iteration_s"] for it in run["iterations"]), 1),
                              "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
                              **summarize(run, target=target, reference=reference, sync_tasks=sync_tasks,
                                          warmup=args.warmup)}
            if name == "sync":
                reference = r["at_target"]
                r["overlap_bound"] = overlap_bound(run, args.warmup)
                min_left = r["outside_iterations_s"] + 30
            a = r["at_target"]
            print(f"{name:22s} {a['samples_per_s']:6.2f} samples/s  {a['timed_samples']} samples in "
                  f"{a['seconds']:6.2f} s  "
                  f"turns {a['turns_hist']} mean {a['turns_mean']}"
                  + (f"  equal work {a['equal_work']}" if "equal_work" in a else "")
                  + f"  not trained {r['not_trained']}  lag {r['lag_hist']}  load {r['load_avg_1m']}"
                  + f"  run {r['run_wall_s']} s ({r['outside_iterations_s']} s outside iterations)", flush=True)
            write()

    configs, headline = write()
    bound = runs["sync"]["overlap_bound"]
    print(f"sync: rollout {bound['rollout_s']} s + train {bound['train_s']} s + weight sync {bound['weight_sync_s']} s "
          f"in {bound['iteration_s']} s of iterations: ideal overlap speedup {bound['ideal_overlap_speedup']}x; "
          f"sync to the target: {headline['sync_seconds']} s (rollout {configs['sync']['rollout_s']} s, train "
          f"{configs['sync']['train_s']} s: the runs' mean); one generation call {bound['turn_s_mean']} s")
    for n, c in configs.items():
        if n == "sync":
            continue
        if "failed" in c:
            print(f"{n:22s} failed: {c['failed'][-1]['error'][:200]}")
            continue
        cover = c["speedup_cover_sync_tasks"]
        print(f"{n:22s} {c['speedup_at_target']:.2f}x at the target ({c['at_target_seconds']} s; rollout wait "
              f"{c['rollout_s']} s, train {c['train_s']} s)"
              + ("" if c["equal_work"] else f" NOT equal work (mean turns {c['turns_mean']})")
              + (f", {cover:.2f}x to train all of sync's tasks" if cover else ", never trained all of sync's tasks"))
    print(f"headline (equal work): {headline['best']} {headline['equal_work_speedup']}x ({headline['measured_as']}); "
          f"goal 2x; ideal overlap {bound['ideal_overlap_speedup']}x" if headline["best"] else
          "headline (equal work): no configuration to compare with the sync run")


if __name__ == "__main__":
    main()
