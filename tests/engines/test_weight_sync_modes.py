"""`--weight-sync-mode distributed|disk|delta` through `agentrl train`: each iteration's weights reach
both engines (a process group per engine, gloo on the CPU; an HF checkpoint they load; or the changed
bytes, applied to a local checkpoint they load), the engines then sample with exactly the trainer's
weights and label tokens with its version."""

import json
import subprocess

import pytest
import torch

from spine_helpers import agentrl_cli, run_env


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_weight_sync_modes_keep_engines_on_policy(tmp_path, mode):
    out = tmp_path / "run"
    proc = subprocess.run(
        [agentrl_cli(), "train", "--env", "target-token", "--num-rollout", "3", "--num-engines", "2",
         "--engine-num-threads", "1", "--weight-sync-mode", mode, "--lr", "3e-2", "--rollout-batch-size", "4",
         "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--no-progress", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=400, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for r in rows:
        # an engine that missed an update is counted in weight_sync_failed (update_engines)
        assert r["weight_sync_s"] > 0 and "weight_sync_failed" not in r, r
    # after a large step (lr 3e-2, ppo_kl > 0) the engines' logprobs still equal the trainer's
    assert rows[0]["ppo_kl"] >= 0 and max(abs(r["train_rollout_logprob_abs_diff"]) for r in rows) < 1e-4, rows
    for i in (1, 2):  # tokens of iteration i were sampled by policy version i, on both engines
        traj = [json.loads(x) for x in (out / "trajectories" / f"rollout_{i:05d}.jsonl").read_text().splitlines()]
        assert {v for t in traj for v in t["policy_versions"]} == {i}
    if mode == "disk":
        assert (out / "weight_sync" / "config.json").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_delta_sync_publishes_only_what_changed_and_engines_hold_the_trainers_weights(tmp_path, encoding):
    """--weight-sync-mode delta on two embedded engines (one local checkpoint: the first applies each
    version, the other finds it done). LoRA on q_proj only, merged: each version holds the q_proj
    weights alone, a small part of the checkpoint. Every version rebuilds the trainer's weights of
    that iteration bit for bit (its checkpoint, reloaded and exported as the sync exports them)."""
    from safetensors.torch import load_file

    from agentrl.build import build_trainer
    from agentrl.config import parse_config
    from agentrl.models import build_tiny_model
    from agentrl.weight_delta import apply_weight_delta

    out = tmp_path / "run"
    argv = ["--env", "target-token", "--num-rollout", "3", "--num-engines", "2", "--engine-num-threads", "1",
            "--weight-sync-mode", "delta", "--weight-delta-encoding", encoding, "--lora-rank", "8",
            "--target-modules", "q_proj", "--lora-trainable-modules", "none", "--rollout-batch-size", "4",
            "--entropy-coef", "0.01",  # a loss that moves the weights whatever the rewards
            "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--save-interval", "1", "--no-progress",
            "--output-dir", str(out)]
    proc = subprocess.run([agentrl_cli(), "train", *argv], capture_output=True, text=True, timeout=400, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["weight_sync_s"] > 0 and "weight_sync_failed" not in r, r
        assert 0 < r["weight_sync_delta_density"] < 0.15, r  # q_proj: ~7% of the tiny model's bytes
    assert max(abs(r["train_rollout_logprob_abs_diff"]) for r in rows) < 1e-4, rows
    full = (build_tiny_model() / "model.safetensors").stat().st_size
    cfg, _ = parse_config(argv)
    trainer = build_trainer(cfg, build_tiny_model(), "cpu")
    for k in (1, 2, 3):
        ckpt = out / "checkpoints" / f"iter_{k:06d}"
        version = json.loads((ckpt / "trainer_state.json").read_text())["version"]
        index = json.loads((out / "weight_delta" / f"weight_v{version:06d}" / "index.json").read_text())
        assert index["encoding"] == encoding and index["wire_bytes"] < full / 8, (index["wire_bytes"], full)
        assert {n.rsplit(".", 2)[-2] for n in index["tensors"]} == {"q_proj"}
        trainer.load(ckpt)
        apply_weight_delta(out / "weight_delta", tmp_path / "replay", version)
        got = load_file(tmp_path / "replay" / "model.safetensors")
        for name, t in trainer.named_tensors():
            assert torch.equal(got[name], t), (version, name)
    final = load_file(out / "weight_delta_local" / "model.safetensors")  # what the engines loaded last
    assert all(torch.equal(final[n], t) for n, t in load_file(tmp_path / "replay" / "model.safetensors").items())
