"""The embedded engine speaks SGLang's protocol: fields, batching, abort, weight updates."""

import asyncio

import aiohttp
import pytest
import torch

from agentrl.engines.embedded import encode_named_tensors
from agentrl.errors import EngineError
from agentrl.rollout.client import EngineClient
from waiting import await_until


def run(coro):
    return asyncio.run(coro)


async def _post(url, path, payload):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=payload) as r:
            return r.status, await r.json() if r.content_type == "application/json" else await r.text()


@pytest.mark.slow
def test_generate_reply_has_sglang_fields(engine, tokenizer):
    ids = tokenizer.encode("the capital of")
    status, body = run(_post(engine.url, "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True}))
    assert status == 200
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 5 and meta["completion_tokens"] == 5 and meta["prompt_tokens"] == len(ids)
    assert meta["finish_reason"]["type"] == "length"
    assert [p[1] for p in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(p[0] <= 0 for p in meta["output_token_logprobs"])
    assert isinstance(body["text"], str) and "weight_version" in meta and "cached_tokens" in meta


def test_greedy_is_deterministic_and_concurrent_requests_are_batched(engine, tokenizer):
    async def go():
        async with EngineClient(engine.url) as c:
            params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
            prompts = [tokenizer.encode(f"question {i} is") for i in range(16)]
            before = await (await c.session.get(engine.url + "/model_info")).json()
            outs = await asyncio.gather(*[c.generate(p, params) for p in prompts])
            after = await (await c.session.get(engine.url + "/model_info")).json()
            again = await c.generate(prompts[3], params)
            return outs, again, before["batching"], after["batching"]

    outs, again, before, after = run(go())
    assert again.output_ids == outs[3].output_ids  # greedy: the same with or without batch-mates
    assert again.logprobs == pytest.approx(outs[3].logprobs, abs=1e-4)
    batches = after["batches"] - before["batches"]
    assert after["requests"] - before["requests"] == 16 and batches < 16, (before, after)


def test_a_sampling_seed_fixes_the_tokens_whatever_the_batch(engine, tokenizer):
    """SGLang's sampling_seed (deterministic inference): a seeded request samples the same tokens
    alone or among others, another seed samples others; an unseeded one varies from run to run."""
    async def go():
        async with EngineClient(engine.url) as c:
            def params(seed):
                extra = {} if seed is None else {"sampling_seed": seed}
                return {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, **extra}
            prompt = tokenizer.encode("the capital of")
            alone = await c.generate(prompt, params(7))
            crowd = await asyncio.gather(*[c.generate(tokenizer.encode(f"other {i}"), params(i)) for i in range(12)],
                                         c.generate(prompt, params(7)))
            others = [await c.generate(prompt, params(s)) for s in (8, 9)]
            free = [await c.generate(prompt, params(None)) for _ in range(3)]
            bad = await _post(engine.url, "/generate", {"input_ids": prompt, "sampling_params": {"sampling_seed": "x"}})
            return alone, crowd[-1], others, free, bad

    alone, in_crowd, others, free, bad = run(go())
    assert in_crowd.output_ids == alone.output_ids
    assert in_crowd.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert all(o.output_ids != alone.output_ids for o in others)
    assert len({tuple(f.output_ids) for f in free}) > 1
    assert bad[0] == 400 and "sampling_seed" in bad[1]["error"]["message"]


def test_seeded_draws_follow_the_distribution():
    """The hashed Gumbel noise samples each token at its probability: over 20,000 (seed, position)
    pairs every share is within 4 standard errors of the distribution's."""
    from agentrl.engines.embedded import seeded_sample

    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    n = 20_000
    seeds = torch.arange(n) % 1000 * 7919
    positions = torch.arange(n) // 1000
    draws = seeded_sample(probs.expand(n, -1), seeds, positions)
    shares = torch.bincount(draws, minlength=len(probs)).double() / n
    stderr = (probs * (1 - probs) / n).sqrt().double()
    assert bool(((shares - probs).abs() <= 4 * stderr + 1e-12).all()), shares
    assert shares[-1] == 0  # a token of probability 0 is never drawn
    again = seeded_sample(probs.expand(n, -1), seeds, positions)
    assert torch.equal(draws, again)


def test_bad_input_is_rejected_and_server_lives(engine):
    for payload in ({"input_ids": []}, {"input_ids": [10**9]}, {"input_ids": "text"}):
        status, body = run(_post(engine.url, "/generate", payload))
        assert status == 400 and "input_ids" in body["error"]["message"]
    with pytest.raises(EngineError, match="HTTP 400"):
        run(EngineClient(engine.url).generate([], {}))
    status, _ = run(_post(engine.url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}))
    assert status == 200


def test_abort_all_returns_partial_output(engine, tokenizer):
    async def go():
        async with EngineClient(engine.url) as c:
            prompt = tokenizer.encode("long")
            task = asyncio.create_task(c.generate(prompt, {"max_new_tokens": 4000, "ignore_eos": True}))
            async def some_tokens_decoded():
                assert not task.done(), "the request ended before it was aborted"
                return (await c.get("/get_load"))[0]["num_tokens"] >= len(prompt) + 8

            await await_until(some_tokens_decoded, timeout_s=60, what="the engine decoding some tokens")
            await c.post("/abort_request", {"abort_all": True})
            return await asyncio.wait_for(task, 30)

    res = run(go())
    assert res.finish_reason == "abort" and 8 <= len(res.output_ids) < 4000


def test_weight_update_from_tensor_and_disk(engine, tokenizer, tiny_model):
    from agentrl.models import load_model

    model = load_model(tiny_model)
    prompt = tokenizer.encode("the answer is")
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}

    async def go():
        async with EngineClient(engine.url) as c:
            base = await c.generate(prompt, params)
            # A zero final norm makes every logit 0: greedy picks token 0. The engine must follow.
            zero = torch.zeros_like(model.model.norm.weight)
            reply = await c.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [encode_named_tensors([("model.norm.weight", zero)])],
                "weight_version": "7", "flush_cache": True})
            changed = await c.generate(prompt, params)
            status, bad = await _post(engine.url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [encode_named_tensors([("no.such.weight", zero)])]})
            restored = await c.post("/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "0"})
            back = await c.generate(prompt, params)
            return base, reply, changed, status, bad, restored, back

    base, reply, changed, status, bad, restored, back = run(go())
    assert reply["success"] and changed.weight_version == "7"
    assert changed.output_ids == [0] * 4 != base.output_ids
    assert status == 400 and not bad["success"] and "no.such.weight" in bad["message"]
    assert restored["success"] and back.output_ids == base.output_ids and back.weight_version == "0"


def test_stop_strings_end_the_generation(engine, tokenizer):
    async def go():
        async with EngineClient(engine.url) as c:
            free = await c.generate(tokenizer.encode("go"), {"temperature": 0.0, "max_new_tokens": 40,
                                                             "ignore_eos": True})
            text = tokenizer.decode(free.output_ids)
            stop = text[8:11]  # a string the greedy continuation is known to produce
            cut = await c.generate(tokenizer.encode("go"), {"temperature": 0.0, "max_new_tokens": 40,
                                                            "ignore_eos": True, "stop": [stop]})
            return text, stop, cut

    text, stop, cut = run(go())
    cut_text = tokenizer.decode(cut.output_ids)
    assert cut.finish_reason == "stop" and stop in cut_text
    assert len(cut.output_ids) < 40 and text.startswith(cut_text)
    assert stop not in tokenizer.decode(cut.output_ids[:-1])  # it stopped at the first occurrence


def test_the_client_pool_has_no_limit_of_its_own_unless_given():
    """The rollout's --max-concurrency bounds the requests in flight; a smaller pool would make
    turns wait for other trajectories' generations (bench/driver_scale.py)."""
    async def limits():
        async with EngineClient("http://127.0.0.1:9") as default, \
                EngineClient("http://127.0.0.1:9", max_connections=8) as given:
            return default.session.connector.limit, given.session.connector.limit

    assert run(limits()) == (0, 8)
