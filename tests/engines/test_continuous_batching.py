"""The embedded engine batches continuously, as SGLang's scheduler does: a request that arrives
while others decode joins them between two steps, a finished one leaves at once, and what each
row samples does not depend on who it decoded beside."""

import asyncio
import threading

import pytest
import torch
from aiohttp.test_utils import TestServer

from agentrl.engines.embedded import EmbeddedEngine, _Request, encode_named_tensors
from agentrl.rollout.client import EngineClient
from waiting import await_until

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def engine(tiny_model):  # one per test: its locks and events belong to one event loop
    torch.set_num_threads(1)
    return EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0)


def _request(rid: str, prompt: list[int], new_tokens: int) -> _Request:
    return _Request(rid=rid, input_ids=prompt, params=GREEDY | {"max_new_tokens": new_tokens},
                    return_logprob=True, future=None)


def _alone(engine: EmbeddedEngine, prompt: list[int], new_tokens: int) -> _Request:
    r = _request("alone", prompt, new_tokens)
    engine._decode_batch([r])
    return r


def test_rows_that_join_midway_and_leave_early_sample_what_they_sample_alone(engine):
    long_prompt, short_prompt, late_prompt = list(range(5, 45)), [7, 8, 9], list(range(100, 117))
    long, short, late = _request("long", long_prompt, 30), _request("short", short_prompt, 4), \
        _request("late", late_prompt, 12)
    decoding = engine._join(None, [long, short])
    left = []
    for _ in range(10):  # the short row finishes (step 4) and leaves; the long one goes on alone
        left += engine._step(decoding)
    assert left == [short] and decoding.rows == [long]
    decoding = engine._join(decoding, [late])  # joins a row 10 tokens into its answer
    while decoding.rows:
        left += engine._step(decoding)
    assert [r.rid for r in left] == ["short", "late", "long"]
    for row, prompt in ((long, long_prompt), (short, short_prompt), (late, late_prompt)):
        ref = _alone(engine, prompt, len(row.output_ids))
        assert row.output_ids == ref.output_ids, row.rid
        assert row.logprobs == pytest.approx(ref.logprobs, abs=1e-4), row.rid
        assert row.finish == {"type": "length", "length": len(row.output_ids)}


def _serve(engine: EmbeddedEngine, go):
    async def main():
        server = TestServer(engine.app())
        await server.start_server()
        try:
            async with EngineClient(str(server.make_url("")).rstrip("/")) as client:
                return await go(client)
        finally:
            await server.close()

    return asyncio.run(main())


def test_a_request_arriving_during_a_long_decode_does_not_wait_for_it(engine):
    async def go(client):
        long = asyncio.create_task(client.generate([5, 6, 7], GREEDY | {"max_new_tokens": 3000}))
        await await_until(lambda: engine.decoding, timeout_s=30, what="decoding")
        short = await asyncio.wait_for(client.generate([9, 10, 11], GREEDY | {"max_new_tokens": 5}), 60)
        running = not long.done()
        await client.post("/abort_request", {"abort_all": True})
        return short, running, await asyncio.wait_for(long, 60)

    short, running, long = _serve(engine, go)
    # static batches made the short request wait for all 3,000 tokens of the long one
    assert running and len(short.output_ids) == 5 and short.finish_reason == "length"
    assert long.finish_reason == "abort"
    assert short.output_ids == _alone(engine, [9, 10, 11], 5).output_ids


def test_a_waiting_weight_update_is_not_overtaken_by_requests_arriving_after_it(engine):
    norm = engine.model.model.norm.weight.detach().clone()
    order = []

    async def go(client):
        first = asyncio.create_task(client.generate([5, 6, 7], GREEDY | {"max_new_tokens": 300}))
        await await_until(lambda: engine.decoding, timeout_s=30, what="decoding")

        async def update():
            reply = await client.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [encode_named_tensors([("model.norm.weight", norm)])],
                "weight_version": "7"})
            order.append("update")
            return reply

        async def later():
            out = await client.generate([9, 9], GREEDY | {"max_new_tokens": 2})
            order.append("later")
            return out

        updating = asyncio.create_task(update())
        await await_until(lambda: engine._weights_waiting, timeout_s=30, what="the update waiting")
        later_task = asyncio.create_task(later())
        await await_until(lambda: engine.waiting, timeout_s=30, what="the later request waiting")
        return await asyncio.wait_for(asyncio.gather(first, updating, later_task), 120)

    first, reply, later = _serve(engine, go)
    # Joining the decoding row would have answered the 2-token request long before the 300-token
    # one ended and the update ran: as SGLang's update lock, a waiting update goes first.
    assert reply["success"] and order == ["update", "later"]
    assert len(first.output_ids) == 300 and later.weight_version == "7"


def test_requests_arriving_while_everything_is_aborted_wait_without_spinning_the_event_loop(engine):
    """During /abort_request's abort_all (until the decoding rows have stopped) nothing joins;
    the scheduler must yield meanwhile, or the abort never sees them stop (a hang)."""
    replies = []

    def serve():
        async def go():
            scheduler = asyncio.create_task(engine.scheduler())
            engine.abort_all = True  # as _abort_everything has it while rows stop
            req = _request("later", [9, 9], 2)
            req.future = asyncio.get_running_loop().create_future()
            engine._enqueue(req)
            await asyncio.sleep(0.2)  # never returns if the scheduler spins
            engine.abort_all = False
            replies.append(await asyncio.wait_for(req.future, 30))
            scheduler.cancel()

        asyncio.run(go())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the event loop spun while requests waited out an abort"
    assert replies and replies[0].finish == {"type": "length", "length": 2}
