"""EngineClient's retry policy, against an in-process HTTP server that answers as scripted:
5xx, a dropped connection and a timeout are sent again with exponential backoff (a timeout only
once more), 4xx never; the error after the last try names the URL, the tries and the cause."""

import asyncio
import contextlib

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentrl.errors import EngineError
from agentrl.http import RetryPolicy
from agentrl.rollout.client import EngineClient

REPLY = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 1,
                                          "output_token_logprobs": [[-0.5, 7, None]]}}


@contextlib.asynccontextmanager
async def serving(path: str, handler):
    """The base URL of an in-process server that answers POST `path` with `handler`."""
    app = web.Application()
    app.router.add_post(path, handler)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def generate_with(script: list, *, retries: int = 3, backoff_s: float = 0.001, max_backoff_s: float = 0.004,
                  jitter: float = 0.25, monkeypatch=None):
    """POST /generate to a server that answers request i with script[i] (an HTTP status, "drop" to
    close the connection, "hang" to answer after the client's timeout). Returns (result or the
    EngineError, requests served, client.retried, the client's back-off sleeps)."""
    served = []
    sleeps = []

    async def generate(request):
        step = script[min(len(served), len(script) - 1)]
        served.append(step)
        if step == "drop":
            request.transport.close()
            return web.Response()
        if step == "hang":
            await asyncio.sleep(5)
        if step == 200:
            return web.json_response(REPLY)
        return web.Response(status=step, text=f"status {step}")

    async def go():
        if monkeypatch is not None:  # the client's own waits: every sleep longer than 0 (aiohttp sleeps 0)
            real_sleep = asyncio.sleep

            async def recording_sleep(delay, *args, **kwargs):
                if delay:
                    sleeps.append(delay)
                return await real_sleep(0)

            monkeypatch.setattr(asyncio, "sleep", recording_sleep)
        retry = RetryPolicy(attempts=retries + 1, backoff_s=backoff_s, max_backoff_s=max_backoff_s, jitter=jitter)
        async with serving("/generate", generate) as url, \
                EngineClient(url, retry=retry, request_timeout_s=0.5) as client:
            try:
                result = await client.generate([1], {})
            except EngineError as exc:
                result = exc
            return result, client.retried

    result, retried = asyncio.run(go())
    return result, served, retried, sleeps


def test_5xx_and_dropped_connections_are_sent_again_until_an_answer():
    result, served, retried, _ = generate_with([503, "drop", 500, 200])
    assert result.output_ids == [7] and served == [503, "drop", 500, 200] and retried == 3


def test_5xx_on_the_last_try_is_the_error_with_the_answer():
    error, served, retried, _ = generate_with([502], retries=2)
    assert served == [502, 502, 502] and retried == 2
    assert isinstance(error, EngineError) and str(error).endswith("/generate: HTTP 502: status 502")


def test_4xx_is_not_sent_again():
    error, served, retried, _ = generate_with([400, 200])
    assert served == [400] and retried == 0 and "HTTP 400: status 400" in str(error)


def test_dropped_connections_stop_after_the_retries_naming_the_tries():
    error, served, retried, _ = generate_with(["drop"], retries=2)
    assert served == ["drop"] * 3 and retried == 2
    assert "/generate failed after 3 tries: " in str(error) and "ServerDisconnectedError" in str(error)


def test_a_request_that_timed_out_twice_is_not_tried_a_third_time():
    error, served, retried, _ = generate_with(["hang"], retries=5)
    assert served == ["hang", "hang"] and retried == 1
    assert "/generate failed after 2 tries: " in str(error) and "TimeoutError" in str(error)


def test_the_back_off_doubles_up_to_its_cap(monkeypatch):
    error, served, retried, sleeps = generate_with([503], retries=5, backoff_s=0.5, max_backoff_s=3.0, jitter=0,
                                                   monkeypatch=monkeypatch)
    assert len(served) == 6 and retried == 5 and "HTTP 503" in str(error)
    assert sleeps == pytest.approx([0.5, 1.0, 2.0, 3.0, 3.0])  # none after the last try


def test_the_back_off_is_jittered_below_its_cap(monkeypatch):
    _, served, _, sleeps = generate_with([503], retries=5, backoff_s=0.5, max_backoff_s=3.0, jitter=0.5,
                                         monkeypatch=monkeypatch)
    assert len(served) == 6 and len(sleeps) == 5
    assert all(0.5 * d <= s <= d for s, d in zip(sleeps, [0.5, 1.0, 2.0, 3.0, 3.0])), sleeps
    assert sleeps != pytest.approx([0.5, 1.0, 2.0, 3.0, 3.0])


def test_the_default_policy_bounds_a_generate_by_attempts_and_a_deadline_past_the_request_timeout():
    from agentrl.rollout.client import GENERATE_RETRY, RETRY_GRACE_S

    client = EngineClient("http://127.0.0.1:9", request_timeout_s=30)
    assert client.retry.attempts == GENERATE_RETRY.attempts == 7
    assert client.retry.deadline_s == 30 + RETRY_GRACE_S


