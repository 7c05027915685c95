"""Grading of code solutions: the solution files go into a FRESH sandbox that the agent never
touched, next to a runner the agent never saw; the runner executes the hidden tests one by
one and reports which passed.

Trust model. The tests come from the task (never from the agent's sandbox); only the named
solution files are copied over, so files the agent planted (a ``conftest.py``, a fake
``tests.py``, a ``sitecustomize.py``) never reach the grader. The runner reads a random
nonce from stdin before it imports the solution and deletes its own file, and the result
line must carry that nonce: a solution that prints a fake report and exits, or calls
``sys.exit(0)`` / ``os._exit(0)``, scores nothing. Each test has a time limit (SIGALRM), the
whole run the sandbox's limits. ``assert a == b`` in a test is checked so that a value whose
``__eq__`` always says True (the "AlwaysEqual" hack) does not match a built-in expected value.
Limits: the tests run in the solution's process, so code written to attack the runner on
purpose (walking its frames for the nonce, patching builtins the tests use) could still fool it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNNER = r'''
import sys, os
_nonce = sys.stdin.readline().strip()
sys.stdin.close()
try:
    os.remove(__file__)
except OSError:
    pass


_PLAIN = {int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset}
# Standard-library value types, captured before the solution runs (it cannot swap them).
import collections as _c, fractions as _f, decimal as _d, datetime as _dt
_PLAIN |= {_c.Counter, _c.OrderedDict, _c.defaultdict, _c.deque, _f.Fraction, _d.Decimal, _dt.date, _dt.datetime,
           _dt.time, _dt.timedelta}
_SEQUENCES = (list, tuple, set, frozenset, _c.deque)


def _trusted(t):
    if t in _PLAIN:
        return True
    np = sys.modules.get("numpy")  # numpy scalars (np.int64, np.float32, ...)
    return (np is not None and t.__module__ == "numpy" and getattr(np, t.__name__, None) is t
            and issubclass(t, np.generic))


def _plain(x, depth=0):
    """Only trusted value types all the way down: nothing with an __eq__ the solution wrote."""
    if not _trusted(type(x)) or depth > 50:
        return False
    if isinstance(x, _SEQUENCES):
        return all(_plain(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return True


def _agentrl_eq(a, b):
    # An expected built-in value must be matched by a built-in value: an object whose
    # __eq__ always says True (the "AlwaysEqual" hack) does not pass.
    if _plain(b) and not _plain(a) or _plain(a) and not _plain(b):
        return False
    return a == b


def _guard(source):
    import ast

    class Eq(ast.NodeTransformer):
        def visit_Assert(self, node):
            test = node.test
            if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
                call = ast.Call(ast.Name("_agentrl_eq", ast.Load()), [test.left, test.comparators[0]], [])
                node.test = call if isinstance(test.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
            return node

    tree = Eq().visit(ast.parse(source))
    return compile(ast.fix_missing_locations(tree), "<hidden test>", "exec")


def _grade(nonce):
    import json, signal, runpy, traceback, io, contextlib
    spec = json.loads(open("_grader_spec.json").read())
    os.remove("_grader_spec.json")
    sys.path.insert(0, os.getcwd())
    results = []

    def on_alarm(signum, frame):
        raise TimeoutError("test timed out")

    signal.signal(signal.SIGALRM, on_alarm)
    namespace = None
    load_error = ""
    out = io.StringIO()
    try:
        signal.alarm(spec["load_timeout"])
        with contextlib.redirect_stdout(out):
            namespace = runpy.run_path(spec["main"], run_name="solution")
            if spec["setup"]:
                exec(compile(spec["setup"], "<test setup>", "exec"), namespace)
    except BaseException as exc:
        load_error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        signal.alarm(0)
    for test in spec["tests"]:
        if namespace is None:
            results.append({"passed": False, "error": "the solution did not load: " + load_error})
            continue
        ns = dict(namespace)
        try:
            signal.alarm(spec["test_timeout"])
            with contextlib.redirect_stdout(out):
                ns["_agentrl_eq"] = _agentrl_eq
                exec(_guard(test), ns)
            results.append({"passed": True})
        except BaseException as exc:
            msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            results.append({"passed": False, "error": msg[:300]})
        finally:
            signal.alarm(0)
    sys.__stdout__.write("\n" + nonce + json.dumps(results) + "\n")
    sys.__stdout__.flush()


_grade(_nonce)
'''


@dataclass
class HiddenTests:
    """Hidden tests of one task: statements run after the solution is loaded, in its namespace."""

    tests: list[str]
    setup: str = ""
    entry_point: str | None = None

    def __post_init__(self):
        if not self.tests:
            raise ValueError("a code task needs at least one test")


@dataclass
class GradeResult:
    passed: int
    total: int
    details: list[dict] = field(default_factory=list)
    error: str | None = None  # why nothing could be scored (no report, solution missing, ...)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def split_tests(code: str) -> tuple[list[str], str]:
    """A test script -> (one test per top-level assert, the other statements as setup)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return [code], ""
    tests, setup = [], []
    for node in tree.body:
        text = ast.get_source_segment(code, node) or ast.unparse(node)
        (tests if isinstance(node, ast.Assert) else setup).append(text)
    return tests, "\n".join(setup)


def entry_point_from_prompt(prompt: str) -> str | None:
    """The last top-level function defined in a HumanEval-style prompt (its signature + docstring)."""
    names = [line.split("def ", 1)[1].split("(", 1)[0].strip()
             for line in str(prompt).splitlines() if line.startswith("def ")]
    return names[-1] if names else None


