"""agentrl.http: the one retry policy's bounds (tries, total time, back-off with jitter) and what
it retries, and the control plane's JSON call (its errors name the URL and the status). The
rollout path's calls are tested through EngineClient in tests/test_engine_client.py."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agentrl.engines.launch import free_port
from agentrl.errors import EngineError
from agentrl.http import NO_RETRY, HTTPCallError, RetryPolicy, http_ok, request_json


def failing(exc: BaseException):
    """A call that always raises `exc`, and the list of its calls' times."""
    calls = []

    def fn():
        calls.append(time.monotonic())
        raise exc

    return fn, calls


def no_answer(timed_out=False):
    return HTTPCallError("GET http://x/: refused", url="http://x/", timed_out=timed_out)


def status(code: int):
    return HTTPCallError(f"GET http://x/: HTTP {code}", url="http://x/", status=code)


FAST = RetryPolicy(attempts=4, backoff_s=0.001, max_backoff_s=0.002)


def test_a_failure_is_tried_attempts_times_then_raised_as_itself():
    fn, calls = failing(status(503))
    with pytest.raises(HTTPCallError, match="HTTP 503"):
        FAST.call_sync(fn)
    assert len(calls) == 4
    fn, calls = failing(no_answer())
    with pytest.raises(HTTPCallError):
        NO_RETRY.call_sync(fn)
    assert len(calls) == 1


def test_no_try_starts_after_the_deadline():
    policy = RetryPolicy(attempts=1000, deadline_s=0.3, backoff_s=0.05, max_backoff_s=0.05, jitter=0)
    fn, calls = failing(no_answer())
    with pytest.raises(HTTPCallError):
        policy.call_sync(fn)
    assert 3 <= len(calls) <= 7  # one every 0.05 s within 0.3 s, not a thousand
    assert calls[-1] - calls[0] < 0.3


@pytest.mark.parametrize("exc, tries", [(status(500), 4), (status(502), 4), (no_answer(), 4),
                                         (status(400), 1), (status(404), 1), (status(429), 1),
                                         (ValueError("a bug, not the network"), 1)])
def test_what_is_retried(exc, tries):
    fn, calls = failing(exc)
    with pytest.raises(type(exc)):
        FAST.call_sync(fn)
    assert len(calls) == tries


def test_statuses_retried_are_the_policys():
    policy = RetryPolicy(attempts=3, backoff_s=0, max_backoff_s=0, retry_statuses=frozenset({429, 503}))
    assert policy.retryable(status(429)) and policy.retryable(status(503)) and not policy.retryable(status(500))


def test_a_call_that_timed_out_twice_is_not_tried_again():
    fn, calls = failing(no_answer(timed_out=True))
    with pytest.raises(HTTPCallError):
        FAST.call_sync(fn)
    assert len(calls) == 2


def test_the_async_form_retries_counts_and_returns_the_answer():
    answers = [status(503), no_answer(), "ok"]
    seen = []

    async def fn():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert asyncio.run(FAST.call(fn, on_retry=seen.append)) == "ok"
    assert [e.status for e in seen] == [503, None]


