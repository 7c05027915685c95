"""The Megatron trainer on CPU (one process, gloo; megatron_cpu_shim.py says what it patches):
HF <-> Megatron weights for Qwen2, Qwen3, Llama 3, Qwen3-MoE and Qwen2-MoE, logprob parity with the HF model,
training steps against the plain-PyTorch trainer, PPO, checkpoints and weight export.

Tolerances (fp32 on CPU): logprobs and logits within 1e-5 of the HF model's; after one Adam
step, within 1e-4 of the PyTorch trainer's (Adam divides by sqrt(v) + 1e-8, so near-zero
gradient entries amplify float rounding); round trips exact (torch.equal)."""

import json
import math

import pytest
import torch

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.trainers.megatron.families.common import Layout, gather_dim, hf_sources, megatron_names  # noqa: E402
from agentrl.trainers.megatron.families.common import to_hf, to_megatron_shard  # noqa: E402
from agentrl.trainers.megatron.families import family_for  # noqa: E402
from agentrl.trainers.megatron.weights import HFCheckpoint  # noqa: E402
from agentrl.trainers.torch_trainer import TorchTrainer  # noqa: E402
from megatron_helpers import make_samples, tiny_family_model  # noqa: E402

MegatronTrainer = megatron_trainer.MegatronTrainer
LOGPROB_TOL = 1e-5
STEP_TOL = 1e-4


def trainers(model, algo=None, **train):
    tc = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2, **train)
    algo = algo or AlgoConfig()
    mt = MegatronTrainer(str(model), train=tc, algo=algo, temperature=0.8, device="cpu", dtype="float32")
    tt = TorchTrainer(str(model), train=tc, algo=algo, temperature=0.8)
    return mt, tt


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


