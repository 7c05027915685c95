"""Evaluation during training: --eval-interval with several eval sets, pass@k, bad input."""

import json
import subprocess

import pytest

from agentrl.inspect import collect
from spine_helpers import agentrl_cli, run_env

pytestmark = pytest.mark.e2e  # the lane: runs agentrl end to end (docs/development.md, "Test lanes")

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--no-progress"]


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def train(*args):
    return subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=600, env=run_env())


def test_eval_sets_are_scored_every_interval_and_at_the_end(tmp_path):
    easy = tmp_path / "easy.jsonl"
    easy.write_text("".join(json.dumps({"prompt": f"Repeat the word: {w}", "label": w}) + "\n"
                            for w in ("the", "and", "of")))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "Repeat the word: in", "label": "in"}) + "\n")
    out = tmp_path / "run"
    proc = train("--num-rollout", "3", "--eval-interval", "2", "--eval-prompt-data", "easy", str(easy), "other",
                 str(other), "--n-samples-per-eval-prompt", "3", "--eval-temperature", "0.7", "--output-dir", str(out),
                 *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["rollout_id"] for r in rows if "eval/easy/reward_mean" in r]
    assert evaluated == [1, 2]  # every 2 iterations, and after the last
    # the starting model, before any training (slime's default), in iteration 0's row only
    assert [r["rollout_id"] for r in rows if "eval_before_train/easy/reward_mean" in r] == [0]
    before = lines(out / "trajectories" / "eval_easy_before_train_00000.jsonl")
    assert len(before) == 9 and all(v == -1 or v == 0 for r in before for v in r["policy_versions"])
    assert abs(sum(r["reward"] for r in before) / 9 - rows[0]["eval_before_train/easy/reward_mean"]) < 1e-9
    for r in rows[1:]:
        assert 0.0 <= r["eval/easy/reward_mean"] <= 1.0 and r["eval/easy/failed"] == 0
        assert "eval/easy/pass@3" in r and "eval/other/reward_mean" in r
    tb = list((out / "tensorboard").glob("events.*"))
    assert tb and b"eval/easy/reward_mean" in tb[0].read_bytes()
    # the eval trajectories are kept, in the rollouts' format, and the report lists them
    for it in (1, 2):
        easy = lines(out / "trajectories" / f"eval_easy_{it:05d}.jsonl")
        assert len(easy) == 9 and all(r["response_tokens"] and "response_text" in r for r in easy)
        mean = sum(r["reward"] for r in easy) / 9
        assert abs(mean - rows[it]["eval/easy/reward_mean"]) < 1e-9
        assert len(lines(out / "trajectories" / f"eval_other_{it:05d}.jsonl")) == 3
    assert [e["it"] for e in collect(out)["evals"]] == ["eval easy_before_train @0", "eval other_before_train @0",
                                                        "eval easy @1", "eval other @1", "eval easy @2",
                                                        "eval other @2"]
    assert "  eval easy " in proc.stderr  # the iteration's console line has the eval reward


def test_bad_eval_flags_are_named(tmp_path):
    proc = train("--eval-prompt-data", "x", "x.jsonl", "y", "--output-dir", str(tmp_path / "a"), *SMALL)
    assert proc.returncode == 2 and "NAME PATH pairs" in proc.stderr
    # one value is a path slime names 'aime'; the error names the flag and the set
    proc = train("--eval-prompt-data", "only-a-path", "--output-dir", str(tmp_path / "a"), *SMALL)
    assert proc.returncode == 2 and "--eval-prompt-data aime only-a-path: no such file" in proc.stderr
    proc = train("--eval-interval", "2", "--output-dir", str(tmp_path / "b"), *SMALL)
    assert proc.returncode == 2 and "--eval-prompt-data" in proc.stderr
    proc = train("--eval-interval", "1", "--eval-prompt-data", "x", str(tmp_path / "missing.jsonl"),
                 "--output-dir", str(tmp_path / "c"), *SMALL)
    assert proc.returncode == 2 and f"--eval-prompt-data x {tmp_path / 'missing.jsonl'}: no such file" in proc.stderr


def test_agentrl_eval_scores_a_checkpoint_without_training(tmp_path, tiny_model):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Repeat the word: {w}", "label": w}) + "\n" for w in ("the", "of")))
    out = tmp_path / "eval"
    proc = subprocess.run([agentrl_cli(), "eval", "--env", "target-token", "--model", str(tiny_model),
                           "--eval-prompt-data", "tt", str(data), "--n-samples-per-eval-prompt", "2",
                           "--output-dir", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    assert 0.0 <= result["eval/tt/reward_mean"] <= 1.0 and "eval/tt/pass@2" in result
    assert "eval/tt/reward_mean" in proc.stdout  # the summary table
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    assert len(lines(out / "trajectories" / "eval_tt_00000.jsonl")) == 4
    assert [e["total"] for e in collect(out)["evals"]] == [4]
    # the env's own tasks when no data is given
    proc = subprocess.run([agentrl_cli(), "eval", "--env", "target-token", "--eval-limit", "4",
                           "--output-dir", str(tmp_path / "own"), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/target-token/reward_mean" in json.loads((tmp_path / "own" / "eval.json").read_text())


def test_agentrl_eval_serves_the_judge_as_train_does(tmp_path, tiny_model):
    """`agentrl eval --rm-type llm-judge --judge-load PATH` starts the judge's engine group (embedded on
    the CPU) and every eval trajectory is scored by it. The tiny judge writes no 'SCORE: N' line, so
    each scores 0 with the judge's reason; without its engine group they would fail (no judge to ask)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Repeat the word: {w}", "label": w}) + "\n" for w in ("the", "of")))
    out = tmp_path / "eval"
    proc = subprocess.run([agentrl_cli(), "eval", "--env", "target-token", "--model", str(tiny_model),
                           "--eval-prompt-data", "tt", str(data), "--n-samples-per-eval-prompt", "2",
                           "--rm-type", "llm-judge", "--judge-load", str(tiny_model),
                           "--output-dir", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Unclosed client session" not in proc.stderr  # the judge's sessions are closed with the eval
    result = json.loads((out / "eval.json").read_text())
    assert result["eval/tt/failed"] == 0
    rows = lines(out / "trajectories" / "eval_tt_00000.jsonl")
    assert len(rows) == 4
    for r in rows:
        assert r["metadata"]["judge"]["reason"] == "judge reply has no 'SCORE: N' line", r["metadata"]["judge"]
        assert r["reward"] == 0.0
    assert (out / "logs" / "judge").is_dir()