def test_the_json_codec_sends_and_reads_what_the_standard_library_does():
    """The client's JSON goes through orjson (rollout overhead, issue 16); what orjson does not take
    falls back to json: the same values either way."""
    import json
    import math

    from agentrl.http import dumps_json as _dumps, loads_json as _loads

    payloads = [
        {"input_ids": list(range(300)), "sampling_params": {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 9,
                                                            "stop": ["</answer>", "ünï 🙂"], "stop_token_ids": None},
         "return_logprob": True, "rid": "g1-s0-t2-0", "lora_path": "v3"},
        {"sampling_params": {"logit_bias": {5: -1.5, 7: 2.0}}},  # int keys: json writes them as strings
        {"big": 2 ** 70, "tuple": (1, 2)},  # past 64 bits: orjson refuses, json takes it
    ]
    for payload in payloads:
        assert json.loads(_dumps(payload)) == json.loads(json.dumps(payload))
    body = json.dumps({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.25, 1, None], [-1e-9, 2, None]],
                                                           "finish_reason": {"type": "stop"}, "engine_id": "é"}})
    assert _loads(body.encode()) == json.loads(body)
    assert math.isnan(_loads(b'{"a": NaN}')["a"])  # not JSON, but json reads it: so does the client, as before
    with pytest.raises(ValueError):
        _loads(b"{not json")


@pytest.mark.parametrize("form", ["string", "dict"])
def test_routed_experts_are_asked_for_and_decoded_per_token(form):
    """R3: with return_routed_experts the request carries SGLang's `return_routed_experts` and the
    reply's meta_info.routed_experts (base64 int32 [tokens, layers, top-k], every token of input +
    output but the last; a string, or newer SGLang's {"topk_ids", "topk_weights"}) comes back per
    token; a reply without it is an EngineError naming the server flag."""
    import base64

    import numpy as np

    ids = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)  # prompt 2 + output 2 - 1 tokens, 2 layers, top-2
    encoded = base64.b64encode(ids.tobytes()).decode()
    seen = []

    async def generate(request):
        body = await request.json()
        seen.append(body)
        meta = {"finish_reason": {"type": "length"}, "prompt_tokens": 2,
                "output_token_logprobs": [[-0.5, 7, None], [-0.1, 8, None]]}
        if len(seen) == 1:
            meta["routed_experts"] = encoded if form == "string" else {"topk_ids": encoded, "topk_weights": ""}
        return web.json_response({"output_ids": [7, 8], "meta_info": meta})

    async def go():
        async with serving("/generate", generate) as url:
            async with EngineClient(url, return_routed_experts=True) as client:
                first = await client.generate([1, 2], {})
                with pytest.raises(EngineError, match="enable-return-routed-experts"):
                    await client.generate([1, 2], {})
            async with EngineClient(url) as plain:
                assert (await plain.generate([1, 2], {})).routed_experts is None
            return first

    result = asyncio.run(go())
    assert seen[0]["return_routed_experts"] is True and "return_routed_experts" not in seen[-1]
    assert result.routed_experts == ids.reshape(3, 4).tolist()


def test_the_weight_check_probe_carries_the_engines_routing_under_r3():
    """With --use-rollout-routing-replay the trainer replays recorded routing and refuses a sample
    without it, so the weight check's probe asks each engine for its routed experts and keeps them
    on the probe sample (the EP=4 MoE run on 4x H100 stopped at its first probe without, 2026-11-26);
    without R3 nothing is asked."""
    import base64
    from types import SimpleNamespace

    import numpy as np

    from agentrl.config import parse_config
    from agentrl.weight_update import probe_engines

    ids = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)  # prompt 3 + output 2 - 1 tokens, 3 ids each
    seen = []

    async def generate(request):
        body = await request.json()
        seen.append(body)
        meta = {"finish_reason": {"type": "length"}, "prompt_tokens": 3, "weight_version": "1",
                "output_token_logprobs": [[-0.5, 7, None], [-0.1, 8, None]]}
        if body.get("return_routed_experts"):
            meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode()
        return web.json_response({"output_ids": [7, 8], "meta_info": meta})

    async def go(flags):
        cfg, _ = parse_config(["--trainer", "megatron", *flags])
        app = web.Application()
        app.router.add_post("/generate", generate)
        server = TestServer(app)
        await server.start_server()
        try:
            async with EngineClient(str(server.make_url("")).rstrip("/")) as client:
                group = SimpleNamespace(probe_prompts=[[1, 2, 3]], probe_lora=None, probe_results=None,
                                        serving=lambda: [client.base_url],
                                        engines=[SimpleNamespace(worker_type="regular")])
                await probe_engines(cfg, group, [client])
                return group.probe_results[0][2]
        finally:
            await server.close()

    replayed = asyncio.run(go(["--use-rollout-routing-replay"]))
    assert seen[-1]["return_routed_experts"] is True and replayed.routed_experts == ids.tolist()
    plain = asyncio.run(go([]))
    assert "return_routed_experts" not in seen[-1] and plain.routed_experts is None


def test_post_keeps_its_older_retries_keyword():
    """`post(..., retries=N)`: N more tries (callers written before RetryPolicy)."""
    served = []

    async def flush(request):
        served.append(1)
        return web.Response(status=503, text="busy")

    async def go():
        async with serving("/flush_cache", flush) as url, EngineClient(url) as client:
            with pytest.raises(EngineError, match="HTTP 503"):
                await client.post("/flush_cache", {}, retries=1)
            assert len(served) == 2
            served.clear()
            with pytest.raises(EngineError, match="HTTP 503"):
                await client.post("/flush_cache", {}, retries=0)
            assert len(served) == 1

    asyncio.run(go())
