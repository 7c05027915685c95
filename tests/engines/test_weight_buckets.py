"""Flattened-bucket weight sync (SGLang's `load_format="flattened_bucket"`: one buffer and one
IPC handle a bucket): the payload rebuilds exactly what the per-tensor payload does (names,
shapes, dtypes, bytes), TP-shard views and MoE experts included; an engine loaded either way
holds the same weights bit for bit; the embedded engine refuses what SGLang would choke on; a
failed bucket still lets the export finish (a sharded trainer's ranks are in its collectives)."""

import asyncio
import base64
import io
import sys
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestServer

from agentrl.engines.embedded import (EmbeddedEngine, decode_flattened_bucket, decode_named_tensors,
                                      encode_flattened_bucket, encode_named_tensors)
from agentrl.errors import EngineError
from agentrl.weight_transfer import ALIGN, buckets, encode_bucket, flatten_bucket, sync_weights_from_tensor
from contract_helpers import RecordingClient, check_request, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))


def export_like() -> list[tuple[str, torch.Tensor]]:
    """What an HF export hands the sync: q/k/v views of one fused tensor, a TP shard gathered along
    dim 1 (non-contiguous view), routed experts under global indices, bf16 and fp32, odd sizes, a scalar."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(24, 16, generator=g).to(torch.bfloat16)
    shards = [torch.randn(16, 5, generator=g) for _ in range(2)]  # two TP ranks' column shards
    full = torch.cat(shards, 1)
    out = [("model.embed_tokens.weight", torch.randn(33, 16, generator=g).to(torch.bfloat16)),
           ("model.layers.0.self_attn.q_proj.weight", qkv[:16]),
           ("model.layers.0.self_attn.k_proj.weight", qkv[16:20]),
           ("model.layers.0.self_attn.v_proj.weight", qkv[20:]),
           ("model.layers.0.self_attn.q_proj.bias", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd: 14 bytes
           ("model.layers.0.self_attn.o_proj.weight", full[:, 1:9]),  # a strided view
           ("model.layers.0.mlp.gate.weight", torch.randn(8, 16, generator=g)),  # router, fp32
           ("model.layers.0.mlp.expert_bias", torch.tensor(0.5))]  # 0-dim
    for e in (0, 5, 7):  # EP rank 1's experts get global indices 4..7
        for w, shape in (("gate_proj", (3, 16)), ("up_proj", (3, 16)), ("down_proj", (16, 3))):
            expert = torch.randn(*shape, generator=g).to(torch.bfloat16)
            out.append((f"model.layers.0.mlp.experts.{e}.{w}.weight", expert))
    return out


def same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                           y.contiguous().reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("bucket_bytes", [64, 700, 1 << 20])  # a tensor larger than a bucket; a few; all in one
def test_flattened_payload_rebuilds_what_the_per_tensor_payload_does(bucket_bytes):
    named = export_like()
    flat_side, tensor_side = [], []
    for chunk in buckets(named, bucket_bytes):
        flat, meta = flatten_bucket(chunk)
        assert all(start % ALIGN == 0 for _, _, _, start, _ in meta) and flat.dtype == torch.uint8 and flat.dim() == 1
        flat_side += decode_flattened_bucket(encode_bucket("embedded", chunk).payload)
        tensor_side += decode_named_tensors(encode_bucket("embedded", chunk, flattened=False).payload)
    same(flat_side, tensor_side)
    same(flat_side, named)


def test_the_embedded_engine_refuses_what_sglang_cannot_load(tiny_model):
    torch.set_num_threads(1)
    engine = EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0, tp_size=2)
    name, param = next(iter(engine.model.state_dict().items()))
    good = [(name, param.detach().clone() * 2)]
    flat, meta = flatten_bucket(good)
    n, shape, dtype, start, end = meta[0]

    def raw(bucket) -> str:
        buf = io.BytesIO()
        torch.save(bucket, buf)
        return base64.b64encode(buf.getvalue()).decode()

    entry = {"name": n, "shape": list(shape), "dtype": "float32", "start_idx": start, "end_idx": end,
             "numel": end - start}
    cases = {
        "per-tensor payload as a bucket": ([encode_named_tensors(good)] * 2, "flattened_bucket"),
        "bucket as a per-tensor payload": ([encode_flattened_bucket(flat, meta)] * 2, None),
        "unknown load_format": ([encode_flattened_bucket(flat, meta)] * 2, "direct"),
        "short slice": ([raw({"flattened_tensor": flat,
                              "metadata": [entry | {"end_idx": end - 4, "numel": end - 4}]})] * 2, "flattened_bucket"),
        "past the buffer": ([raw({"flattened_tensor": flat[:-4], "metadata": [entry]})] * 2, "flattened_bucket"),
        "misaligned": ([raw({"flattened_tensor": torch.cat([torch.zeros(2, dtype=torch.uint8), flat]),
                             "metadata": [entry | {"start_idx": 2, "end_idx": end + 2}]})] * 2, "flattened_bucket"),
        "not uint8": ([raw({"flattened_tensor": flat.view(torch.float32), "metadata": [entry]})] * 2,
                      "flattened_bucket"),
        "TP ranks differ": ([encode_flattened_bucket(flat, meta),
                             encode_flattened_bucket(flatten_bucket([(name, param.detach() * 3)])[0], meta)],
                            "flattened_bucket"),
        "one payload for two TP ranks": ([encode_flattened_bucket(flat, meta)], "flattened_bucket"),
    }

    async def go(client):
        errors = {}
        for label, (payloads, fmt) in cases.items():
            with pytest.raises(EngineError) as err:
                await client.post("/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                                  "load_format": fmt, "flush_cache": False}, retries=0)
            errors[label] = str(err.value)
        reply = await client.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [encode_flattened_bucket(flat, meta)] * 2, "load_format": "flattened_bucket",
            "flush_cache": True, "weight_version": "3"})
        return errors, reply

    errors, reply = serve(engine, go)
    assert "needs load_format 'flattened_bucket'" in errors["bucket as a per-tensor payload"]
    assert "a dict of flattened_tensor and metadata" in errors["per-tensor payload as a bucket"]
    assert "reads None and 'flattened_bucket'" in errors["unknown load_format"]
    for label in ("short slice", "past the buffer", "misaligned"):
        assert f"metadata[0] ({name})" in errors[label], (label, errors[label])
    assert "1-D uint8" in errors["not uint8"]
    assert "TP rank 1 got other weights than TP rank 0" in errors["TP ranks differ"]
    assert "holds 1 payloads for 2 TP ranks" in errors["one payload for two TP ranks"]
    assert reply["success"] and engine.weight_version == "3"
    assert torch.equal(engine.model.state_dict()[name], good[0][1])


def test_moe_weights_land_the_same_flattened_or_per_tensor(tmp_path, tiny_model):
    """A Qwen3-MoE model's every tensor (experts, routers, norms) through the sync into two engines,
    one flattened (TP=2: a payload per rank), one per tensor: both hold the sent weights bit for bit."""
    from megatron_helpers import tiny_family_model

    torch.set_num_threads(1)
    model = tiny_family_model(tmp_path / "moe", "qwen3_moe", tokenizer_from=tiny_model)
    flat_engine = EmbeddedEngine(str(model), prefix_cache_tokens=0, tp_size=2)
    tensor_engine = EmbeddedEngine(str(model), prefix_cache_tokens=0)
    g = torch.Generator().manual_seed(1)
    named = [(n, p.detach() + torch.randn(p.shape, generator=g).to(p.dtype)) for n, p in
             flat_engine.model.named_parameters()]
    # three MoE layers, each with its experts (transformers packs them as 3-D tensors) and router
    assert sum(".experts." in n for n, _ in named) >= 6 and sum(n.endswith("mlp.gate.weight") for n, _ in named) == 3

    async def go():
        out = {}
        for label, engine, flattened in (("flat", flat_engine, True), ("tensor", tensor_engine, False)):
            server = TestServer(engine.app())
            await server.start_server()
            try:
                client = RecordingClient(str(server.make_url("")).rstrip("/"))
                out[label] = await sync_weights_from_tensor([client], iter(named), version=4, bucket_bytes=32 * 1024,
                                                            flattened=flattened)
                out[label + "_calls"] = client.calls
                await client.close()
            finally:
                await server.close()
        return out

    out = asyncio.run(go())
    for engine in (flat_engine, tensor_engine):
        state = engine.model.state_dict()
        same([(n, state[n]) for n, _ in named], named)
        assert engine.weight_version == "4"
    flat, per_tensor = out["flat"], out["tensor"]
    assert flat["weight_sync_flattened"] == 1.0 and per_tensor["weight_sync_flattened"] == 0.0
    assert flat["weight_sync_buckets"] == per_tensor["weight_sync_buckets"] > 3
    assert flat["weight_sync_mb"] == per_tensor["weight_sync_mb"] > 0
    for key in ("weight_sync_export_s", "weight_sync_encode_s", "weight_sync_wait_s", "weight_sync_finish_s"):
        assert 0 <= flat[key] <= flat["weight_sync_s"], key
    posts = [(p, payload) for p, payload, *_ in out["flat_calls"] if p == "/update_weights_from_tensor"]
    assert len(posts) == flat["weight_sync_buckets"]
    for path, payload in posts:
        check_request(path, payload)  # a valid SGLang 0.5.15 request
        assert payload["load_format"] == "flattened_bucket" and len(payload["serialized_named_tensors"]) == 2
    assert [p for p, *_ in out["flat_calls"]][-2:] == ["/update_weight_version", "/flush_cache"]


class FailingEngine:
    """Takes the first bucket, rejects the second."""

    def __init__(self):
        self.base_url, self.posts = "http://stub", []

    async def kind(self):
        return "embedded"

    async def get(self, path):
        return {"tp_size": 1}

    async def post(self, path, payload, **kw):
        self.posts.append(path)
        return {"success": len(self.posts) < 2, "message": "no"}


def test_a_rejected_bucket_still_lets_the_export_finish():
    exported = []

    def export():
        for i in range(6):
            exported.append(i)
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB each, 1 bucket each

    engine = FailingEngine()
    with pytest.raises(EngineError, match="rejected by http://stub"):
        asyncio.run(sync_weights_from_tensor([engine], export(), version=1, bucket_bytes=1024))
    assert exported == list(range(6))  # all of it ran (a sharded trainer's collectives), nothing more was sent
    assert engine.posts == ["/update_weights_from_tensor"] * 2


class PairGather:
    """Two ranks' RankGather over queues (rank 0 and rank 1 in two threads): a collective one rank
    makes and the other does not times out instead of hanging, and each rank logs its calls."""

    def __init__(self, rank: int, items, verdicts):
        self.rank, self.items, self.verdicts, self.calls = rank, items, verdicts, []

    def collect(self, item):
        self.calls.append("collect")
        if self.rank:
            self.items.put(item)
            return None
        return [item, self.items.get(timeout=20)]

    def verdict(self, error):
        self.calls.append("verdict")
        if self.rank == 0:
            self.verdicts.put(error)
            return error
        return self.verdicts.get(timeout=20)


@pytest.mark.parametrize("fail_at", [None, 1])
def test_per_rank_protocol_keeps_both_ranks_in_step(fail_at):
    """Rank 0 (sync_weights_per_rank) and rank 1 (serve_weights_per_rank) make the same collectives
    in the same order, with the engine taking every bucket or rejecting one: then both stop
    gathering, both finish their export, and rank 0 raises."""
    import queue
    import threading

    from agentrl.weight_transfer import serve_weights_per_rank, sync_weights_per_rank

    items, verdicts = queue.Queue(), queue.Queue()
    gathers = [PairGather(0, items, verdicts), PairGather(1, items, verdicts)]
    exported = {0: [], 1: []}

    def export(rank):
        for i in range(5):
            exported[rank].append(i)
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB: a bucket each

    class Engine:
        base_url = "http://e0"

        def __init__(self):
            self.loaded = []

        async def post(self, path, payload, **kw):
            if path != "/update_weights_from_tensor":
                return {"success": True}
            names = [n for n, _ in decode_flattened_bucket(payload["serialized_named_tensors"][0])]
            ok = len(self.loaded) != fail_at
            self.loaded.append(names)
            return {"success": ok, "message": "rejected"}

    engine = Engine()
    other = threading.Thread(target=serve_weights_per_rank, args=(export(1),),
                             kwargs=dict(bucket_bytes=1024, kind="embedded", gather=gathers[1]))
    other.start()
    try:
        result = asyncio.run(sync_weights_per_rank([engine], export(0), version=2, bucket_bytes=1024, sources=[[1, 0]],
                                                   kind="embedded", gather=gathers[0]))
    except EngineError as exc:
        result = exc
    other.join(timeout=30)
    assert not other.is_alive()
    assert gathers[0].calls == gathers[1].calls  # the same collectives, in the same order
    assert exported == {0: list(range(5)), 1: list(range(5))}
    if fail_at is None:
        assert result["weight_sync_buckets"] == 5 and engine.loaded == [[f"w{i}"] for i in range(5)]
        assert gathers[0].calls == ["collect"] + ["verdict", "collect"] * 4 + ["verdict"]
    else:
        assert isinstance(result, EngineError) and "rejected" in str(result)
        assert engine.loaded == [["w0"], ["w1"]]  # nothing after the rejected bucket
        assert gathers[0].calls == ["collect", "verdict", "collect", "verdict"]


def test_a_gpu_bucket_buffer_is_allocated_outside_expandable_segments(monkeypatch):
    """Under expandable segments (agentrl's trainer ranks) a bucket's buffer is a plain block, one
    IPC handle (not one per 20 MB of a segment); the allocator's settings come back whole, even
    when the allocation fails."""
    from agentrl import weight_transfer

    calls, real_empty = [], torch.empty

    def empty(n, dtype, device):
        calls.append(("empty", str(device)))
        if n < 0:
            raise RuntimeError("CUDA out of memory")
        return real_empty(n, dtype=dtype)

    conf = "max_split_size_mb:256,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(weight_transfer.torch, "empty", empty)
    cuda = torch.device("cuda", 0)
    assert weight_transfer._ipc_buffer(64, cuda).numel() == 64
    with pytest.raises(RuntimeError, match="out of memory"):
        weight_transfer._ipc_buffer(-1, cuda)
    off = "max_split_size_mb:256,expandable_segments:False"
    assert calls == [off, ("empty", "cuda:0"), conf] * 2
    calls.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    weight_transfer._ipc_buffer(64, cuda)  # the allocator's default: nothing to switch
    weight_transfer._ipc_buffer(64, torch.device("cpu"))
    assert calls == [("empty", "cuda:0"), ("empty", "cpu")]
