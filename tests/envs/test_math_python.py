"""math-python: a python tool over MCP (in a sandbox when one is available), a \\boxed{} answer."""

from __future__ import annotations

import pytest

import agentrl
from agentrl.envs.math_python import MathPythonEnv

from envtest_helpers import assert_iteration_ok, episode, sandbox_backend_or_skip, tool_call, train_one_iteration

TASK = {"prompt": "Ravi has 17 boxes with 23 coins in each. How many coins?", "label": "391", "metadata": {}}


def call(code: str) -> str:
    return tool_call("python", code=code)


def _episode(env, actions):
    return episode(env, actions, TASK)


def test_tool_call_then_correct_answer(run_async):
    env = agentrl.make("math-python", sandbox=None)  # host process: the test's own code only
    (obs, info), computed, final = run_async(_episode(env, [
        "I will compute it. " + call("boxes = 17\nboxes * 23"),
        "The tool says 391, so the answer is \\boxed{391}.",
    ]))
    assert obs[0]["role"] == "system" and "python" in obs[0]["content"]
    assert obs[1] == {"role": "user", "content": TASK["prompt"] + "\n\nPut the final answer in \\boxed{}."}
    assert [t["function"]["name"] for t in info["tools"]] == ["python"]
    assert computed[0] == [{"role": "tool", "name": "python", "content": "391", "tool_call_id": "call_0"}]
    assert computed[1:4] == (0.0, False, False)
    assert final[:4] == ([], 1.0, True, False) and final[4]["tool_calls"] == 1


def test_wrong_answer_and_malformed_tool_call(run_async):
    env = MathPythonEnv(sandbox=None)
    _, bad_call, error, wrong = run_async(_episode(env, [
        '<tool_call>{"name": "python", "arguments": {"code": </tool_call>',
        call("1/0"),
        "\\boxed{390}",
    ]))
    assert bad_call[0][0]["role"] == "tool" and bad_call[0][0]["content"].startswith("Error")
    assert bad_call[1:3] == (0.0, False) and bad_call[4]["tool_errors"] == 1
    assert "ZeroDivisionError" in error[0][0]["content"] and error[2] is False
    assert wrong[1:3] == (0.0, True)
    env = MathPythonEnv(sandbox=None)
    _, no_box = run_async(_episode(env, ["391"]))
    assert no_box[1:3] == (0.0, True) and "boxed" in no_box[4]["error"]


def test_python_runs_in_a_sandbox(run_async):
    backend = sandbox_backend_or_skip("auto")
    env = MathPythonEnv(sandbox=backend)
    _, out, final = run_async(_episode(env, [call("import os\n(os.getcwd(), os.getuid(), 17 * 23)"),
                                             "\\boxed{391}"]))
    cwd, uid, value = eval(out[0][0]["content"])
    assert (cwd, value) == ("/work", 391) and uid != 0
    assert final[1] == 1.0


def test_dataset_is_the_math_problems():
    rows = list(MathPythonEnv.dataset(seed=2, n_problems=3))
    assert len(rows) == 3 and all(r["label"].lstrip("-").isdigit() for r in rows)


@pytest.mark.e2e
def test_train_one_iteration(tmp_path):
    sandbox_backend_or_skip("auto")
    out = tmp_path / "run"
    rows = train_one_iteration("math-python", out, "--rollout-max-response-len", "128",
                               "--rollout-max-tokens-per-turn", "64")
    assert_iteration_ok(out, rows)
