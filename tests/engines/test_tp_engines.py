"""Engines of several TP ranks, on the CPU: the embedded engine's --tp-size emulation is as strict
as SGLang about `serialized_named_tensors` (one payload per TP rank, every one the same weights),
the weight sync sends one payload per rank, and the weight check catches an engine that does not
hold the trainer's weights."""

import asyncio

import pytest
import torch

from agentrl.config import parse_config
from agentrl.engines.embedded import EmbeddedEngine, encode_named_tensors
from agentrl.engines.group import Engine, EngineGroup
from agentrl.errors import EngineError
from agentrl.http import NO_RETRY
from agentrl.weight_transfer import sync_weights_from_tensor
from agentrl.weight_update import check_probe, probe_engines, weight_check_due
from contract_helpers import serve

pytestmark = pytest.mark.e2e  # starts engines, Ray or agentrl train


@pytest.fixture
def engine2(tiny_model):
    torch.set_num_threads(1)
    return EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0, tp_size=2)


def _one_weight(engine: EmbeddedEngine, scale: float = 2.0) -> list[tuple[str, torch.Tensor]]:
    name, param = next(iter(engine.model.state_dict().items()))
    return [(name, param.detach().clone() * scale)]


def test_emulated_tp_engine_takes_exactly_one_identical_payload_per_rank(engine2):
    named = _one_weight(engine2)
    other = [(named[0][0], named[0][1] + 1)]

    async def go(client):
        info = await client.get("/server_info")
        assert info["tp_size"] == 2
        replies = {}
        for label, payloads in (("one", [encode_named_tensors(named)]),
                                ("different", [encode_named_tensors(named), encode_named_tensors(other)])):
            with pytest.raises(EngineError) as err:
                await client.post("/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                                  "flush_cache": True}, retry=NO_RETRY)
            replies[label] = str(err.value)
        # the weight sync reads tp_size from /server_info and sends one payload per rank
        out = await sync_weights_from_tensor([client], named, version=7, bucket_bytes=1 << 20)
        return replies, out

    replies, out = serve(engine2, go)
    assert "holds 1 payloads for 2 TP ranks" in replies["one"]
    assert "TP rank 1 got other weights than TP rank 0" in replies["different"]
    assert out["weight_sync_buckets"] == 1
    assert torch.equal(engine2.model.state_dict()[named[0][0]], named[0][1]) and engine2.weight_version == "7"


def test_emulated_tp_engine_refuses_a_distributed_group(engine2):
    async def go(client):
        with pytest.raises(EngineError) as err:
            await client.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                             "rank_offset": 1, "world_size": 3, "group_name": "g"},
                              retry=NO_RETRY)
        return str(err.value)

    assert "emulates --tp-size 2 for tensor updates only" in serve(engine2, go)


class ProbeTrainer:
    """The trainer's half of the weight check: its model's logprobs of the probe's tokens."""

    def __init__(self, model, temperature: float):
        self.model, self.temperature = model, temperature

    async def probe_logprobs(self, samples):
        out = []
        with torch.no_grad():
            for s in samples:
                ids = torch.tensor([s.prompt_tokens + s.response_tokens])
                logits = self.model(ids).logits[0, len(s.prompt_tokens) - 1:-1].float() / self.temperature
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0]
                out.append(lp.tolist())
        return out


def test_weight_check_passes_on_the_same_weights_and_fails_loudly_on_others(tiny_model):
    torch.set_num_threads(1)
    engine = EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0)
    engine.weight_version = "1"
    cfg, _ = parse_config(["--weight-check-interval", "3"])
    assert [v for v in range(1, 8) if weight_check_due(cfg, v)] == [1, 3, 6]
    assert not weight_check_due(parse_config(["--weight-check-interval", "0"])[0], 1)
    assert not weight_check_due(parse_config(["--rollout-temperature", "0"])[0], 1)
    same = ProbeTrainer(engine.model, cfg.rollout.rollout_temperature)
    other_model = EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0).model
    with torch.no_grad():
        for p in other_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    other = ProbeTrainer(other_model, cfg.rollout.rollout_temperature)

    async def go(client):
        engine_state = Engine(url=client.base_url, kind="embedded")
        group = EngineGroup(url=client.base_url, engine_urls=[client.base_url], engines=[engine_state])
        results = {}
        for label, trainer in (("same", same), ("other", other)):
            group.probe_prompts = [[5, 6, 7, 8], [9, 10]]
            await probe_engines(cfg, group, [client])
            assert group.probe_prompts is None and len(group.probe_results) == 2
            try:
                results[label] = await check_probe(cfg, trainer, group, version=1)
            except EngineError as exc:
                results[label] = str(exc)
            assert group.probe_results is None
        engine_state.state = "catching_up"
        group.probe_prompts = [[5, 6, 7, 8]]
        await probe_engines(cfg, group, [client])  # an engine catching up holds older weights: not probed
        assert not group.probe_results
        engine_state.state = "serving"
        group.probe_prompts = [[5, 6, 7, 8]]
        await probe_engines(cfg, group, [client])
        with pytest.raises(EngineError, match="reports weight version 1, the trainer synced version 2"):
            await check_probe(cfg, same, group, version=2)
        return results

    results = serve(engine, go)
    assert results["same"]["weight_check/mean_abs_diff"] < 1e-4, results
    assert results["same"]["weight_check/tokens"] == 16
    assert isinstance(results["other"], str) and "engine http://" in results["other"], results
    assert "disagrees with the trainer" in results["other"] and "--weight-check-max-diff 0.25" in results["other"]