def test_the_wait_doubles_to_its_cap_and_jitter_only_shortens_it():
    exact = RetryPolicy(attempts=9, backoff_s=0.5, max_backoff_s=3.0, jitter=0)
    assert [exact.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    jittered = RetryPolicy(attempts=9, backoff_s=0.5, max_backoff_s=3.0, jitter=0.5)
    waits = [[jittered.delay(n) for _ in range(200)] for n in range(1, 7)]
    for n, ws in enumerate(waits, 1):
        assert all(0.5 * exact.delay(n) <= w <= exact.delay(n) for w in ws)
        assert max(ws) - min(ws) > 0.1 * exact.delay(n)  # spread, not one value


@pytest.mark.parametrize("kwargs, field", [({"attempts": 0}, "attempts"), ({"deadline_s": 0}, "deadline_s"),
                                           ({"backoff_s": 2, "max_backoff_s": 1}, "backoff_s"),
                                           ({"jitter": 1.5}, "jitter"), ({"max_timeouts": 0}, "max_timeouts")])
def test_a_policy_without_a_bound_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RetryPolicy(**kwargs)


@pytest.fixture(scope="module")
def server():
    """A local server: /json answers {"echo": body}, /empty 200 with no body, /status/N that status,
    /garbled a body that is not JSON."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.startswith("/status/"):
                self.send_response(int(self.path.rsplit("/", 1)[1]))
                out = b"the server says no"
            elif self.path == "/json":
                self.send_response(200)
                out = json.dumps({"echo": json.loads(body) if body else None, "method": self.command}).encode()
            elif self.path == "/garbled":
                self.send_response(200)
                out = b"{not json"
            elif self.path == "/big":
                self.send_response(200)
                out = BIG
            elif self.path == "/cut":  # promises more than it sends, then closes
                self.send_response(200)
                self.send_header("Content-Length", str(len(BIG)))
                self.end_headers()
                self.wfile.write(BIG[: len(BIG) // 2])
                self.close_connection = True
                return
            else:
                self.send_response(200)
                out = b""
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def test_request_json_sends_and_reads_json(server):
    assert request_json("POST", server + "/json", {"a": [1, "é"]}, timeout=5) == {"echo": {"a": [1, "é"]},
                                                                                 "method": "POST"}
    assert request_json("GET", server + "/json", timeout=5) == {"echo": None, "method": "GET"}
    assert request_json("DELETE", server + "/empty", timeout=5) is None


def test_request_json_errors_name_the_url_and_the_status(server):
    with pytest.raises(HTTPCallError) as err:
        request_json("GET", server + "/status/503", timeout=5)
    assert err.value.status == 503 and str(err.value) == f"GET {server}/status/503: HTTP 503: the server says no"
    assert isinstance(err.value, EngineError)
    with pytest.raises(HTTPCallError, match=f"GET {server}/garbled: JSONDecodeError") as err:
        request_json("GET", server + "/garbled", timeout=5)
    assert err.value.status is None
    url = f"http://127.0.0.1:{free_port()}/x"
    with pytest.raises(HTTPCallError, match=f"POST {url}: URLError.*refused") as err:
        request_json("POST", url, {}, timeout=5)
    assert err.value.status is None and not err.value.timed_out


BIG = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MB: several of download's 1-MB reads


def test_download_streams_to_the_file_and_leaves_nothing_on_failure(server, tmp_path):
    from agentrl.http import download

    download(server + "/big", tmp_path / "big", timeout=5)
    assert (tmp_path / "big").read_bytes() == BIG
    for path, match in (("/status/404", "HTTP 404"), ("/cut", "IncompleteRead")):
        with pytest.raises(HTTPCallError, match=f"GET {server}{path}: .*{match}"):
            download(server + path, tmp_path / "part", timeout=5)
        assert not (tmp_path / "part").exists()


def test_http_ok_is_a_yes_or_no(server):
    assert http_ok(server + "/empty")
    assert not http_ok(server + "/status/500")
    assert not http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=1)


def test_post_json_reads_json_by_content_type_or_when_expected(server):
    from agentrl.http import get_json, json_session, post_json

    async def main():
        async with json_session(timeout_s=5) as session:
            body, _ = await post_json(session, server + "/json", {"k": 1})  # no JSON content type: text
            assert json.loads(body) == {"echo": {"k": 1}, "method": "POST"}
            body, _ = await post_json(session, server + "/json", {"k": 1}, expect_json=True)
            assert body == {"echo": {"k": 1}, "method": "POST"}
            with pytest.raises(HTTPCallError, match=f"POST {server}/garbled: the answer is not JSON") as err:
                await post_json(session, server + "/garbled", {}, expect_json=True, retry=FAST)
            assert err.value.status == 200 and not FAST.retryable(err.value)  # a wrong answer is not sent again
            with pytest.raises(HTTPCallError, match=f"GET {server}/status/502: HTTP 502"):
                await get_json(session, server + "/status/502")
            url = f"http://127.0.0.1:{free_port()}/x"
            with pytest.raises(HTTPCallError, match=f"POST {url} failed after 4 tries: ClientConnectorError"):
                await post_json(session, url, {}, retry=FAST)

    asyncio.run(main())


def test_get_ok_is_a_yes_or_no_on_the_session(server):
    from agentrl.http import get_ok, json_session

    async def main():
        async with json_session(timeout_s=5) as session:
            return [await get_ok(session, server + "/garbled", timeout_s=2),  # 200: the body is not read
                    await get_ok(session, server + "/status/503", timeout_s=2),
                    await get_ok(session, f"http://127.0.0.1:{free_port()}/health", timeout_s=2)]

    assert asyncio.run(main()) == [True, False, False]
