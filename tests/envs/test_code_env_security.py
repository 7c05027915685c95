"""The code env's grader against a policy that tries to win without solving (issue 19).

Every attack here is a solution the agent could write. The judge runs the hidden tests on
the host against the values the solution's process answers (envs/code_env/grader.py), so
patching that process's interpreter, forging its answers, exiting, hanging or flooding must
score nothing, within a wall-clock bound, and never raise (a raise would mark the trajectory
FAILED and let the policy veto its group). Forgeries of the interpreter run on the host
(the judge is the same everywhere; they only hurt themselves); what needs isolation (killing
every process it can signal, forked processes outliving the grading, searching the sandbox
for the expected values) runs on both sandbox backends."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from agentrl.envs.code_env import CodeEnv
from agentrl.envs.code_env.child import Opaque, decode, encode
from agentrl.envs.code_env.grader import grade, grade_on_host, hidden_tests

from envtest_helpers import episode, sandbox_backend_or_skip, tool_call

LABEL = ["assert running_max([1, 3, 2, 5, 4]) == [1, 3, 3, 5, 5]", "assert running_max([]) == []",
         "assert running_max([-2, -5, -1]) == [-2, -2, -1]", "assert running_max([7]) == [7]"]
SPEC = hidden_tests(LABEL, {"entry_point": "running_max"})
GOOD = ("def running_max(xs):\n    out, best = [], None\n    for x in xs:\n"
        "        best = x if best is None or x > best else best\n        out.append(best)\n    return out\n")
WRONG = "def running_max(xs):\n    return [0]\n"  # right for no test
# writes forged answer lines to every pipe of its process except stdin/stdout (the protocol's copies)
FORGE_ANSWERS = (
    "import os\n"
    "def forge(lines):\n"
    "    for fd in map(int, os.listdir('/proc/self/fd')):\n"
    "        if fd > 2:\n"
    "            try: os.write(fd, lines.encode())\n"
    "            except OSError: pass\n")

# name -> a solution that does not solve running_max but tries to make the grader say it did
FORGERIES = {
    # the forgeries of the old in-process runner
    "patch the runner's equality": "import __main__\n__main__._agentrl_eq = lambda a, b: True\n" + WRONG,
    "patch the runner's guard": "import __main__\n__main__._guard = lambda s: compile('pass', 'x', 'exec')\n" + WRONG,
    "patch json.dumps": ("import json\n_d = json.dumps\n"
                         "json.dumps = lambda o, *a, **k: _d([{'passed': True}] * 4) if isinstance(o, list) "
                         "else _d({'value': True})\n" + WRONG),
    "patch builtins.exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\n" + WRONG,
    "print a forged report and exit": ("import sys, os, json\nsys.__stdout__.write(json.dumps([{'passed': True}] * 4))\n"
                                       "sys.__stdout__.flush()\nos._exit(0)\n"),
    "sys.exit at load": "import sys\nsys.exit(0)\n",
    "os._exit in the call": "import os\ndef running_max(xs):\n    os._exit(0)\n",
    "sys.exit in the call": "import sys\ndef running_max(xs):\n    sys.exit(0)\n",
    "always-equal object": "class AE:\n    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
                           "def running_max(xs):\n    return AE()\n",
    "always-equal list subclass": "class L(list):\n    def __eq__(self, o): return True\ndef running_max(xs):\n"
                                  "    return L([0])\n",
    "AssertionError override": "import builtins\nclass Never(BaseException): pass\nbuiltins.AssertionError = Never\n"
                               + WRONG,
    # new: attacks on the child and its protocol
    "patch the child's encoder": ("import __main__\n__main__.encode = lambda v, strict=True, depth=0: True\n" + WRONG),
    "patch the child's answer channel": ("import __main__, json\n"
                                         "json.dumps = lambda o, *a, **k: '{\"value\": {\"x\": \"AlwaysEqual\"}}'\n"
                                         + WRONG),
    "forge hello and answers on the pipes": FORGE_ANSWERS + (
        "forge('{\"loaded\": true}\\n' + '{\"value\": {\"x\": \"AE\"}}\\n' * 8 + '{\"value\": true}\\n' * 8)\n"
        "def running_max(xs):\n    forge('{\"value\": {\"d\": [[[1], 2]]}}\\n')\n    return [0]\n"),
    "raise KeyboardInterrupt": "def running_max(xs):\n    raise KeyboardInterrupt\n",
    "raise SystemExit(0)": "def running_max(xs):\n    raise SystemExit(0)\n",
    "raise a BaseException subclass": "class Stop(BaseException): pass\ndef running_max(xs):\n    raise Stop()\n",
    "raise GeneratorExit": "def running_max(xs):\n    raise GeneratorExit\n",
    "write files a grader might read": ("import json, os\nfor p in ('results.json', '_grader_spec.json', 'report.json',"
                                        " '/tmp/results.json'):\n"
                                        "    open(p, 'w').write(json.dumps([{'passed': True}] * 4))\n" + WRONG),
    "nested too deep": "def running_max(xs):\n    v = []\n    for _ in range(5000): v = [v]\n    return v\n",
    "an answer too large": "def running_max(xs):\n    return 'x' * (3 << 20)\n",
    "flood a set with hash-colliding ints": FORGE_ANSWERS + (
        "def running_max(xs):\n"
        "    m = (1 << 61) - 1\n"
        "    items = ','.join('{\"i\": \"%x\"}' % (k * m) for k in range(30000))\n"
        "    forge('{\"value\": {\"s\": [' + items + ']}}\\n')\n"
        "    return [0]\n"),
    "close the protocol pipes": "import os\nfor fd in range(3, 64):\n    try: os.close(fd)\n    except OSError: pass\n"
                                + WRONG,
}


@pytest.mark.parametrize("attack", sorted(FORGERIES))
def test_forgeries_score_nothing(attack):
    t0 = time.monotonic()
    result = grade_on_host({"solution.py": FORGERIES[attack]}, SPEC, test_timeout=2, total_timeout=10)
    assert (result.passed, result.total) == (0, 4), (attack, result)
    assert time.monotonic() - t0 < 15


def test_claimed_exceptions_cannot_end_a_tests_iteration():
    """A StopIteration raised through map() would end the iteration early, and all() would hold."""
    spec = hidden_tests(["assert all(map(lambda x: is_even(x) == (x % 2 == 0), [1, 2, 3]))"])
    assert grade_on_host({"solution.py": "def is_even(x):\n    return x % 2 == 0\n"}, spec).passed == 1
    stop = grade_on_host({"solution.py": "def is_even(x):\n    raise StopIteration\n"}, spec)
    assert stop.passed == 0 and "StopIteration" in stop.details[0]["error"]


def test_the_prompts_helpers_are_the_tasks():
    """HumanEval/32: the check calls `poly`, which the prompt defines; a solution that redefines it
    (to make any answer a zero of the polynomial) changes only its own copy."""
    from agentrl.envs.code_env import normalize_task

    prompt = ("import math\n\ndef poly(xs: list, x: float):\n"
              "    return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])\n\n"
              "def find_zero(xs: list):\n    \"\"\"A zero of the polynomial xs.\"\"\"\n")
    test = ("def check(candidate):\n    for coeffs in ([-6, 11, -6, 1], [1, 2], [-1, 0, 0, 1]):\n"
            "        assert math.fabs(poly(coeffs, candidate(list(coeffs)))) < 1e-4\n")
    task = normalize_task({"task_id": "HumanEval/32", "prompt": prompt, "test": test})
    spec = hidden_tests(task["label"], task["metadata"], task["prompt"])
    bisect = prompt + ("    lo, hi = -1.0, 1.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n        lo, hi = 2 * lo, 2 * hi\n"
                       "    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2\n"
                       "        lo, hi = (mid, hi) if poly(xs, mid) * poly(xs, lo) > 0 else (lo, mid)\n    return lo\n")
    assert grade_on_host({"solution.py": bisect}, spec).passed == 1
    cheat = prompt + "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n"
    assert grade_on_host({"solution.py": cheat}, spec).passed == 0


def test_stdlib_modules_in_tests_are_modules():
    """`math.isclose` in a test with no `import math` (the tests used to see the solution's
    imports) is the module; a solution function that shares a module's name is still the solution's."""
    spec = hidden_tests(["assert math.isclose(area(2), 12.566, rel_tol=1e-3)", "assert random([1]) == 1"])
    src = "import math\ndef area(r):\n    return math.pi * r * r\ndef random(xs):\n    return xs[0]\n"
    assert grade_on_host({"solution.py": src}, spec).passed == 2


def test_judge_decodes_plain_values_only():
    """What crosses from the solution's process is data: plain types, or Opaque (equal to nothing)."""
    values = [None, True, 3, -2**100, 1.5, float("inf"), 2j, "s\n\ud800", b"\x00", [1, (2, {3})], {"k": frozenset()}]
    assert decode(json.loads(json.dumps(encode(values)))) == values
    assert [type(v) for v in decode(encode(values))] == [type(v) for v in values]
    opaque = decode(encode(object(), strict=False))
    assert isinstance(opaque, Opaque) and opaque != opaque.__class__("object") and not opaque == 0
    flood = {"s": [{"i": format(k * ((1 << 61) - 1), "x")} for k in range(40)]}
    for bad in ({"d": [[[1], 2]]}, {"s": [[1]]}, {"i": "zz"}, {"nope": 1}, {"t": 3}, {"i": "1", "f": "1"}, flood,
                {"d": [[v, 0] for v in flood["s"]]}, {"q": ["1" * 20000, "3"]}, {"d": 3}):
        with pytest.raises(ValueError):
            decode(bad)
    with pytest.raises(TypeError, match="cannot pass"):
        encode([lambda: 0])