def hidden_tests(label: Any, metadata: dict | None = None, prompt: Any = None) -> HiddenTests:
    """Build the hidden tests from a task's label and metadata. Accepted shapes:

    * MBPP: a list of assert statements (``test_list``), setup in ``test_setup_code`` / ``test_imports``;
    * HumanEval: a test script defining ``check(candidate)`` (``test``), run as ``check(entry_point)``;
      the entry point comes from metadata, the label dict, or the prompt's last ``def``;
    * a script of asserts (one test each), or a dict with any of those keys.
    """
    metadata = dict(metadata or {})
    if isinstance(label, dict):
        metadata = {**label, **metadata}
        label = label.get("test_list", label.get("tests", label.get("test")))
    if isinstance(label, str):
        try:
            parsed = json.loads(label)
            if isinstance(parsed, list):
                label = parsed
        except ValueError:
            pass
    setup_parts = [metadata.get("test_imports"), metadata.get("test_setup_code"), metadata.get("setup")]
    setup = "\n".join(s if isinstance(s, str) else "\n".join(s) for s in setup_parts if s)
    entry = metadata.get("entry_point") or (entry_point_from_prompt(prompt) if isinstance(prompt, str) else None)
    if isinstance(label, (list, tuple)):
        return HiddenTests([str(t) for t in label], setup, entry)
    if isinstance(label, str):
        if "def check(" in label:
            if not entry:
                raise ValueError("a HumanEval-style test (def check) needs an entry_point")
            return HiddenTests([f"check({entry})"], "\n".join(filter(None, [setup, label])), entry)
        tests, extra = split_tests(label)
        return HiddenTests(tests, "\n".join(filter(None, [setup, extra])), entry)
    raise ValueError(f"code task: cannot read hidden tests from a label of type {type(label).__name__}")


def parse_report(stdout: str, nonce: str, total: int) -> GradeResult:
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce):
            try:
                details = json.loads(line[len(nonce):])
            except ValueError:
                break
            if isinstance(details, list) and len(details) == total:
                return GradeResult(sum(bool(d.get("passed")) for d in details), total, details)
            break
    return GradeResult(0, total, [], error="the test run ended without a report (the solution exited, "
                                          "crashed or hung)")


def _runner_inputs(files: dict[str, str], spec: HiddenTests, main: str, test_timeout: int) -> tuple[str, dict, str]:
    nonce = "AGENTRL-GRADE-" + secrets.token_hex(16) + ":"
    runner_name = f"_grader_{secrets.token_hex(6)}.py"
    payload = {"main": main, "tests": spec.tests, "setup": spec.setup, "test_timeout": int(test_timeout),
               "load_timeout": int(max(test_timeout, 10))}
    staged = dict(files)
    staged["_grader_spec.json"] = json.dumps(payload)
    staged[runner_name] = RUNNER
    return nonce, staged, runner_name


async def grade_in_sandbox(files: dict[str, str], spec: HiddenTests, *, main: str = "solution.py",
                           backend: str = "auto", limits: dict | None = None, test_timeout: int = 10,
                           total_timeout: float = 120.0) -> GradeResult:
    """Run the hidden tests against `files` ({relative path: text}) in a new sandbox.
    Raises SandboxError when the sandbox itself fails (an infrastructure failure)."""
    from agentrl.sandboxes import SandboxLimits, create

    nonce, staged, runner = _runner_inputs(files, spec, main, test_timeout)
    sb = create(backend, limits=SandboxLimits(**{"memory_mb": 512, "cpus": 1.0, **(limits or {})}))
    await sb.start()
    try:
        for path, text in staged.items():
            await sb.write_file(path, text)
        result = await sb.exec(["python3", "-I", runner], timeout=total_timeout, stdin=nonce + "\n")
    finally:
        await sb.close()
    graded = parse_report(result.stdout, nonce, len(spec.tests))
    if graded.error:
        graded.error += f" (exit code {result.exit_code}{', timed out' if result.timed_out else ''})"
    return graded


def grade_on_host(files: dict[str, str], spec: HiddenTests, *, main: str = "solution.py", test_timeout: int = 10,
                  total_timeout: float = 120.0) -> GradeResult:
    """The same run as a host subprocess in a temp dir: NOT isolated, for trusted code (tests,
    reference solutions) only."""
    nonce, staged, runner = _runner_inputs(files, spec, main, test_timeout)
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-grade-"))
    try:
        for path, text in staged.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / path).write_text(text)
        try:
            proc = subprocess.run([sys.executable, "-I", runner], cwd=tmp, input=nonce + "\n", capture_output=True,
                                  text=True, timeout=total_timeout, env={"PATH": os.environ.get("PATH", "")})
            stdout, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired:
            stdout, code = "", 137
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    graded = parse_report(stdout, nonce, len(spec.tests))
    if graded.error:
        graded.error += f" (exit code {code})"
    return graded


async def grade(files: dict[str, str], spec: HiddenTests, *, backend: str | None = "auto", **kw) -> GradeResult:
    """grade_in_sandbox, or grade_on_host when backend is None."""
    if backend is None:
        kw.pop("limits", None)
        return await asyncio.to_thread(grade_on_host, files, spec, **kw)
    return await grade_in_sandbox(files, spec, backend=backend, **kw)
