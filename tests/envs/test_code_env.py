"""code: an agent in a sandbox writes solution.py with the files/bash/python tools; hidden tests
run in a fresh sandbox. Sandbox tests skip cleanly where no docker image / bubblewrap is there."""

from __future__ import annotations

import json
import os

import pytest

import agentrl
import agentrl.registry
from agentrl.envs.code_env import CodeEnv, normalize_task, read_tasks
from agentrl.envs.code_env.grader import grade_on_host, hidden_tests

from envtest_helpers import assert_iteration_ok, episode, sandbox_backend_or_skip, train_one_iteration
from envtest_helpers import tool_call as call

TASK = {"prompt": "Write `running_max(xs)`: the i-th element is max(xs[:i+1]).",
        "label": ["assert running_max([1, 3, 2, 5, 4]) == [1, 3, 3, 5, 5]", "assert running_max([]) == []",
                  "assert running_max([-2, -5, -1]) == [-2, -2, -1]", "assert running_max([7]) == [7]"],
        "metadata": {"entry_point": "running_max"}}
GOOD = ("def running_max(xs):\n    out, best = [], None\n    for x in xs:\n"
        "        best = x if best is None or x > best else best\n        out.append(best)\n    return out\n")
HALF = "def running_max(xs):\n    return list(xs)\n"  # right for [] and [7] only


def _episode(env, actions, task=TASK):
    return episode(env, actions, task)


@pytest.fixture(scope="module")
def backend():
    return sandbox_backend_or_skip("auto")


@pytest.mark.slow
def test_passing_solution(run_async, backend):
    env = agentrl.make("code", sandbox=backend)
    (obs, info), wrote, ran, final = run_async(_episode(env, [
        call("write_file", path="solution.py", content=GOOD),
        call("bash", command="python3 -c 'from solution import running_max; print(running_max([3, 1, 4]))'"),
        "Done: solution.py defines running_max.",
    ]))
    assert obs[0]["role"] == "system" and "solution.py" in obs[0]["content"]
    assert "Define `running_max` in solution.py." in obs[1]["content"]
    assert "assert running_max([1, 3, 2, 5, 4])" in obs[1]["content"]  # the first test, as an example
    assert {t["function"]["name"] for t in info["tools"]} >= {"python", "bash", "write_file", "read_file"}
    assert wrote[0][0]["role"] == "tool" and "solution.py" in wrote[0][0]["content"]
    assert ran[0][0]["content"].startswith("[3, 3, 4]") and ran[1:3] == (0.0, False)
    assert final[:4] == ([], 1.0, True, False)
    assert final[4]["passed"] == final[4]["total"] == 4 and final[4]["solution_from"] == "file"


@pytest.mark.slow
def test_failing_solution_partial_and_all_or_nothing(run_async, backend):
    env = CodeEnv(sandbox=backend)
    *_, final = run_async(_episode(env, [call("write_file", path="solution.py", content=HALF), "done"]))
    assert final[1] == 0.5 and (final[4]["passed"], final[4]["total"]) == (2, 4)
    assert any("AssertionError" in e for e in final[4]["test_errors"])
    strict = CodeEnv(sandbox=backend, all_or_nothing=True)
    *_, final = run_async(_episode(strict, [call("python", code=f"open('solution.py', 'w').write({HALF!r})"),
                                            "done"]))
    assert final[1] == 0.0 and final[4]["passed"] == 2


@pytest.mark.slow
def test_tampering_with_tests_scores_nothing(run_async, backend):
    """The agent plants test files and a solution that fakes a report / exits early / reads
    files it left behind: none of it reaches or fools the fresh grader sandbox."""
    tamper = "\n".join([
        "import os, sys, json",
        "for name in os.listdir('.'):",  # overwrite whatever looks like a test or the grader's input
        "    if name not in ('solution.py', 'answers.json'):",
        "        try: open(name, 'w').write('')",
        "        except OSError: pass",
        "open('tests.py', 'w').write('')",
        "if os.path.exists('answers.json'):",  # only in the agent's sandbox
        "    def running_max(xs): return json.load(open('answers.json'))[str(xs)]",
        "else:",
        "    print(json.dumps([{'passed': True}] * 4))",
        "    os._exit(0)",
    ]) + "\n"
    answers = {str(xs): out for xs, out in [([1, 3, 2, 5, 4], [1, 3, 3, 5, 5]), ([], []), ([-2, -5, -1], [-2, -2, -1]),
                                             ([7], [7])]}
    env = CodeEnv(sandbox=backend)
    *_, check, final = run_async(_episode(env, [
        call("write_file", path="tests.py", content="def test_all():\n    pass\n"),
        call("write_file", path="conftest.py", content="import pytest\n"),
        call("write_file", path="sitecustomize.py", content="import builtins\nbuiltins.AssertionError = Exception\n"),
        call("write_file", path="answers.json", content=json.dumps(answers)),
        call("write_file", path="solution.py", content=tamper),
        call("bash", command="python3 -c 'from solution import running_max; print(running_max([7]))'"),
        "All tests pass.",
    ]))
    assert check[0][0]["content"].startswith("[7]")  # in the agent's own sandbox the trick "works"
    assert final[1] == 0.0 and final[4]["passed"] == 0
    assert "did not load" in final[4]["error"]


