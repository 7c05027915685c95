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
@pytest.mark.slow
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


def test_keep_bytes_leaves_the_largest_storages_on_the_device():
    """--colocate-offload fit: what fits the budget stays (no copy, no free), largest first;
    gradients are dropped whatever the budget; the rest moves and comes back."""
    from agentrl.trainers.offload import Offloaded

    big, mid, small, grad = torch.ones(100), torch.full((50,), 2.0), torch.full((10,), 3.0), torch.full((100,), 4.0)
    stash = Offloaded([small, big, mid, grad], discard=[grad], keep_bytes=4 * 100 + 4 * 10)
    assert stash.kept_bytes == 4 * 110  # big and small fit together; mid would not
    assert big.untyped_storage().nbytes() == 400 and big.eq(1).all() and small.eq(3).all()
    assert mid.untyped_storage().nbytes() == 0 and grad.untyped_storage().nbytes() == 0
    assert stash.bytes == 4 * 50 and stash.dropped_bytes == 400
    stash.restore()
    assert mid.eq(2).all() and not grad.any() and big.eq(1).all()
    everything = Offloaded([small, big, mid], keep_bytes=0)
    assert everything.kept_bytes == 0 and everything.bytes == 4 * 160
    everything.restore()


def test_resident_budget_leaves_the_engines_their_share_and_a_headroom():
    from agentrl.trainers.offload import ENGINE_HEADROOM_SHARE, resident_budget

    gib = 2**30
    total = 80 * gib
    headroom = ENGINE_HEADROOM_SHARE * total  # 4.8 GiB: above the 4 GiB floor on this GPU
    # 1.5B colocated: engines released (40 GiB to take back), the trainer holds 26 GiB, 48 GiB free
    keep = resident_budget(free=48 * gib, total=total, offloadable=26 * gib, engines_take=40 * gib)
    assert keep == int(48 * gib + 26 * gib - 40 * gib - headroom)
    # after the resume, what is free is at least the headroom
    assert 48 * gib + 26 * gib - keep - 40 * gib >= headroom
    # a GPU too full to keep anything
    assert resident_budget(free=2 * gib, total=total, offloadable=20 * gib, engines_take=70 * gib) == 0
    # a small GPU: the 4 GiB floor
    assert resident_budget(free=10 * gib, total=24 * gib, offloadable=0, engines_take=0) == 6 * gib


def test_engine_memory_fraction_follows_the_flags():
    from agentrl.config import parse_config
    from agentrl.engines.sglang import DEFAULT_SHARED_MEM_FRACTION
    from agentrl.cluster.trainer_actor import engine_memory_fraction

    def load_config(argv):
        return parse_config(argv)[0]

    sglang = ["--rollout-engine", "sglang", "--colocate"]
    assert engine_memory_fraction(load_config(sglang + ["--sglang-mem-fraction-static", "0.5"])) == 0.5
    assert engine_memory_fraction(load_config(sglang)) == DEFAULT_SHARED_MEM_FRACTION
    assert engine_memory_fraction(load_config(sglang + ["--colocate-offload", "all"])) is None
    assert engine_memory_fraction(load_config(["--colocate"])) is None  # the embedded engine: unknown
    assert engine_memory_fraction(load_config(sglang + ["--rollout-engine-urls", "http://127.0.0.1:30000"])) is None


def test_the_handover_tells_the_trainer_whether_the_engines_released_their_memory():
    """Before the engines' first release they still hold their share (iteration 0): the offload's
    budget must not count it twice. The offload's figures reach the iteration's metrics."""
    import asyncio

    from agentrl.config import parse_config
    from agentrl.engines.colocate import EngineMemory
    from agentrl.weight_update import colocated

    class Trainer:
        def __init__(self):
            self.calls = []

        async def offload(self, engines_released):
            self.calls.append(engines_released)
            return {"colocate/kept_gib": 1.5}

        async def onload(self):
            pass

        async def gpu_memory(self):
            return {}

    class Client:
        base_url = "http://engine"

        async def post(self, path, payload):
            return {}

        async def get(self, path):
            return [{"num_reqs": 0}]

    class Engines:
        memory = EngineMemory()
        probe_prompts = None  # no weight check due

    cfg = parse_config(["--rollout-engine", "sglang", "--colocate"])[0]
    trainer, engines = Trainer(), Engines()

    async def iteration():
        async with colocated(cfg, trainer, engines, [Client()]) as out:
            pass
        return out

    first, second = asyncio.run(iteration()), asyncio.run(iteration())
    assert trainer.calls == [False, True]
    assert first["colocate/kept_gib"] == second["colocate/kept_gib"] == 1.5


def test_a_chain_of_optimizers_is_walked_without_touching_its_single_optimizer_view():
    """Megatron's ChainedOptimizer (MoE: one optimizer for dense parameters, one for experts)
    asserts it holds one optimizer when `.optimizer` is read: both members' state is found, and
    that property is never read (the colocated MoE run at EP=4 died on it, 2026-11-26)."""
    dense, expert = torch.nn.Linear(3, 3), torch.nn.Linear(2, 2)
    opts = [torch.optim.Adam(dense.parameters()), torch.optim.Adam(expert.parameters())]
    for m, opt in zip((dense, expert), opts):
        m(torch.ones(1, m.in_features)).sum().backward()
        opt.step()

    class Wrapper:  # megatron's per-group optimizer wrapper: the torch optimizer as `.optimizer`
        def __init__(self, opt):
            self.optimizer = opt

    class Chain:
        chained_optimizers = [Wrapper(o) for o in opts]

        @property
        def optimizer(self):
            raise AssertionError("ChainedOptimizer has more than one optimizer when accessing self.optimizer")

    found = {id(t) for t in held_tensors(Chain())}
    for opt in opts:
        for state in opt.state.values():
            assert {id(state["exp_avg"]), id(state["exp_avg_sq"])} <= found
