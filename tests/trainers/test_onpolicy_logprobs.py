"""The on-policy shortcut (issue #34): when the rollout is one optimizer step and nothing reads the
old-policy logprobs before it, train_iteration skips their separate forward pass and the loss
takes them from the training forward, detached. The step must be the same as with the pass
(--recompute-old-logprobs): loss, gradient and every metric (the engine-vs-trainer gap and the
TIS ratios included), in both trainers; the policy's forwards per iteration drop from 2 to 1,
and with two steps per rollout the pass stays."""

import pytest

pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

import torch  # noqa: E402

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.trainers.megatron.trainer import MegatronTrainer  # noqa: E402
from agentrl.trainers.torch_trainer import TorchTrainer  # noqa: E402
from megatron_helpers import make_samples  # noqa: E402

ALGOS = {
    "grpo": {},
    "grpo_kl_loss": dict(use_kl_loss=True, kl_loss_coef=0.1),
    # the toy rollout logprobs sit below the trainer's: these bounds clamp some tokens
    "grpo_tis": dict(use_tis=True, tis_clip_low=0.5, tis_clip=1.2),
}
KEYS = ("loss", "pg_loss", "kl_loss", "clipfrac", "ppo_kl", "grad_norm", "train_rollout_logprob_abs_diff",
        "tis_ratio", "tis_weight", "tis_clipfrac")


def build(kind, tiny_model, gbs, **algo):
    torch.manual_seed(0)
    tc = TrainConfig(lr=1e-3, global_batch_size=gbs, micro_batch_size=2, max_tokens_per_gpu=64)
    if kind == "torch":
        t = TorchTrainer(str(tiny_model), train=tc, algo=AlgoConfig(**algo), temperature=0.8)
        t.optimizer.step = lambda: None  # compare gradients: Adam's first step amplifies float noise near 0
    else:
        t = MegatronTrainer(str(tiny_model), train=tc, algo=AlgoConfig(**algo), temperature=0.8, device="cpu",
                            dtype="float32")
    return t


def count_policy_forwards(t) -> list[int]:
    """Samples the policy itself (not the reference) runs forward over, per call, recorded in a list."""
    seen: list[int] = []
    if isinstance(t, TorchTrainer):
        inner = t._response_logprobs

        def recording(model, chunk, with_entropy=False):
            if model is t.model:
                seen.append(len(chunk))
            return inner(model, chunk, with_entropy)
        t._response_logprobs = recording
    else:
        inner = t._run

        def recording(model, ddp_or_model, batches, loss_fn, *, forward_only):
            if model is t.model:
                seen.append(sum(len(b.indices) for b in batches if not getattr(b, "dummy", False)))
            return inner(model, ddp_or_model, batches, loss_fn, forward_only=forward_only)
        t._run = recording
    return seen


def grads(t) -> list[torch.Tensor]:
    params = [p for p in t.model.parameters() if p.requires_grad]
    return [(p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for p in params]


@pytest.mark.parametrize("kind", ["torch", "megatron"])
@pytest.mark.parametrize("name", list(ALGOS))
def test_one_step_without_the_pass_equals_the_step_with_it(tiny_model, kind, name):
    samples = make_samples()
    fast, full = build(kind, tiny_model, 6, **ALGOS[name]), build(kind, tiny_model, 6, recompute_old_logprobs=True,
                                                                   **ALGOS[name])
    seen_fast, seen_full = count_policy_forwards(fast), count_policy_forwards(full)
    a, b = fast.train_rollout(samples), full.train_rollout(samples)
    assert sum(seen_fast) == len(samples) and sum(seen_full) == 2 * len(samples), (seen_fast, seen_full)
    assert set(a) == set(b), set(a) ^ set(b)
    assert (a["old_logprob_pass"], b["old_logprob_pass"]) == (0.0, 1.0)
    for key in KEYS:
        if key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert a["train_rollout_logprob_abs_diff"] > 0.05  # the toy engine logprobs are off: a real gap, measured
    if name == "grpo_tis":
        assert 0 < a["tis_clipfrac"] < 1 and a["tis_weight"] != pytest.approx(a["tis_ratio"])
    if name == "grpo_kl_loss":
        assert "kl_loss" in a
    for g, h in zip(grads(fast), grads(full)):
        assert torch.allclose(g, h, atol=1e-6, rtol=1e-4)
    assert any(g.abs().max() > 0 for g in grads(fast))


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_two_steps_per_rollout_keep_the_pass(tiny_model, kind):
    t = build(kind, tiny_model, 3)  # 6 samples: two optimizer steps, the second on a moved policy
    seen = count_policy_forwards(t)
    assert t.train_rollout(make_samples())["old_logprob_pass"] == 1.0
    assert sum(seen) == 2 * 6, seen


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_lora_dropout_keeps_the_pass(tiny_model, kind):
    tc = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2, lora_rank=4, lora_dropout=0.1)
    if kind == "torch":
        t = TorchTrainer(str(tiny_model), train=tc, algo=AlgoConfig(), temperature=0.8)
    else:
        t = MegatronTrainer(str(tiny_model), train=tc, algo=AlgoConfig(), temperature=0.8, device="cpu",
                            dtype="float32")
    assert t.train_forward_has_dropout  # training-mode dropout: the step's logprobs are not the eval pass's
    assert t.train_rollout(make_samples())["old_logprob_pass"] == 1.0
