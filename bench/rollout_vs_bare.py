"""The rollout phase of a finished `agentrl train` run against the same engine driven by a bare
client sending the same requests (issue 34's goal: the run's output tokens/s at least 0.95x; issue 16's was 0.9x).

    python bench/rollout_vs_bare.py --run RUN_DIR [--iterations 0,1,2] [--repeats 3] [--warmup 1] \
        [--out FILE.json] [--model DIR] [--rollout-engine sglang] [--num-engines N] [--use-router auto] \
        [--max-concurrency N] [--engine-url URL] [--sglang-ARG VALUE ...] [--router-ARG VALUE ...]

From the run folder: metrics.jsonl (each iteration's rollout_s, generated_tokens, tokens_per_s and
the --colocate switch's seconds), trajectories/rollout_NNNNN.jsonl (its first num_samples rows are
the batch those figures count; failed attempts follow them), config.yaml (the engines' arguments,
sampling, --max-concurrency) and run.json (the model folder the run loaded). Engine flags given
here override config.yaml's (or stand in for it when it is missing).

Each trajectory's requests are rebuilt from its saved tokens: request k of a trajectory sent
tokens[:P_k] (P_k: the prompt length the engine reported for that call, metadata
turn_prompt_tokens) and got the policy tokens (loss mask 1) that follow, up to the next request.
Without that metadata, each run of policy tokens is one request. The replayed tokens are the
ones metrics.jsonl counts (generated_tokens: the loss mask's 1s); a stop token that
agentrl took back before an env's continuation text, or tokens masked afterwards
(--mask-offpolicy-in-partial-rollout), are not replayed.

Engines start as `agentrl train` starts them (agentrl.engines.group.start_engines: the same
SGLang arguments, sglang-router in front when the run had one). Each selected iteration is then
sent `--repeats` times by one aiohttp session: every trajectory at once (at most the run's
--max-concurrency), its turns one after the other, each turn a plain POST /generate with the
run's temperature, top_p and top_k, max_new_tokens = the turn's token count and ignore_eos (so
the engine generates exactly that many: checked on every reply), return_logprob as agentrl
asks, and the trajectory id as the routing key (X-SMG-Routing-Key), as agentrl sends it. The
env's stop strings are not sent (they could end a turn early; target-token has none). Before each
replay the engines' prefix caches are flushed: a training iteration starts with an empty cache
too (a weight update or, colocated, the KV cache's release clears it). `--warmup` replays of the
first iteration to be replayed go first, untimed (kernels SGLang compiles on first use).

Output tokens/s of a replay = tokens generated / seconds from its first request to its last
reply. ratio = the run's tokens_per_s / the replay's (median of the repeats); the summary is the
median over iterations >= 1 (iteration 0 apart: the run's first batch pays one-time costs).
Colocated, the run's rollout_s also holds the GPU switch (colocate/offload_s, resume_s,
release_s, onload_s): ratio_without_switch takes it out, for understanding; the goal's figure is
`ratio`. Iterations >= 1 are replayed first, iteration 0 last, and the JSON report (--out; default
RUN_DIR/rollout_vs_bare.json) is rewritten after each iteration ("complete": false until the last),
so a bench stopped half-way keeps what it measured. Prints a table at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp
import orjson
import yaml

try:
    import agentrl  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.config import Config  # noqa: E402
from agentrl.data import iter_jsonl  # noqa: E402
from agentrl.rollout.client import ROUTING_KEY_HEADER  # noqa: E402
from agentrl.types import Sample  # noqa: E402

GOAL = 0.95  # issue 34
SWITCH_KEYS = ("colocate/offload_s", "colocate/resume_s", "colocate/release_s", "colocate/onload_s")


class ReplayError(Exception):
    """The run folder cannot be replayed, or the engine did not do what was asked."""


@dataclass
class Trajectory:
    id: str
    tokens: list[int]  # prompt + response, as saved
    turns: list[tuple[int, int]]  # per request: (input length: it sent tokens[:length], tokens it generated)


# -- the run folder ----------------------------------------------------------------------------

def turn_requests(sample: Sample) -> list[tuple[int, int]]:
    """(input length, policy tokens generated) of each /generate call the trajectory made."""
    mask = [0] * len(sample.prompt_tokens) + list(sample.loss_mask)

    def policy_run(start: int, end: int) -> int:
        n = 0
        while start + n < end and mask[start + n]:
            n += 1
        return n

    starts = sample.metadata.get("turn_prompt_tokens") or []
    ends = list(starts[1:]) + [len(mask)]
    if starts and all(0 < s <= e <= len(mask) for s, e in zip(starts, ends)):
        turns = [(s, policy_run(s, e)) for s, e in zip(starts, ends)]
        if sum(n for _, n in turns) == sample.num_trained_tokens:
            return [(s, n) for s, n in turns if n]  # a call that gave no kept token is not replayed
    turns, i = [], len(sample.prompt_tokens)  # no usable metadata: one request per run of policy tokens
    while i < len(mask):
        n = policy_run(i, len(mask))
        if n:
            turns.append((i, n))
        i += n or 1
    return turns


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ReplayError(f"{path}: missing ({run} is not the folder of a finished `agentrl train` run)")
    rows: dict[int, dict] = {}
    for lineno, row in iter_jsonl(path, ReplayError):
        lacks = [k for k in ("rollout_id", "rollout_s", "generated_tokens") if k not in row]
        if lacks:
            raise ReplayError(f"{path}:{lineno}: not a metrics row of agentrl train (no {', '.join(lacks)})")
        if not row.get("partial"):  # a stopped iteration's row: not a whole rollout phase
            rows[row["rollout_id"]] = row  # a resumed run may repeat an iteration: the last one counts
    if not rows:
        raise ReplayError(f"{path}: no complete iteration in it")
    return [rows[k] for k in sorted(rows)]


def load_batch(run: Path, row: dict) -> list[Trajectory]:
    """The trajectories metrics row `row` counts, with their requests (checked against its generated_tokens)."""
    path = run / "trajectories" / f"rollout_{row['rollout_id']:05d}.jsonl"
    if not path.is_file():
        raise ReplayError(f"{path}: missing (metrics.jsonl has iteration {row['rollout_id']})")
    lines = path.read_text().splitlines()
    n = row.get("num_samples", len(lines))
    if len(lines) < n:
        raise ReplayError(f"{path}: {len(lines)} trajectories, but metrics.jsonl says the batch had {n}")
    out = []
    for lineno, line in enumerate(lines[:n], 1):
        try:
            data = json.loads(line)
            if not data.get("prompt_tokens"):  # never reached the engine (its env could not be built, ...)
                continue
            sample = Sample.from_dict(data)
        except Exception as exc:
            raise ReplayError(f"{path}:{lineno}: not a saved trajectory: {exc}") from None
        out.append(Trajectory(sample.trajectory_id, sample.tokens, turn_requests(sample)))
    tokens = sum(n for t in out for _, n in t.turns)
    if tokens != row["generated_tokens"]:
        raise ReplayError(f"{path}: the batch's trajectories hold {tokens} policy tokens, metrics.jsonl's "
                          f"generated_tokens says {row['generated_tokens']}")
    return out


def run_config(run: Path, args) -> tuple[Config, str, str]:
    """(config with this command's overrides, model folder, device)."""
    path = run / "config.yaml"
    if path.is_file():
        try:
            cfg = Config.model_validate(yaml.safe_load(path.read_text()) or {})
        except Exception as exc:
            raise ReplayError(f"{path}: not a config this agentrl reads: {exc}") from None
    else:
        print(f"note: {path} is missing: the engine is what this command's flags say", flush=True)
        cfg = Config()
    rollout = {k: v for k, v in (("rollout_engine", args.rollout_engine), ("num_engines", args.num_engines),
                                 ("use_router", args.use_router), ("max_concurrency", args.max_concurrency))
               if v is not None}
    sglang_args, router_args = {**cfg.sglang_args, **args.sglang_args}, {**cfg.router_args, **args.router_args}
    if args.engine_url:  # attach: nothing launched, so no launch arguments
        rollout["rollout_engine_urls"], sglang_args = [args.engine_url], {}
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout), "sglang_args": sglang_args,
                                 "router_args": router_args})
    facts = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    model = args.model or facts.get("model_path") or cfg.model.model
    if model is None:  # the run used the built-in tiny model
        from agentrl.models import build_tiny_model

        model = str(build_tiny_model())
    if not Path(model).exists():
        raise ReplayError(f"model folder {model} (from {run / 'run.json'} or config.yaml) is not here: pass --model")
    device = facts.get("device") or ("cuda" if cfg.rollout.rollout_engine == "sglang" else "cpu")
    return cfg, str(model), device