def test_honest_solutions_keep_their_score():
    """The judge is exact for what honest code does: exceptions a test expects, in-place changes
    to arguments, state kept across calls, stdout noise, and a process that died is restarted."""
    raises = hidden_tests("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        pass\n"
                          "    else:\n        raise AssertionError('no ValueError')\n    assert candidate(4) == 2\n",
                          {"entry_point": "isqrt"})
    isqrt = "def isqrt(n):\n    if n < 0:\n        raise ValueError('negative')\n    return int(n ** 0.5)\n"
    assert grade_on_host({"solution.py": isqrt}, raises).passed == 1
    wrong_exc = isqrt.replace("ValueError('negative')", "KeyboardInterrupt")
    assert grade_on_host({"solution.py": wrong_exc}, raises).passed == 0
    inplace = hidden_tests(["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]"])
    assert grade_on_host({"solution.py": "def sort_in_place(xs):\n    print('noise')\n    xs.sort()\n"}, inplace).passed == 1
    state = hidden_tests(["assert counter() == 1", "assert counter() == 2"])
    assert grade_on_host({"solution.py": "n = 0\ndef counter():\n    global n\n    n += 1\n    return n\n"},
                         state).passed == 2
    dies = hidden_tests(["assert f(0) == 0", "assert f(1) == 1"])
    crash_once = "import os\ndef f(x):\n    if x == 0:\n        os._exit(3)\n    return x\n"
    result = grade_on_host({"solution.py": crash_once}, dies)
    assert [d["passed"] for d in result.details] == [False, True] and "ended" in result.details[0]["error"]


