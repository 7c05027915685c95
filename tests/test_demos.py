"""`agentrl demos`: a scripted expert per built-in env, graded by the env itself at 1.0 (so every
env's grading path runs), written as `agentrl sft` reads it. The SFT check uses the real
SmolLM2 tokenizer and ChatML template: each trained span is exactly one assistant turn."""

import itertools
import json
import sys
from pathlib import Path

import pytest

from agentrl.config import DataConfig
from agentrl.demos import make_demos, math_steps, _run_steps
from agentrl.sft import load_sft_samples

sys.path.insert(0, str(Path(__file__).parent / "envs"))
from envtest_helpers import sandbox_backend_or_skip  # noqa: E402

N = {"target-token": 8, "math": 16, "math-python": 4, "search-r1": 16, "code": 4}


def env_kwargs(env: str) -> dict:
    if env == "math-python":
        return {"sandbox": None}  # the python tool as a host process: the scripted policy's own code only
    if env == "code":
        return {"sandbox": sandbox_backend_or_skip("auto")}  # agent and hidden tests in real sandboxes
    return {}


@pytest.mark.parametrize("env", list(N))
@pytest.mark.slow
def test_demonstrations_score_one_and_sft_reads_them(env, smollm2, tmp_path):
    from agentrl.models import load_tokenizer

    rows, failed = make_demos(env, N[env], env_kwargs=env_kwargs(env))
    assert failed == [] and len(rows) == N[env]
    assert all(r["reward"] == 1.0 and r["env"] == env for r in rows)
    if env in ("math-python", "code"):  # the tools were used and answered
        assert all(any(m["role"] == "tool" for m in r["messages"]) and r["tools"] for r in rows)
        assert not any("Error" in m["content"] for r in rows for m in r["messages"] if m["role"] == "tool")
    if env == "search-r1":
        assert all("<search>" in r["messages"][1]["content"] and "<information>" in r["messages"][2]["content"]
                   for r in rows)
        assert any(r["task"].get("hops") == 2 and len(r["messages"]) == 6 for r in rows)  # followed a bridge
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(smollm2)
    samples = load_sft_samples(DataConfig(prompt_data=str(path), input_key="messages"), tok)
    assert len(samples) == len(rows)
    for sample, row in zip(samples, rows):
        pairs = zip(sample.response_tokens, sample.loss_mask)  # the trained runs of tokens
        spans = [[t for t, _ in run] for trained, run in itertools.groupby(pairs, key=lambda p: p[1]) if trained]
        assert [tok.decode(s) for s in spans] == \
            [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]


def test_math_steps_recompute_every_kind_of_builtin_problem():
    from agentrl.envs.math_env import generate
    from agentrl.envs.math_env.problems import TEMPLATES

    kinds = set()
    for task in generate(seed=3, n=200):
        steps, result = math_steps(task)
        assert str(_run_steps(steps)[result]) == task["label"], task
        kinds.add(task["metadata"]["kind"])
    assert kinds == set(TEMPLATES)
    assert math_steps({"prompt": "What is 2 + 2?", "label": "4", "metadata": {}}) is None


@pytest.mark.e2e
def test_the_commands_chain(tmp_path, capsys):
    """agentrl demos -> agentrl sft (the default tiny model) -> a checkpoint."""
    from agentrl.cli import main

    out = tmp_path / "demos.jsonl"
    assert main(["demos", "--env", "search-r1", "--n", "4", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "search-r1: 4 demonstrations (reward 1.0)" in err
    assert "search-r1: 2/4 demonstrations, 0 not scored 1.0" in err  # progress as it goes
    assert len(out.read_text().splitlines()) == 4
    assert main(["sft", "--prompt-data", str(out), "--global-batch-size", "2", "--output-dir", str(tmp_path / "sft")]) == 0
    assert (tmp_path / "sft" / "checkpoints" / "iter_000002" / "model" / "config.json").exists()
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'nope'", the envs listed
        main(["demos", "--env", "nope", "--n", "1", "--out", str(out)])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_an_episode_that_raises_is_played_again_and_a_failing_env_stops_the_run_keeping_its_rows(
        tmp_path, monkeypatch, capsys):
    """Under load a sandboxed tool server can miss its start timeout (code and math-python demos on a busy
    2-core machine, 2026-12-07): that episode is played again, not the whole run lost; when the env's
    machinery keeps failing the run stops with DemosError, and the rows made so far are in the file."""
    import agentrl.demos as demos
    from agentrl.cli import main

    real_play, calls = demos.play, []

    async def flaky(env, task, policy, ctx):  # every other episode's first try raises
        calls.append(task["prompt"])
        if calls.count(task["prompt"]) == 1 and len(calls) % 2 == 0:
            await env.aclose()
            raise TimeoutError("MCP server 'builtin' did not start within 60 s")
        return await real_play(env, task, policy, ctx)

    monkeypatch.setattr(demos, "play", flaky)
    out = tmp_path / "demos.jsonl"
    rows, failed = make_demos("search-r1", 8, out=out)
    assert len(rows) == 8 and failed == []
    assert len(calls) > len(set(calls))  # some episodes were played twice
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows
    assert "an episode raised (try 1 of 3): TimeoutError: MCP server" in capsys.readouterr().err

    async def broken_after(env, task, policy, ctx):  # four episodes, then the machinery is down
        calls.append(task["prompt"])
        if len(calls) > 4:
            await env.aclose()
            raise OSError("docker: cannot connect")
        return await real_play(env, task, policy, ctx)

    calls.clear()
    monkeypatch.setattr(demos, "play", broken_after)
    assert main(["demos", "--env", "search-r1", "--n", "40", "--concurrency", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "episodes raised 3 times each (more than 3); the last: OSError: docker: cannot connect" in err
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert 1 <= len(kept) <= 4 and all(r["reward"] == 1.0 for r in kept)
    assert f"the {len(kept)} demonstrations made before it are in {out}" in err
    assert len(calls) == 4 + 3 * 4  # bounded: four failing episodes of three tries each, then the stop
