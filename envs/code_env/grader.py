"""Grading of code solutions. Pass/fail is decided by a judge on the host that never imports
or runs the solution's code; the solution runs in a sandbox and only answers calls.

How a task's tests are run. The hidden tests (assert statements, or a HumanEval ``check``)
and their setup code are trusted task data: the judge executes them on the host, in a
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
clock, measured on the host: a solution that ignores SIGALRM is killed all the same), each
answer ``max_answer_bytes`` (and a decoded answer: ints of 4 Mbit, Fractions of 64 kbit,
nesting 100 deep, 32 members of a set or dict per hash value). After a hang, an answer that
breaks the protocol or these bounds, or a failed load, the solution's process is killed and the remaining tests fail with the reason in
``GradeResult.error``.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import importlib
import json
import os
import signal
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from agentrl.envs.code_env.child import decode, encode

CHILD_SOURCE = (Path(__file__).with_name("child.py")).read_text()
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
            context = prompt if isinstance(prompt, str) and _parses(prompt) else ""
            return HiddenTests([f"check({entry})"], "\n".join(filter(None, [setup, label])), entry, context)
        tests, extra = split_tests(label)
        return HiddenTests(tests, "\n".join(filter(None, [setup, extra])), entry)
    raise ValueError(f"code task: cannot read hidden tests from a label of type {type(label).__name__}")



# ---- the host's end of the solution's process ------------------------------------------------------
class SolutionBroke(BaseException):
    """The solution's process hung, died, did not load or broke the protocol. A BaseException, so
    that no ``except Exception`` in a test takes it for an exception the test expected."""


class SolutionError(Exception):
    """The solution raised an exception the judge has no built-in class for (its type name is the message)."""


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

    async def call(self, name: str, args: list, kwargs: dict) -> dict:
        if self.gave_up:
            raise SolutionBroke(self.gave_up)
        request = {"call": name, "args": encode(args), "kwargs": encode(kwargs)}
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


# ---- the judge: the hidden tests, run on the host against the solution's answers -------------------
_BUILTIN_NAMES = set(dir(builtins))


def free_names(spec: HiddenTests) -> tuple[set[str], set[str]]:
    """(proxied, modules): names the tests (or their setup) read that no builtin provides, and the
    entry point, are the solution's functions as far as the tests are concerned -- except a
    standard-library module's name used only as ``name.attr`` (``math.isclose``: tests that relied
    on the solution's own ``import math``), which is that module. Setup code may rebind any."""
    used, plain = set(), set()  # every name read; those read other than as name.attr
    for code in [spec.setup, *spec.tests]:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        bases = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                used.add(n.id)
                if id(n) not in bases:
                    plain.add(n.id)
    names = {n for n in used if n not in _BUILTIN_NAMES}
    modules = {n for n in names - plain if n in sys.stdlib_module_names and n != spec.entry_point}
    proxied = (names - modules) | ({spec.entry_point} if spec.entry_point else set())
    return proxied, modules


def _raise_like(answer: dict) -> None:
    """Raise what the solution said it raised: a built-in exception class by name, else SolutionError."""
    name, message = str(answer.get("raised"))[:100], str(answer.get("message", ""))[:300]
    cls = getattr(builtins, name, None)
    # StopIteration would end the iteration it was raised in: `all(map(candidate, xs))` would hold
    if isinstance(cls, type) and issubclass(cls, Exception) and cls not in (StopIteration, StopAsyncIteration):
        try:
            exc = cls(message)
        except Exception:
            exc = SolutionError(f"{name}: {message}")
        raise exc
    if isinstance(cls, type) and issubclass(cls, BaseException):  # SystemExit, KeyboardInterrupt, ...
        raise SolutionBroke(f"the solution raised {name}")
    raise SolutionError(f"{name}: {message}")


def _write_back(args: list, after: Any) -> None:
    """In-place changes the solution made to its arguments, made to the judge's own objects."""
    if not isinstance(after, list) or len(after) != len(args):
        return
    for before, now in zip(args, after):
        if type(before) is list and type(now) is list or type(before) is bytearray and type(now) is bytes:
            before[:] = now
        elif type(before) in (dict, set) and type(now) is type(before):
            before.clear()
            before.update(now)


