"""The PyTorch trainer's micro-batching: --max-tokens-per-gpu forms pieces by a padded-token
budget (what keeps long multi-turn samples from running a GPU out of memory) and trains to the
same weights as --micro-batch-size, since every loss is a sum over the whole step."""

import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainers.torch_trainer import TorchTrainer
from megatron_helpers import make_samples


def trainer(model, **train):
    torch.manual_seed(0)
    return TorchTrainer(str(model), train=TrainConfig(lr=1e-3, global_batch_size=6, **train), algo=AlgoConfig(),
                        temperature=0.8)


def test_token_budget_pieces_fit_and_train_the_same(tiny_model):
    samples = make_samples()  # 14 .. 24 tokens each
    budget = 40
    by_count, by_tokens = trainer(tiny_model, micro_batch_size=32), trainer(tiny_model, max_tokens_per_gpu=budget)
    shapes = []
    forward = by_tokens._response_logprobs

    def recording(model, chunk, with_entropy=False):
        shapes.append((len(chunk), max(len(s.tokens) for s in chunk)))
        return forward(model, chunk, with_entropy)

    by_tokens._response_logprobs = recording
    for t in (by_count, by_tokens):  # compare the step's gradients (Adam would amplify float noise near 0)
        t.optimizer.step = lambda: None
    a, b = by_count.train_rollout(samples), by_tokens.train_rollout(samples)
    assert len(shapes) > 2 and all(n * longest <= budget or n == 1 for n, longest in shapes), shapes
    assert sum(n for n, _ in shapes) == len(samples)  # one step: its forward gives the old logprobs too (#34)
    assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, (a, b)
    for (name, p), q in zip(by_count.model.named_parameters(), by_tokens.model.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_a_sample_longer_than_the_budget_goes_alone(tiny_model):
    samples = make_samples()
    t = trainer(tiny_model, max_tokens_per_gpu=10)  # shorter than every sample
    assert [len(p) for p in t._micro_batches(samples)] == [1] * len(samples)
    assert [len(p) for p in trainer(tiny_model, micro_batch_size=4)._micro_batches(samples)] == [4, 2]
