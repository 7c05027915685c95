"""What a run leaves behind: metrics.jsonl, tensorboard events, trajectories/*.jsonl and a
PNG plot of reward and response length per iteration."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.types import Sample


class RunLog:
    def __init__(self, output_dir: Path, tokenizer=None):
        self.dir = output_dir
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
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "rollout_id":
                self.tb.add_scalar(key, value, step)
        self.tb.flush()

    def save_trajectories(self, rollout_id: int, samples: list[Sample]) -> None:
        with open(self.dir / "trajectories" / f"rollout_{rollout_id:05d}.jsonl", "w") as f:
            for s in samples:
                row = s.to_dict()
                if self.tokenizer is not None:
                    row["prompt_text"] = self.tokenizer.decode(s.prompt_tokens)
                    row["response_text"] = self.tokenizer.decode(s.response_tokens)
                f.write(json.dumps(row) + "\n")

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


def read_metrics(path: Path) -> list[dict]:
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["rollout_id"]] = row  # a resumed run may repeat an iteration: keep the last
    return [rows[k] for k in sorted(rows)]
