"""What a run leaves behind: metrics.jsonl, tensorboard events (and a wandb run with
--use-wandb), trajectories/*.jsonl, a PNG plot of reward and response length per iteration,
and run.json (RunContext: the facts config.yaml cannot hold)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from agentrl.types import Sample


class RunContext:
    """run.json, beside config.yaml: what the run found and decided as it started (the device
    'auto' became, the model folder it loaded, where engines and trainer sit and why, the
    sandbox backend) and how it ended. config.yaml stays exactly the config that was given, so
    `--config config.yaml` reproduces the run; run.json says what that config met here."""

    def __init__(self, output_dir: Path):
        from agentrl import __version__

        self.path = output_dir / "run.json"
        self._lock = threading.Lock()  # the driver's set-up thread records too
        self.facts: dict = {"agentrl": __version__, "command": sys.argv, "host": platform.node(), "pid": os.getpid(),
                            "python": platform.python_version(), "started_at": _now()}
        self.record()

    def record(self, **facts) -> None:
        """Add facts and rewrite the file (atomically: a reader never sees half of it)."""
        with self._lock:
            self.facts.update(facts)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.facts, indent=1, default=str) + "\n")
            tmp.replace(self.path)

    def end(self, outcome: str) -> None:
        self.record(ended_at=_now(), outcome=outcome)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def process_started_at() -> float:
    """When this process was created (epoch seconds): the command's start, before Python's imports."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil, or a platform it cannot read: from here on
        return time.time()


class Timeline:
    """The run's start-up and stop, step by step: when each step began and ended, in seconds
    since the command started (the process's creation, so Python's imports count), into
    run.json ("startup", "stop") as [start, end] pairs, and a line on the console per part.
    Steps may overlap (they run in parallel: engines, trainer, data set-up); `mark` records a
    moment (the first rollout request). Thread-safe: the data set-up runs in a thread."""

    def __init__(self, context: RunContext, note: Callable[[str], None] | None = None,
                 started_at: float | None = None):
        self.context, self.note = context, note
        self.started_at = process_started_at() if started_at is None else started_at
        self.parts: dict[str, dict] = {"startup": {}, "stop": {}}
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.time() - self.started_at

    def add(self, part: str, name: str, start: float, end: float | None = None) -> None:
        """A step of `part` from `start` to `end` (seconds since the command; None: a moment)."""
        with self._lock:
            self.parts.setdefault(part, {})[name] = round(start, 2) if end is None else [round(start, 2), round(end, 2)]
            self.context.record(**{part: dict(self.parts[part])})

    def mark(self, part: str, name: str, at: float | None = None) -> None:
        """A moment of `part`: `at` in epoch seconds (None: now)."""
        self.add(part, name, (time.time() if at is None else at) - self.started_at)

    @contextlib.contextmanager
    def step(self, part: str, name: str):
        start = self.now()
        try:
            yield
        finally:
            self.add(part, name, start, self.now())

    def summary(self, part: str) -> str:
        """'start-up: ray 2.1-5.0s, engines 5.0-41.2s, ...' in the order the steps began."""
        items = sorted(self.parts.get(part, {}).items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1])
        words = [f"{k} {v[0]:.1f}-{v[1]:.1f}s" if isinstance(v, list) else f"{k} at {v:.1f}s" for k, v in items]
        return f"{part}: " + ", ".join(words)

    def report(self, part: str) -> None:
        if self.note is not None:
            self.note(self.summary(part) + " (seconds since the command started; run.json has them)")


# SGLang's start-up log lines (`[YYYY-MM-DD HH:MM:SS TP0] message`) that begin and end its own
# steps: step -> (first line's words, last line's words)
# SGLang 0.5.15 captures prefill CUDA graphs (58 token counts: 29-35 s on a 1x H200, 2026-12-03),
# then decode ones ("Capture target prefill / decode CUDA graph begin"); earlier ones decode graphs
# alone ("Capture cuda graph begin")
SGLANG_STEPS = {"weights": ("Load weight begin", "Load weight end"),
                "kv_cache": ("Load weight end", ("KV Cache is allocated", "Memory pool end")),
                "prefill_graphs": ("prefill CUDA graph begin", "prefill CUDA graph end"),
                "cuda_graphs": (("decode CUDA graph begin", "Capture cuda graph begin"),
                                ("decode CUDA graph end", "Capture cuda graph end")),
                "warmup": (("decode CUDA graph end", "Capture cuda graph end"), "The server is fired up")}
