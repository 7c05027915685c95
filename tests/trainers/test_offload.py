"""--colocate's offload, for both trainers: every storage the trainer holds (weights, grads and
Megatron's grad buffers, optimizer state and master weights, reference model) is freed, and after
the restore training goes on exactly as if nothing had happened. Run on the CPU: the same storage
moves that free GPU memory there."""

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainers.offload import TRAINER_PARTS, gradient_tensors, held_tensors, offload_trainer
from agentrl.trainers.torch_trainer import TorchTrainer
from megatron_helpers import make_samples

ALGO = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1)  # a reference model to offload too
TC = dict(lr=1e-3, global_batch_size=6, micro_batch_size=2)


def torch_trainer(model):
    return TorchTrainer(str(model), train=TrainConfig(**TC), algo=ALGO, temperature=0.8)


def megatron_trainer(model):
    mod = pytest.importorskip("agentrl.trainers.megatron.trainer")
    import megatron_cpu_shim
    megatron_cpu_shim.apply()
    return mod.MegatronTrainer(str(model), train=TrainConfig(**TC), algo=ALGO, temperature=0.8, device="cpu",
                               dtype="float32")


@pytest.mark.parametrize("make", [torch_trainer, megatron_trainer], ids=["torch", "megatron"])
def test_offload_frees_everything_and_training_goes_on_exactly(tiny_model, make):
    samples = make_samples()
    a, b = make(tiny_model), make(tiny_model)
    for t in held_tensors([getattr(a, n, None) for n in TRAINER_PARTS]):
        if not t.untyped_storage().resizable():  # weights the CPU maps from the checkpoint file; on a GPU,
            t.data = t.data.clone()               # every storage is a resizable allocation
    a.train_rollout(samples)
    b.train_rollout(samples)
    held = list(held_tensors([getattr(a, n, None) for n in TRAINER_PARTS]))
    grads = list(gradient_tensors([getattr(a, n, None) for n in TRAINER_PARTS]))
    assert grads and all(g.abs().sum() > 0 for g in grads)  # the last step's, still there
    stash = offload_trainer(a)
    weights = sum(p.numel() * p.element_size() for p in a.model.parameters())
    assert stash.bytes > 2 * weights  # + Adam's moments (and Megatron's master weights)
    assert stash.dropped_bytes >= weights  # the gradients: freed, not copied
    assert all(t.untyped_storage().nbytes() == 0 for t in held)
    stash.restore()
    assert all(not g.any() for g in grads)  # back as zeros
    again = offload_trainer(a, spare=stash.hosts[::-1])  # the next iteration reuses the host buffers,
    assert sorted(map(id, again.hosts)) == sorted(map(id, stash.hosts))  # by size, whatever their order
    again.restore()
    m_a, m_b = a.train_rollout(samples), b.train_rollout(samples)
    assert m_a["loss"] == m_b["loss"] and m_a["grad_norm"] == m_b["grad_norm"] and m_a["kl_loss"] > 0
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), name


def test_host_buffers_are_reused_by_size_when_storages_appear():
    """Adam's moments appear at the first step, after the first offload (before the first
    rollout): the next offload still reuses every earlier buffer (pinning is what costs)."""
    from agentrl.trainers.offload import Offloaded

    a, b = torch.ones(25), torch.full((50,), 2.0)
    first = Offloaded([a, b])
    first.restore()
    moment = torch.full((10,), 3.0)
    second = Offloaded([moment, a, b], spare=first.hosts)
    assert second.hosts[1] is first.hosts[0] and second.hosts[2] is first.hosts[1]
    second.restore()
    assert a.eq(1).all() and b.eq(2).all() and moment.eq(3).all()


def test_host_buffers_made_ahead_serve_every_offload(tiny_model):
    """--colocate pins the offload's host memory while the engines start: buffers for what the
    trainer holds and for the Adam moments its first step creates. Neither the offload before
    iteration 0 (no moments yet) nor the one after the first step then allocates any."""
    from agentrl.trainers.offload import host_buffers_for

    a = torch_trainer(tiny_model)
    for t in held_tensors([getattr(a, n, None) for n in TRAINER_PARTS]):
        if not t.untyped_storage().resizable():
            t.data = t.data.clone()
    made = host_buffers_for(a, device_type="cpu")
    first = offload_trainer(a, spare=made)
    first.restore()
    assert first.spare_left  # the moments' buffers, kept for the next offload
    a.train_rollout(make_samples())  # Adam's moments appear
    second = offload_trainer(a, spare=first.hosts + first.spare_left)
    second.restore()
    big = [h for h in second.hosts if h.numel() > 64]  # (Adam's step counters are 4-byte CPU tensors)
    assert big and {id(h) for h in big} <= {id(h) for h in made}