def judge(spec: HiddenTests, call: Callable[[str, list, dict], dict]) -> list[dict]:
    """Run the hidden tests on the host; `call(name, args, kwargs)` asks the solution (blocking) and
    gives its decoded answer: {"value": v, "args": [...]} or {"raised": type name, "message": str}.
    One {"passed": bool, "error"?: str} per test."""

    def proxy(name: str):
        def solution_function(*args, **kwargs):
            args = list(args)
            answer = call(name, args, kwargs)
            if "raised" in answer:
                _raise_like(answer)
            _write_back(args, answer["args"])
            return answer["value"]

        solution_function.__name__ = solution_function.__qualname__ = name
        return solution_function

    base: dict[str, Any] = {"__name__": "hidden_tests", "__builtins__": builtins}
    proxied, modules = free_names(spec)
    base.update({name: proxy(name) for name in proxied})
    for name in modules:
        try:
            base[name] = importlib.import_module(name)
        except ImportError:
            base[name] = proxy(name)
    if spec.context:
        try:
            exec(compile(spec.context, "<task prompt>", "exec"), base)
        except BaseException:  # noqa: BLE001 - what it did not define stays the solution's
            pass
        if spec.entry_point:
            base[spec.entry_point] = proxy(spec.entry_point)
    setup_error = ""
    try:
        exec(compile(spec.setup, "<test setup>", "exec"), base)
    except BaseException as exc:  # noqa: BLE001 - a test setup that fails fails every test, with the reason
        setup_error = f"the test setup failed: {_describe(exc)}"
    results = []
    for test in spec.tests:
        if setup_error:
            results.append({"passed": False, "error": setup_error})
            continue
        try:
            exec(compile(test, "<hidden test>", "exec"), dict(base))
            results.append({"passed": True})
        except BaseException as exc:  # noqa: BLE001 - whatever a test raises, it failed
            results.append({"passed": False, "error": _describe(exc)})
    return results


def _describe(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]


async def judge_solution(spec: HiddenTests, spawn: Callable[[], Awaitable[asyncio.subprocess.Process]], *,
                         main: str = "solution.py", bounds: Bounds | None = None) -> GradeResult:
    """Grade the solution that `spawn()` starts (a child.py process): the judge runs in a worker
    thread, each call of the solution is a request to the child on this event loop."""
    bounds = bounds or Bounds()
    loop = asyncio.get_running_loop()
    solution = SolutionProcess(spawn, main, bounds)

    def on_loop(coro, timeout: float):
        # the coroutine bounds itself; the margin only keeps this thread from waiting on a dead loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout + 30)

    def call(name: str, args: list, kwargs: dict) -> dict:
        answer = on_loop(solution.call(name, args, kwargs), bounds.test_timeout + max(bounds.test_timeout, 10.0))
        if "raised" in answer:
            return answer
        try:  # decoded here, in the judge's thread: an answer of up to max_answer_bytes never stalls the loop
            return {"value": decode(answer["value"]), "args": decode(answer.get("args"))}
        except (KeyError, ValueError, RecursionError) as e:
            why = f"{name}(): a malformed answer ({type(e).__name__}: {str(e)[:200]})"
            on_loop(solution.give_up(why), 10)  # what it sends next cannot be trusted to answer anything
            raise SolutionBroke(why) from None

    try:
        details = await _in_thread(judge, spec, call)
        error = solution.gave_up or None
    finally:
        # a judge left running (the grading was cancelled) gets no new process for its next calls
        solution.gave_up = solution.gave_up or "the grading ended"
        await solution.kill()
    passed = sum(d["passed"] for d in details)
    return GradeResult(passed, len(details), details, error=error)


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a thread of its own: a judge waits on the solution for up to total_timeout,
    and in asyncio's shared executor (a few threads) it would hold up other gradings and every
    other to_thread of the rollout, its deadline running while it waited for a thread."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if not done.done():
            done.set_exception(exc) if exc is not None else done.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="agentrl-judge", daemon=True).start()
    return await done


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
