"""Routing replay (slime's R3, --use-rollout-routing-replay) on CPU: the Megatron trainer routes
each token to the experts recorded on the Sample (`routed_experts`, as the engine reports them)
instead of its own router's top-k. The record here is what transformers' own
Qwen3MoeForCausalLM routed (hooks on its routers): replaying it gives the trainer's own
logprobs; a perturbed record changes them, to exactly what the HF model computes when forced
to the same experts."""

import pytest
import torch

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from megatron_helpers import make_samples, tiny_family_model  # noqa: E402

TOL = 1e-5


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def hf_run(model, samples, forced=None):
    """(per-sample response logprobs, per-sample routing [tokens, moe layers, k]) of the HF model;
    forced: per-sample routing to use instead of its routers' top-k (probabilities renormalised
    over the forced experts, as its router does over its own)."""
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    logprobs, routing = [], []
    for n, s in enumerate(samples):
        seen = []

        def make_forward(router, j):
            def forward(hidden):
                hidden = hidden.reshape(-1, router.hidden_dim)
                logits = torch.nn.functional.linear(hidden, router.weight)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                if forced is None:
                    top, idx = torch.topk(probs, router.top_k, dim=-1)
                else:
                    idx = torch.as_tensor(forced[n])[:, j]
                    top = probs.gather(1, idx)
                top = top / top.sum(dim=-1, keepdim=True)
                seen.append(idx)
                return logits, top.to(logits.dtype), idx
            return forward

        for j, r in enumerate(routers):
            r.forward = make_forward(r, j)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s.tokens])).logits[0].float()
        p = len(s.prompt_tokens)
        lp = torch.log_softmax(logits[p - 1:-1], dim=-1).gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        logprobs.append(lp.tolist())
        routing.append(torch.stack(seen, dim=1))  # [tokens, moe layers, k]
    for r in routers:
        del r.forward
    return logprobs, routing


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_family_model(tmp_path_factory.mktemp("qwen3_moe_r3"), "qwen3_moe", tokenizer_from=tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    samples = make_samples(n=4)
    hf_logprobs, routing = hf_run(hf, samples)
    for s, r in zip(samples, routing):
        s.routed_experts = r[:-1].tolist()  # every token but the last, as SGLang reports them
    train = TrainConfig(lr=1e-3, global_batch_size=4, micro_batch_size=2)
    kw = dict(train=train, algo=AlgoConfig(), temperature=1.0, device="cpu", dtype="float32")
    plain = megatron_trainer.MegatronTrainer(str(path), **kw)
    replay = megatron_trainer.MegatronTrainer(str(path), **kw, megatron_args={"use_rollout_routing_replay": None})
    return hf, samples, hf_logprobs, plain, replay


def test_replaying_the_recorded_routing_gives_the_models_own_logprobs(setup):
    hf, samples, hf_logprobs, plain, replay = setup
    own = plain.compute_logprobs(samples)
    replayed = replay.compute_logprobs(samples)
    print(f"own routing vs HF {max_diff(own, hf_logprobs):.1e}; replayed vs own {max_diff(replayed, own):.1e}")
    assert max_diff(own, hf_logprobs) < TOL
    assert max_diff(replayed, own) < TOL


def test_perturbed_routing_changes_logprobs_as_the_hf_model_forced_to_it(setup):
    hf, samples, _, plain, replay = setup
    perturbed = []
    for s in samples:
        r = torch.tensor(s.routed_experts)
        r[:, 0] = (r[:, 0] + 3) % 8  # the first MoE layer: other (still distinct) experts for every token
        perturbed.append(r)
    originals = [s.routed_experts for s in samples]
    try:
        for s, r in zip(samples, perturbed):
            s.routed_experts = r.tolist()
        replayed = replay.compute_logprobs(samples)
    finally:
        for s, r in zip(samples, originals):
            s.routed_experts = r
    forced, _ = hf_run(hf, samples, forced=[torch.cat([r, r[-1:]]) for r in perturbed])
    own = plain.compute_logprobs(samples)
    print(f"perturbed replay vs own routing {max_diff(replayed, own):.2e}; vs HF forced {max_diff(replayed, forced):.1e}")
    assert max_diff(replayed, own) > 1e-3
    assert max_diff(replayed, forced) < TOL


def test_flat_records_and_records_ending_after_the_last_trained_token(setup):
    """As the client decodes SGLang's reply ([tokens, layers * top-k]), and cut after the last
    trained token's input (env tokens appended after the last generation): the same logprobs
    on every trained token."""
    _, samples, _, plain, replay = setup
    own = plain.compute_logprobs(samples)
    originals = [s.routed_experts for s in samples]
    try:
        for s in samples:
            r = torch.tensor(s.routed_experts)
            last = len(s.prompt_tokens) + max(j for j, m in enumerate(s.loss_mask) if m)
            s.routed_experts = r[:last].reshape(last, -1).tolist()
        replayed = replay.compute_logprobs(samples)
    finally:
        for s, r in zip(samples, originals):
            s.routed_experts = r
    trained = [[x for x, m in zip(row, s.loss_mask) if m] for row, s in zip(replayed, samples)]
    want = [[x for x, m in zip(row, s.loss_mask) if m] for row, s in zip(own, samples)]
    assert max_diff(trained, want) < TOL


def test_training_step_with_replay_and_bad_records(setup):
    _, samples, _, _, replay = setup
    metrics = replay.train_rollout(samples)
    assert metrics["grad_norm"] > 0
    broken = make_samples(n=4)  # the same tokens as samples
    with pytest.raises(ValueError, match="routed experts"):
        replay.compute_logprobs(broken)
    for s, good in zip(broken[1:], samples[1:]):
        s.routed_experts = good.routed_experts
    broken[0].routed_experts = [[[0, 1]] * 3] * 2  # ends before the trained tokens
    with pytest.raises(ValueError, match="routed_experts has shape"):
        replay.compute_logprobs(broken)
