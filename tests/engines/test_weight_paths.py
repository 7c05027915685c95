"""Weights into engines from a process group (SGLang's distributed protocol, gloo on CPU),
and pause/continue with SGLang's semantics (abort by default; in place keeps requests)."""

import asyncio
import contextlib

import pytest
import torch
from aiohttp.test_utils import TestServer

from agentrl.engines.embedded import EmbeddedEngine, encode_named_tensors
from agentrl.http import NO_RETRY
from agentrl.models import load_model
from agentrl.rollout.client import EngineClient
from agentrl.weight_transfer import WeightUpdateGroup, sync_weights_from_disk
from contract_helpers import RecordingClient, check_reply, check_request
from waiting import await_until


def test_weights_from_a_process_group(engine, tiny_model):
    model = load_model(tiny_model)
    named = [(n, p.detach() * 1.5) for n, p in model.named_parameters()]

    async def go():
        client = RecordingClient(engine.url)
        group = WeightUpdateGroup([client])
        await group.init(device="cpu")
        sync = await group.sync(named, version=9, bucket_bytes=1 << 18)
        after = await client.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
        gen = await client.generate([5, 6, 7, 8], {"max_new_tokens": 2, "temperature": 0.0})
        await group.close()
        await sync_weights_from_disk([client], str(tiny_model), version=0)  # as it was, for the other tests
        back = await client.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
        await client.close()
        return client.calls, sync, after, gen, back

    calls, sync, after, gen, back = asyncio.run(go())
    assert sync["weight_sync_buckets"] > 1 and sync["weight_sync_mb"] > 0
    assert sync["weight_sync_nccl"] == 0.0  # gloo on the CPU (the GPU suite checks 1.0 across GPUs)
    norm = model.model.norm.weight.detach()
    assert torch.allclose(torch.tensor(after), norm[:4] * 1.5) and torch.allclose(torch.tensor(back), norm[:4])
    assert gen.weight_version == "9"
    paths = [c[0] for c in calls]
    assert paths.count("/init_weights_update_group") == 1 and "/destroy_weights_update_group" in paths
    assert paths.count("/update_weights_from_distributed") == sync["weight_sync_buckets"]
    for path, payload, status, ctype, body in calls:
        if path != "/get_weights_by_name":
            check_request(path, payload)
            if path in ("/init_weights_update_group", "/update_weights_from_distributed",
                        "/destroy_weights_update_group", "/update_weights_from_disk"):
                check_reply(path, status, ctype, body)
    last = [p for path, p, *_ in calls if path == "/update_weights_from_distributed"][-1]
    assert last["weight_version"] == "9" and last["flush_cache"] is True


@contextlib.asynccontextmanager
async def serving(eng):
    """The engine's app on a local test server: its URL, for the length of the block."""
    server = TestServer(eng.app())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.slow
def test_pause_in_place_keeps_requests_and_pause_abort_ends_them(tiny_model):
    torch.set_num_threads(1)
    eng = EmbeddedEngine(str(tiny_model))
    norm = eng.model.model.norm.weight.detach().clone()

    async def go():
        async with serving(eng) as url:
            async with EngineClient(url) as c:
                params = {"max_new_tokens": 1500, "ignore_eos": True}
                running = asyncio.create_task(c.generate([5, 6, 7], params))
                await await_until(eng.lock.locked, timeout_s=30, what="the engine decoding")  # the request is in the decode loop
                await c.post("/pause_generation", {"mode": "in_place"})  # answers once the loop is parked
                parked = eng._parked.is_set()
                held = not running.done()
                reply = await c.post("/update_weights_from_tensor", {  # allowed while parked, without a flush
                    "serialized_named_tensors": [encode_named_tensors([("model.norm.weight", norm)])],
                    "weight_version": "4", "flush_cache": False})
                held = held and not running.done() and eng._parked.is_set()
                await c.post("/continue_generation", {})
                kept = await asyncio.wait_for(running, 120)

                running = asyncio.create_task(c.generate([5, 6, 7], params))
                await await_until(eng.lock.locked, timeout_s=30, what="the engine decoding")
                await c.post("/pause_generation", {})  # SGLang's default mode: abort
                aborted = await asyncio.wait_for(running, 30)
                waiting = asyncio.create_task(c.generate([9, 9], {"max_new_tokens": 2}))
                await await_until(lambda: eng.inflight >= 1, timeout_s=30, what="the engine receiving the request")
                await asyncio.sleep(0.2)  # a running engine answers 2 tokens well within this
                queued = not waiting.done()  # paused: new requests wait
                await c.post("/continue_generation", {})
                served = await asyncio.wait_for(waiting, 30)
            return parked, held, reply, kept, aborted, queued, served

    parked, held, reply, kept, aborted, queued, served = asyncio.run(go())
    assert parked and held and reply["success"]
    assert kept.finish_reason == "length" and len(kept.output_ids) == 1500 and kept.weight_version == "4"
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 1500
    assert queued and served.finish_reason == "length"


