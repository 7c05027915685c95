"""bench/rollout_vs_bare.py on the CPU: a tiny multi-turn `agentrl train` run, then its rollout
requests rebuilt from the run folder and replayed against an embedded engine by the bench's bare
client (the GPU scenario: tests/gpu/test_rollout_gpu.py)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spine_helpers import agentrl_cli, run_env

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rollout_vs_bare.py"

# Episodes of 1, 2 or 3 turns (the task says how many); with 8 tokens a turn, the 24-token user
# turns between them and a 70-token budget, a third turn gets only the 6 tokens left.
TALK_ENV = BENCH.parent / "talk_env.py"  # registers "count-talk"


def load_bench():
    spec = importlib.util.spec_from_file_location("rollout_vs_bare", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def policy_runs(row: dict) -> list[tuple[int, int]]:
    """(start, length) of each run of policy tokens (mask 1) in prompt + response: one turn each here."""
    mask = [0] * len(row["prompt_tokens"]) + row["loss_mask"]
    runs, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


@pytest.mark.e2e
def test_bench_replays_a_multi_turn_run(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", "--env-module", str(TALK_ENV), "--env",
                           "count-talk", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "8", "--rollout-max-response-len", "70",
                           "--rollout-max-tokens-per-turn", "8", "--no-progress", "--output-dir", str(run)],
                          capture_output=True, text=True, timeout=300, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # the requests, rebuilt: each turn's input is the trajectory's tokens before that turn's policy
    # tokens (the engine's reported prompt length), and it asks for exactly those tokens
    bench = load_bench()
    turn_counts, turn_sizes = set(), set()
    for row in rows:
        saved = [json.loads(line) for line in
                 (run / "trajectories" / f"rollout_{row['rollout_id']:05d}.jsonl").read_text().splitlines()]
        batch = bench.load_batch(run, row)
        assert [t.id for t in batch] == [s["trajectory_id"] for s in saved]
        for t, s in zip(batch, saved):
            assert t.tokens == s["prompt_tokens"] + s["response_tokens"]
            assert t.turns == policy_runs(s)
            assert [length for length, _ in t.turns] == s["metadata"]["turn_prompt_tokens"]
            assert sum(n for _, n in t.turns) == sum(s["loss_mask"])
            assert len(t.turns) == s["num_turns"]
            turn_counts.add(len(t.turns))
            turn_sizes |= {n for _, n in t.turns[:2]}
            if len(t.turns) == 3:  # a third turn gets what is left of the budget (70 response tokens)
                assert t.turns[2][1] == 70 - (t.turns[2][0] - len(s["prompt_tokens"])) < 8, (t.turns, s["prompt_tokens"])
        assert sum(n for t in batch for _, n in t.turns) == row["generated_tokens"]
    assert turn_counts == {1, 2, 3}, turn_counts
    # --rollout-max-tokens-per-turn: no turn past 8; a turn is shorter only when the random model
    # samples its stop token early (CI saw a 7 once)
    assert max(turn_sizes) == 8 and turn_sizes <= set(range(1, 9)), turn_sizes

    # the bench, as a user runs it
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--run", str(run), "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=run_env())
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio (the run's rollout tok/s / the bare client's)" in proc.stdout
    report = json.loads(out.read_text())
    for key in ("run", "command", "train_command", "machine", "engine", "sampling_params", "max_concurrency",
                "iterations", "ratio_median", "ratio_without_switch_median", "iteration_0", "goal", "goal_met"):
        assert key in report, key
    assert str(BENCH) in report["command"] and report["engine"]["kind"] == "embedded"
    assert report["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    assert [it["rollout_id"] for it in report["iterations"]] == [0, 1]
    for it, row in zip(report["iterations"], rows):
        assert it["output_tokens"] == row["generated_tokens"]
        assert it["replayed_tokens"] == [row["generated_tokens"]] * 2  # what the engine generated, each repeat
        assert it["train_tokens_per_s"] == pytest.approx(row["generated_tokens"] / row["rollout_s"])  # the phase
        assert it["trajectories"] == 8 and it["requests"] == sum(len(t.turns) for t in bench.load_batch(run, row))
        b = it["bare_tokens_per_s"]
        assert 0 < b["min"] <= b["median"] <= b["max"] and len(b["all"]) == 2
        assert it["ratio"] > 0 and it["ratio_without_switch"] == pytest.approx(it["ratio"])  # not colocated
    assert report["ratio_median"] == pytest.approx(report["iterations"][1]["ratio"]) and report["ratio_median"] > 0
    assert report["iteration_0"]["ratio"] == pytest.approx(report["iterations"][0]["ratio"])


def test_a_folder_that_is_not_a_run_names_the_missing_file(tmp_path, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(sys, "argv", ["rollout_vs_bare.py", "--run", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert f"{tmp_path / 'metrics.jsonl'}: missing" in str(stopped.value.code)

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0, "rollout_s": 1.0, "generated_tokens": 5,
                                                        "num_samples": 1}) + "\n")
    with pytest.raises(bench.ReplayError, match=r"trajectories/rollout_00000\.jsonl: missing"):
        bench.run(["--run", str(tmp_path)])
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "rollout_00000.jsonl").write_text("{not json\n")
    with pytest.raises(bench.ReplayError, match=r"rollout_00000\.jsonl:1: not a saved trajectory"):
        bench.run(["--run", str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text('{"rollout_id": 0}\n')
    with pytest.raises(bench.ReplayError, match=r"metrics\.jsonl:1: not a metrics row .*rollout_s"):
        bench.run(["--run", str(tmp_path)])


@pytest.mark.slow
def test_rollout_gap_bench_prints_both_sides_against_the_stand_in(tmp_path):
    """bench/rollout_gap.py (issue 34 on the CPU), small: every side's requests span covers the
    stand-in's delay, and target-token's reset and step take no worker-thread queue (they did:
    0.05 s and 0.1 s a trajectory at 256)."""
    out = tmp_path / "gap.json"
    done = subprocess.run([sys.executable, str(BENCH.parent / "rollout_gap.py"), "--trajectories", "32", "--tokens",
                           "64", "--delay", "0.3", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ratio bare/agentrl span" in done.stdout
    report = json.loads(out.read_text())
    for side in ("bare", "agentrl", "threaded_env"):
        assert report["median"][side]["span_s"] >= 0.3, side
    ours = report["median"]["agentrl"]
    assert ours["reset"] < ours["generate"] / 10 and ours["env"] < ours["generate"] / 10
    assert set(report["ratio_span"]) == {"agentrl", "threaded_env"}
