"""The judge: a task's hidden tests, run on the host against the values the solution answers.

Standard library only, and no import of agentrl: `grader.judge_solution` runs this file in a
host process of its own (``python -I judge.py child.py``), so that a test doing unbounded work
with what the solution returned (``range(candidate(n))``, ``"x" * candidate(n)``) is ended by
the grading's wall-clock bound and a memory cap, instead of holding the trainer's process.

Protocol on its stdin/stdout (one JSON object per line): it reads ``{"spec": {...}}``, then
sends ``{"call": name, "args": wire, "kwargs": wire}`` and reads the solution's answer as the
child sent it (or ``{"broke": why}``), sends ``{"give_up": why}`` when an answer is malformed,
``{"result": {...}}`` per test and ``{"done": true}`` at the end.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable


class SolutionBroke(BaseException):
    """The solution's process hung, died, did not load or broke the protocol. A BaseException, so
    that no ``except Exception`` in a test takes it for an exception the test expected."""


class SolutionError(Exception):
    """The solution raised an exception the judge has no built-in class for (its type name is the message)."""


_BUILTIN_NAMES = set(dir(builtins))


def free_names(spec: Any) -> tuple[set[str], set[str]]:
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


def judge(spec: Any, call: Callable[[str, list, dict], dict],
          on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Run the hidden tests on the host; `call(name, args, kwargs)` asks the solution (blocking) and
    gives its decoded answer: {"value": v, "args": [...]} or {"raised": type name, "message": str}.
    One {"passed": bool, "error"?: str} per test (each also given to `on_result` as it is known)."""

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
            result = {"passed": False, "error": setup_error}
        else:
            try:
                exec(compile(test, "<hidden test>", "exec"), dict(base))
                result = {"passed": True}
            except BaseException as exc:  # noqa: BLE001 - whatever a test raises, it failed
                result = {"passed": False, "error": _describe(exc)}
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _describe(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]


def _load_child(path: str):
    """child.py (encode/decode of the wire format) by path, as a module of this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("agentrl_judge_child", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(child_path: str, memory_mb: int = 4096) -> None:
    """The judge's own process: run one spec's tests, asking the parent for the solution's answers."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    except (ImportError, ValueError, OSError):
        pass
    child = _load_child(child_path)
    proto_in, proto_out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the tests print goes to stderr, never into the protocol
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto_out.write(json.dumps(obj).encode() + b"\n")
        proto_out.flush()

    def receive() -> dict:
        line = proto_in.readline()
        if not line:
            raise SystemExit(0)  # the parent is gone
        return json.loads(line)

    spec = SimpleNamespace(**receive()["spec"])

    def call(name: str, args: list, kwargs: dict) -> dict:
        send({"call": name, "args": child.encode(args), "kwargs": child.encode(kwargs)})
        answer = receive()
        if "broke" in answer:
            raise SolutionBroke(str(answer["broke"]))
        if "raised" in answer:
            return answer
        try:
            return {"value": child.decode(answer["value"]), "args": child.decode(answer.get("args"))}
        except (KeyError, ValueError, RecursionError, TypeError) as e:
            why = f"{name}(): a malformed answer ({type(e).__name__}: {str(e)[:200]})"
            send({"give_up": why})  # what it sends next cannot be trusted to answer anything
            raise SolutionBroke(why) from None

    judge(spec, call, on_result=lambda r: send({"result": r}))
    send({"done": True})


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