def machine() -> dict:
    gpus = None
    if shutil.which("nvidia-smi"):
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True)
        gpus = [g.strip() for g in found.stdout.splitlines() if g.strip()] or None
    return {"host": platform.node(), "gpus": gpus, "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def sglang_capacity(log_dir: Path) -> dict:
    """Per SGLang engine log: its KV pool (tokens) and running-request limit, from its start-up line.
    The run's engine sized its pool beside the trainer (--colocate), the replay's alone: the same
    arguments can still give different pools, and a smaller one queues requests."""
    out = {}
    for path in sorted(log_dir.glob("sglang-*.log")):
        text = path.read_text(errors="replace")
        found = {key: int(hits[-1]) for key in ("max_total_num_tokens", "max_running_requests")
                 if (hits := re.findall(rf"{key}=(\d+)", text))}  # the last start (logs are appended to)
        if found:
            out[path.stem] = found
    return out


# -- the bare client ---------------------------------------------------------------------------

async def flush(session: aiohttp.ClientSession, url: str, notes: list[str], tries: int = 100) -> None:
    """Empties an engine's prefix cache. SGLang answers 400 while a request is still being wound
    down: tried again for ~20 s, then noted (a cached prompt changes little) rather than fatal."""
    for _ in range(tries):
        async with session.post(url + "/flush_cache", json={}) as resp:
            if resp.status == 200:
                return
            why = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        await asyncio.sleep(0.2)
    notes.append(f"POST {url}/flush_cache failed {tries} times ({why}): a replay started with a warm prefix cache")
    print(f"warning: {notes[-1]}", flush=True)


async def replay(session: aiohttp.ClientSession, url: str, engine_urls: list[str], batch: list[Trajectory],
                 sampling: dict, concurrency: int, notes: list[str]) -> tuple[float, int]:
    """One replay of a batch: (seconds from the first request to the last reply, tokens generated)."""
    for u in engine_urls:  # each replay starts with an empty prefix cache, as a training iteration does
        await flush(session, u, notes)
    slots = asyncio.Semaphore(concurrency)

    async def trajectory(t: Trajectory) -> int:
        generated = 0
        async with slots:
            for length, n in t.turns:  # a turn's request waits for the one before it, as in the agent loop
                payload = {"input_ids": t.tokens[:length], "return_logprob": True,
                           "sampling_params": {**sampling, "max_new_tokens": n, "ignore_eos": True}}
                async with session.post(url + "/generate", json=payload, headers={ROUTING_KEY_HEADER: t.id}) as resp:
                    if resp.status != 200:
                        raise ReplayError(f"POST {url}/generate: HTTP {resp.status}: {(await resp.text())[:300]}")
                    meta = (await resp.json(loads=orjson.loads, content_type=None))["meta_info"]
                got = int(meta["completion_tokens"])
                if got != n or len(meta.get("output_token_logprobs", [None] * n)) != n:
                    raise ReplayError(f"trajectory {t.id}: asked for {n} tokens after {length} (ignore_eos), the "
                                      f"engine generated {got} (finish_reason {meta.get('finish_reason')})")
                generated += got
        return generated

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[trajectory(t) for t in batch])
    return time.perf_counter() - t0, sum(counts)


