"""`agentrl train --trainer megatron` end to end on CPU (megatron_cpu_shim.child_env makes the
trainer, in its Ray actor, apply the CPU shim): rollouts from the embedded engine, Megatron training steps, weight sync of the
exported HF-named tensors into the engine every iteration, a distributed checkpoint, and a
resume from it at the same data position."""

import json
import subprocess
from pathlib import Path

import pytest

import megatron_cpu_shim
from spine_helpers import agentrl_cli, run_env

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
SMALL = ["--env", "target-token", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size",
         "8", "--rollout-max-response-len", "8", "--no-progress", "--trainer", "megatron",
         "--tensor-model-parallel-size", "1", "--max-tokens-per-gpu", "256", "--lr", "1e-3"]


def train(*args):
    env = megatron_cpu_shim.child_env(run_env())
    return subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=500, env=env)


def rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_train_loop_with_the_megatron_trainer_and_resume(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    proc = train("--num-rollout", "2", "--save-interval", "1", "--output-dir", str(a), *SMALL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = rows(a)
    assert [r["rollout_id"] for r in first] == [0, 1]
    assert first[-1]["weight_sync_mb"] > 0 and "grad_norm" in first[-1] and "loss" in first[-1]
    ckpt = a / "checkpoints" / "iter_000001"
    assert (ckpt / "megatron").is_dir() and (ckpt / "model" / "model.safetensors").exists()
    proc = train("--num-rollout", "2", "--load", str(ckpt), "--output-dir", str(b), *SMALL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    assert [r["rollout_id"] for r in rows(b)] == [1]
