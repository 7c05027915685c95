"""The delta weight sync's codec and apply (agentrl.weight_delta), on real safetensors files: the
trainer's side publishes versions, the engine's side brings a local checkpoint to one of them; the
embedded engine's route and agentrl's SGLang wrapper's ASGI route run the same apply."""

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.errors import ConfigError
from agentrl.weight_delta import (DeltaError, DeltaPublisher, apply, apply_weight_delta, check_checksum, encode,
                                  version_dir)


def _seed(folder, dtypes=(torch.bfloat16, torch.float32)):
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for i, dtype in enumerate(dtypes):
        weights[f"layers.{i}.w"] = torch.randn(48, 40, generator=g).to(dtype)
        weights[f"layers.{i}.b"] = torch.randn(40, generator=g).to(dtype)
    weights["norm.weight"] = torch.ones(40)  # never changes: never published
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    return weights


def _step(weights, seed, fraction=0.3):
    """Weights after a training step: a `fraction` of each trained tensor's elements moved."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        if name == "norm.weight":
            out[name] = t.clone()
            continue
        moved = torch.rand(t.shape, generator=g) < fraction
        out[name] = torch.where(moved, (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype), t)
    return out


def _bitwise_equal(folder, weights):
    got = load_file(folder / "model.safetensors")
    assert set(got) == set(weights)
    for name, t in weights.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("checksum", ["xxh3-128", "adler32"])
def test_round_trip_is_bitwise_for_bf16_and_fp32(tmp_path, encoding, checksum):
    weights = _seed(tmp_path / "seed")
    pub = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed", encoding=encoding, checksum_name=checksum)
    for version in (1, 2, 3):
        weights = _step(weights, version)
        # the trainer's tensors may be in another dtype: they are published in the checkpoint's
        trainer = {n: t.float() for n, t in weights.items()}
        m = pub.publish(trainer.items(), version)
        assert 0.1 < m["weight_sync_delta_density"] < 0.5, m
        done = apply_weight_delta(tmp_path / "shared", tmp_path / "local", version)
        assert done["applied"] == [version] and done["seeded"] == (version == 1)
        _bitwise_equal(tmp_path / "local", weights)
        index = json.loads((version_dir(tmp_path / "shared", version) / "index.json").read_text())
        assert "norm.weight" not in index["tensors"]  # unchanged: left out
        entry = index["tensors"]["layers.0.w"]
        assert (entry["dtype"], entry["shape"], entry["encoding"]) == ("BF16", [48, 40], encoding)
        assert index["tensors"]["layers.1.w"]["dtype"] == "F32" and index["checksum"] == checksum
        assert index["compression"] == "zstd-1" and index["base"] == (None if version == 1 else version - 1)
    _bitwise_equal(tmp_path / "seed", _seed(tmp_path / "again"))  # the seed itself was never patched


def test_without_zstandard_the_payloads_are_zlib_and_say_so(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    weights = _step(_seed(tmp_path / "seed"), 1)
    DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed").publish(weights.items(), 1)
    assert json.loads((version_dir(tmp_path / "shared", 1) / "index.json").read_text())["compression"] == "zlib-1"
    apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    _bitwise_equal(tmp_path / "local", weights)


def test_a_catch_up_applies_every_missing_version_in_order(tmp_path):
    weights = _seed(tmp_path / "seed")
    pub = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed")
    for version in (1, 2, 3):
        weights = _step(weights, version)
        pub.publish(weights.items(), version)
    assert apply_weight_delta(tmp_path / "shared", tmp_path / "local", 3)["applied"] == [1, 2, 3]
    _bitwise_equal(tmp_path / "local", weights)
    assert apply_weight_delta(tmp_path / "shared", tmp_path / "local", 3)["applied"] == []  # already there


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_xor_applied_twice_reverts_and_overwrite_does_not(dtype):
    old = torch.randn(1000).to(dtype)
    new = old.clone()
    new[::7] += 1
    o, n = old.view(torch.uint8).numpy().copy(), new.view(torch.uint8).numpy().copy()
    for encoding, twice in (("xor", o), ("overwrite", n)):
        payload, entry = encode(encoding, o, n)
        target = o.copy()
        apply(encoding, target, payload, entry)
        assert np.array_equal(target, n)
        apply(encoding, target, payload, entry)
        assert np.array_equal(target, twice), encoding
    assert encode("xor", o, o.copy()) is None


def test_a_version_is_never_applied_twice_and_a_wrong_base_fails_its_checksum(tmp_path):
    weights = _seed(tmp_path / "seed")
    pub = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed", encoding="xor")
    weights = _step(weights, 1)
    pub.publish(weights.items(), 1)
    apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    assert apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)["applied"] == []  # the record says done
    _bitwise_equal(tmp_path / "local", weights)
    # a record that lies (says the seed while the files hold version 1): xor on the wrong base is caught
    state = tmp_path / "local" / ".agentrl_delta.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "version": None}))
    with pytest.raises(DeltaError, match=r"tensor layers\.\d\.[wb] fails its xxh3-128 checksum after applying version 1"):
        apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    # left mid-apply: the next call seeds the folder again and gets it right
    done = apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    assert done["seeded"] and done["applied"] == [1]
    _bitwise_equal(tmp_path / "local", weights)


def test_a_corrupt_payload_fails_naming_the_tensor_and_the_file(tmp_path):
    from agentrl.weight_delta import compress, decompress

    weights = _seed(tmp_path / "seed", dtypes=(torch.float32,))
    pub = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed", encoding="overwrite", checksum_name="adler32")
    pub.publish(_step(weights, 1, fraction=1.0).items(), 1)
    folder = version_dir(tmp_path / "shared", 1)
    index = json.loads((folder / "index.json").read_text())
    entry = index["tensors"]["layers.0.w"]
    good = (folder / entry["file"]).read_bytes()
    # a payload that still decompresses, one new value wrong: the checksum catches it
    payload = bytearray(decompress("zstd-1", good[entry["offset"]:entry["offset"] + entry["length"]],
                                   entry["payload_bytes"]))
    payload[-1] ^= 0x01
    bad = compress("zstd-1", bytes(payload))
    (folder / "data_00001.bin").write_bytes(bad)
    index["tensors"]["layers.0.w"] = {**entry, "file": "data_00001.bin", "offset": 0, "length": len(bad)}
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(DeltaError, match=r"weight_v000001/data_00001\.bin: tensor layers\.0\.w fails its adler32 "
                                         r"checksum after applying version 1"):
        apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    # a flipped byte in the compressed stream
    index["tensors"]["layers.0.w"] = entry
    (folder / "index.json").write_text(json.dumps(index))
    broken = bytearray(good)
    broken[entry["offset"] + entry["length"] - 10] ^= 0xFF
    (folder / entry["file"]).write_bytes(bytes(broken))
    with pytest.raises(DeltaError, match=r"weight_v000001/data_00000\.bin: tensor layers\.0\.w('s payload does not "
                                         r"decompress| fails its adler32 checksum)"):
        apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)


def test_a_missing_version_or_a_local_checkpoint_ahead_is_a_clear_error(tmp_path):
    weights = _seed(tmp_path / "seed")
    pub = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed", keep=2)
    for version in (1, 2, 3, 4):
        weights = _step(weights, version)
        pub.publish(weights.items(), version)
        if version == 1:
            apply_weight_delta(tmp_path / "shared", tmp_path / "early", 1)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["weight_v000003", "weight_v000004"]
    with pytest.raises(DeltaError, match=r"holds version 1; reaching version 4 needs version 2: delta version 2 is "
                                         r"not in .*shared \(kept there: \[3, 4\]\)"):
        apply_weight_delta(tmp_path / "shared", tmp_path / "early", 4)
    with pytest.raises(DeltaError, match=r"delta version 7 is not in .*\(kept there: \[3, 4\]\)"):
        apply_weight_delta(tmp_path / "shared", tmp_path / "early", 7)
    fresh = tmp_path / "fresh"  # a new host: seeded, then needs versions 1.. which are gone
    with pytest.raises(DeltaError, match="reaching version 4 needs version 2"):
        apply_weight_delta(tmp_path / "shared", fresh, 4)
    # a local checkpoint ahead of the version asked for
    pub2 = DeltaPublisher(tmp_path / "shared2", seed=tmp_path / "seed")
    w = _seed(tmp_path / "seed2")
    for version in (1, 2):
        w = _step(w, version)
        pub2.publish(w.items(), version)
    apply_weight_delta(tmp_path / "shared2", tmp_path / "ahead", 2)
    with pytest.raises(DeltaError, match="holds version 2, newer than version 1 asked for"):
        apply_weight_delta(tmp_path / "shared2", tmp_path / "ahead", 1)


def test_a_folder_that_is_not_agentrls_is_never_overwritten(tmp_path):
    weights = _seed(tmp_path / "seed")
    DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed").publish(_step(weights, 1).items(), 1)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "notes.txt").write_text("mine")
    with pytest.raises(DeltaError, match="is not empty and holds no delta record"):
        apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    assert (tmp_path / "local" / "notes.txt").read_text() == "mine"


def test_a_new_trainer_start_reseeds_the_local_checkpoint(tmp_path):
    """Another chain (a resumed run, a new run in the same folders): the local checkpoint is seeded
    again from the new chain's seed, never patched with deltas of another base."""
    weights = _seed(tmp_path / "seed")
    first = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed")
    w1 = _step(weights, 1)
    first.publish(w1.items(), 1)
    apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    second = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed")  # starts from the seed again
    w2 = _step(weights, 2)
    second.publish(w2.items(), 1)
    done = apply_weight_delta(tmp_path / "shared", tmp_path / "local", 1)
    assert done["seeded"] and done["applied"] == [1]
    _bitwise_equal(tmp_path / "local", w2)