@pytest.mark.slow
def test_no_solution_and_solution_in_message(run_async, backend):
    env = CodeEnv(sandbox=backend)
    _, final = run_async(_episode(env, ["I could not do it."]))
    assert final[:3] == ([], 0.0, True) and "no solution.py" in final[4]["error"]
    env = CodeEnv(sandbox=backend)
    _, final = run_async(_episode(env, [f"Here it is:\n```python\n{GOOD}```\n"]))
    assert final[1] == 1.0 and final[4]["solution_from"] == "message"


@pytest.mark.slow
def test_a_cut_off_episode_is_graded_on_its_file(run_async, backend):
    """The turn limit or the token budget ended it before a final message: the file written is
    graded all the same (unless grade_truncated=False); no file scores 0."""
    async def cut(env, actions):
        try:
            await env.areset(seed=0, options=TASK)
            for action in actions:
                await env.astep(action)
            return await env.atruncated("max_turns")
        finally:
            await env.aclose()

    half = [call("write_file", path="solution.py", content=HALF)]
    assert run_async(cut(CodeEnv(sandbox=backend), half)) == 0.5
    assert run_async(cut(CodeEnv(sandbox=backend, grade_truncated=False), half)) is None
    assert run_async(cut(CodeEnv(sandbox=backend), [call("bash", command="ls")])) == 0.0


def test_malformed_tool_call_is_an_observation(run_async, backend):
    env = CodeEnv(sandbox=backend)
    _, bad, final = run_async(_episode(env, ['<tool_call>{"name": "bash", "arguments": </tool_call>', "bye"]))
    assert bad[0][0]["role"] == "tool" and bad[0][0]["content"].startswith("Error") and bad[2] is False
    assert final[1] == 0.0


# -- task formats and the built-in set (host grading of trusted reference code) -----------------------
def test_builtin_tasks_reference_solutions_pass():
    rows = [json.loads(line) for line in (CodeEnv.dataset.__globals__["DEFAULT_TASKS"]).read_text().splitlines()]
    assert len(rows) == 20
    for row in rows:
        task = normalize_task(row)
        spec = hidden_tests(task["label"], task["metadata"], task["prompt"])
        result = grade_on_host({"solution.py": row["canonical_solution"]}, spec)
        assert result.passed == result.total, (row["task_id"], result)
        wrong = grade_on_host({"solution.py": f"def {row['entry_point']}(*a, **k):\n    return None\n"}, spec)
        assert wrong.passed < wrong.total, row["task_id"]
    assert len(read_tasks(CodeEnv.dataset.__globals__["DEFAULT_TASKS"])) == 20


def test_mbpp_and_humaneval_shapes(tmp_path):
    mbpp = normalize_task({"task_id": 2, "text": "Write a function to add.", "test_setup_code": "import math",
                           "test_list": ["assert add(1, 2) == 3", "assert add(math.floor(1.5), 0) == 1"]})
    spec = hidden_tests(mbpp["label"], mbpp["metadata"], mbpp["prompt"])
    assert spec.setup == "import math" and len(spec.tests) == 2
    assert grade_on_host({"solution.py": "def add(a, b):\n    return a + b\n"}, spec).passed == 2
    humaneval = normalize_task({"task_id": "HumanEval/0", "prompt": 'def inc(x):\n    """x + 1"""\n',
                                "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"})
    spec = hidden_tests(humaneval["label"], humaneval["metadata"], humaneval["prompt"])
    assert humaneval["metadata"]["entry_point"] == "inc" and spec.tests == ["check(inc)"]
    assert grade_on_host({"solution.py": "def inc(x):\n    return x + 1\n"}, spec).fraction == 1.0
    assert grade_on_host({"solution.py": "def inc(x):\n    return x\n"}, spec).fraction == 0.0
    script = hidden_tests("import math\nassert f(4) == 2\nassert f(9) == 3\n")  # a plain script of asserts
    assert len(script.tests) == 2 and script.setup == "import math"
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": "no tests"}) + "\n")
    with pytest.raises(ValueError, match="no tests"):
        read_tasks(path)


