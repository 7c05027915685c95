"""slime's --ref-load: the KL reference is read from that checkpoint, not the start model, in
both trainers. At step 0 the policy is the start model, so the reported kl_loss is the KL of
the start model to the reference: zero when they are the same weights, and, for another
reference, exactly the k3 estimate computed directly from the two models' logprobs. The
Megatron trainer reads the reference from an HF folder or from a Megatron distributed
checkpoint (an agentrl checkpoint's megatron/, or slime's torch_dist layout with
latest_checkpointed_iteration.txt), with the same result. An HF reference whose vocab_size or
tokenizer differs from the start model's is refused, naming --ref-load and the difference."""

import json
import shutil

import pytest
import torch

from agentrl.algorithms import kl_penalty
from agentrl.config import AlgoConfig, TrainConfig
from agentrl.errors import ConfigError
from agentrl.trainers.torch_trainer import TorchTrainer
from megatron_helpers import make_samples

ALGO = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl")
TRAIN = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2)


@pytest.fixture(scope="module")
def other_ref(tiny_model, tmp_path_factory):
    """The tiny model with every weight nudged: another model of the same shape and tokenizer."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ref")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def wide_vocab(tiny_model, tmp_path_factory):
    """The tiny model with 8 more embedding rows: the same tokenizer, another vocab_size."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("wide")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def other_tokenizer(tiny_model, tmp_path_factory):
    """The tiny model's weights under a tokenizer with two token ids swapped: the same vocab_size,
    other tokens."""
    out = tmp_path_factory.mktemp("tok")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["Ġin"], vocab["ld"] = vocab["ld"], vocab["Ġin"]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def direct_kl(start, ref, samples) -> float:
    """k3 (low_var_kl) of the start model's logprobs against the reference's, mean over trained tokens."""
    policy = TorchTrainer(str(start), train=TRAIN, algo=AlgoConfig(), temperature=0.8).compute_logprobs(samples)
    reference = TorchTrainer(str(ref), train=TRAIN, algo=AlgoConfig(), temperature=0.8).compute_logprobs(samples)
    lp = torch.tensor([x for s, row in zip(samples, policy) for x, m in zip(row, s.loss_mask) if m])
    lr = torch.tensor([x for s, row in zip(samples, reference) for x, m in zip(row, s.loss_mask) if m])
    return float(kl_penalty(lp, lr, "low_var_kl").mean())


@pytest.mark.slow
def test_torch_trainer_reads_the_kl_reference_from_ref_load(tiny_model, other_ref):
    samples = make_samples()
    expected = direct_kl(tiny_model, other_ref, samples)
    assert expected > 1e-4  # the two models differ

    trainer = TorchTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8, ref_load=str(other_ref))
    assert trainer.train_rollout(samples)["kl_loss"] == pytest.approx(expected, rel=1e-4)
    for ref in (str(tiny_model), None):  # the start model itself (given, or by default): no KL at step 0
        same = TorchTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8, ref_load=ref)
        assert abs(same.train_rollout(make_samples())["kl_loss"]) < 1e-7


def test_a_slime_command_line_keeps_the_kl_at_its_ref_load(tiny_model, other_ref):
    """slime's flags through the config to the trainer: the actor starts from --load (an HF
    folder), the KL at iteration 0 is the start's against --ref-load's; 0 for the same folder."""
    from agentrl.build import build_trainer
    from agentrl.config import parse_config

    def kl(ref) -> float:
        cfg, _ = parse_config(["--load", str(tiny_model), "--ref-load", str(ref), "--trainer", "torch", "--dtype",
                               "float32", "--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "low_var_kl",
                               "--rollout-temperature", "0.8", "--global-batch-size", "6", "--micro-batch-size", "2",
                               "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
                               "--rm-type", "math"])
        assert cfg.model.model == str(tiny_model) and cfg.run.ref_load == str(ref)
        return build_trainer(cfg, cfg.model.model, "cpu").train_rollout(make_samples())["kl_loss"]

    assert kl(other_ref) == pytest.approx(direct_kl(tiny_model, other_ref, make_samples()), rel=1e-4)
    assert abs(kl(tiny_model)) < 1e-7


