"""Grading of code solutions. Pass/fail is decided by a judge on the host that never imports
or runs the solution's code; the solution runs in a sandbox and only answers calls.

How a task's tests are run. The hidden tests (assert statements, or a HumanEval ``check``)
and their setup code are trusted task data: the judge (judge.py, in a host process of its own
that never loads the solution) executes them, in a
namespace where every name the tests use that is not a builtin or defined by the setup (the
entry point, always) is a proxy -- except a standard-library module's name used only as
``name.attr`` (``math.isclose``), which is that module. Calling a proxy sends the function's name and its
arguments (plain values: numbers, strings, bytes, lists, tuples, sets, dicts, Fractions,
Decimals) to a child process in a sandbox (child.py), which holds the solution and nothing
else; it calls the solution's function and answers with the return value (and the
arguments after the call, so in-place changes show) or the exception's type name. The
answer is decoded into plain values -- an object with an ``__eq__`` the agent wrote cannot
reach the judge -- and the test goes on with it: ``assert running_max([1, 3]) == [1, 3]``
compares the decoded list on the host. So the tests' expected values never enter the
sandbox (unless a test hands them to a function of the solution), and nothing the solution does to its own interpreter (patching ``json``,
``builtins``, the child, ``AssertionError``; ``sys.exit``; printing a forged answer) can
change a verdict: at most it claims return values, which the judge checks like any others.

What a solution can pass: functions called with plain values that return plain values (or
raise); an object with methods (``Stack().push(1)``) comes back as an unrepresentable value
that equals nothing. The solution's module state persists across calls of one grading (one
child process), except after its process died, when the next call starts a new one.

Bounds. Each call has ``test_timeout`` seconds, the whole grading ``total_timeout`` (wall
clock, measured on the host: a solution that ignores SIGALRM is killed all the same; so is the
judge's process, ``JUDGE_MARGIN_S`` later, when a test does unbounded work with an answer, and
it has ``JUDGE_MEMORY_MB`` of address space), each
answer ``max_answer_bytes`` (and a decoded answer: ints of 4 Mbit, Fractions of 64 kbit,
nesting 100 deep, 32 members of a set or dict per hash value). After a hang, an answer that
breaks the protocol or these bounds, or a failed load, the solution's process is killed and the remaining tests fail with the reason in
``GradeResult.error``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from agentrl.data import json_list_label
from agentrl.envs.code_env.judge import SolutionBroke, SolutionError, free_names, judge  # noqa: F401 (API)

CHILD_FILE = str(Path(__file__).with_name("child.py"))
JUDGE_FILE = str(Path(__file__).with_name("judge.py"))
JUDGE_MEMORY_MB = 4096  # address space of the judge's process (the tests and the answers they hold)
JUDGE_MARGIN_S = 5.0    # wall clock the judge gets past total_timeout (its start, the last test)
CHILD_SOURCE = Path(CHILD_FILE).read_text()
CHILD_ARGV = ["python3", "-I", "-c", CHILD_SOURCE]  # -I: nothing of the workdir on its path before it loads the solution

@dataclass
class HiddenTests:
    """Hidden tests of one task: statements (asserts, ``check(entry_point)``) the judge runs after `setup`."""

    tests: list[str]
    setup: str = ""
    entry_point: str | None = None
    #: trusted code whose definitions the tests use (HumanEval: the prompt, with helpers such as
    #: ``poly`` that a check calls); run by the judge before `setup`, so a solution that redefines
    #: them changes nothing. What it defines of the entry point stays the solution's.
    context: str = ""

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


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


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
    label = json_list_label(label)
    setup_parts = [metadata.get("test_imports"), metadata.get("test_setup_code"), metadata.get("setup")]
    setup = "\n".join(s if isinstance(s, str) else "\n".join(s) for s in setup_parts if s)
    entry = metadata.get("entry_point") or (entry_point_from_prompt(prompt) if isinstance(prompt, str) else None)
    if isinstance(label, (list, tuple)):
        return HiddenTests([str(t) for t in label], setup, entry)
    if isinstance(label, str):
        if "def check(" in label:
            if not entry:
                raise ValueError("a HumanEval-style test (def check) needs an entry_point")
            context = prompt if isinstance(prompt, str) and _parses(prompt) else ""
            return HiddenTests([f"check({entry})"], "\n".join(filter(None, [setup, label])), entry, context)
        tests, extra = split_tests(label)
        return HiddenTests(tests, "\n".join(filter(None, [setup, extra])), entry)
    raise ValueError(f"code task: cannot read hidden tests from a label of type {type(label).__name__}")



# ---- the host's end of the solution's process ------------------------------------------------------
@dataclass
class Bounds:
    test_timeout: float = 10.0      # seconds per call of the solution
    total_timeout: float = 60.0     # seconds for the whole grading
    max_answer_bytes: int = 1 << 20  # one answer line


class SolutionProcess:
    """One child.py process at a time, started by `spawn`; calls go to it one by one. Once it hung,
    failed to load, or broke the protocol, every later call fails at once (`gave_up`)."""

    def __init__(self, spawn: Callable[[], Awaitable[asyncio.subprocess.Process]], main: str, bounds: Bounds):
        self.spawn, self.main, self.bounds = spawn, main, bounds
        self.proc: asyncio.subprocess.Process | None = None
        self.buf = bytearray()
        self.gave_up = ""
        self.deadline = asyncio.get_running_loop().time() + bounds.total_timeout
        self.starts = 0

    def _left(self, limit: float) -> float:
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise self._give_up(f"grading took longer than total_timeout={self.bounds.total_timeout:g}s")
        return min(limit, left)

    def _give_up(self, why: str) -> SolutionBroke:
        self.gave_up = why
        return SolutionBroke(why)

    async def _exchange(self, request: dict, timeout: float) -> dict:
        """Send one request line, read one answer line. TimeoutError, EOFError or ValueError."""
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        async with asyncio.timeout(timeout):
            try:
                await self.proc.stdin.drain()
            except ConnectionError:
                raise EOFError from None
            while (end := self.buf.find(b"\n")) < 0:
                if len(self.buf) > self.bounds.max_answer_bytes:
                    raise ValueError(f"an answer longer than {self.bounds.max_answer_bytes} bytes")
                chunk = await self.proc.stdout.read(1 << 16)
                if not chunk:
                    raise EOFError
                self.buf += chunk
        line, self.buf = bytes(self.buf[:end]), self.buf[end + 1:]
        try:
            answer = json.loads(line)
        except RecursionError:
            raise ValueError("an answer nested too deep") from None
        if not isinstance(answer, dict):
            raise ValueError("an answer that is not a JSON object")
        return answer

    async def _start(self) -> None:
        self.starts += 1
        self.buf = bytearray()
        self.proc = await self.spawn()
        cpu_s = int(self.bounds.total_timeout) + 1  # an orphaned busy loop dies of RLIMIT_CPU
        try:
            hello = await self._exchange({"main": self.main, "cpu_s": cpu_s},
                                         self._left(max(self.bounds.test_timeout, 10.0)))
        except SolutionBroke:
            raise
        except (TimeoutError, EOFError, ValueError, OSError) as e:
            raise self._give_up(f"the solution did not load: {_why(e)}") from None
        if not hello.get("loaded"):
            raise self._give_up(f"the solution did not load: {str(hello.get('load_error'))[:500]}")

    async def call(self, name: str, args: Any, kwargs: Any) -> dict:
        """Call `name` with arguments in the wire format (the judge encoded them); the answer as sent."""
        if self.gave_up:
            raise SolutionBroke(self.gave_up)
        request = {"call": name, "args": args, "kwargs": kwargs}
        try:
            if self.proc is None or self.proc.returncode is not None:
                await self._start()
            return await self._exchange(request, self._left(self.bounds.test_timeout))
        except EOFError:  # it exited (sys.exit, os._exit, a crash): the next call starts a new one
            await self.kill()
            raise SolutionBroke(f"the solution's process ended during {name}()") from None
        except (TimeoutError, ValueError, OSError) as e:
            await self.kill()
            raise self._give_up(f"{name}(): {_why(e, self.bounds.test_timeout)}") from None

    async def give_up(self, why: str) -> None:
        self.gave_up = self.gave_up or why
        await self.kill()

    async def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session (host children and the sandbox's client)
            except (ProcessLookupError, PermissionError):
                pass

        async def drain() -> None:  # to EOF, so the pipe's transport closes (reading stops on a full buffer)
            while await proc.stdout.read(1 << 16):
                pass
            await proc.wait()

        try:
            await asyncio.wait_for(drain(), 10)
        except (asyncio.TimeoutError, OSError, RuntimeError):  # RuntimeError: a cancelled call still reads
            pass


def _why(exc: BaseException, timeout: float | None = None) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out (test_timeout={timeout:g}s)" if timeout else "timed out"
    if isinstance(exc, EOFError):
        return "its process ended"
    return f"{type(exc).__name__}: {exc}"[:300]


async def judge_solution(spec: HiddenTests, spawn: Callable[[], Awaitable[asyncio.subprocess.Process]], *,
                         main: str = "solution.py", bounds: Bounds | None = None) -> GradeResult:
    """Grade the solution that `spawn()` starts (a child.py process): the judge runs in a host
    process of its own (judge.py), each call of the solution it asks for is a request to the child.
    Both are killed at the wall-clock bound, whatever the tests were doing with the answers."""
    bounds = bounds or Bounds()
    solution = SolutionProcess(spawn, main, bounds)
    judge_proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", JUDGE_FILE, CHILD_FILE, str(JUDGE_MEMORY_MB), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True, limit=64 << 20)
    details: list[dict] = []

    async def send(obj: dict) -> None:
        judge_proc.stdin.write(json.dumps(obj).encode() + b"\n")
        await judge_proc.stdin.drain()

    try:
        # the solution's deadline ends its calls; this one ends a judge busy with what they returned
        async with asyncio.timeout(bounds.total_timeout + JUDGE_MARGIN_S):
            await send({"spec": {"tests": spec.tests, "setup": spec.setup, "entry_point": spec.entry_point,
                                 "context": spec.context}})
            while len(details) < len(spec.tests):
                line = await judge_proc.stdout.readline()
                if not line:
                    break  # the judge died (its memory cap): the tests not reported fail
                msg = json.loads(line)
                if "result" in msg:
                    details.append(msg["result"])
                elif "give_up" in msg:
                    await solution.give_up(str(msg["give_up"]))
                elif "call" in msg:
                    try:
                        answer = await solution.call(msg["call"], msg["args"], msg["kwargs"])
                    except SolutionBroke as e:
                        answer = {"broke": str(e)}
                    await send(answer)
    except TimeoutError:
        solution.gave_up = solution.gave_up or f"grading took longer than total_timeout={bounds.total_timeout:g}s"
    except (ConnectionError, ValueError) as e:  # the judge's pipe broke, or it wrote something else
        solution.gave_up = solution.gave_up or f"the judge failed: {type(e).__name__}: {e}"[:300]
    finally:
        try:
            os.killpg(judge_proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await judge_proc.wait()
        error = solution.gave_up or None
        if len(details) < len(spec.tests):
            why = error or "the judge ended before this test (its memory cap)"
            error = error or why
            details += [{"passed": False, "error": why}] * (len(spec.tests) - len(details))
        solution.gave_up = solution.gave_up or "the grading ended"
        await solution.kill()
    passed = sum(d["passed"] for d in details)
    return GradeResult(passed, len(details), details, error=error)


# ---- where the solution runs ------------------------------------------------------------------------
def _is_pool(obj: Any) -> bool:
    return hasattr(obj, "get") and hasattr(obj, "release")


async def grade(files: dict[str, str], spec: HiddenTests, *, sandbox: Any = "auto", main: str = "solution.py",
                limits: dict | None = None, test_timeout: float = 10, total_timeout: float = 60,
                max_answer_bytes: int = 1 << 20) -> GradeResult:
    """Grade `files` ({relative path: text}; `main` is the module the tests call into) against `spec`.

    sandbox: a backend name ("auto" | "docker" | "local": a new sandbox, closed after), a
    SandboxPool (a sandbox from it, destroyed after, since the solution's processes may outlive
    the grading), or None: a host subprocess in a temp dir, NOT isolated (trusted code only).
    Raises SandboxError when the sandbox itself fails (an infrastructure failure)."""
    bounds = Bounds(float(test_timeout), float(total_timeout), int(max_answer_bytes))
    if sandbox is None:
        return await _grade_on_host(files, spec, main, bounds)
    from agentrl.sandboxes import SandboxLimits, create

    if _is_pool(sandbox):
        pool, sb = sandbox, await sandbox.get()
    else:
        pool, sb = None, create(sandbox, limits=SandboxLimits(**{"memory_mb": 512, "cpus": 1.0, **(limits or {})}))
        await sb.start()
    try:
        try:
            for path, text in files.items():
                await sb.write_file(path, text)
        except OSError as e:  # the files themselves (a path that cannot be a file there)
            return GradeResult(0, len(spec.tests), [], error=f"the solution files could not be staged: {e}")

        async def spawn():
            return await sb.spawn(CHILD_ARGV, cwd=sb.workdir, stderr=asyncio.subprocess.DEVNULL)

        return await judge_solution(spec, spawn, main=main, bounds=bounds)
    finally:
        if pool is not None:
            sb.taint("it ran a solution for grading (its processes may outlive the grading)")
            await pool.release(sb)
        else:
            await sb.close()


async def _grade_on_host(files: dict[str, str], spec: HiddenTests, main: str, bounds: Bounds) -> GradeResult:
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-grade-"))
    try:
        for path, text in files.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / path).write_text(text)

        async def spawn():
            return await asyncio.create_subprocess_exec(
                sys.executable, *CHILD_ARGV[1:], cwd=tmp, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "")}, start_new_session=True)

        return await judge_solution(spec, spawn, main=main, bounds=bounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def grade_on_host(files: dict[str, str], spec: HiddenTests, *, main: str = "solution.py", test_timeout: float = 10,
                  total_timeout: float = 60) -> GradeResult:
    """grade(sandbox=None) for sync callers: NOT isolated, for trusted code (tests, reference solutions) only."""
    return asyncio.run(grade(files, spec, sandbox=None, main=main, test_timeout=test_timeout,
                             total_timeout=total_timeout))
