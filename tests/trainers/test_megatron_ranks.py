"""`agentrl train --trainer megatron --tensor-model-parallel-size 2 --actor-num-gpus-per-node 2` on CPU:
two TrainerWorker actors (gloo ranks, the CPU shim applied in each: megatron_cpu_shim.child_env),
one per bundle, driven by the loop as one trainer.

- The 2-rank run's engine, after each weight sync, samples with the logprobs the trainer
  recomputes (`train_rollout_logprob_abs_diff`): rank 0 posted the TP-gathered weights.
- The TP=1 single-actor trainer replaying the same rollouts (`--debug-train-only`) gives the
  same loss and grad norm, iteration by iteration (the engine samples with one RNG over
  batches formed by arrival, so two runs with engines need not draw the same rollouts).
- The distributed checkpoint the two ranks saved resumes on two ranks at the saved iteration,
  and the resumed trainer agrees with the engines that loaded the checkpoint's HF copy."""

import json
import subprocess
from pathlib import Path

import pytest

import megatron_cpu_shim
from spine_helpers import agentrl_cli, run_env

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
COMMON = ["--env", "target-token", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size",
          "4", "--rollout-max-response-len", "8", "--no-progress", "--trainer", "megatron", "--max-tokens-per-gpu",
          "256", "--lr", "1e-3", "--seed", "3", "--num-rollout", "2", "--entropy-coef", "0.01"]  # a loss that is not ~0
TP2 = [*COMMON, "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]


def train(*args):
    env = megatron_cpu_shim.child_env(run_env())
    proc = subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_two_megatron_ranks_match_one_and_resume(tmp_path):
    two, one, resumed = tmp_path / "tp2", tmp_path / "tp1", tmp_path / "resumed"
    train(*TP2, "--save-interval", "1", "--output-dir", str(two))
    a = rows(two)
    assert [r["rollout_id"] for r in a] == [0, 1]
    assert all(r["weight_sync_mb"] > 0 for r in a)
    # iteration 1 was sampled under the weights rank 0 synced after iteration 0's step
    assert a[1]["train_rollout_logprob_abs_diff"] < 1e-4, a[1]

    train(*COMMON, "--tensor-model-parallel-size", "1", "--debug-train-only", "--load-debug-rollout-data", str(two),
          "--output-dir", str(one))
    b = rows(one)
    for ra, rb in zip(a, b, strict=True):
        print(f"iteration {ra['rollout_id']}: loss {ra['loss']:.7f} (TP=2, 2 ranks) vs {rb['loss']:.7f} (TP=1); "
              f"grad norm {ra['grad_norm']:.7f} vs {rb['grad_norm']:.7f}; logprob diff "
              f"{ra['train_rollout_logprob_abs_diff']:.1e} vs {rb['train_rollout_logprob_abs_diff']:.1e}")
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "train_rollout_logprob_abs_diff"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), key

    ckpt = two / "checkpoints" / "iter_000001"
    assert (ckpt / "megatron").is_dir() and (ckpt / "megatron" / "rng_rank00001.pt").exists()
    proc = train(*TP2, "--load", str(ckpt), "--output-dir", str(resumed))
    assert "resumed from" in proc.stderr
    c = rows(resumed)
    assert [r["rollout_id"] for r in c] == [1]
    assert c[0]["train_rollout_logprob_abs_diff"] < 1e-4, c[0]


@pytest.mark.e2e
def test_two_megatron_ranks_sync_a_lora_adapter(tmp_path):
    """--lora-sync adapter with TP=2: writing the adapter gathers its TP shards, so both ranks take
    part (rank 0 alone would wait in the gather forever); so does the export of the modules trained
    whole (--lora-trainable-modules auto: the tiny model's embeddings, split over TP, and final
    norm), sent by the full-weight path in the same sync; the engine serves the adapter on policy."""
    out = tmp_path / "lora_tp2"
    train(*TP2, "--lora-rank", "4", "--lora-alpha", "8", "--lora-sync", "adapter", "--lr", "1e-2",
          "--output-dir", str(out))
    a = rows(out)
    assert [r["rollout_id"] for r in a] == [0, 1]
    assert all("weight_sync_save_s" in r for r in a), a
    assert all(r["weight_sync_modules_mb"] > 0 for r in a), a
    # iteration 1 was sampled with the adapter synced after iteration 0's step
    assert a[1]["train_rollout_logprob_abs_diff"] < 1e-4, a[1]