# -- model and weights -----------------------------------------------------------------------
def test_logprobs_equal_hf_model_and_round_trip_is_exact(tiny_model):
    mt, tt = trainers(tiny_model, max_tokens_per_gpu=48)  # several packed samples per micro-batch
    samples = make_samples()
    ours, ref = mt.compute_logprobs(samples), tt.compute_logprobs(samples)
    print(f"qwen2 tiny: max |megatron - hf| logprob = {max_diff(ours, ref):.2e}")
    assert max_diff(ours, ref) < LOGPROB_TOL
    ckpt = HFCheckpoint(tiny_model)
    exported = dict(mt.named_tensors())
    assert sorted(exported) == sorted(ckpt.keys()) == sorted(n for n, _ in tt.model.named_parameters())
    assert all(torch.equal(exported[k], ckpt.get(k)) for k in exported)
    buckets = list(mt.hf_buckets(bucket_bytes=100_000))
    assert len(buckets) > 3
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= 100_000 for b in buckets if len(b) > 1)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "qwen2_moe"])
def test_other_families_logits_and_round_trip(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl.trainers.megatron.args import parse_megatron_args
    from agentrl.trainers.megatron.model import build_gpt, init_distributed, layer_spec, layout_for, transformer_config
    from agentrl.trainers.megatron.packing import pack
    from agentrl.trainers.megatron.weights import export_hf, load_hf_weights
    from agentrl.types import Sample

    path = tiny_family_model(tmp_path / family, family)
    hf_config = AutoConfig.from_pretrained(path)
    margs = parse_megatron_args({})
    init_distributed(margs, "cpu")  # (a no-op after another test's trainer)
    fam, layout = layout_for(hf_config, margs, te=False)
    cfg = transformer_config(hf_config, fam, margs, dtype="float32", device="cpu")
    gpt = build_gpt(hf_config, cfg, layer_spec(cfg, fam, False), padded_vocab=layout.padded_vocab)
    load_hf_weights(gpt, HFCheckpoint(path), fam, layout, 0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (90, 17, 40)]  # past RoPE's original 64
    batch = pack([Sample(prompt_tokens=s) for s in seqs], [0, 1, 2])
    with torch.no_grad():
        out = gpt(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params())[0]
        ref = torch.cat([hf(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    diff = (out[:, :512] - ref).abs().max().item()
    print(f"{family} tiny: max |megatron - hf| logit = {diff:.2e}")
    assert diff < LOGPROB_TOL
    exported = {n: t for b in export_hf(gpt, fam, layout, bucket_bytes=1 << 16) for n, t in b}
    ckpt = HFCheckpoint(path)  # (transformers 5 fuses MoE experts in memory; checkpoints keep one tensor each)
    assert sorted(exported) == sorted(ckpt.keys())
    assert all(torch.equal(exported[n], ckpt.get(n)) for n in exported)


@pytest.mark.parametrize("family,tp", [("qwen2", 2), ("qwen3", 2), ("llama", 2), ("qwen3_moe", 2), ("qwen2_moe", 2)])
def test_tp_shards_reassemble_exactly(tmp_path, tiny_model, family, tp):
    """The qkv (GQA), gate/up and vocab layouts (and the experts' gate/up split by expert TP):
    HF -> TP shards -> gathered -> HF, exact."""
    from transformers import AutoConfig

    path = tiny_model if family == "qwen2" else tiny_family_model(tmp_path / family, family)
    hf_config = AutoConfig.from_pretrained(path)
    ckpt = HFCheckpoint(path)
    fam = family_for(hf_config)
    layout = Layout.from_hf(hf_config, tp, padded_vocab=-(-hf_config.vocab_size // (tp * 3)) * tp * 3)
    seen = set()
    for name in megatron_names(hf_config.num_hidden_layers, fam, layout):
        kind, sources = hf_sources(name, fam, layout)
        hf = [ckpt.get(s) for s in sources]
        shards = [to_megatron_shard(kind, hf, layout, r) for r in range(tp)]
        dim = gather_dim(kind)
        full = shards[0] if dim is None else torch.cat(shards, dim=dim)
        back = to_hf(kind, full, layout)
        assert all(torch.equal(a, b) for a, b in zip(back, hf)), name
        seen.update(sources)
        if kind == "qkv" and name.endswith("weight"):  # rank 0 holds the first KV groups' q, k, v rows
            d, per = layout.head_dim, layout.num_heads // layout.num_groups
            assert torch.equal(shards[0][:per * d], hf[0][:per * d])
            assert torch.equal(shards[0][per * d:(per + 1) * d], hf[1][:d])
    assert seen == set(ckpt.keys())


@pytest.mark.parametrize("padded", [False, True])
def test_fused_logprobs_equal_plain_autograd(padded):
    """The chunked, recomputing logprob/entropy function (what the trainer uses) against plain
    log_softmax autograd: values and gradients, with temperature and a padded vocab."""
    from agentrl.trainers.megatron import logprobs as lp

    g = torch.Generator().manual_seed(0)
    vocab = 37 if padded else 40
    logits = torch.randn(50, 40, generator=g, dtype=torch.float64) * 3
    rows = torch.randperm(50, generator=g)[:33]
    targets = torch.randint(0, vocab, (33,), generator=g)
    w1, w2 = torch.randn(33, generator=g, dtype=torch.float64), torch.randn(33, generator=g, dtype=torch.float64)
    old_chunk, lp.CHUNK_ROWS = lp.CHUNK_ROWS, 8  # several chunks
    try:
        a = logits.clone().requires_grad_(True)
        logp, ent = lp.fused_logprobs(a, rows, targets, temperature=0.7, vocab_size=vocab, with_entropy=True)
        ((logp * w1).sum() + (ent * w2).sum()).backward()
    finally:
        lp.CHUNK_ROWS = old_chunk
    b = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = lp.reference_logprobs(b[rows] / 0.7, targets, vocab, None, 0, with_entropy=True)
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert (a.grad[~torch.isin(torch.arange(50), rows)] == 0).all()


# -- training --------------------------------------------------------------------------------
def test_grpo_step_matches_the_pytorch_trainer(tiny_model):
    mt, tt = trainers(tiny_model)
    samples = make_samples()
    head_rows = []  # the LM head runs over response positions only (enable_response_head)
    mt.model.output_layer.register_forward_hook(lambda m, args, out: head_rows.append(out[0].shape[0]))
    m1, m2 = mt.train_rollout(samples), tt.train_rollout(samples)
    # the step alone: one step a rollout, so its forward gives the old logprobs too (#34)
    assert head_rows and sum(head_rows) == sum(len(s.response_tokens) for s in samples)
    print("megatron GRPO step:", json.dumps(m1))
    assert mt.version == 1
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert m1["train_rollout_logprob_abs_diff"] == pytest.approx(m2["train_rollout_logprob_abs_diff"], abs=1e-5)
    assert max_diff(mt.compute_logprobs(samples), tt.compute_logprobs(samples)) < STEP_TOL


def test_gspo_kl_loss_entropy_tis_match_the_pytorch_trainer(tiny_model):
    algo = AlgoConfig(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, tis_clip=1.5)
    mt, tt = trainers(tiny_model, algo, max_tokens_per_gpu=64)
    samples = make_samples()
    first = [mt.train_rollout(samples), tt.train_rollout(samples)]
    second = [mt.train_rollout(samples), tt.train_rollout(samples)]  # now off the reference: kl > 0
    for a, b in (first, second):
        for key in ("loss", "pg_loss", "kl_loss", "entropy", "tis_weight", "clipfrac", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert second[0]["kl_loss"] > 0 and second[0]["entropy"] > 0 and first[0]["tis_weight"] != 1.0


def test_ppo_with_critic_and_kl_in_reward(tiny_model):
    algo = AlgoConfig(advantage_estimator="ppo", kl_coef=0.05, gamma=1.0, lambd=0.95, value_clip=0.2)
    mt = MegatronTrainer(str(tiny_model), train=TrainConfig(lr=1e-3, global_batch_size=3, micro_batch_size=2),
                         algo=algo, temperature=0.8, device="cpu", dtype="float32")
    samples = make_samples()
    v0 = mt.compute_values(samples)
    assert [len(v) for v in v0] == [s.response_length for s in samples]
    m = mt.train_rollout(samples)  # two global batches: two policy and two critic steps
    assert mt.version == 2 and {"value_loss", "value_clipfrac", "critic_grad_norm", "pg_loss"} <= set(m)
    assert all(math.isfinite(v) for v in m.values())
    assert max_diff(mt.compute_values(samples), v0) > 1e-4  # the critic learned


def test_save_and_load_resume_exactly(tiny_model, tmp_path):
    from agentrl.models import load_model

    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.05)
    tc = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=3, save_hf=str(tmp_path / "hf-{rollout_id}"))
    a = MegatronTrainer(str(tiny_model), train=tc, algo=algo, temperature=0.8, device="cpu", dtype="float32")
    samples = make_samples()
    a.train_rollout(samples)
    a.save(tmp_path / "ckpt", {"rollout_id": 1, "data": {"epoch": 0, "offset": 6}})
    after_save = a.compute_logprobs(samples)
    a.train_rollout(samples)
    expected = a.compute_logprobs(samples)

    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state == {"version": 1, "rollout_id": 1, "data": {"epoch": 0, "offset": 6},
                     "ref_model_path": str(tiny_model.resolve()), "distributed_optimizer": False}
    # the HF copy (what the engines reload on resume) holds the trained weights
    hf = TorchTrainer(str(tmp_path / "ckpt" / "model"), train=tc, algo=AlgoConfig(), temperature=0.8)
    assert max_diff(hf.compute_logprobs(samples), after_save) < LOGPROB_TOL
    assert (tmp_path / "hf-1" / "model.safetensors").exists() and load_model(tmp_path / "hf-1") is not None

    b = MegatronTrainer(str(tmp_path / "ckpt" / "model"), train=tc, algo=algo, temperature=0.8, device="cpu",
                        dtype="float32")
    assert b.load(tmp_path / "ckpt")["data"] == {"epoch": 0, "offset": 6} and b.version == 1
    b.train_rollout(samples)  # same optimizer moments: the same second step
    assert max_diff(b.compute_logprobs(samples), expected) < 1e-6


def test_multi_tensor_ops_without_apex():
    """no_apex's foreach grad norm and master->model copy replace megatron-core's fallbacks (one
    host sync per parameter, a Python copy loop) and compute the same values."""
    from megatron.core.optimizer import clip_grads, optimizer

    from agentrl.trainers.megatron import no_apex

    assert no_apex.install_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is no_apex.foreach_l2_norm
    assert optimizer._multi_tensor_copy_this_to_that is no_apex.foreach_copy
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g), torch.randn(11, 2, generator=g)]
    norm, _ = no_apex.foreach_l2_norm(0, None, [grads], False)
    assert norm.shape == (1,) and torch.allclose(norm[0], torch.cat([x.flatten() for x in grads]).norm())
    model = [torch.empty(x.shape, dtype=torch.bfloat16) for x in grads]
    no_apex.foreach_copy(grads, model)
    assert all(torch.equal(m, x.bfloat16()) for m, x in zip(model, grads))


def test_layouts_megatron_core_cannot_train_are_refused_up_front(tmp_path, tiny_model):
    """Context parallelism in a form the trainer does not do (p2p: Transformer Engine's), MoE with
    TP but no sequence parallelism (megatron-core's MoE layer refuses it at the first training
    step), and an EP size that does not divide the experts (or a dense model): a ConfigError
    naming the flag, before any model is built."""
    from transformers import AutoConfig

    from agentrl.errors import ConfigError
    from agentrl.trainers.megatron.args import parse_megatron_args
    from agentrl.trainers.megatron.model import layout_for, transformer_config

    with pytest.raises(ConfigError, match="cp-comm-type p2p"):
        MegatronTrainer(str(tiny_model), train=TrainConfig(), algo=AlgoConfig(), temperature=1.0, device="cpu",
                        dtype="float32", megatron_args={"context_parallel_size": "2", "cp_comm_type": "p2p"})
    moe = AutoConfig.from_pretrained(tiny_family_model(tmp_path / "moe", "qwen3_moe"))
    margs = parse_megatron_args({"tensor_model_parallel_size": "2"})
    fam, _ = layout_for(moe, margs, te=False)
    with pytest.raises(ConfigError, match="sequence-parallel"):
        transformer_config(moe, fam, margs, dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="expert-model-parallel-size 3"):
        layout_for(moe, parse_megatron_args({"expert_model_parallel_size": "3"}), te=False)
    with pytest.raises(ConfigError, match="dense"):
        layout_for(AutoConfig.from_pretrained(tiny_model), parse_megatron_args({"expert_model_parallel_size": "2"}),
                   te=False)