_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?: TP(\d+))?[^\]]*\]\s*(.*)")


def triton_cache_kernels() -> int | None:
    """How many compiled kernels Triton's on-disk cache holds (TRITON_CACHE_DIR, else
    ~/.triton/cache; one folder each). A machine's first SGLang start with the triton attention
    backend compiles its kernels there while it captures its CUDA graphs; later starts find them:
    the count before and after the engines start tells a cold machine's start-up from a warm one's.
    None: no cache."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return sum(1 for _ in folder.iterdir())
    except OSError:
        return None


def engine_log_steps(log_dir: Path, since: float = 0.0) -> dict[str, tuple[float, float]]:
    """Each SGLang engine's start-up steps from its log (logs/sglang-N.log): {"sglang-N/weights":
    (start, end), ...} in epoch seconds (the log's local time, one-second resolution), first
    matching lines of TP rank 0 stamped at or after `since` (epoch: an earlier run's lines in a
    reused folder are older). Nothing for an engine whose log lacks them (the embedded one)."""
    from datetime import datetime as dt

    out = {}
    for path in sorted(Path(log_dir).glob("sglang-*.log")):
        seen: dict[str, float] = {}
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_TIME.match(line)
            if m and m.group(2) in (None, "0"):
                for words in {w for pair in SGLANG_STEPS.values() for end in pair
                              for w in (end if isinstance(end, tuple) else (end,))}:
                    if words in m.group(3) and words not in seen:
                        stamp = dt.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                        if stamp >= since - 1:  # one-second stamps
                            seen[words] = stamp

        def at(words):
            return next((seen[w] for w in (words if isinstance(words, tuple) else (words,)) if w in seen), None)

        for step, (begin, end) in SGLANG_STEPS.items():
            if at(begin) is not None and at(end) is not None:
                out[f"{path.stem}/{step}"] = (at(begin), at(end))
    return out


STAGE_KEYS = ("slot_wait_s", "build_env_s", "reset_s", "prompt_s", "gate_wait_s", "generate_s", "decode_s", "env_s",
              "render_s", "close_s", "reward_s")
# the stages that run on the event loop itself (synchronous Python): while one runs, no other
# trajectory sends or reads anything
LOOP_STAGES = ("build_env_s", "prompt_s", "decode_s", "render_s")


def rollout_stage_metrics(samples: list[Sample], start_at: float, end_at: float) -> dict[str, float]:
    """Where one rollout phase's time went (the gap to a bare client driving the same engine,
    stage by stage). `start_at`/`end_at`: the phase's start and end, epoch seconds. Keys:
    - stage/first_request_after_s: from the phase's start to its first /generate (the
      --colocate switch and the ramp-up before any request is out; negative under --async,
      whose batch was generated ahead, during the previous training step);
    - stage/after_last_reply_s: from the last reply to the batch handed over (scoring, the
      last env steps, the batch's assembly); stage/requests_span_s: between the two;
    - stage/<stage>_mean: seconds a trajectory spent in each stage (STAGE_KEYS: the queue for a
      --max-concurrency slot, env build/reset/step/close, prompt rendering, the weight-update
      gate, /generate round trips (client + router + engine), decoding the reply, rendering and
      tokenizing the next turn, the reward function);
    - stage/loop_busy_frac: the event loop's share of requests_span_s spent in our own
      synchronous work (LOOP_STAGES summed over trajectories): near 1, the loop is what paces
      the requests;
    - stage/critical_*: the trajectory that replied last, its round trips and the rest of its
      time (what the phase's end waited for)."""
    timed = [s.metadata["stages"] for s in samples if "first_request_at" in s.metadata.get("stages", {})]
    if not timed:
        return {}
    first = min(t["first_request_at"] for t in timed)
    last = max(t["last_reply_at"] for t in timed)
    span = max(last - first, 1e-9)
    out = {"stage/first_request_after_s": first - start_at, "stage/after_last_reply_s": end_at - last,
           "stage/requests_span_s": last - first, "stage/requests": float(sum(t.get("requests", 0) for t in timed))}
    for key in STAGE_KEYS:
        out[f"stage/{key[:-2]}_s_mean"] = sum(t.get(key, 0.0) for t in timed) / len(timed)
    out["stage/loop_busy_frac"] = sum(t.get(k, 0.0) for t in timed for k in LOOP_STAGES) / span
    critical = max(timed, key=lambda t: t["last_reply_at"])
    out["stage/critical_generate_s"] = critical.get("generate_s", 0.0)
    out["stage/critical_other_s"] = critical["last_reply_at"] - critical["first_request_at"] - critical.get("generate_s", 0.0)
    out["stage/critical_first_request_after_s"] = critical["first_request_at"] - start_at
    return out


class RunLog:
    """`wandb_run` (from `start_wandb`), if given, gets the same scalars as tensorboard."""

    def __init__(self, output_dir: Path, tokenizer=None, wandb_run=None):
        self.dir = output_dir
        self.wandb = wandb_run
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "trajectories").mkdir(exist_ok=True)
        self.tokenizer = tokenizer
        self._metrics = open(self.dir / "metrics.jsonl", "a")
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.dir / "tensorboard"))

    def log(self, metrics: dict) -> None:
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        step = metrics["rollout_id"]
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "rollout_id"}
        for key, value in scalars.items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def save_trajectories(self, rollout_id: int, samples: list[Sample]) -> None:
        write_trajectories(self.dir / "trajectories" / f"rollout_{rollout_id:05d}.jsonl", samples, self.tokenizer)

    def save_eval_trajectories(self, name: str, rollout_id: int, samples: list[Sample]) -> None:
        """trajectories/eval_<name>_NNNNN.jsonl: one eval set's samples after iteration NNNNN."""
        write_trajectories(eval_trajectories_path(self.dir, name, rollout_id), samples, self.tokenizer)

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = read_metrics(self.dir / "metrics.jsonl")
        xs = [r["rollout_id"] for r in rows]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(xs, [r["reward_mean"] for r in rows], marker="o")
        a.set(title="reward (mean)", xlabel="iteration")
        b.plot(xs, [r["response_len_mean"] for r in rows], marker="o", color="tab:orange")
        b.set(title="response length (tokens, mean)", xlabel="iteration")
        fig.tight_layout()
        path = self.dir / "reward.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self._metrics.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_trajectories(path: Path, samples: list[Sample], tokenizer=None) -> None:
    """One `Sample.to_dict()` row per line, with the decoded prompt and response for reading; a
    VLM's images once, in `images` (the messages' image parts say "images[k]")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for s in samples:
            row = s.to_dict()
            if s.images:  # each image once: the messages' image parts name it in `images`
                from agentrl.vision import image_refs

                row["messages"] = image_refs(row["messages"], s.images)
            if tokenizer is not None:
                row["prompt_text"] = tokenizer.decode(s.prompt_tokens)
                row["response_text"] = tokenizer.decode(s.response_tokens)
            f.write(json.dumps(row) + "\n")


def eval_trajectories_path(run_dir: Path, name: str, rollout_id: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "eval"
    return run_dir / "trajectories" / f"eval_{safe}_{rollout_id:05d}.jsonl"


def start_wandb(run_cfg, config: dict, output_dir: Path):
    """--use-wandb: a wandb run in --wandb-mode (default: online when WANDB_API_KEY is set, else
    offline, which needs no network; `wandb sync` uploads an offline run later), writing under
    --wandb-dir/wandb/ (default: the run folder). None without --use-wandb."""
    if not run_cfg.use_wandb:
        return None
    import wandb

    mode = run_cfg.wandb_mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    folder = Path(run_cfg.wandb_dir or output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=run_cfg.wandb_project, group=run_cfg.wandb_group, name=output_dir.name, mode=mode,
                      dir=str(folder), config=config,
                      settings=wandb.Settings(console="off", silent=True, disable_git=True, x_save_requirements=False))


def read_metrics(path: Path) -> list[dict]:
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["rollout_id"]] = row  # a resumed run may repeat an iteration: keep the last
    return [rows[k] for k in sorted(rows)]
