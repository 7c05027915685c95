"""What a run leaves behind: metrics.jsonl, tensorboard events (and a wandb run with
--use-wandb), trajectories/*.jsonl, a PNG plot of reward and response length per iteration,
and run.json (RunContext: the facts config.yaml cannot hold)."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

from agentrl.types import Sample


class RunContext:
    """run.json, beside config.yaml: what the run found and decided as it started (the device
    'auto' became, the model folder it loaded, where engines and trainer sit and why, the
    sandbox backend) and how it ended. config.yaml stays exactly the config that was given, so
    `--config config.yaml` reproduces the run; run.json says what that config met here."""

    def __init__(self, output_dir: Path):
        from agentrl import __version__

        self.path = output_dir / "run.json"
        self.facts: dict = {"agentrl": __version__, "command": sys.argv, "host": platform.node(), "pid": os.getpid(),
                            "python": platform.python_version(), "started_at": _now()}
        self.record()

    def record(self, **facts) -> None:
        """Add facts and rewrite the file (atomically: a reader never sees half of it)."""
        self.facts.update(facts)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.facts, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def end(self, outcome: str) -> None:
        self.record(ended_at=_now(), outcome=outcome)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
    """One `Sample.to_dict()` row per line, with the decoded prompt and response for reading."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for s in samples:
            row = s.to_dict()
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
