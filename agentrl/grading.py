"""Grading with a wall-clock bound, from any thread, off the event loop.

A grader reads what the model wrote, and the model is an adversary: math_verify hands a
``\\boxed{10^{10}!}`` to sympy, which computes for minutes in C code where no signal reaches
it (and ``signal.alarm``, math_verify's own guard, works only in the main thread). So graders
run in worker processes (`GraderPool`): a call past its time limit kills its worker (the next
call starts a fresh one) and raises `GradingTimeout`, an `AgentFault`: the answer scores 0
with the reason recorded, never a failed group. Each worker is an ordinary ``python -m
agentrl.grading`` subprocess (no multiprocessing: its spawn and forkserver modes re-import the
parent's ``__main__``), capped in memory, and dies with its parent.

    from agentrl.grading import grading_pool
    ok = grading_pool().call("agentrl.envs.math_env.grader:verify_in_process", answer, gold, timeout=20)
    ok = await grading_pool().acall(...)   # the same from the event loop, in a thread: never blocks it

User code registered in-process (``--custom-rm-path`` reward functions, ``register_parser``
tool-call parsers) may be a closure, so it cannot be named for a fresh interpreter: a sync one
runs in a process forked from the caller for the call (`call_in_fork`), which inherits the
function and its arguments (nothing is pickled on the way in; the value comes back pickled),
and is killed past its time limit or memory bound: `GradingTimeout`, the agent's fault, and
nothing left running. What a forked call changes in its arguments or globals stays in the
child, and the child has only the thread that forked it: a function that waits on a lock
another thread of the parent held at that moment waits until its bound.

An async reward function (`call_reward_fn`) runs on an event loop of its own in a daemon thread
(`_RewardLoop`), never on the caller's: one that computes without awaiting (sympy inside an
`async def`) blocks that loop, not the rollout's. Its calls share that loop, so a client it keeps
between calls (an aiohttp session to a remote reward model) keeps working, and what it keeps in
globals stays. Past its limit a call is cancelled; if the loop does not answer within
`STUCK_GRACE_S` it is blocked: it is left to its thread (told to stop when it comes back) and the
next call gets a fresh loop. A blocked thread cannot be killed, so at most
`MAX_BLOCKED_LOOPS` are left at once; past that, each call runs in a forked child instead
(`asyncio.run` there: bounded and killed like a sync function's, but a client or state made on
the shared loop is not there, and nothing it changes comes back).
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import importlib
import inspect
import json
import os
import pickle
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from agentrl.errors import AgentFault, AgentRLError
from agentrl.parent_death import die_with_parent

__all__ = ["GraderPool", "GradingTimeout", "GradingError", "grading_pool", "call_reward_fn", "call_in_fork"]

WORKER_MEMORY_MB = 3072      # address space of a worker: a huge number's digits end in MemoryError, not the host's OOM
WORKER_START_TIMEOUT_S = 60  # importing sympy on a loaded machine
MAX_MESSAGE_BYTES = 16 << 20  # one request or answer line


class GradingTimeout(AgentFault):
    """A grader ran past its time limit on the agent's answer (or its worker died on it): the
    answer scores 0, the trajectory is not failed."""


class GradingError(AgentRLError):
    """The grading machinery itself failed (a worker that cannot start): infrastructure."""


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` has data (or its end) within `timeout_s`; poll, not select: a trainer's
    process may hold more than select's 1024 descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, timeout_s) * 1000))


class _Worker:
    def __init__(self, preload: tuple[str, ...], memory_mb: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "agentrl.grading", str(memory_mb), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.buf = b""
        ready = self.read_line(time.monotonic() + WORKER_START_TIMEOUT_S)
        if ready != {"ready": True}:
            self.kill()
            raise GradingError(f"a grading worker did not start ({ready!r}); run `{sys.executable} -m agentrl.grading` "
                               "to see why")

    def read_line(self, deadline: float) -> Any:
        """The next JSON line; None at the deadline; "ended" if the worker closed its output."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(self.buf) > MAX_MESSAGE_BYTES:
                return None
            if not _readable(fd, left):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "ended"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class GraderPool:
    """Up to `size` worker processes; `call` runs ``module:function(*args)`` in an idle one
    (starting one when none is idle) and returns its JSON value within `timeout` seconds."""

    def __init__(self, size: int = 0, *, preload: tuple[str, ...] = (), memory_mb: int = WORKER_MEMORY_MB):
        self.size = size or max(1, min(4, os.cpu_count() or 1))
        self.preload, self.memory_mb = tuple(preload), memory_mb
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.size)
        # acall's waits: threads of their own, so a queue of graders never holds the loop's default executor
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="grading")
        self.timeouts = 0  # calls that ran past their limit (their worker was killed)

    def call(self, function: str, *args: Any, timeout: float) -> Any:
        """`function` ("module:name", importable in a fresh interpreter) applied to JSON `args`.
        GradingTimeout past `timeout` s; GradingError if it raised or a worker cannot start."""
        # every holder gives its slot back within its own timeout: this wait is bounded too
        if not self._slots.acquire(timeout=600):
            raise GradingError("no grading worker was free for 600 s")
        try:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.poll() is not None:
                worker = _Worker(self.preload, self.memory_mb)
            request = json.dumps({"fn": function, "args": list(args)}).encode() + b"\n"  # ASCII: surrogates escaped
            try:
                worker.proc.stdin.write(request)
                worker.proc.stdin.flush()
                answer = worker.read_line(time.monotonic() + timeout)
            except (OSError, ValueError):  # a broken pipe: it ended
                answer = "ended"
            if not isinstance(answer, dict):
                ended = answer == "ended"
                worker.kill()
                self.timeouts += 1
                raise GradingTimeout(f"{function.rsplit(':', 1)[-1]} " + (
                    "ended its worker process" if ended else f"ran past its {timeout:g} s limit") + " on this answer")
            with self._lock:
                self._idle.append(worker)
            if "error" in answer:
                raise GradingError(f"{function} raised {answer['error']}")
            return answer.get("value")
        finally:
            self._slots.release()

    async def acall(self, function: str, *args: Any, timeout: float) -> Any:
        """`call` from the event loop: it waits in one of the pool's threads, the loop goes on."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: self.call(function, *args, timeout=timeout))

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for w in workers:
            w.kill()


_POOL: GraderPool | None = None
_POOL_LOCK = threading.Lock()


def grading_pool() -> GraderPool:
    """The process's pool of grading workers (started on first use, killed at exit)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = GraderPool(preload=("math_verify",))
            atexit.register(_POOL.close)
        return _POOL