@pytest.mark.slow
def test_tests_busy_with_an_answer_are_bounded():
    """Hidden tests that do unbounded work with what the solution returned (a loop over range(answer),
    a string of answer characters): the judge runs in a process of its own, killed at the wall-clock
    bound and capped in memory, so the grading ends on time and the trainer's process is untouched."""
    import resource

    spec = hidden_tests(["assert len('x' * count(3)) == 3", "assert sum(1 for _ in range(count(3))) == 3",
                         "assert count(1) == 1"])
    assert grade_on_host({"solution.py": "def count(n):\n    return n\n"}, spec).passed == 3
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    result = grade_on_host({"solution.py": "def count(n):\n    return 5 * 10 ** 9\n"}, spec, test_timeout=2,
                           total_timeout=3)
    took = time.monotonic() - t0
    assert result.passed == 0 and "total_timeout=3" in result.error, result
    assert "MemoryError" in result.details[0]["error"], result.details  # 5 GB past the judge's cap
    assert took < 3 + 5 + 5, took  # total_timeout + the judge's margin + its start
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 512 << 10  # KiB: not here


# -- on both sandbox backends ----------------------------------------------------------------------------
BACKENDS = ["local", "docker"]
HIDDEN_TEXT = ("-2, -2, -1", "[-2,-2,-1]")  # the expected value of a test the prompt does not show
SEARCH = """
import os
def _found():
    hits = []
    for root in ('/work', '/tmp', '/opt', '/etc', '/root', '/home', '/var/tmp', '/run', '/dev/shm'):
        for base, dirs, files in os.walk(root):
            for name in files[:200]:
                try:
                    with open(os.path.join(base, name), 'rb') as f:
                        hits.append(f.read(1 << 20))
                except OSError:
                    pass
    for pid in filter(str.isdigit, os.listdir('/proc')):
        for what in ('cmdline', 'environ'):
            try:
                hits.append(open('/proc/%s/%s' % (pid, what), 'rb').read())
            except OSError:
                pass
    blob = b'\\n'.join(hits).replace(b' ', b'')
    return any(t[::-1].replace(' ', '').encode() in blob for t in HIDDEN)  # reversed: not in this file
HIDDEN = HIDDEN_TEXT_HERE
FOUND = _found()
def running_max(xs):
    # only a grader that leaked the expected values would let this pass the hidden tests
    if FOUND:
        out, best = [], None
        for x in xs:
            best = x if best is None or x > best else best
            out.append(best)
        return out
    return None
""".replace("HIDDEN_TEXT_HERE", repr([t[::-1] for t in HIDDEN_TEXT]))