def test_the_reference_logprobs_are_the_ref_folders_models(tiny_model, other_ref):
    """--ref-load other than the start: the reference the KL terms read (--use-kl-loss, --kl-coef)
    scores with the ref folder's weights, the policy with the start's."""
    samples = make_samples()
    expected = TorchTrainer(str(other_ref), train=TRAIN, algo=AlgoConfig(), temperature=0.8).compute_logprobs(samples)
    for algo in (ALGO, AlgoConfig(kl_coef=0.1, advantage_estimator="reinforce_plus_plus")):
        trainer = TorchTrainer(str(tiny_model), train=TRAIN, algo=algo, temperature=0.8, ref_load=str(other_ref))
        ref = trainer.compute_logprobs(samples, trainer.ref_model)
        policy = trainer.compute_logprobs(samples)
        assert all(r == pytest.approx(e, abs=1e-5) for r, e in zip(ref, expected))
        assert max(abs(a - b) for r, p in zip(ref, policy) for a, b in zip(r, p)) > 1e-3
    trainer = TorchTrainer(str(tiny_model), train=TRAIN, algo=AlgoConfig(), temperature=0.8, ref_load=str(other_ref))
    assert trainer.ref_model is None  # no KL term: not loaded


def test_a_reference_of_another_vocabulary_is_refused(tiny_model, wide_vocab, other_tokenizer):
    with pytest.raises(ConfigError, match=rf"--ref-load {wide_vocab}: vocab_size 520 differs from the start "
                                          rf"model {tiny_model}'s 512: the KL reference must score the actor's token ids"):
        TorchTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8, ref_load=str(wide_vocab))
    with pytest.raises(ConfigError, match=rf"--ref-load {other_tokenizer}: its tokenizer differs from the start "
                                          rf"model {tiny_model}'s"):
        TorchTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8, ref_load=str(other_tokenizer))


def test_a_reference_the_trainer_cannot_read_is_named(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=f"--ref-load {tmp_path}: neither an HF folder"):
        TorchTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8, ref_load=str(tmp_path))
    (tmp_path / "metadata.json").write_text("{}")  # a Megatron distributed checkpoint
    with pytest.raises(ConfigError, match="read by the Megatron trainer only"):
        TorchTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8, ref_load=str(tmp_path))


@pytest.mark.slow
def test_megatron_trainer_reads_the_kl_reference_from_hf_or_a_megatron_checkpoint(tiny_model, other_ref, wide_vocab,
                                                                                  tmp_path):
    megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")
    import megatron_cpu_shim

    megatron_cpu_shim.apply()

    def kl(ref) -> float:
        trainer = megatron_trainer.MegatronTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8,
                                                   device="cpu", dtype="float32", ref_load=ref)
        return trainer.train_rollout(make_samples())["kl_loss"]

    expected = direct_kl(tiny_model, other_ref, make_samples())
    assert kl(str(other_ref)) == pytest.approx(expected, rel=1e-4)
    assert abs(kl(str(tiny_model))) < 1e-7
    # the reference's logprobs are the ref folder's model's, not the policy's
    samples = make_samples()
    trainer = megatron_trainer.MegatronTrainer(str(tiny_model), train=TRAIN, algo=ALGO, temperature=0.8,
                                               device="cpu", dtype="float32", ref_load=str(other_ref))
    ref, policy = trainer.compute_logprobs(samples, trainer.ref_model), trainer.compute_logprobs(samples)
    expected_lp = TorchTrainer(str(other_ref), train=TRAIN, algo=AlgoConfig(), temperature=0.8).compute_logprobs(samples)
    assert all(r == pytest.approx(e, abs=1e-4) for r, e in zip(ref, expected_lp))
    assert max(abs(a - b) for r, p in zip(ref, policy) for a, b in zip(r, p)) > 1e-3
    with pytest.raises(ConfigError, match=rf"--ref-load {wide_vocab}: vocab_size 520 differs"):
        kl(str(wide_vocab))

    # the reference as a Megatron distributed checkpoint: an agentrl checkpoint of the other model ...
    saver = megatron_trainer.MegatronTrainer(str(other_ref), train=TRAIN, algo=AlgoConfig(), temperature=0.8,
                                             device="cpu", dtype="float32")
    saver.save(tmp_path / "agentrl_ckpt", {"rollout_id": 0})
    assert kl(str(tmp_path / "agentrl_ckpt")) == pytest.approx(expected, rel=1e-4)
    # ... and slime's torch_dist layout (megatron.training's tracker file and iteration folder)
    slime = tmp_path / "torch_dist"
    shutil.copytree(tmp_path / "agentrl_ckpt" / "megatron", slime / "iter_0000003")
    (slime / "latest_checkpointed_iteration.txt").write_text("3")
    assert kl(str(slime)) == pytest.approx(expected, rel=1e-4)