def test_the_trainer_refuses_a_tensor_the_checkpoint_lacks_or_shapes_differently(tmp_path):
    weights = _seed(tmp_path / "seed")
    pub = DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed")
    with pytest.raises(ConfigError, match=r"the trainer's tensor lm_head.weight is not in the engines' checkpoint"):
        pub.publish([*weights.items(), ("lm_head.weight", torch.zeros(3))], 1)
    with pytest.raises(ConfigError, match=r"layers.0.b has shape \[41\] in the trainer, \[40\] in"):
        pub.publish([("layers.0.b", torch.zeros(41))], 1)
    assert not list((tmp_path / "shared").iterdir())  # nothing half-written is left


def test_a_checksum_whose_package_is_missing_is_named(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_blake3(name, *a, **kw):
        if name == "blake3":
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_blake3)
    with pytest.raises(DeltaError, match=r"checksum blake3 needs the `blake3` package \(pip install blake3\)"):
        check_checksum("blake3")
    check_checksum("adler32")


def test_the_embedded_engine_applies_and_loads_a_delta(tmp_path, tiny_model):
    """Through the engine's route (agentrl's own) and SGLang's /update_weights_from_disk, as the
    trainer's sync drives them: the engine then holds the trainer's weights bit for bit."""
    from aiohttp.test_utils import TestServer

    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_transfer import sync_weights_from_delta

    torch.set_num_threads(1)
    engine = EmbeddedEngine(str(tiny_model))
    trainer = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    pub = DeltaPublisher(tmp_path / "shared", seed=tiny_model)

    async def go():
        server = TestServer(engine.app())
        await server.start_server()
        client = EngineClient(str(server.make_url("")).rstrip("/"))
        try:
            for version in (1, 2):
                with torch.no_grad():
                    trainer["model.layers.0.self_attn.q_proj.weight"][version] += 0.5
                m = pub.publish(trainer.items(), version)
                assert m["weight_sync_delta_tensors"] == 1 and m["weight_sync_delta_density"] < 0.01
                await sync_weights_from_delta([client], str(tmp_path / "shared"), str(tmp_path / "local"),
                                              version=version)
                for name, p in engine.model.named_parameters():
                    assert torch.equal(p, trainer[name]), name
                assert engine.weight_version == str(version)
            reply = await client.session.post(client.base_url + "/agentrl/apply_weight_delta",
                                              json={"delta_dir": str(tmp_path / "shared"),
                                                    "local_dir": str(tmp_path / "local"), "version": 5})
            assert reply.status == 400 and "delta version 5 is not in" in (await reply.json())["message"]
        finally:
            await client.close()
            await server.close()

    asyncio.run(go())