def test_two_megatron_ranks_feed_an_engine_of_two_tp_ranks_each_its_own_copy(tmp_path):
    """`agentrl train --trainer megatron --tensor-model-parallel-size 2 --actor-num-gpus-per-node 2
    --rollout-num-gpus-per-engine 2` on the CPU: the embedded engine emulates two TP ranks, each
    gets the payload of another trainer rank (the per-rank path: every rank's collectives in step
    with rank 0's), it checks both are the same weights, and the weight check agrees."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))
    import megatron_cpu_shim
    from spine_helpers import agentrl_cli, run_env

    out = tmp_path / "run"
    args = ["--env", "target-token", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--rollout-max-response-len", "8", "--no-progress", "--trainer", "megatron",
            "--max-tokens-per-gpu", "256", "--lr", "1e-3", "--seed", "3", "--num-rollout", "2",
            "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
            "--rollout-num-gpus-per-engine", "2", "--weight-check-interval", "1", "--update-weight-buffer-size", "524288",
            "--output-dir", str(out)]
    proc = subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=600,
                          env=megatron_cpu_shim.child_env(run_env()))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    # slime's --update-weight-buffer-size (bytes) sets the bucket: 512 KiB buckets of the ~3 MB tiny model
    assert all(r["weight_sync_per_rank"] == 1.0 and r["weight_sync_buckets"] > 3 for r in rows), rows
    assert rows[1]["weight_check/mean_abs_diff"] < 1e-4 and rows[1]["weight_check/tokens"] > 0
    assert rows[1]["train_rollout_logprob_abs_diff"] < 1e-4


class FakeGather:
    """Rank 0's view of the gather: the other ranks' (meta, payload) per bucket, given by the test."""

    def __init__(self, others):
        self.others, self.verdicts, self.gathered = others, [], 0

    def collect(self, mine):
        self.gathered += 1
        return [mine, *self.others(mine)]

    def verdict(self, error):
        self.verdicts.append(error)
        return error


class RecordingEngine:
    def __init__(self, url):
        self.base_url, self.posts = url, []

    async def post(self, path, payload, **kw):
        self.posts.append((path, payload))
        return {"success": True}


def test_per_rank_sync_orders_payloads_by_tp_rank_and_stops_every_rank_on_a_failure():
    from agentrl.weight_transfer import sync_weights_per_rank

    named = [(f"w{i}", torch.full((256,), float(i))) for i in range(4)]  # 1 KiB each: 2 buckets of 2 KiB
    engines = [RecordingEngine("http://e0"), RecordingEngine("http://e1")]
    gather = FakeGather(lambda mine: [(mine[0], f"rank1:{mine[0][0][0]}")])
    out = asyncio.run(sync_weights_per_rank(engines, iter(named), version=3, bucket_bytes=2048,
                                            sources=[[0, 1], [1, 0]], kind="embedded", gather=gather))
    assert out["weight_sync_buckets"] == 2 and gather.verdicts == [None, None]
    tensor_posts = [p for path, p in engines[1].posts if path == "/update_weights_from_tensor"]
    assert [p["serialized_named_tensors"][0] for p in tensor_posts] == ["rank1:w0", "rank1:w2"]  # TP rank 0 <- rank 1
    assert all(not p["flush_cache"] for p in tensor_posts)
    assert [path for path, _ in engines[0].posts][-2:] == ["/update_weight_version", "/flush_cache"]
    assert engines[0].posts[-2][1]["new_version"] == "3"

    # rank 1 could not serialize the first bucket: nothing is posted, every rank is told, no more gathers
    engines = [RecordingEngine("http://e0")]
    gather = FakeGather(lambda mine: [("RuntimeError: no IPC here", None)])
    with pytest.raises(EngineError, match="trainer rank 1 could not serialize bucket 0: RuntimeError: no IPC here"):
        asyncio.run(sync_weights_per_rank(engines, iter(named), version=4, bucket_bytes=2048, sources=[[0, 1]],
                                          kind="embedded", gather=gather))
    assert engines[0].posts == [] and gather.gathered == 1 and "could not serialize" in gather.verdicts[0]
    # a rank holding other weights (a sharded export) is named, not loaded
    gather = FakeGather(lambda mine: [([("w9", (256,), "torch.float32")], "x")])
    with pytest.raises(EngineError, match="trainer rank 1 exported other weights than rank 0 in bucket 0"):
        asyncio.run(sync_weights_per_rank([RecordingEngine("http://e0")], iter(named), version=4, bucket_bytes=2048,
                                          sources=[[0, 1]], kind="embedded", gather=gather))
