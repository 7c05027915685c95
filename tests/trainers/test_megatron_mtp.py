"""MiMo and its multi-token-prediction (MTP) layers in the Megatron trainer, on CPU (gloo):
the `mimo` family's HF <-> Megatron mapping (main model and `model.mtp_layers.*`, exact both
ways, at TP 1 and 2), its logits against HF Qwen2's on the same weights, `--mtp-num-layers`
building the MTP block, `--enable-mtp-training`'s loss against a plain-torch reference from
the HF-named weights, the policy untouched by it, and the trained MTP layers reaching the
engines (weight sync, save_hf)."""

import asyncio
import json
import math

import pytest
import torch

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.errors import ConfigError  # noqa: E402
from agentrl.trainers.megatron.families import family_for  # noqa: E402
from agentrl.trainers.megatron.families.common import (Layout, gather_dim, hf_sources, megatron_names, to_hf,  # noqa: E402
                                                      to_megatron_shard)
from agentrl.trainers.megatron.weights import HFCheckpoint  # noqa: E402
from megatron_helpers import make_samples, run_ranks, tiny_mimo_model  # noqa: E402

MegatronTrainer = megatron_trainer.MegatronTrainer
TOL = 1e-5
MTP = {"mtp_num_layers": "1"}
TRAIN_MTP = {"mtp_num_layers": "1", "enable_mtp_training": None}


@pytest.fixture(scope="module")
def mimo(tmp_path_factory, tiny_model):
    return tiny_mimo_model(tmp_path_factory.mktemp("mimo"), tiny_model)