def _vm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _child(fn: Callable, args: tuple, out: int, memory_mb: int) -> None:
    """The forked child: fn(*args), its value (or exception) pickled to `out`; never returns."""
    try:
        # No collections: a pass would touch every object the parent had (copying its heap page
        # by page) and run finalizers of objects that belong to the parent's other threads.
        gc.disable()
        os.setpgid(0, 0)  # its own group: the kill reaches what it started
        die_with_parent()
        limit = _vm_bytes() + (memory_mb << 20)  # on top of what it inherited mapped
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                data = pickle.dumps(("bad", "returned an awaitable: define it with `async def` so it runs on the "
                                            "event loop"))
            else:
                try:
                    data = pickle.dumps(("value", value))
                except Exception as e:  # noqa: BLE001 - said to the caller
                    data = pickle.dumps(("bad", f"returned a value that cannot come back from its process "
                                                f"({type(e).__name__}: {e}): return a number, a dict or "
                                                "another picklable value"[:1000]))
        except MemoryError:
            data = pickle.dumps(("memory", None))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            try:
                data = pickle.dumps(("raised", e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
                data = pickle.dumps(("error", f"{type(e).__name__}: {e}"[:1000]))
        view = memoryview(struct.pack("<Q", len(data)) + data)
        while view:
            view = view[os.write(out, view[:1 << 16]):]
    finally:
        os._exit(0)  # no atexit, no flushing of the parent's buffers


def call_in_fork(fn: Callable, *args: Any, timeout: float, what: str = "",
                 memory_mb: int = WORKER_MEMORY_MB) -> Any:
    """``fn(*args)`` in a child forked from this process for this call, from any thread: its
    value (pickled back), or its exception re-raised. Past `timeout` s, or past `memory_mb` MiB
    more than it inherited, or dead by a signal, the child's process group is killed and
    GradingTimeout (the agent's fault) raised. A value that does not pickle is a GradingError
    naming `what`: the function's own bug."""
    what = what or getattr(fn, "__qualname__", repr(fn))
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        raise GradingError(f"{what}: cannot fork a process to run it in ({e})") from None
    if pid == 0:
        os.close(r)
        _child(fn, args, w, memory_mb)
    os.close(w)
    # The message is length-prefixed, so its end is known without EOF: a child forked meanwhile by
    # another thread's call inherits this pipe's write end and may keep it open for its whole bound.
    chunks, size, deadline, ended, expected = [], 0, time.monotonic() + timeout, False, None
    try:
        while size <= MAX_MESSAGE_BYTES + 8:
            if expected is None and size >= 8:
                expected = 8 + struct.unpack("<Q", b"".join(chunks)[:8])[0]
            if expected is not None and size >= expected:
                ended = True  # all of it: the child exits now
                break
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(r, left):
                break
            chunk = os.read(r, 1 << 16)
            if not chunk:
                ended = True
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(r)
        if not ended:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
            except PermissionError:  # before its setpgid: the child alone
                os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)  # it wrote all and exits, or was just killed
    try:
        message = b"".join(chunks)
        complete = len(message) >= 8 and len(message) == 8 + struct.unpack("<Q", message[:8])[0]
        kind, value = pickle.loads(message[8:]) if ended and complete else (None, None)
    except Exception:  # noqa: BLE001 - cut short or garbled: it died while writing
        kind, value = None, None
    if kind == "value":
        return value
    if kind == "raised":
        raise value
    if kind == "error":
        raise GradingError(f"{what} raised {value}")
    if kind == "bad":
        raise GradingError(f"{what} {value}")
    if kind == "memory":
        raise GradingTimeout(f"{what} ran out of its {memory_mb} MiB memory bound on this output")
    if size > MAX_MESSAGE_BYTES + 8:
        raise GradingTimeout(f"{what} returned more than {MAX_MESSAGE_BYTES >> 20} MiB on this output (its process "
                             "was killed)")
    if not ended:
        raise GradingTimeout(f"{what} ran past its {timeout:g} s limit on this output (its process was killed)")
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    raise GradingTimeout(f"{what} ended its worker process" + (f" (signal {sig})" if sig else "") + " on this output")


STUCK_GRACE_S = 1.0      # how long a loop whose call ran past its limit gets to take the cancellation
MAX_BLOCKED_LOOPS = 4    # blocked reward loops left to their threads at once, before calls go to forks


class _RewardLoop:
    """An event loop running in a daemon thread of its own, for async reward functions."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="agentrl-reward-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.loop.run_forever()
        self.loop.close()  # stopped after it was left blocked: its descriptors go with it

    def answers(self, within_s: float) -> bool:
        answered = threading.Event()
        self.loop.call_soon_threadsafe(answered.set)
        return answered.wait(within_s)

    def abandon(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)  # runs once the blocked call lets go


_reward_loop: _RewardLoop | None = None
_blocked: list[_RewardLoop] = []
_reward_loop_lock = threading.Lock()


def _shared_reward_loop() -> _RewardLoop | None:
    """The loop async reward functions run on; None while MAX_BLOCKED_LOOPS are blocked."""
    global _reward_loop
    with _reward_loop_lock:
        _blocked[:] = [b for b in _blocked if b.thread.is_alive()]
        if _reward_loop is None and len(_blocked) < MAX_BLOCKED_LOOPS:
            _reward_loop = _RewardLoop()
        return _reward_loop


def _leave_blocked(holder: _RewardLoop) -> None:
    global _reward_loop
    with _reward_loop_lock:
        if _reward_loop is holder:
            _reward_loop = None
            _blocked.append(holder)
    holder.abandon()


async def _within(rm: Callable, args: tuple, timeout: float, what: str) -> Any:
    bound = asyncio.timeout(timeout)
    try:
        async with bound:
            return await rm(*args)
    except TimeoutError:
        if bound.expired():
            raise GradingTimeout(f"{what} ran past its {timeout:g} s limit") from None
        raise  # its own (a request of its own timed out)


def _run_to_completion(rm: Callable, *args: Any) -> Any:
    """A forked child's body for an async reward function: a loop of its own."""
    return asyncio.run(rm(*args))


async def call_reward_fn(rm: Callable, *args: Any, timeout: float) -> Any:
    """``rm(*args)`` within `timeout` seconds, GradingTimeout past it (the agent's fault), never
    blocking the caller's loop. A sync rm runs in a forked child (`call_in_fork`) that is killed at
    the limit, waited on from a thread; an async one on the reward loop (see the module docstring)."""
    what = "the custom reward function"
    if not inspect.iscoroutinefunction(rm):
        return await asyncio.to_thread(call_in_fork, rm, *args, timeout=timeout, what=what)
    holder = _shared_reward_loop()
    if holder is None:  # every loop it was given is blocked: a process, killed at the limit
        return await asyncio.to_thread(call_in_fork, _run_to_completion, rm, *args, timeout=timeout, what=what)
    call = asyncio.run_coroutine_threadsafe(_within(rm, args, timeout, what), holder.loop)
    waiting = asyncio.wrap_future(call)
    try:
        done, _ = await asyncio.wait({waiting}, timeout=timeout + STUCK_GRACE_S)
    except asyncio.CancelledError:
        call.cancel()  # the caller gave up: so does the call
        raise
    if not done:  # the reward loop's own timeout never fired: something blocks that loop
        call.cancel()
        if not await asyncio.to_thread(holder.answers, STUCK_GRACE_S):
            _leave_blocked(holder)
        raise GradingTimeout(f"{what} ran past its {timeout:g} s limit (it blocked its event loop)")
    return waiting.result()


# ---- the worker's side ------------------------------------------------------------------------------
def _serve(memory_mb: int, preload: list[str]) -> None:
    import resource

    die_with_parent()
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the call that needs it says so
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            module, _, name = request["fn"].partition(":")
            value = getattr(importlib.import_module(module), name)(*request["args"])
            answer = json.dumps({"value": value})
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the worker goes on
            answer = json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]})
        out.write(answer.encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else WORKER_MEMORY_MB, sys.argv[2:])