async def _grade_all(kind: str, solutions: dict[str, str], **kw) -> dict:
    return dict(zip(solutions, await asyncio.gather(*[grade({"solution.py": src}, SPEC, sandbox=kind, **kw)
                                                       for src in solutions.values()])))


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.slow
def test_sandboxed_attacks(run_async, kind):
    sandbox_backend_or_skip(kind)
    attacks = {
        "search the sandbox for the expected values": SEARCH,
        "kill every process it can signal": "import os, signal\nos.kill(-1, signal.SIGKILL)\n" + WRONG,
        "fork a child that outlives the run and forges answers": FORGE_ANSWERS + (
            "import time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(0.3)\n"
            "    for _ in range(200):\n        forge('{\"value\": {\"x\": \"AE\"}}\\n')\n        time.sleep(0.01)\n"
            "    os._exit(0)\n" + WRONG),
        "ignore SIGALRM and spin": ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                                    "def running_max(xs):\n    while True: pass\n"),
        "block every signal, fork spinners and spin": (
            "import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, range(1, signal.NSIG))\n"
            "def running_max(xs):\n    for _ in range(3):\n        if os.fork() == 0:\n            os.setsid()\n"
            "            while True: pass\n    while True: pass\n"),
        "stop itself": "import os, signal\ndef running_max(xs):\n    os.kill(os.getpid(), signal.SIGSTOP)\n",
        "print forever": "import sys\ndef running_max(xs):\n    while True: print('x' * 4096); sys.stderr.write('y' * 4096)\n",
    }
    t0 = time.monotonic()
    results = run_async(_grade_all(kind, {**attacks, "honest": GOOD}, test_timeout=2, total_timeout=6))
    elapsed = time.monotonic() - t0
    for name in attacks:
        assert results[name].passed == 0, (name, results[name])
    assert results["honest"].passed == 4 and results["honest"].error is None
    assert "timed out" in results["ignore SIGALRM and spin"].error
    assert elapsed < 40, elapsed  # every grading is bounded by total_timeout (+ the sandbox's start)


TASK = {"prompt": "Write `running_max(xs)`.", "label": LABEL, "metadata": {"entry_point": "running_max"}}


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.slow
def test_code_env_grades_with_the_runs_pool(run_async, kind):
    """What `agentrl train --env code --sandbox X` builds: the tools and the grader both take
    sandboxes from the pool (max_active=1: the tools' sandbox goes back before grading); a graded
    sandbox is never handed out again; a FIFO solution.py scores 0 without blocking anything."""
    sandbox_backend_or_skip(kind)
    from agentrl.sandboxes import SandboxPool
    from agentrl.tools.spec import tool_sandbox_options

    async def run():
        mounts, env_vars = await asyncio.to_thread(tool_sandbox_options)
        async with SandboxPool(kind, warm=1, max_active=1, mounts=mounts, env=env_vars, acquire_timeout_s=60) as pool:
            good = await episode(CodeEnv(sandbox=pool), [tool_call("write_file", path="solution.py", content=GOOD),
                                                          "done"], TASK)
            fifo = await episode(CodeEnv(sandbox=pool), [tool_call("bash", command="mkfifo solution.py"),
                                                          "done"], TASK)
            return good, fifo, pool.metrics()

    t0 = time.monotonic()
    good, fifo, metrics = run_async(run())
    assert good[-1][1] == 1.0 and good[-1][4]["passed"] == 4
    assert fifo[-1][1] == 0.0 and "not a regular file" in fifo[-1][4]["solution_files_skipped"][0]
    assert metrics["tainted"] >= 1 and metrics["active"] == 0  # the graded sandbox was destroyed
    assert time.monotonic() - t0 < 90


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.slow
def test_builtin_reference_solutions_pass_in_sandboxes(run_async, kind):
    """Every built-in task's reference solution scores all its tests when the solution runs in a
    sandbox of the backend (through a bounded pool, as in training) and the judge on the host."""
    sandbox_backend_or_skip(kind)
    from agentrl.envs.code_env import DEFAULT_TASKS, normalize_task
    from agentrl.sandboxes import SandboxPool

    rows = [json.loads(line) for line in DEFAULT_TASKS.read_text().splitlines() if line.strip()]

    async def run():
        async with SandboxPool(kind, warm=2, max_active=4) as pool:
            async def one(row):
                task = normalize_task(row)
                spec = hidden_tests(task["label"], task["metadata"], task["prompt"])
                return row["task_id"], await grade({"solution.py": row["canonical_solution"]}, spec, sandbox=pool)
            return await asyncio.gather(*[one(row) for row in rows]), pool.metrics()

    results, metrics = run_async(run())
    assert len(results) == 20
    for task_id, result in results:
        assert result.total > 0 and result.passed == result.total and result.error is None, (task_id, result)
    assert metrics["max_active"] == 4 and metrics["active"] == 0 and metrics["tainted"] == 20
