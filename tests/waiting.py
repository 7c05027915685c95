"""One way for tests to wait: poll a condition until it holds, with a timeout that fails the
test naming what never happened (no hand-written deadline loops, no fixed sleeps)."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from typing import Any, Callable


def wait_until(condition: Callable[[], Any], *, timeout_s: float, what: str = "the condition",
               interval_s: float = 0.2, while_: Callable[[], Any] | None = None) -> Any:
    """condition()'s first truthy value, polled every `interval_s`; an AssertionError after
    `timeout_s` (or as soon as `while_()` turns false: the process it waits on died), saying
    `what` did not happen. `what` may be a callable, for a message built at the failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if while_ is not None and not while_():
            raise AssertionError(f"{_text(what)} never happened: what it waited on ended")
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_text(what)} did not happen within {timeout_s:g}s")
        time.sleep(interval_s)


async def await_until(condition: Callable[[], Any], *, timeout_s: float, what: str = "the condition",
                      interval_s: float = 0.01) -> Any:
    """`wait_until` for a test's event loop: the loop runs other tasks between polls. The
    condition may be a coroutine function (one that asks a server, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_text(what)} did not happen within {timeout_s:g}s")
        await asyncio.sleep(interval_s)


def accepts_connections(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server listens on the port yet (a condition for `wait_until`)."""
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def _text(what) -> str:
    return what() if callable(what) else what
