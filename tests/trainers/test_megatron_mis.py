"""Sequence-level MIS (--use-tis --tis-mode mask --tis-level sequence|geometric) in the Megatron
trainer's packed layout equals the plain-PyTorch trainer's padded one. The toy trajectories'
engine logprobs sit below the trainer's, so their geometric-mean ratios are 0.90, 0.66, 0.79,
0.85, 0.78, 0.95 and their products 0.53, 0.055, 0.15, 0.22, 0.08, 0.59 (worked out from the
tiny model's logprobs): the bounds below keep trajectories 0, 3 and 5 and mask 1, 2 and 4,
25 of the 51 trained tokens."""

import math

import pytest

pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.trainers.megatron.trainer import MegatronTrainer  # noqa: E402
from agentrl.trainers.torch_trainer import TorchTrainer  # noqa: E402
from megatron_helpers import make_samples  # noqa: E402


@pytest.mark.parametrize("level,low,high", [("sequence", 0.2, 2.0), ("geometric", 0.8, 1.2)])
def test_sequence_level_mis_matches_the_pytorch_trainer(tiny_model, level, low, high):
    algo = AlgoConfig(use_tis=True, tis_mode="mask", tis_level=level, tis_clip_low=low, tis_clip=high)
    tc = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2, max_tokens_per_gpu=64)
    mt = MegatronTrainer(str(tiny_model), train=tc, algo=algo, temperature=0.8, device="cpu", dtype="float32")
    tt = TorchTrainer(str(tiny_model), train=tc, algo=algo, temperature=0.8)
    samples = make_samples()
    assert sum(s.num_trained_tokens for s in samples) == 51
    a, b = mt.train_rollout(samples), tt.train_rollout(samples)
    for key in ("loss", "pg_loss", "tis_ratio", "tis_weight", "tis_masked_frac", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert a["tis_masked_frac"] == pytest.approx(25 / 51)


def test_the_veto_drops_the_same_trajectories_in_both_trainers(tiny_model):
    """--rs-veto-threshold between the smallest per-token ratios of the toy trajectories: the ones
    with a token below it leave the loss in the packed layout as in the padded one, counted."""
    tc = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2, max_tokens_per_gpu=64)
    probe = TorchTrainer(str(tiny_model), train=tc, algo=AlgoConfig(), temperature=0.8)
    samples = make_samples()
    old = probe.compute_logprobs(samples)
    smallest = sorted(min(o - r for o, r, m in zip(lo, s.rollout_logprobs, s.loss_mask) if m)
                      for lo, s in zip(old, samples))
    threshold = math.exp((smallest[2] + smallest[3]) / 2)  # three trajectories below it, three above
    algo = AlgoConfig(use_tis=True, tis_clip=1e6, rs_veto_threshold=threshold)
    mt = MegatronTrainer(str(tiny_model), train=tc, algo=algo, temperature=0.8, device="cpu", dtype="float32")
    tt = TorchTrainer(str(tiny_model), train=tc, algo=algo, temperature=0.8)
    a, b = mt.train_rollout(make_samples()), tt.train_rollout(make_samples())
    assert a["rs_veto_seqs"] == b["rs_veto_seqs"] == 3
    for key in ("loss", "pg_loss", "rs_veto_token_frac", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert 0 < a["rs_veto_token_frac"] < 1
    # over two optimizer steps (the old logprobs from the pass before them): the iteration's count is their sum
    two = TorchTrainer(str(tiny_model), train=tc.model_copy(update={"global_batch_size": 3}), algo=algo,
                       temperature=0.8).train_rollout(make_samples())
    assert two["old_logprob_pass"] == 1.0 and two["rs_veto_seqs"] == 3