def test_grader_limits_on_host():
    spec = hidden_tests(TASK["label"])
    hang = grade_on_host({"solution.py": "def running_max(xs):\n    while True: pass\n"}, spec, test_timeout=1)
    assert hang.passed == 0 and "timed out" in hang.details[0]["error"] and "timed out" in hang.error
    exits = grade_on_host({"solution.py": "import sys\nsys.exit(0)\n"}, spec)
    assert exits.passed == 0 and "did not load: SystemExit" in exits.error


@pytest.mark.e2e
def test_train_one_iteration(tmp_path, backend):
    """Default flags (no --sandbox): the agents' and the grader's sandboxes come from one pool, bounded
    by what the machine holds (issue 20: a sandbox per trajectory started ~100 containers on 2 cores)."""
    from agentrl.sandboxes import default_max_active

    out = tmp_path / "run"
    rows = train_one_iteration("code", out, "--rollout-max-response-len", "128", "--rollout-max-tokens-per-turn", "64")
    assert_iteration_ok(out, rows)
    assert rows[0]["sandbox/max_active"] == default_max_active(backend) <= 64
    assert rows[0]["sandbox/acquired"] >= 4  # 4 trajectories' tools (and gradings, if a solution was written)


def test_default_sandbox_pool_is_bounded(run_async):
    """What `agentrl train --env code` builds with default flags: a pool of the env's own backend,
    sized to the machine; --sandbox and --sandbox-max-active override it; an env kwarg picks the backend."""
    from agentrl.config import parse_config
    from agentrl.sandboxes import default_max_active
    from agentrl.build import run_sandbox_backend, start_sandbox_pool

    def cfg(*argv):
        return parse_config(["--env", "code", *argv])[0]

    assert run_sandbox_backend(cfg(), CodeEnv) == "auto"
    assert run_sandbox_backend(cfg("--sandbox", "docker"), CodeEnv) == "docker"
    assert run_sandbox_backend(cfg("--env-kwargs", '{"sandbox": "local"}'), CodeEnv) == "local"
    assert run_sandbox_backend(cfg("--env-kwargs", '{"sandbox": null}'), CodeEnv) is None  # tools on the host
    assert run_sandbox_backend(parse_config(["--env", "math"])[0], agentrl.registry.get_spec("math").load()) is None
    assert default_max_active("docker") == max(2, min(2 * len(os.sched_getaffinity(0)), 64,
                                                      (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20)
                                                      // 2 // 1024))
    assert 2 <= default_max_active("docker") <= default_max_active("local") <= 64
    sandbox_backend_or_skip("local")

    async def pool_of(config):
        pool = await start_sandbox_pool(config)
        try:
            return pool.metrics()
        finally:
            await pool.close()

    sized = run_async(pool_of(cfg("--env-kwargs", '{"sandbox": "local"}')))
    assert (sized["backend"], sized["max_active"]) == ("local", default_max_active("local"))
    assert sized["warm"] == min(4, sized["max_active"])
    assert run_async(pool_of(cfg("--sandbox", "local", "--sandbox-max-active", "3")))["max_active"] == 3


@pytest.mark.parametrize("kind", ["local", "docker"])
def test_grader_in_each_sandbox_backend(run_async, kind):
    from agentrl.envs.code_env.grader import grade

    sandbox_backend_or_skip(kind)
    spec = hidden_tests(TASK["label"])
    good = run_async(grade({"solution.py": GOOD}, spec, sandbox=kind))
    assert (good.passed, good.total) == (4, 4)
    fake = run_async(grade({"solution.py": "print('[{\"passed\": true}]')\nimport os\nos._exit(0)\n"}, spec,
                           sandbox=kind))
    assert fake.passed == 0 and "did not load" in fake.error


def test_always_equal_objects_do_not_pass():
    """A result whose __eq__ always says True (or a list subclass that does) does not match."""
    spec = hidden_tests(TASK["label"])
    always = "class AE:\n    def __eq__(self, other):\n        return True\ndef running_max(xs):\n    return AE()\n"
    assert grade_on_host({"solution.py": always}, spec).passed == 0
    sub = "class L(list):\n    def __eq__(self, other):\n        return True\ndef running_max(xs):\n    return L()\n"
    assert grade_on_host({"solution.py": sub}, spec).passed == 1  # an empty L travels as [], right for []
    inner = "class AE:\n    def __eq__(self, other):\n        return True\ndef running_max(xs):\n    return [AE()] * len(xs)\n"
    assert grade_on_host({"solution.py": inner}, spec).passed == 1  # only the empty-list test
    counter = hidden_tests(["assert count('abca') == {'a': 2, 'b': 1, 'c': 1}"])
    legit = "from collections import Counter\ndef count(s):\n    return Counter(s)\n"  # stdlib types are fine
    assert grade_on_host({"solution.py": legit}, counter).passed == 1
