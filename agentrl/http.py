"""The host side's HTTP, in one place: every call agentrl makes to an engine, the router or
another service goes through here.

- `request_json(method, url, payload, timeout=...)` and `http_ok(url)`: blocking calls for the
  control plane (the router's worker API, /model_info, /health probes), through the standard
  library.
- `json_session(...)` and `post_json` / `get_json` / `get_ok`: the aiohttp session and calls
  of the rollout path (/generate and the engines' other protocol calls; the reward model, the
  judge and the retrieval service), JSON through orjson.
- `RetryPolicy`: the one retry policy, run by tenacity: a bounded number of tries, a bound
  on the total time, exponential back-off with jitter, and which failures are retried
  (no answer at all, or an HTTP status in `retry_statuses`; never a 4xx).

Every failure to get a usable answer is an `HTTPCallError` that names the method, the URL and
the HTTP status (or what went wrong on the way). It is an EngineError: every HTTP peer of the
host side is an engine, the router in front of them, or a service the rollout depends on.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import aiohttp
import orjson
import tenacity

from agentrl.errors import EngineError

T = TypeVar("T")

__all__ = ["HTTPCallError", "RetryPolicy", "NO_RETRY", "request_json", "http_ok", "json_session", "post_json",
           "get_json", "get_ok", "dumps_json", "loads_json"]


class HTTPCallError(EngineError):
    """No usable answer from a URL: `status` is the HTTP status of an answer that cannot be used
    (not 2xx, or not the JSON asked for), None when none came (refused, reset, timed out, a
    garbled reply); `timed_out` says it was a timeout."""

    def __init__(self, message: str, *, url: str, status: int | None = None, timed_out: bool = False):
        super().__init__(message)
        self.url, self.status, self.timed_out = url, status, timed_out


@dataclass(frozen=True)
class RetryPolicy:
    """How a call is retried. A failure is retried when `retryable` says so, while both bounds
    hold: at most `attempts` tries in all, and no try starts `deadline_s` or more after the
    first (None: the tries alone bound it; each try is bounded by its call's own timeout).
    The wait after the n-th failure is backoff_s * 2**(n-1), capped at max_backoff_s, then
    shortened by a random fraction up to `jitter` (callers that failed together do not all
    come back at the same instant)."""

    attempts: int = 3
    deadline_s: float | None = None
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    jitter: float = 0.25
    retry_statuses: frozenset[int] = field(default=frozenset(range(500, 600)))
    max_timeouts: int = 2  # a call that timed out this many times is not tried again (it would only time out again)

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1 (the first try), got {self.attempts}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"RetryPolicy.deadline_s must be positive or None, got {self.deadline_s}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"RetryPolicy: need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, "
                             f"{self.max_backoff_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")
        if self.max_timeouts < 1:
            raise ValueError(f"RetryPolicy.max_timeouts must be at least 1, got {self.max_timeouts}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failed try (1 for the first)."""
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
        return base * (1 - self.jitter * random.random())

    def retryable(self, exc: BaseException) -> bool:
        """No answer at all (the server may be restarting, the router dropping it), or a
        status in `retry_statuses`; a 4xx (the request itself is wrong) never."""
        if not isinstance(exc, HTTPCallError):
            return False
        return exc.status is None or exc.status in self.retry_statuses

    def _retrying(self, cls, on_retry: Callable[[BaseException], None] | None, sleep):
        timeouts = 0

        def retry(state: tenacity.RetryCallState) -> bool:
            nonlocal timeouts
            exc = state.outcome.exception()
            if exc is None or not self.retryable(exc):
                return False
            timeouts += bool(getattr(exc, "timed_out", False))
            return timeouts < self.max_timeouts

        def before_sleep(state: tenacity.RetryCallState) -> None:
            if on_retry is not None:
                on_retry(state.outcome.exception())

        stop = tenacity.stop_after_attempt(self.attempts)
        if self.deadline_s is not None:
            stop = stop | tenacity.stop_before_delay(self.deadline_s)
        return cls(retry=retry, stop=stop, wait=lambda state: self.delay(state.attempt_number),
                   before_sleep=before_sleep, sleep=sleep, reraise=True)

    async def call(self, fn: Callable[[], Awaitable[T]], *, on_retry: Callable[[BaseException], None] | None = None
                   ) -> T:
        """await fn() until it returns, or raise the last failure once the policy gives up.
        `on_retry(exc)` runs before each wait (to count retries)."""
        # asyncio.sleep looked up at each wait, not bound at import (tests record the waits)
        return await self._retrying(tenacity.AsyncRetrying, on_retry, lambda s: asyncio.sleep(s))(fn)

    def call_sync(self, fn: Callable[[], T], *, on_retry: Callable[[BaseException], None] | None = None) -> T:
        """The blocking form of `call`."""
        return self._retrying(tenacity.Retrying, on_retry, lambda s: time.sleep(s))(fn)


NO_RETRY = RetryPolicy(attempts=1)


# ---- the control plane: blocking JSON calls ---------------------------------------------------

def request_json(method: str, url: str, payload: Any = None, *, timeout: float) -> Any:
    """One JSON call: `payload` (if any) as the body, the answer's JSON back (None for an empty
    body). HTTPCallError when there is no usable answer: a non-2xx status (with the start of
    the body), or none at all (refused, reset, timed out, a garbled or non-JSON reply)."""
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body.strip() else None
    except urllib.error.HTTPError as exc:  # an answer, with a status that is not 2xx
        text = exc.read(500).decode(errors="replace") if exc.fp is not None else ""
        raise HTTPCallError(f"{method} {url}: HTTP {exc.code}: {text}", url=url, status=exc.code) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # no answer, or not JSON
        timed_out = isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)
        raise HTTPCallError(f"{method} {url}: {type(exc).__name__}: {exc}", url=url, timed_out=timed_out) from None


