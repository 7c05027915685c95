"""The embedded engine's prefix cache: later turns reuse the KV of earlier ones, say so in
cached_tokens, and sample exactly what the no-cache path samples (logprobs within 1e-4)."""

import asyncio
import random

import pytest
import torch

from agentrl.engines.embedded import EmbeddedEngine, _Request
from agentrl.engines.prefix_cache import BLOCK, PrefixCache


@pytest.fixture(scope="module")
def engines(tiny_model):
    torch.set_num_threads(1)
    cached = EmbeddedEngine(str(tiny_model), prefix_cache_tokens=100_000)
    plain = EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0)
    return cached, plain


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _run(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int = 6) -> list[_Request]:
    reqs = [_Request(rid=f"r{i}", input_ids=p, params={"temperature": 0.0, "max_new_tokens": new_tokens,
                                                       "ignore_eos": True},
                     return_logprob=True, future=None) for i, p in enumerate(prompts)]
    engine._decode_batch(reqs)
    return reqs


def test_later_turns_hit_and_match_the_no_cache_path(engines):
    cached, plain = engines
    cached._clear_prefix_cache()
    prompts = [_ids(1, 40), _ids(2, 23), _ids(3, 57)]
    first = _run(cached, prompts)
    assert [r.cached_tokens for r in first] == [0, 0, 0]
    # turn 2 of the first two trajectories (prompt + answer + an observation), batched with a
    # fresh prompt: hits and a miss decode together
    turn2 = [prompts[0] + first[0].output_ids + _ids(4, 9), prompts[1] + first[1].output_ids + _ids(5, 30),
             _ids(6, 31)]
    hit = _run(cached, turn2)
    ref = _run(plain, turn2)
    assert [r.cached_tokens for r in hit] == [40 + 5, 23 + 5, 0]  # all but the unfed last answer token
    for h, p in zip(hit, ref):
        assert h.output_ids == p.output_ids
        assert h.logprobs == pytest.approx(p.logprobs, abs=1e-4)
    # turn 3 extends turn 2 again
    turn3 = [turn2[0] + hit[0].output_ids + _ids(7, 17)]
    (h3,), (p3,) = _run(cached, turn3), _run(plain, turn3)
    assert h3.cached_tokens == len(turn2[0]) + 5
    assert h3.output_ids == p3.output_ids and h3.logprobs == pytest.approx(p3.logprobs, abs=1e-4)
    stats = cached.prefix_cache_stats()
    assert stats["hits"] >= 3 and stats["cached_tokens"] >= 40 + 23 + 10


def test_shared_prompt_reuses_the_common_prefix(engines):
    cached, plain = engines
    cached._clear_prefix_cache()
    prompt = _ids(10, 48)
    (a,) = _run(cached, [prompt])
    # a GRPO sibling sends the same prompt: all but its last token come from the cache
    (b,), (ref,) = _run(cached, [prompt]), _run(plain, [prompt])
    assert b.cached_tokens == len(prompt) - 1
    assert b.output_ids == ref.output_ids and b.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    # a prompt sharing only its first 35 tokens reuses the 32 of whole blocks and the rest it matches
    other = prompt[:35] + _ids(11, 20)
    (c,), (ref_c,) = _run(cached, [other]), _run(plain, [other])
    assert c.cached_tokens == 35 and c.logprobs == pytest.approx(ref_c.logprobs, abs=1e-4)


def test_sampled_logprobs_match_with_temperature(engines):
    cached, plain = engines
    cached._clear_prefix_cache()
    prompt = _ids(20, 33)
    _run(cached, [prompt])
    follow = prompt + _ids(21, 12)
    cached.generator.manual_seed(5)
    plain.generator.manual_seed(5)
    params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True}
    h = _Request("h", follow, params, True, None)
    p = _Request("p", follow, params, True, None)
    cached._decode_batch([h])
    plain._decode_batch([p])
    assert h.cached_tokens == 33 and h.output_ids == p.output_ids
    assert h.logprobs == pytest.approx(p.logprobs, abs=1e-4)


def test_flush_and_weight_updates_clear_it(engines, tiny_model):
    from aiohttp.test_utils import TestClient, TestServer

    from agentrl.engines.embedded import encode_named_tensors

    cached, _ = engines
    prompt = _ids(30, 40)

    async def go():
        async with TestClient(TestServer(cached.app())) as client:
            async def gen(ids):
                r = await client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                                         "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
                assert r.status == 200 and r.headers["X-Agentrl-Engine"] == cached.engine_id
                return (await r.json())["meta_info"]

            await gen(prompt)
            again = await gen(prompt)
            assert (await client.post("/flush_cache")).status == 200
            after_flush = await gen(prompt)
            await gen(prompt)
            norm = cached.model.model.norm.weight.detach().clone()
            r = await client.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [encode_named_tensors([("model.norm.weight", norm)])],
                "weight_version": "3"})
            assert (await r.json())["success"]
            after_update = await gen(prompt)
            return again, after_flush, after_update

    again, after_flush, after_update = asyncio.run(go())
    assert again["cached_tokens"] == len(prompt) - 1 and again["engine_id"] == cached.engine_id
    assert after_flush["cached_tokens"] == 0
    assert after_update["cached_tokens"] == 0 and after_update["weight_version"] == "3"


def test_cache_is_bounded_and_lru():
    cache = PrefixCache(max_tokens=3 * BLOCK)
    kv = lambda n: [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]  # noqa: E731
    a, b, c = _ids(40, BLOCK + 1), _ids(41, BLOCK + 1), _ids(42, BLOCK + 1)
    cache.insert(a, kv(len(a)))
    cache.insert(b, kv(len(b)))
    assert cache.lookup(a + [7])[0] == len(a)  # a is now the most recent
    cache.insert(c, kv(len(c)))  # over budget: b (least recently used) goes
    assert cache.lookup(b + [7])[0] == 0
    assert cache.lookup(a + [7])[0] == len(a) and cache.lookup(c + [7])[0] == len(c)
    assert cache.lookup(a[:BLOCK - 1] + [9])[0] == 0  # shorter than one block: not reused