def trainer(path, megatron=None, lr=1e-3, **train):
    tc = TrainConfig(lr=lr, global_batch_size=6, micro_batch_size=2, **train)
    return MegatronTrainer(str(path), train=tc, algo=AlgoConfig(), temperature=0.8, device="cpu", dtype="float32",
                           megatron_args=dict(megatron or {}))


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def hf_qwen2(path):
    """The main model as HF's Qwen2 (the MTP tensors left unread)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in json.loads((path / "config.json").read_text()).items()
                            if k not in ("model_type", "architectures", "num_nextn_predict_layers")})
    model = Qwen2ForCausalLM(config)
    ckpt = HFCheckpoint(path)
    model.load_state_dict({n: ckpt.get(n) for n in ckpt.keys() if not n.startswith("model.mtp_layers.")})
    return model.eval()


# -- the mimo family's weights ---------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_mimo_shards_reassemble_exactly(mimo, tp):
    """Every HF tensor, the MTP layers' included, HF -> TP shards -> gathered -> HF, exact."""
    from transformers import AutoConfig

    from agentrl import hf_mimo

    hf_mimo.register()
    hf_config = AutoConfig.from_pretrained(mimo)
    ckpt, fam = HFCheckpoint(mimo), family_for(hf_config)
    assert fam.name == "mimo" and fam.mtp
    layout = Layout.from_hf(hf_config, tp, padded_vocab=-(-hf_config.vocab_size // (tp * 3)) * tp * 3, mtp_layers=1)
    seen = set()
    for name in megatron_names(hf_config.num_hidden_layers, fam, layout):
        kind, sources = hf_sources(name, fam, layout)
        hf = [ckpt.get(s) for s in sources]
        shards = [to_megatron_shard(kind, hf, layout, r) for r in range(tp)]
        full = shards[0] if gather_dim(kind) is None else torch.cat(shards, dim=gather_dim(kind))
        assert all(torch.equal(a, b) for a, b in zip(to_hf(kind, full, layout), hf)), name
        seen.update(sources)
        if name == "mtp.layers.0.eh_proj.weight":  # megatron-core's [embedding; hidden] is MiMo's [hidden; embedding]
            h = layout.hidden
            assert torch.equal(full[:, :h], hf[0][:, h:]) and torch.equal(full[:, h:], hf[0][:, :h])
    assert seen == set(ckpt.keys())
    assert any(s.startswith("model.mtp_layers.0.self_attn.q_proj.bias") for s in seen)


def test_mimo_logits_equal_hf_qwen2_and_the_model_round_trips(mimo):
    """TP 1, in this process: the Megatron model (with its MTP block) gives HF Qwen2's logits on the
    same weights, and exports every checkpoint tensor back bit for bit."""
    from agentrl.trainers.megatron.packing import pack
    from agentrl.types import Sample

    mt = trainer(mimo, MTP)
    assert "mtp.layers.0.eh_proj.weight" in dict(mt.model.named_parameters())
    exported = dict(mt.named_tensors())
    ckpt = HFCheckpoint(mimo)
    assert sorted(exported) == sorted(ckpt.keys())
    assert all(torch.equal(exported[k], ckpt.get(k)) for k in exported)
    hf = hf_qwen2(mimo)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (90, 17, 40)]
    batch = pack([Sample(prompt_tokens=s) for s in seqs], [0, 1, 2])
    with torch.no_grad():
        out = mt.model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params())[0]
        ref = torch.cat([hf(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    diff = (out[:, :512] - ref).abs().max().item()
    print(f"mimo tiny: max |megatron - hf qwen2| logit = {diff:.2e}")
    assert diff < TOL


# -- the MTP loss ------------------------------------------------------------------------------
def reference_mtp_loss(path, samples) -> float:
    """Plain torch from the HF-named weights: MTP layer 0 at position i takes the main model's
    final hidden state i and token i+1's embedding and predicts token i+2; the mean of its
    cross-entropy over the trained (loss mask 1) response tokens it predicts, over the batch's
    trained tokens."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    hf = hf_qwen2(path)
    ckpt, cfg = HFCheckpoint(path), hf.config
    w = {n.removeprefix("model.mtp_layers.0."): ckpt.get(n) for n in ckpt.keys() if n.startswith("model.mtp_layers.0.")}
    layer = Qwen2DecoderLayer(cfg, layer_idx=0).eval()
    layer.load_state_dict({k: v for k, v in w.items() if k in layer.state_dict()})
    rope = Qwen2RotaryEmbedding(cfg)

    def norm(x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(x.dtype)

    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            n = ids.shape[1]
            hidden = hf.model(input_ids=ids).last_hidden_state  # after model.norm: [1, n, h]
            nxt = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=ids.dtype)], dim=1)  # token i+1 (0 past the end)
            emb = hf.model.embed_tokens(nxt)
            x = torch.cat([norm(hidden, w["hidden_layernorm.weight"]), norm(emb, w["token_layernorm.weight"])], -1)
            x = x @ w["input_proj.weight"].T
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))
            x = x[0] if isinstance(x, tuple) else x
            logits = norm(x, w["final_layernorm.weight"]) @ hf.lm_head.weight.T  # [1, n, V]
            logp = torch.log_softmax(logits[0].float(), -1)
            start = len(s.prompt_tokens)
            for r, m in enumerate(s.loss_mask):  # response token j = start + r, predicted at i = j - 2
                if m:
                    count += 1
                    j = start + r
                    if j >= 2:
                        total -= logp[j - 2, s.tokens[j]].item()
    return total / count


def test_mtp_loss_equals_the_plain_torch_reference_and_leaves_the_policy_alone(mimo):
    samples = make_samples()
    ref = reference_mtp_loss(mimo, samples)
    big_clip = {"clip_grad": 1e9}  # the MTP layers' gradient would otherwise enter the policy's clipping
    on = trainer(mimo, TRAIN_MTP, **big_clip)
    off = trainer(mimo, {}, **big_clip)
    assert on.compute_logprobs(samples) == off.compute_logprobs(samples)  # the MTP block leaves the logits alone
    m_on, m_off = on.train_rollout(samples), off.train_rollout(samples)
    print(f"mtp_loss {m_on['mtp_loss']:.6f}, plain-torch reference {ref:.6f}")
    assert abs(m_on["mtp_loss"] - ref) < 1e-5 and m_on["mtp_1_loss"] == m_on["mtp_loss"]
    assert "mtp_loss" not in m_off
    assert abs(m_on["pg_loss"] - m_off["pg_loss"]) < 1e-7
    # the policy's update is the one without MTP training: its path into the MTP layers is detached
    assert max_diff(on.compute_logprobs(samples), off.compute_logprobs(samples)) < 1e-6
    trained = dict(on.named_tensors())
    start = HFCheckpoint(mimo)
    assert not torch.equal(trained["model.mtp_layers.0.input_proj.weight"], start.get("model.mtp_layers.0.input_proj.weight"))


def test_mtp_training_lowers_the_mtp_loss_and_scales_it(mimo):
    samples = make_samples()
    mt = trainer(mimo, {**TRAIN_MTP, "mtp_loss_scaling_factor": "0.5"}, lr=3e-3)
    assert mt.mtp_factor == 0.5
    losses = [mt.train_rollout(samples)["mtp_loss"] for _ in range(5)]
    print("mtp_loss over 5 steps on one batch:", [f"{x:.4f}" for x in losses])
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.05
    assert trainer(mimo, TRAIN_MTP).mtp_factor == 0.2  # slime's default


def test_without_enable_mtp_training_the_mtp_layers_stay_the_checkpoints(mimo):
    mt = trainer(mimo, MTP, lr=1e-2)
    mtp_params = {n: p for n, p in mt.model.named_parameters() if n.startswith("mtp.")}
    assert mtp_params and not any(p.requires_grad for p in mtp_params.values())
    m = mt.train_rollout(make_samples())
    assert "mtp_loss" not in m
    ckpt, exported = HFCheckpoint(mimo), dict(mt.named_tensors())
    mtp_names = [n for n in ckpt.keys() if n.startswith("model.mtp_layers.")]
    assert mtp_names and all(torch.equal(exported[n], ckpt.get(n)) for n in mtp_names)
    assert not torch.equal(exported["model.norm.weight"], ckpt.get("model.norm.weight"))  # the rest trained


def test_a_mimo_trained_without_mtp_layers_saves_the_checkpoints(mimo, tmp_path):
    """Without --mtp-num-layers no MTP block is built and none is synced (the engines keep theirs), and a
    saved checkpoint still carries the start's MTP tensors, for a later EAGLE draft."""
    mt = trainer(mimo, {}, lr=1e-2)
    mt.train_rollout(make_samples())
    assert not any(n.startswith("model.mtp_layers.") for n, _ in mt.named_tensors())
    mt.save_hf(tmp_path / "hf")
    ckpt, saved = HFCheckpoint(mimo), HFCheckpoint(tmp_path / "hf")
    assert sorted(saved.keys()) == sorted(ckpt.keys())
    assert all(torch.equal(saved.get(n), ckpt.get(n)) for n in ckpt.keys() if n.startswith("model.mtp_layers."))


def test_mtp_flags_are_checked_naming_why(mimo, tiny_model):
    with pytest.raises(ConfigError, match="--mtp-num-layers 2 differs from config.json's num_nextn_predict_layers"):
        trainer(mimo, {"mtp_num_layers": "2"})
    with pytest.raises(ConfigError, match="--enable-mtp-training needs the MTP layers built: add --mtp-num-layers"):
        trainer(mimo, {"enable_mtp_training": None})
    with pytest.raises(ConfigError, match="model family 'qwen2' has no multi-token-prediction layers"):
        trainer(tiny_model, MTP)


# -- TP 2 ----------------------------------------------------------------------------------------
@pytest.mark.slow  # two Megatron ranks
def test_tp2_sequence_parallel_round_trip_logprobs_and_mtp_loss(mimo, tmp_path):
    """Two gloo ranks, TP 2 with sequence parallelism: the exported model is the checkpoint,
    logprobs equal TP 1's, and the MTP loss of the first step equals TP 1's."""
    one = trainer(mimo, TRAIN_MTP)
    samples = make_samples()
    before1 = one.compute_logprobs(samples)
    m1 = one.train_rollout(samples)
    out = tmp_path / "tp2.json"
    res = run_ranks(2, ["--model", str(mimo), "--megatron", json.dumps(
        {**TRAIN_MTP, "tensor_model_parallel_size": 2, "sequence_parallel": True})], out)
    assert res["roundtrip"]
    assert max_diff(res["before"], before1) < TOL
    print(f"mtp_loss TP1 {m1['mtp_loss']:.6f}, TP2+SP {res['metrics']['mtp_loss']:.6f}")
    assert abs(res["metrics"]["mtp_loss"] - m1["mtp_loss"]) < 1e-5
    assert max_diff(res["after"], one.compute_logprobs(samples)) < 1e-4


# -- the MTP layers reach the engines --------------------------------------------------------
@pytest.fixture(scope="module")
def trained(mimo):
    mt = trainer(mimo, TRAIN_MTP)
    mt.train_rollout(make_samples())
    return mt


def test_the_embedded_engine_takes_the_mtp_tensors_and_save_writes_them(mimo, trained, tmp_path):
    """The contract: an engine on a MiMo takes `model.mtp_layers.*` by name (its MiMo model holds the
    MTP layers as parameters, unused when serving: agentrl/hf_mimo.py) and still refuses unknown
    names; the trained MTP layers are in what the trainer sends and in its save_hf checkpoint."""
    from agentrl.engines.embedded import EmbeddedEngine

    sent = dict(trained.named_tensors())
    assert any(n.startswith("model.mtp_layers.0.") for n in sent)
    engine = EmbeddedEngine(str(mimo))
    engine._load_named(list(sent.items()))
    state = engine.model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in sent.items())
    with pytest.raises(KeyError, match="unknown weight names"):
        engine._load_named([("model.mtp_layers.7.input_proj.weight", sent["model.mtp_layers.0.input_proj.weight"])])

    trained.save_hf(tmp_path / "hf")
    saved = HFCheckpoint(tmp_path / "hf")
    assert sorted(saved.keys()) == sorted(sent)
    assert all(torch.equal(saved.get(n), t) for n, t in sent.items() if n.startswith("model.mtp_layers."))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mimo"


@pytest.mark.e2e  # an engine process
def test_a_weight_sync_into_an_embedded_engine_sends_the_mtp_layers(mimo, trained, tmp_path):
    from agentrl.engines.launch import launch_embedded_engine
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_transfer import sync_weights_from_tensor

    sent = []

    def named():
        for name, t in trained.named_tensors():
            sent.append(name)
            yield name, t

    server = launch_embedded_engine(str(mimo), log_dir=tmp_path / "logs", num_threads=1)
    try:
        async def go():
            async with EngineClient(server.url) as client:
                return await sync_weights_from_tensor([client], named(), version=1, bucket_bytes=64 * 1024)
        assert asyncio.run(go())["weight_sync_buckets"] >= 1  # (an engine refusing a name fails the sync)
    finally:
        server.stop()
    assert any(n.startswith("model.mtp_layers.0.") for n in sent)


def test_a_checkpoint_resumes_the_mtp_layers_exactly(mimo, tmp_path):
    """save/load (Megatron's distributed checkpoint and the HF copy) keep the MTP block and its
    optimizer state: the resumed trainer's next step is the original's."""
    a = trainer(mimo, TRAIN_MTP)
    samples = make_samples()
    a.train_rollout(samples)
    a.save(tmp_path / "ckpt", {"rollout_id": 1})
    b = trainer(tmp_path / "ckpt" / "model", TRAIN_MTP)
    b.load(tmp_path / "ckpt")
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_tensors(), b.named_tensors()))
    assert a.train_rollout(samples)["mtp_loss"] == b.train_rollout(samples)["mtp_loss"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_tensors(), b.named_tensors()))
