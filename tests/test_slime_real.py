"""slime's own default `generate` (slime/rollout/sglang_rollout.py), unchanged, through
`agentrl train` for 2 iterations on the tiny model and the embedded engine.

Needs slime's source: set SLIME_SRC to a folder holding THUDM/slime's `slime/` package
(checked against commit 624b824), or have slime installed; its rm_hub imports pylatexenc.
Skipped otherwise (CI has no GitHub, so no slime): docs/slime.md lists what was verified."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from spine_helpers import agentrl_cli, run_env

SLIME_SRC = os.environ.get("SLIME_SRC")


def slime_env() -> dict | None:
    """The subprocess environment with slime importable, or None."""
    env = run_env()
    if SLIME_SRC:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [SLIME_SRC, env.get("PYTHONPATH")]))
    probe = subprocess.run([sys.executable, "-c", "import slime.rollout.sglang_rollout"],
                           env=env, capture_output=True, text=True, timeout=120)
    return env if probe.returncode == 0 else None


@pytest.fixture(scope="module")
def slime_run_env():
    if not SLIME_SRC and importlib.util.find_spec("slime") is None:
        pytest.skip("slime is not importable (set SLIME_SRC to THUDM/slime's source; CI has none)")
    found = slime_env()
    if found is None:
        pytest.skip("slime.rollout.sglang_rollout does not import here (missing slime dependencies)")
    return found


def train(env, out, *flags):
    proc = subprocess.run([agentrl_cli(), "train", *flags, "--num-rollout", "2", "--output-dir", str(out),
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                           "--rollout-max-response-len", "12", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_slimes_default_generate_trains(slime_run_env, tmp_path):
    out = tmp_path / "run"
    train(slime_run_env, out, "--custom-generate-function-path", "slime.rollout.sglang_rollout.generate")
    check_run(out)


def test_slimes_generate_rollout_with_an_rm_hub_math_reward(slime_run_env, tmp_path):
    """slime's own generate_rollout: its GenerateState, semaphore (concurrency x engines),
    async_rm with the row's rm_type "math" (rm_hub's grade_answer_verl), and its abort
    against the engine's /workers and /v1/loads."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a}+{b}? Answer in \\boxed{{}}.", "label": str(a + b),
                                        "metadata": {"rm_type": "math"}}) + "\n" for a, b in [(2, 3), (4, 4), (1, 6)]))
    out = tmp_path / "run"
    proc = train(slime_run_env, out, "--env", "math", "--prompt-data", str(data),
                 "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout")
    assert "404" not in proc.stderr  # slime's abort found /workers and /v1/loads
    rewards = check_run(out)
    assert all(r in (0, 1) for r in rewards)  # set by slime (generate_and_rm), so agentrl did not score


def check_run(out) -> list:
    """Two iterations; every trajectory's mask and logprobs cover its response; trained tokens
    carry the engine's logprobs and the iteration's weights. Returns the rewards."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == [0, 1] and metrics[0]["train_rollout_logprob_abs_diff"] < 1e-3
    rewards = []
    for it in (0, 1):
        for line in (out / "trajectories" / f"rollout_{it:05d}.jsonl").read_text().splitlines():
            t = json.loads(line)
            n = len(t["response_tokens"])
            assert n > 0 and len(t["loss_mask"]) == n == len(t["rollout_logprobs"])
            assert t["loss_mask"] == [1] * n  # one generate call: every token is the policy's
            assert all(lp < 0 for lp in t["rollout_logprobs"]) and set(t["policy_versions"]) == {it}
            rewards.append(t["reward"])
    return rewards