def http_ok(url: str, timeout: float = 5.0) -> bool:
    """Does GET url answer 200? Any failure to get an answer (refused, reset, a garbled or
    partial reply, a timeout) is "no", never an exception: a server that is starting or dying
    can fail in all of these ways."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException, ValueError):
        return False


def download(url: str, path, *, timeout: float) -> None:
    """GET url into the file `path`, streamed (a model's wheel: hundreds of MB). HTTPCallError
    when there is no usable answer; a partial file is removed."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(path, "wb") as f:
            expected, got = resp.headers.get("Content-Length"), 0
            while chunk := resp.read(1 << 20):
                got += f.write(chunk)
        if expected is not None and got != int(expected):  # the connection ended early
            raise http.client.IncompleteRead(b"", int(expected) - got)
    except urllib.error.HTTPError as exc:
        _unlink(path)
        raise HTTPCallError(f"GET {url}: HTTP {exc.code}", url=url, status=exc.code) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        _unlink(path)
        raise HTTPCallError(f"GET {url}: {type(exc).__name__}: {exc}", url=url) from None


def _unlink(path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# ---- the rollout path: one aiohttp session per client ----------------------------------------

# JSON both ways through orjson: the standard library's codec was ~10% of a turn's client CPU with a
# 100-token context (bench/rollout_overhead.py), and grows with the context. What orjson refuses to
# write (integers past 64 bits) or read (NaN) goes through json as before. Unlike json, orjson writes
# NaN and infinities as null and reads integers past 64 bits as floats: no engine reply holds those.
def dumps_json(value) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value)


def loads_json(data: bytes):
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def json_session(*, timeout_s: float, max_connections: int | None = None) -> aiohttp.ClientSession:
    """The rollout path's session: `timeout_s` bounds each request; `max_connections` None sets
    no pool limit (the caller's own concurrency bound holds the requests in flight)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections or 0),  # 0: no limit
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), json_serialize=dumps_json)


# what "no answer" looks like in aiohttp: refused, reset, cut mid-body, timed out
_NO_ANSWER = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


async def _json_call(session: aiohttp.ClientSession, method: str, url: str, payload: Any,
                     headers: dict | None, timeout: aiohttp.ClientTimeout | None, expect_json: bool = False):
    """One try: (body, response headers); the body is JSON when the server says so (or
    `expect_json`: whatever it says; a body that is not JSON is then an HTTPCallError), else text."""
    extra = {"timeout": timeout} if timeout is not None else {}  # aiohttp reads timeout=None as "none at all"
    try:
        async with session.request(method, url, json=payload, headers=headers, **extra) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:500]
                raise HTTPCallError(f"{method} {url}: HTTP {resp.status}: {text}", url=url, status=resp.status)
            if expect_json:
                data = (await resp.read()).strip()
                try:
                    return (loads_json(data) if data else None), resp.headers
                except ValueError:
                    raise HTTPCallError(f"{method} {url}: the answer is not JSON: {data[:200]!r}", url=url,
                                        status=resp.status) from None
            if resp.content_type == "application/json":  # as resp.json(), without its checks redone
                data = (await resp.read()).strip()
                return (loads_json(data) if data else None), resp.headers
            return await resp.text(), resp.headers
    except _NO_ANSWER as exc:
        raise HTTPCallError(f"{method} {url}: {exc!r}", url=url, timed_out=isinstance(exc, asyncio.TimeoutError)
                            ) from exc


async def post_json(session: aiohttp.ClientSession, url: str, payload: Any, *, headers: dict | None = None,
                    retry: RetryPolicy = NO_RETRY, on_retry: Callable[[BaseException], None] | None = None,
                    expect_json: bool = False):
    """POST `payload` as JSON under `retry`: (body, response headers); `expect_json`: the body is
    read as JSON whatever its content type says. After the last try: the status error as it
    is, or "failed after N tries" naming the last transport failure."""
    tries = 0

    async def once():
        nonlocal tries
        tries += 1
        return await _json_call(session, "POST", url, payload, headers, None, expect_json)

    try:
        return await retry.call(once, on_retry=on_retry)
    except HTTPCallError as exc:
        if exc.status is not None or tries == 1:
            raise
        raise HTTPCallError(f"POST {url} failed after {tries} tries: {exc.__cause__ or exc!r}", url=url,
                            timed_out=exc.timed_out) from exc.__cause__


async def get_ok(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> bool:
    """`http_ok` on the rollout path's session: does GET url answer 200 (the body unread)?"""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def get_json(session: aiohttp.ClientSession, url: str, *, timeout_s: float | None = None):
    """GET once: the body (JSON when the server says so, else text); HTTPCallError otherwise."""
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
    body, _ = await _json_call(session, "GET", url, None, None, timeout)
    return body