async def replay_all(url: str, engine_urls: list[str], batches: dict[int, list[Trajectory]], *, sampling: dict,
                     concurrency: int, repeats: int, warmup: int, timeout_s: float, notes: list[str],
                     done: Callable[[int, list[tuple[float, int]]], None]) -> None:
    """Replays every batch `repeats` times; `done(rollout_id, [(seconds, tokens), ...])` after each batch."""
    # no connection limit of the client's own (aiohttp's default is 100): the concurrency bound
    # is the run's --max-concurrency, as in agentrl's EngineClient; JSON through orjson both ways,
    # as there (the standard library's would be client time agentrl does not spend)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     json_serialize=lambda value: orjson.dumps(value).decode()) as session:
        first = next(iter(batches))
        for i in range(warmup):
            seconds, _ = await replay(session, url, engine_urls, batches[first], sampling, concurrency, notes)
            print(f"warm-up {i + 1}/{warmup} (iteration {first}, untimed): {seconds:.2f} s", flush=True)
        for rollout_id, batch in batches.items():
            runs = []
            for k in range(repeats):
                seconds, tokens = await replay(session, url, engine_urls, batch, sampling, concurrency, notes)
                runs.append((seconds, tokens))
                print(f"iteration {rollout_id} replay {k + 1}/{repeats}: {tokens} tokens in {seconds:.3f} s, "
                      f"{tokens / seconds:.0f} tok/s", flush=True)
            done(rollout_id, runs)


