"""A ToolEnv with the built-in servers (python, bash, files: real MCP servers over stdio on
the host), driven through `astep` with tool calls in the hermes format."""
import json
import time

import pytest

from agentrl.tools import ToolEnv
from tools_fixtures import arun  # noqa: F401 (fixtures)


def call(name, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class BuiltinEnv(ToolEnv):
    builtin_tools = ("python", "bash", "files")
    max_tool_output = 2000

    async def final_answer(self, action):
        return [], float("42" in action), True, False, {"answer": str(action)}


@pytest.fixture(scope="module")
def env(arun):
    env = BuiltinEnv(system_prompt="You are a tool user.")
    obs, info = arun(env.areset(options={"prompt": "compute"}))
    assert obs == [{"role": "system", "content": "You are a tool user."}, {"role": "user", "content": "compute"}]
    names = [t["function"]["name"] for t in info["tools"]]
    assert names == ["python", "bash", "read_file", "write_file", "list_files", "edit_file"]
    assert info["tools"][0]["type"] == "function" and "code" in info["tools"][0]["function"]["parameters"]["properties"]
    yield env
    arun(env.aclose())


def step(arun, env, action):
    obs, reward, terminated, truncated, info = arun(env.astep(action))
    return obs, reward, terminated, truncated, info


def test_python_state_persists_and_last_value(arun, env):
    obs, reward, term, trunc, info = step(arun, env, call("python", code="x = 20\nprint('set')\nx + 1"))
    assert (reward, term, trunc) == (0.0, False, False)
    assert obs == [{"role": "tool", "name": "python", "content": "set\n21", "tool_call_id": "call_0"}]
    obs, *_ = step(arun, env, call("python", code="def f(y):\n    return x * y\nf(2)"))
    assert obs[0]["content"] == "40"
    obs, *_ = step(arun, env, call("python", code="import sys\nprint('oops', file=sys.stderr)\n1/0"))
    assert "oops" in obs[0]["content"] and "ZeroDivisionError" in obs[0]["content"]
    obs, *_ = step(arun, env, call("python", code="x"))  # the error did not lose the state
    assert obs[0]["content"] == "20"


def test_python_timeout_restarts_interpreter_and_server_survives(arun, env):
    step(arun, env, call("python", code="keep = 1"))
    t0 = time.monotonic()
    obs, *_ = step(arun, env, call("python", code="import time\ntime.sleep(30)", timeout=1))
    assert time.monotonic() - t0 < 10
    assert obs[0]["content"].startswith("Error: TimeoutError") and "variables" in obs[0]["content"]
    obs, *_ = step(arun, env, call("python", code="print(1 + 1)"))
    assert obs[0]["content"] == "2"
    obs, *_ = step(arun, env, call("python", code="keep"))
    assert "NameError" in obs[0]["content"]


def test_bash_exit_code_output_and_timeout(arun, env):
    obs, *_ = step(arun, env, call("bash", command="echo out; echo err >&2; exit 3"))
    assert obs[0]["content"] == "out\nerr\n[exit code: 3]"
    obs, *_ = step(arun, env, call("bash", command="echo start; sleep 30", timeout=0.5))
    assert "start" in obs[0]["content"] and "timed out after 0.5 s" in obs[0]["content"]


def test_files_edit_and_errors(arun, env):
    obs, *_ = step(arun, env, call("write_file", path="src/a.py", content="a = 1\nb = 1\nb = 1\n"))
    assert "wrote" in obs[0]["content"]
    obs, *_ = step(arun, env, call("edit_file", path="src/a.py", old_string="b = 1", new_string="b = 2"))
    assert obs[0]["content"].startswith("Error:") and "found 2 times" in obs[0]["content"] \
        and "more context" in obs[0]["content"]
    obs, *_ = step(arun, env, call("edit_file", path="src/a.py", old_string="c = 1", new_string="c = 2"))
    assert "not found" in obs[0]["content"]
    obs, *_ = step(arun, env, call("edit_file", path="src/a.py", old_string="b = 1\nb = 1", new_string="b = 2"))
    assert obs[0]["content"].startswith("edited src/a.py")
    obs, *_ = step(arun, env, call("read_file", path="src/a.py"))
    assert obs[0]["content"] == "a = 1\nb = 2\n"
    obs, *_ = step(arun, env, call("read_file", path="../../etc/passwd"))
    assert "outside the working directory" in obs[0]["content"]
    obs, *_ = step(arun, env, call("read_file", path="src/nope.py"))
    assert "does not exist" in obs[0]["content"] and "a.py" in obs[0]["content"]
    obs, *_ = step(arun, env, call("list_files", path=".", recursive=True))
    assert "src/" in obs[0]["content"] and "src/a.py" in obs[0]["content"]
    # the python tool works in the same directory
    obs, *_ = step(arun, env, call("python", code="open('src/a.py').read().count('b')"))
    assert obs[0]["content"] == "1"


def test_model_mistakes_become_error_observations(arun, env):
    action = (call("pyhton", code="1") + call("python", cod="1") + call("python", code=5)
              + '<tool_call>{"name": "python", "arguments": {"code": "1"</tool_call>'
              + '<tool_call>{"arguments": {}}</tool_call>')
    obs, reward, term, trunc, info = step(arun, env, action)
    assert (term, info["tool_calls"], info["tool_errors"]) == (False, 5, 5)
    texts = [m["content"] for m in obs]
    assert all(t.startswith("Error:") for t in texts)
    assert "unknown tool 'pyhton'" in texts[0] and "Did you mean python" in texts[0]
    assert "'code' is a required property" in texts[1] and "python(code: string" in texts[1]
    assert "is not of type 'string'" in texts[2]
    assert "JSON is invalid" in texts[3]
    assert 'no "name"' in texts[4]


def test_too_many_calls_in_one_turn(arun, env):
    env.max_tool_calls_per_turn = 2
    try:
        obs, *_ = step(arun, env, call("python", code="1") * 5)
    finally:
        del env.max_tool_calls_per_turn
    assert [m["content"] for m in obs][:2] == ["1", "1"] and "at most 2 tool calls per turn" in obs[2]["content"]
    assert len(obs) == 3 and "3 more tool calls were not run" in obs[2]["content"]  # one message for the rest


def test_calls_of_one_turn_run_concurrently(arun, env):
    t0 = time.monotonic()
    obs, *_ = step(arun, env, call("bash", command="sleep 1; echo a") + call("bash", command="sleep 1; echo b"))
    elapsed = time.monotonic() - t0
    assert [m["content"] for m in obs] == ["a\n[exit code: 0]", "b\n[exit code: 0]"]
    assert elapsed < 1.8, f"two 1 s calls took {elapsed:.2f} s: not concurrent"


def test_long_output_is_truncated_with_a_note(arun, env):
    obs, *_ = step(arun, env, call("python", code="print('x' * 10000)"))
    text = obs[0]["content"]
    assert len(text) < 2300 and "characters truncated" in text and "the limit is 2000" in text


def test_no_tool_call_goes_to_final_answer(arun, env):
    obs, reward, term, trunc, info = step(arun, env, "The answer is 42.")
    assert (obs, reward, term, trunc, info) == ([], 1.0, True, False, {"answer": "The answer is 42."})