def test_sglang_wrapper_serves_the_route_and_passes_the_rest(tmp_path):
    """agentrl.engines.sglang_server's ASGI middleware, on a stand-in app (no SGLang needed)."""
    from agentrl.engines.sglang_server import WeightDeltaRoute

    weights = _seed(tmp_path / "seed")
    DeltaPublisher(tmp_path / "shared", seed=tmp_path / "seed").publish(_step(weights, 1).items(), 1)
    passed = []

    async def app(scope, receive, send):
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"sglang"})

    async def call(path, body: bytes, method="POST"):
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        await WeightDeltaRoute(app)({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
        return sent[0]["status"], sent[1]["body"]

    body = json.dumps({"delta_dir": str(tmp_path / "shared"), "local_dir": str(tmp_path / "local"), "version": 1})
    status, reply = asyncio.run(call("/agentrl/apply_weight_delta", body.encode()))
    assert status == 200 and json.loads(reply)["applied"] == [1], reply
    _bitwise_equal(tmp_path / "local", _step(weights, 1))
    status, reply = asyncio.run(call("/agentrl/apply_weight_delta", b"{}"))
    assert status == 400 and b"version (int) are required" in reply
    assert asyncio.run(call("/generate", b"{}")) == (200, b"sglang") and passed == ["/generate"]


def test_an_engine_without_the_route_is_named(tmp_path):
    """An engine agentrl did not start (plain SGLang behind --rollout-engine-urls) has no delta route."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.errors import EngineError
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_transfer import sync_weights_from_delta

    async def go():
        server = TestServer(web.Application())
        await server.start_server()
        client = EngineClient(str(server.make_url("")).rstrip("/"))
        try:
            with pytest.raises(EngineError, match=r"/agentrl/apply_weight_delta: HTTP 404, not served: "
                                                  r"--weight-sync-mode delta needs engines started by agentrl"):
                await sync_weights_from_delta([client], str(tmp_path / "d"), str(tmp_path / "l"), version=1)
        finally:
            await client.close()
            await server.close()

    asyncio.run(go())
