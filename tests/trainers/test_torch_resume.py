"""Exact resume of the PyTorch trainer: N iterations straight through, or N/2, a checkpoint, a
fresh trainer loading it and N/2 more, end with bit-identical weights and optimizer state
(the critic's too, for ppo). With LoRA dropout the steps draw from torch's RNG, so the
checkpoint must carry the RNG state for the masks after the resume to match."""

import random

import numpy as np
import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainers.torch_trainer import TorchTrainer
from megatron_helpers import make_samples

N = 4  # iterations; each is 2 optimizer steps (6 samples, global batch 3)

SETUPS = {
    "full": (dict(), dict(use_kl_loss=True, kl_loss_coef=0.1)),  # every weight trains; KL against the reference
    "lora-dropout": (dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.3), dict()),  # dropout: the RNG matters
    "ppo": (dict(), dict(advantage_estimator="ppo")),  # a critic and its optimizer
}


def build(model_path, setup: str) -> TorchTrainer:
    train, algo = SETUPS[setup]
    return TorchTrainer(str(model_path), train=TrainConfig(lr=1e-2, global_batch_size=3, micro_batch_size=2, **train),
                        algo=AlgoConfig(**algo), temperature=0.8)


def run(trainer: TorchTrainer, iterations: range) -> None:
    for i in iterations:  # a different rollout each iteration (made with its own generator: no global RNG)
        trainer.train_rollout(make_samples(seed=100 + i))


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"], what
    assert sa["state"].keys() == sb["state"].keys() and sa["state"], what
    for index in sa["state"]:
        assert_same_tensors(sa["state"][index], sb["state"][index], f"{what} state of parameter {index}")


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.slow
def test_a_resumed_trainer_ends_bit_identical_to_one_that_ran_straight_through(tiny_model, tmp_path, setup):
    seed_all(0)
    straight = build(tiny_model, setup)
    run(straight, range(N))
    rng_after = torch.get_rng_state()

    seed_all(0)
    first = build(tiny_model, setup)
    run(first, range(N // 2))
    first.save(tmp_path / "ckpt", {"rollout_id": N // 2})
    del first
    seed_all(12345)  # another process, another history: whatever the RNG holds now, the checkpoint's state wins
    torch.rand(7)
    resumed = build(tiny_model, setup)
    assert resumed.load(tmp_path / "ckpt")["rollout_id"] == N // 2
    run(resumed, range(N // 2, N))

    assert resumed.version == straight.version == 2 * N
    assert_same_tensors(dict(straight.model.named_parameters()), dict(resumed.model.named_parameters()), "weights")
    assert_same_optimizer(straight.optimizer, resumed.optimizer, "optimizer")
    if setup == "ppo":
        assert_same_tensors(straight.critic.state_dict(), resumed.critic.state_dict(), "critic")
        assert_same_optimizer(straight.critic_optimizer, resumed.critic_optimizer, "critic optimizer")
    assert torch.equal(torch.get_rng_state(), rng_after)  # the same draws, in the same order


def test_the_check_sees_a_resume_that_is_off_by_one_step(tiny_model, tmp_path):
    """The comparison can fail: a resume that skips one iteration's rollout is not identical."""
    seed_all(0)
    straight = build(tiny_model, "full")
    run(straight, range(2))
    seed_all(0)
    other = build(tiny_model, "full")
    run(other, [0, 2])
    with pytest.raises(AssertionError):
        assert_same_tensors(dict(straight.model.named_parameters()), dict(other.model.named_parameters()), "weights")
    with pytest.raises(AssertionError):
        assert_same_optimizer(straight.optimizer, other.optimizer, "optimizer")