def test_a_flushing_weight_update_over_requests_paused_in_place_kills_the_engine(tiny_model):
    """SGLang flushes its cache after a weight update (its default) and asserts the flush
    worked, which it does not while requests paused in place hold KV: its scheduler dies.
    So does the embedded engine (agentrl's update drains the engines first)."""
    torch.set_num_threads(1)
    eng = EmbeddedEngine(str(tiny_model))
    norm = eng.model.model.norm.weight.detach().clone()

    async def go():
        async with serving(eng) as url:
            async with EngineClient(url) as c:
                running = asyncio.create_task(c.generate([5, 6, 7], {"max_new_tokens": 1500, "ignore_eos": True}))
                await await_until(eng.lock.locked, timeout_s=30, what="the engine decoding")
                await c.post("/pause_generation", {"mode": "in_place"})
                try:
                    await c.post("/update_weights_from_tensor", {
                        "serialized_named_tensors": [encode_named_tensors([("model.norm.weight", norm)])]},
                        retry=NO_RETRY)
                    error = None
                except Exception as exc:  # noqa: BLE001 - the reply is a 500
                    error = str(exc)
                eng._run.set()  # unpark the decode loop so the request can end
                running.cancel()
            return error

    error = asyncio.run(go())
    assert error and "Cache flush failed after updating weights" in error and eng.dead


@pytest.mark.slow
def test_a_weight_update_waits_for_the_generation_in_flight(tiny_model):
    """update_engines without --partial-rollout: the generation in flight finishes under the old
    weights, then the engine takes the new ones and flushes (over a generation paused in place,
    the flush would kill SGLang's scheduler, and the embedded engine: the test above)."""
    from types import SimpleNamespace

    from agentrl.config import parse_config
    from agentrl.rollout.control import RolloutControl
    from agentrl.weight_transfer import sync_weights_from_tensor
    from agentrl.weight_update import update_engines

    torch.set_num_threads(1)
    eng = EmbeddedEngine(str(tiny_model))
    named = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]

    class Trainer:  # the real weight path into the engine, flush on the last bucket
        async def sync_weights(self, urls, version, fresh=False):
            async with EngineClient(urls[0]) as c:
                out = await sync_weights_from_tensor([c], named, version=version, bucket_bytes=1 << 30)
            return out | {"failed_engines": []}

    async def go():
        async with serving(eng) as url:
            async with EngineClient(url) as c:
                running = asyncio.create_task(c.generate([5, 6, 7], {"max_new_tokens": 1500, "ignore_eos": True}))
                await await_until(eng.lock.locked, timeout_s=30, what="the engine decoding")
                cfg, _ = parse_config([])
                out = await update_engines(cfg, RolloutControl(), SimpleNamespace(live=lambda: [url], monitor=None),
                                           Trainer(), 1)
                return out, await asyncio.wait_for(running, 120)

    out, result = asyncio.run(go())
    assert eng.dead is None and eng.weight_version == "1"
    assert result.finish_reason == "length" and len(result.output_ids) == 1500
    assert result.weight_version == "0"  # finished before the update, under the old weights
    assert out["weight_update_drain_s"] > 0
