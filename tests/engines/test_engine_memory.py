"""The embedded engine is as strict as SGLang about memory release and health (--colocate's
handover): what kills SGLang's scheduler kills it too, so a caller that would crash SGLang on
a GPU fails here first. And agentrl's own handover (agentrl.engines.colocate) follows the
rules: it resumes only what it released, and releases only idle engines."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest
import torch
from aiohttp.test_utils import TestServer

from agentrl.engines.colocate import EngineMemory, wait_idle
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.launch import ENGINE_ENV, ephemeral_range, launch_embedded_engine, server_port
from agentrl.errors import EngineError
from agentrl.rollout.client import EngineClient
from waiting import await_until

IDS = list(range(5, 20))


def _serve(tiny_model, body, env: dict | None = None):
    """Run `body(engine, client)` against an in-process embedded engine."""
    torch.set_num_threads(1)
    engine = EmbeddedEngine(str(tiny_model))

    async def go():
        server = TestServer(engine.app())
        await server.start_server()
        try:
            async with EngineClient(str(server.make_url("")).rstrip("/"), request_timeout_s=60) as c:
                return await body(engine, c)
        finally:
            await server.close()

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return engine, asyncio.run(go())
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


async def _status(c: EngineClient, method: str, path: str, payload=None) -> int:
    async with c.session.request(method, c.base_url + path, json=payload) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("violation", ["resume_never_released", "resume_other_tag", "generate_while_released",
                                       "health_generation_while_released", "release_while_running"])
def test_what_kills_sglang_kills_the_embedded_engine(tiny_model, violation):
    async def body(engine, c):
        if violation == "resume_never_released":
            first = await _status(c, "POST", "/resume_memory_occupation", {})
        elif violation == "resume_other_tag":
            assert await _status(c, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}) == 200
            first = await _status(c, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
        elif violation == "generate_while_released":
            assert await _status(c, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}) == 200
            first = await _status(c, "POST", "/generate", {"input_ids": IDS, "sampling_params": {"max_new_tokens": 2}})
        elif violation == "health_generation_while_released":
            assert await _status(c, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}) == 200
            first = await _status(c, "GET", "/health")
        else:
            long = asyncio.create_task(c.generate(IDS, {"max_new_tokens": 3000, "ignore_eos": True}, rid="long"))
            await await_until(lambda: engine.inflight, timeout_s=30, what="the engine receiving the long request")
            first = await _status(c, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
            engine.aborted.add("long")  # (the engine is dead to HTTP now) or asyncio.run waits out 3000 tokens
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)
        after = await _status(c, "GET", "/model_info")
        return first, after

    engine, (first, after) = _serve(tiny_model, body)
    assert first == 500 and after == 500 and engine.dead  # dead from then on, as SGLang's scheduler


def test_the_rules_kept_the_engine_lives(tiny_model):
    """Release what you will resume, resume only that, generate only when nothing is
    released; with health generation off (as agentrl starts engines) /health is safe."""
    async def body(engine, c):
        await c.post("/release_memory_occupation", {"tags": ["kv_cache"]})
        await c.post("/release_memory_occupation", {"tags": ["kv_cache"]})  # twice is fine (a set in SGLang)
        health_released = await _status(c, "GET", "/health")
        await c.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
        out = await c.generate(IDS, {"max_new_tokens": 2})
        load = await c.get("/get_load")
        return health_released, out, load

    engine, (health, out, load) = _serve(tiny_model, body, env=ENGINE_ENV)
    assert health == 200 and len(out.output_ids) == 2 and not engine.dead and not engine.released
    assert load[0]["num_reqs"] == 0 and set(load[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}


def test_colocate_handover_resumes_only_what_it_released(tiny_model):
    async def body(engine, c):
        memory = EngineMemory()
        await memory.resume([c])  # first rollout: nothing was released, nothing is resumed
        out = await c.generate(IDS, {"max_new_tokens": 2})
        long = asyncio.create_task(c.generate(IDS, {"max_new_tokens": 3000, "ignore_eos": True}))
        await await_until(lambda: engine.inflight, timeout_s=30, what="the engine receiving the long request")
        await c.post("/abort_request", {"abort_all": True})
        await wait_idle([c], timeout_s=30)
        aborted = await long
        await memory.release([c])
        released = set(engine.released)
        await memory.resume([c])
        memory.forget(c.base_url)
        await memory.resume([c])  # a restarted engine: nothing to resume
        again = await c.generate(IDS, {"max_new_tokens": 2})
        return out, aborted, released, again

    engine, (out, aborted, released, again) = _serve(tiny_model, body)
    assert not engine.dead and released == {"kv_cache"} and not engine.released
    assert aborted.finish_reason == "abort" and len(again.output_ids) == 2


def test_wait_idle_times_out_naming_the_busy_engine(tiny_model):
    async def body(engine, c):
        long = asyncio.create_task(c.generate(IDS, {"max_new_tokens": 3000, "ignore_eos": True}, rid="long"))
        await await_until(lambda: engine.inflight, timeout_s=30, what="the engine receiving the long request")
        try:
            with pytest.raises(EngineError, match=c.base_url):
                await wait_idle([c], timeout_s=0.3)
        finally:
            engine.aborted.add("long")  # or asyncio.run waits out the 3000 tokens
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)

    _serve(tiny_model, body)


@pytest.mark.e2e
def test_a_fatal_violation_ends_the_server_process(tiny_model, tmp_path):
    server = launch_embedded_engine(str(tiny_model), log_dir=tmp_path, num_threads=1)
    try:
        proc = subprocess.run(["curl", "-s", "-X", "POST", server.url + "/resume_memory_occupation", "-d", "{}"],
                              capture_output=True, text=True, timeout=30)
        assert "not released" in proc.stdout
        server.proc.wait(timeout=30)
        assert server.proc.returncode == 70 and "SGLang's scheduler dies here too" in server.log_tail()
    finally:
        server.stop()


def test_server_ports_are_outside_the_ephemeral_range():
    """A port inside it can be the source port of our own health poll: a TCP self-connect."""
    low, high = ephemeral_range()
    ports = {server_port() for _ in range(50)}
    assert all(not low <= p <= high and p + 10000 < 65536 for p in ports)


@pytest.mark.e2e
def test_a_client_that_goes_away_aborts_its_request(tiny_model, tmp_path):
    """As SGLang (its tokenizer manager aborts a request whose HTTP client disconnected): a
    3000-token generation whose client gave up stops, and the engine is idle and serving."""
    server = launch_embedded_engine(str(tiny_model), log_dir=tmp_path, num_threads=1)

    async def go():
        async with EngineClient(server.url, request_timeout_s=30) as c:
            long = asyncio.create_task(c.generate(IDS, {"max_new_tokens": 3000, "ignore_eos": True}))
            async def requests():
                return (await c.get("/get_load"))[0]["num_reqs"]

            async def no_requests():
                return not await requests()

            await await_until(requests, timeout_s=30, interval_s=0.05, what="the engine receiving the long request")
            long.cancel()  # closes its connection
            await asyncio.gather(long, return_exceptions=True)
            await await_until(no_requests, timeout_s=5, interval_s=0.05,
                              what="the engine stopping the generation of a client that went away")
            return await c.generate(IDS, {"max_new_tokens": 2})

    try:
        assert len(asyncio.run(go()).output_ids) == 2
    finally:
        server.stop()
