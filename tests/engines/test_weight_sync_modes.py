"""`--weight-sync-mode distributed|disk` through `agentrl train`: each iteration's weights reach
both engines (a process group per engine, gloo on the CPU; or an HF checkpoint they load),
the engines then sample with exactly the trainer's weights and label tokens with its version."""

import json
import subprocess
from pathlib import Path

import pytest

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