# -- the report --------------------------------------------------------------------------------

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def iteration_report(row: dict, batch: list[Trajectory], replays: list[tuple[float, int]]) -> dict:
    tokens = row["generated_tokens"]
    rates = [t / s for s, t in replays]
    bare = statistics.median(rates)
    switch_s = sum(row.get(k, 0.0) for k in SWITCH_KEYS)
    train = tokens / row["rollout_s"]
    without = tokens / (row["rollout_s"] - switch_s) if row["rollout_s"] > switch_s else None
    return {
        "rollout_id": row["rollout_id"], "trajectories": len(batch), "requests": sum(len(t.turns) for t in batch),
        "output_tokens": tokens, "replayed_tokens": [t for _, t in replays],
        "train_rollout_s": row["rollout_s"], "train_tokens_per_s": train, "switch_s": switch_s,
        "train_tokens_per_s_without_switch": without,
        "bare_s": [s for s, _ in replays],
        "bare_tokens_per_s": {"median": bare, "min": min(rates), "max": max(rates), "all": rates},
        "ratio": train / bare, "ratio_without_switch": without / bare if without is not None else None,
    }


def print_table(report: dict) -> None:
    print("\niteration  tokens  requests  train s  switch s  train tok/s  bare tok/s: median [min, max]  "
          "ratio  without switch")
    for it in report["iterations"]:
        b, without = it["bare_tokens_per_s"], it["ratio_without_switch"]
        bare = f"{b['median']:.0f} [{b['min']:.0f}, {b['max']:.0f}]"
        print(f"{it['rollout_id']:>9} {it['output_tokens']:>7} {it['requests']:>9} {it['train_rollout_s']:>8.2f} "
              f"{it['switch_s']:>9.2f} {it['train_tokens_per_s']:>12.0f}  {bare:>29}  {it['ratio']:>5.3f}  "
              f"{'-' if without is None else f'{without:.3f}':>14}")
    r, first = report["ratio_median"], report["iteration_0"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print("ratio (the run's rollout tok/s / the bare client's), median over iterations >= 1: "
          + ("none replayed" if r is None else f"{r:.3f} (goal {GOAL}: {'met' if r >= GOAL else 'NOT met'})")
          + f"; without the colocate switch: {fmt(report['ratio_without_switch_median'])}; iteration 0: "
          + ("not replayed" if first is None else f"{fmt(first['ratio'])} ({fmt(first['ratio_without_switch'])} "
                                                  "without the switch)"), flush=True)


# -- the command -------------------------------------------------------------------------------

def iteration_ids(text: str) -> set[int]:
    return {int(x) for x in text.split(",") if x.strip()}


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="--sglang-ARG VALUE / --router-ARG VALUE override the run's own")
    p.add_argument("--run", required=True, help="the run folder (metrics.jsonl, trajectories/, config.yaml)")
    p.add_argument("--iterations", type=iteration_ids, help="comma-separated ids (default: every complete iteration)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed replays of the first selected iteration")
    p.add_argument("--out", help="JSON report (default RUN/rollout_vs_bare.json)")
    p.add_argument("--log-dir", help="engine logs (default RUN/replay_logs)")
    p.add_argument("--model", help="model folder (default: run.json's model_path)")
    p.add_argument("--rollout-engine", choices=["embedded", "sglang"])
    p.add_argument("--num-engines", type=int)
    p.add_argument("--use-router", choices=["auto", "always", "never"])
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--engine-url", help="attach to this running engine instead of starting one")
    args, rest = p.parse_known_args(argv)
    args.sglang_args, args.router_args = {}, {}
    i = 0
    while i < len(rest):  # --sglang-* / --router-* pass through, as `agentrl train` takes them
        arg = rest[i]
        prefix = next((x for x in ("--sglang-", "--router-") if arg.startswith(x)), None)
        if prefix is None:
            p.error(f"unknown argument {arg!r}")
        name, eq, value = arg[len(prefix):].partition("=")
        if not eq:
            value = None
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                value, i = rest[i + 1], i + 1
        (args.sglang_args if prefix == "--sglang-" else args.router_args)[name] = value
        i += 1
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def run(argv: list[str]) -> dict:
    """The whole bench; returns the report (also written to --out). ReplayError on bad input."""
    args = parse_args(argv)
    folder = Path(args.run)
    if not folder.is_dir():
        raise ReplayError(f"{folder}: not a folder")
    rows = read_metrics(folder)
    if args.iterations:
        wanted = args.iterations
        missing = wanted - {r["rollout_id"] for r in rows}
        if missing:
            raise ReplayError(f"{folder / 'metrics.jsonl'}: no complete iteration {sorted(missing)}")
        rows = [r for r in rows if r["rollout_id"] in wanted]
    batches = {r["rollout_id"]: load_batch(folder, r) for r in rows}  # every input checked before any engine starts
    cfg, model, device = run_config(folder, args)
    r = cfg.rollout
    sampling = {"temperature": r.rollout_temperature, "top_p": r.rollout_top_p, "top_k": r.rollout_top_k}
    notes: list[str] = []
    if r.async_rollout:
        notes.append("an --async run: its rollout phases overlapped training")
    if cfg.train.lora_rank and cfg.train.lora_sync == "adapter":
        notes.append("the run generated with LoRA adapters (--lora-sync adapter); the replay uses the base model")
    for note in notes:
        print(f"note: {note}", flush=True)

    from agentrl.engines.group import start_engines

    log_dir = Path(args.log_dir or folder / "replay_logs")
    out = Path(args.out or folder / "rollout_vs_bare.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting {r.rollout_engine if not r.rollout_engine_urls else 'attached'} engine(s) on {model} "
          f"(logs: {log_dir})", flush=True)
    t0 = time.perf_counter()
    group = start_engines(r, model_path=model, device=device, seed=cfg.run.seed, log_dir=log_dir,
                          sglang_args=cfg.sglang_args, router_args=cfg.router_args, dtype=cfg.model.dtype)
    facts = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    report = {
        "run": str(folder.resolve()), "command": shlex.join([sys.executable, str(Path(__file__).resolve()), *argv]),
        "train_command": facts.get("command"), "machine": machine(),
        "engine": {"kind": group.kind, "urls": group.engine_urls, "generate_url": group.url,
                   "router": group.router is not None, "model": model, "sglang_args": cfg.sglang_args,
                   "router_args": cfg.router_args, "start_s": time.perf_counter() - t0,
                   "capacity_run": sglang_capacity(folder / "logs"), "capacity_replay": sglang_capacity(log_dir)},
        "sampling_params": {**sampling, "ignore_eos": True}, "max_concurrency": r.max_concurrency,
        "repeats": args.repeats, "warmup": args.warmup, "goal": GOAL, "complete": False, "iterations": [],
        "notes": notes,
    }
    if report["engine"]["capacity_run"] != report["engine"]["capacity_replay"]:
        notes.append(f"SGLang's pool differs: the run's {report['engine']['capacity_run']}, the replay's "
                     f"{report['engine']['capacity_replay']} (--sglang-max-total-tokens pins it)")
        print(f"note: {notes[-1]}", flush=True)
    rows_by_id = {row["rollout_id"]: row for row in rows}

    def done(rollout_id: int, runs: list[tuple[float, int]]) -> None:
        # the report is rewritten after each iteration: a bench stopped half-way keeps what it measured
        report["iterations"] = sorted(report["iterations"] + [
            iteration_report(rows_by_id[rollout_id], batches[rollout_id], runs)], key=lambda it: it["rollout_id"])
        later = [it for it in report["iterations"] if it["rollout_id"] >= 1]
        first = next((it for it in report["iterations"] if it["rollout_id"] == 0), None)
        report["ratio_median"] = _median([it["ratio"] for it in later])
        report["ratio_without_switch_median"] = _median([it["ratio_without_switch"] for it in later
                                                         if it["ratio_without_switch"] is not None])
        report["iteration_0"] = first and {"ratio": first["ratio"], "ratio_without_switch":
                                           first["ratio_without_switch"]}
        report["goal_met"] = None if report["ratio_median"] is None else report["ratio_median"] >= GOAL
        report["complete"] = len(report["iterations"]) == len(batches)
        out.write_text(json.dumps(report, indent=1) + "\n")

    try:
        print(f"engine(s) up in {report['engine']['start_s']:.1f} s: /generate at {group.url}", flush=True)
        # iterations >= 1 first (the goal's figure), iteration 0 last
        order = {k: batches[k] for k in sorted(batches, key=lambda k: (k == 0, k))}
        asyncio.run(replay_all(group.url, group.engine_urls, order, sampling=sampling, concurrency=r.max_concurrency,
                               repeats=args.repeats, warmup=args.warmup, timeout_s=r.request_timeout_s, notes=notes,
                               done=done))
    finally:
        group.stop()
    print_table(report)
    print(f"wrote {out}", flush=True)
    return report


def main() -> None:
    try:
        run(sys.argv[1:])
    except ReplayError as exc:
        sys.exit(f"rollout_vs_bare: {exc}")


if __name__ == "__main__":
    main()
