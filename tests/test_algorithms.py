"""Every advantage estimator and loss in agentrl.algorithms against a direct calculation on
small tensors (numbers worked out by hand or with plain Python loops)."""

import math

import pytest
import torch

from agentrl.algorithms import (catastrophic_veto, check_algo, compute_advantages, discounted_returns, gae,
                                group_advantages, importance_weights, kl_penalty, policy_loss, policy_objective,
                                sequence_log_ratio, value_loss, whiten)
from agentrl.config import AlgoConfig
from agentrl.errors import ConfigError
from agentrl.types import Sample, SampleStatus


def test_grpo_dr_grpo_rloo_against_direct_calculation():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    mean0, std0 = 0.5, math.sqrt(((0.5) ** 2 + (0.5) ** 2 + 0) / 2)
    grpo = group_advantages(r, g, "grpo")
    assert grpo[:3].tolist() == pytest.approx([(1 - mean0) / std0, (0 - mean0) / std0, 0.0], abs=1e-4)
    assert grpo[3:].tolist() == [0.0, 0.0]  # zero-variance group: no signal
    assert group_advantages(r, g, "gspo").tolist() == grpo.tolist()  # GSPO differs in the loss, not here
    assert group_advantages(r, g, "dr_grpo")[:3].tolist() == pytest.approx([0.5, -0.5, 0.0])
    rloo = group_advantages(r, g, "rloo")
    assert rloo[:3].tolist() == pytest.approx([1 - 0.25, 0 - 0.75, 0.5 - 0.5])
    assert group_advantages(r, g, "reinforce_plus_plus_baseline")[:3].tolist() == pytest.approx([0.5, -0.5, 0.0])
    with pytest.raises(ValueError, match="unknown group advantage estimator"):
        group_advantages(r, g, "nope")


def test_policy_loss_clips_and_is_zero_kl_on_policy():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.ones_like(lp)
    same = policy_loss(lp, lp, adv, mask)
    assert same.loss.item() == pytest.approx(-1.0)  # ratio 1, mean over the 2 trained tokens
    assert same.ppo_kl.item() == 0.0 and same.clipfrac.item() == 0.0
    # ratio e^1 > 1.2 with a positive advantage: clipped at 1.2
    out = policy_loss(lp, lp - 1.0, adv, mask, clip_low=0.2, clip_high=0.2)
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.clipfrac.item() == 1.0


def test_clip_low_and_high_are_separate():
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    old = torch.tensor([[math.log(2.0), -math.log(2.0)]])  # ratios 0.5 and 2
    adv = torch.tensor([[-1.0, 1.0]])
    out = policy_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    # token 0: A<0, ratio 0.5 -> max(-A*0.5, -A*0.9) = 0.9; token 1: A>0, ratio 2 -> max(-2, -1.3) = -1.3
    assert out.loss.item() == pytest.approx((0.9 - 1.3) / 2)
    assert out.clipfrac.item() == 1.0


def test_dual_clip_bounds_negative_advantage_loss():
    lp, old = torch.tensor([[0.0]]), torch.tensor([[-3.0]])  # ratio e^3
    out = policy_loss(lp, old, torch.tensor([[-1.0]]), torch.ones(1, 1), dual_clip_c=3.0)
    assert out.loss.item() == pytest.approx(3.0)
    no_dual = policy_loss(lp, old, torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert no_dual.loss.item() == pytest.approx(math.exp(3.0))


def test_denominator_makes_micro_batches_add_up():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    old = lp - 0.1
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    whole = policy_loss(lp, old, adv, mask, clip_low=1.0, clip_high=1.0)
    parts = sum(policy_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], clip_low=1.0, clip_high=1.0,
                            denom=3.0).loss for i in range(2))
    assert parts.item() == pytest.approx(whole.loss.item())


def test_gspo_sequence_ratio_value_and_gradient():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.2, -9.0], [-0.4, -0.7, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    log_ratio = sequence_log_ratio(lp, old, mask)
    s0 = (0.2 + 0.2) / 2  # the masked token does not count
    s1 = (-0.1 + 0.2 + 0.0) / 3
    assert log_ratio.detach()[0, :2].tolist() == pytest.approx([s0, s0])
    assert log_ratio.detach()[1].tolist() == pytest.approx([s1, s1, s1])
    # GSPO loss (no clipping hit: the clip range is wide): -A * exp(s_i), token mean
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    out = policy_loss(lp, old, adv, mask, clip_low=0.5, clip_high=0.5, ratio_level="sequence")
    direct = (-(math.exp(s0)) * 2 + math.exp(s1) * 3) / 5
    assert out.loss.item() == pytest.approx(direct, rel=1e-6)
    out.loss.backward()
    # d/dlp_t of -A exp(s) (token-level weight): -A * exp(s) / 5 for each trained token
    assert lp.grad[0, :2].tolist() == pytest.approx([-math.exp(s0) / 5] * 2, rel=1e-6)
    assert lp.grad[0, 2].item() == 0.0
    assert lp.grad[1].tolist() == pytest.approx([math.exp(s1) / 5] * 3, rel=1e-6)
    # packed (1-D) input with explicit sequence ids gives the same ratios
    flat = sequence_log_ratio(lp.detach().reshape(-1), old.reshape(-1), mask.reshape(-1),
                              torch.tensor([0, 0, 0, 1, 1, 1]))
    assert flat.tolist() == pytest.approx(log_ratio.detach().reshape(-1).tolist())


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = 0.5
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-d) - 1 + d)
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k9")


def test_importance_weights_truncate_and_mask():
    old = torch.tensor([0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, -math.log(3.0), math.log(4.0)])  # w = 1, 3, 0.25
    mask = torch.ones(3)
    iw = importance_weights(old, rollout, mask, mode="truncate", low=0.5, high=2.0)
    assert iw.weights.tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert iw.ratio.tolist() == pytest.approx([1.0, 3.0, 0.25])
    assert iw.outside.tolist() == [0.0, 1.0, 1.0]
    iw = importance_weights(old, rollout, mask, mode="mask", low=0.5, high=2.0)
    assert iw.weights.tolist() == pytest.approx([1.0, 0.0, 0.0])
    # TIS scales each token's surrogate: on-policy ratio 1, loss = -sum(A * w) / n
    adv = torch.tensor([1.0, 1.0, 1.0])
    tw = importance_weights(old, rollout, mask, mode="truncate", low=0.0, high=2.0).weights
    out = policy_loss(old, old, adv, mask, token_weights=tw)
    assert out.loss.item() == pytest.approx(-(1.0 + 2.0 + 0.25) / 3)


# Two sequences of a [2, 3] batch; sequence 0's third token is an env token (mask 0).
# token ratios: seq 0: 2, 1.5, (env: 100); seq 1: 0.5, 0.8, 1.25
_LV_OLD = torch.zeros(2, 3)
_LV_ROLLOUT = -torch.log(torch.tensor([[2.0, 1.5, 100.0], [0.5, 0.8, 1.25]]))
_LV_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_sequence_level_weights_are_the_product_of_the_trained_tokens_ratios():
    # seq 0: 2 * 1.5 = 3 (the env token's 100 is not an action); seq 1: 0.5 * 0.8 * 1.25 = 0.5
    iw = importance_weights(_LV_OLD, _LV_ROLLOUT, _LV_MASK, mode="truncate", low=0.0, high=2.0, level="sequence")
    assert (iw.ratio * _LV_MASK).flatten().tolist() == pytest.approx([3.0, 3.0, 0.0, 0.5, 0.5, 0.5])
    assert (iw.weights * _LV_MASK).flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 0.5, 0.5, 0.5])
    # MIS at sequence level drops the whole of sequence 0 (ratio 3 > 2) and keeps sequence 1 whole
    iw = importance_weights(_LV_OLD, _LV_ROLLOUT, _LV_MASK, mode="mask", low=0.25, high=2.0, level="sequence")
    assert (iw.weights * _LV_MASK).flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    assert (iw.outside * _LV_MASK).tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_geometric_level_is_the_geometric_mean_and_packed_input_matches_padded():
    # seq 0: sqrt(2 * 1.5) = sqrt(3); seq 1: (0.5)^(1/3)
    g0, g1 = math.sqrt(3.0), 0.5 ** (1 / 3)
    iw = importance_weights(_LV_OLD, _LV_ROLLOUT, _LV_MASK, mode="mask", low=0.7, high=1.5, level="geometric")
    assert (iw.ratio * _LV_MASK).flatten().tolist() == pytest.approx([g0, g0, 0.0, g1, g1, g1])
    # sqrt(3) = 1.73 > 1.5: sequence 0 masked; 0.79 inside [0.7, 1.5]: sequence 1 kept
    assert (iw.weights * _LV_MASK).flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, g1, g1, g1])
    # the Megatron trainer's packed [N] layout with seq_ids gives the same weights
    packed = importance_weights(_LV_OLD.reshape(-1), _LV_ROLLOUT.reshape(-1), _LV_MASK.reshape(-1),
                                mode="mask", low=0.7, high=1.5, level="geometric",
                                seq_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert packed.weights.tolist() == pytest.approx(iw.weights.reshape(-1).tolist())
    with pytest.raises(ValueError, match="seq_ids"):
        importance_weights(_LV_OLD.reshape(-1), _LV_ROLLOUT.reshape(-1), _LV_MASK.reshape(-1), level="sequence")
    with pytest.raises(ValueError, match="tis level"):
        importance_weights(_LV_OLD, _LV_ROLLOUT, _LV_MASK, level="tokens")


def test_token_level_mis_masks_tokens_out_of_the_loss_and_reports_the_fraction():
    # token ratios of the trained tokens: 2, 1.5 | 0.5, 0.8, 1.25; bounds [0.6, 1.6] mask 2 and 0.5
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    algo = AlgoConfig(use_tis=True, tis_mode="mask", tis_clip_low=0.6, tis_clip=1.6)
    loss, stats = policy_objective(algo, logprobs=lp, old_logprobs=lp, advantages=adv, mask=_LV_MASK, denom=5.0,
                                   rollout_logprobs=_LV_ROLLOUT)
    # kept: 1.5 (A=1), 0.8 and 1.25 (A=-1); surrogate at ratio 1 is -A * w
    assert stats["pg_loss"].item() == pytest.approx((-1.5 + 0.8 + 1.25) / 5)
    assert stats["tis_masked_frac"].item() == pytest.approx(2 / 5)
    assert stats["tis_ratio"].item() == pytest.approx((2 + 1.5 + 0.5 + 0.8 + 1.25) / 5)
    assert stats["tis_weight"].item() == pytest.approx((1.5 + 0.8 + 1.25) / 5)
    # the masked tokens get no gradient
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_objective(algo, logprobs=lp, old_logprobs=lp.detach(), advantages=adv, mask=_LV_MASK,
                               denom=5.0, rollout_logprobs=_LV_ROLLOUT)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -1.5 / 5, 0.0, 0.0, 0.8 / 5, 1.25 / 5])


# token ratios 2, 1.5 (and an untrained 1e-6) | 0.5, 0.8, 1.25
_VETO_ROLLOUT = -torch.log(torch.tensor([[2.0, 1.5, 1e-6], [0.5, 0.8, 1.25]]))


def test_a_token_below_the_veto_threshold_drops_its_whole_sequence():
    vetoed, count = catastrophic_veto(_LV_OLD, _VETO_ROLLOUT, _LV_MASK, threshold=0.6)
    # sequence 1's 0.5 vetoes all of it; sequence 0's 1e-6 is not trained, so it vetoes nothing
    assert vetoed.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]] and count.item() == 1
    assert catastrophic_veto(_LV_OLD, _VETO_ROLLOUT, _LV_MASK, threshold=0.5)[1].item() == 0  # not below: kept
    assert catastrophic_veto(_LV_OLD, _VETO_ROLLOUT, _LV_MASK, threshold=0.9)[1].item() == 1
    assert catastrophic_veto(_LV_OLD, _VETO_ROLLOUT, torch.ones(2, 3), threshold=0.9)[1].item() == 2
    # the packed [N] layout with seq_ids (the Megatron trainer's) vetoes the same tokens
    packed, n = catastrophic_veto(_LV_OLD.reshape(-1), _VETO_ROLLOUT.reshape(-1), _LV_MASK.reshape(-1),
                                  threshold=0.6, seq_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert packed.tolist() == vetoed.reshape(-1).tolist() and n.item() == 1


@pytest.mark.parametrize("mode,level", [("truncate", "token"), ("mask", "token"), ("truncate", "geometric")])
def test_the_veto_takes_the_sequence_out_of_the_loss_under_every_mode_and_level(mode, level):
    adv = torch.ones(2, 3)
    base = dict(use_tis=True, tis_mode=mode, tis_level=level, tis_clip_low=0.0 if mode == "truncate" else 0.1,
                tis_clip=3.0)
    lp = torch.zeros(2, 3, requires_grad=True)
    _, plain = policy_objective(AlgoConfig(**base), logprobs=lp, old_logprobs=lp.detach(), advantages=adv,
                                mask=_LV_MASK, denom=5.0, rollout_logprobs=_VETO_ROLLOUT)
    assert "rs_veto_seqs" not in plain
    loss, stats = policy_objective(AlgoConfig(**base, rs_veto_threshold=0.6), logprobs=lp, old_logprobs=lp.detach(),
                                   advantages=adv, mask=_LV_MASK, denom=5.0, rollout_logprobs=_VETO_ROLLOUT)
    loss.backward()
    assert stats["rs_veto_seqs"].item() == 1 and stats["rs_veto_token_frac"].item() == pytest.approx(3 / 5)
    assert lp.grad[1].tolist() == [0.0, 0.0, 0.0]  # the vetoed sequence: no gradient
    assert lp.grad[0, :2].abs().min().item() > 0  # the other keeps its own
    # what is left of the loss is sequence 0's part of the loss without the veto
    if level == "token":
        assert stats["pg_loss"].item() == pytest.approx(-(2.0 + 1.5) / 5)
    assert stats["pg_loss"].item() > plain["pg_loss"].item()  # sequence 1's (negative) part is gone
    assert stats["tis_weight"].item() == pytest.approx(plain["tis_weight"].item())  # the weights' stat: before it


def test_sequence_level_tis_in_the_objective():
    lp = torch.zeros(2, 3)
    adv = torch.ones(2, 3)
    algo = AlgoConfig(use_tis=True, tis_level="sequence", tis_clip=2.0)
    _, stats = policy_objective(algo, logprobs=lp, old_logprobs=lp, advantages=adv, mask=_LV_MASK, denom=5.0,
                                rollout_logprobs=_LV_ROLLOUT)
    # sequence 0's weight 3 truncated to 2 on its 2 tokens, sequence 1's 0.5 on its 3
    assert stats["pg_loss"].item() == pytest.approx(-(2 * 2.0 + 3 * 0.5) / 5)
    assert stats["tis_clipfrac"].item() == pytest.approx(2 / 5)
    assert stats["tis_ratio"].item() == pytest.approx((2 * 3.0 + 3 * 0.5) / 5)


def test_value_loss_clipped():
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.0]), torch.tensor([2.0, 1.0])
    mask = torch.ones(2)
    loss, clipfrac = value_loss(v, old, ret, mask, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1; clipped V = 0.5 + 0.2 = 0.7 -> (0.7-2)^2 = 1.69 -> max 1.69
    # token 1: V = old = 0: both (0-1)^2 = 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss, _ = value_loss(v, old, ret, mask, clip=0.0)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)


def test_returns_gae_and_whitening():
    r = torch.tensor([0.0, -0.1, 1.0])
    assert discounted_returns(r, 1.0).tolist() == pytest.approx([0.9, 0.9, 1.0])
    assert discounted_returns(r, 0.5).tolist() == pytest.approx([-0.05 + 0.25, -0.1 + 0.5, 1.0])
    v = torch.tensor([0.5, 0.2, 0.4])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.4
    d1 = -0.1 + gamma * 0.4 - 0.2
    d0 = 0.0 + gamma * 0.2 - 0.5
    a2, a1 = d2, d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    adv, ret = gae(r, v, gamma, lam)
    assert adv.tolist() == pytest.approx([a0, a1, a2], abs=1e-6)
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4], abs=1e-6)
    w = whiten([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    flat = torch.cat(w)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def _sample(reward, mask, group=0, status=SampleStatus.COMPLETED):
    s = Sample(prompt_tokens=[1, 2], group_id=group, reward=reward, status=status)
    for m in mask:
        if m:
            s.append_generated([5], [-1.0], 0)
        else:
            s.append_observation([6])
    return s


def test_compute_advantages_group_estimators_per_token():
    samples = [_sample(1.0, [1, 0, 1]), _sample(0.0, [1, 1]), _sample(5.0, [1], status=SampleStatus.FAILED)]
    adv = compute_advantages(samples, AlgoConfig(advantage_estimator="dr_grpo")).advantages
    assert adv == [[0.5, 0.0, 0.5], [-0.5, -0.5], [0.0]]  # env token and failed sample: 0
    adv = compute_advantages(samples, AlgoConfig(advantage_estimator="rloo")).advantages
    assert adv[0] == [1.0, 0.0, 1.0] and adv[1] == [-1.0, -1.0]


def test_compute_advantages_reinforce_plus_plus_with_kl_in_reward():
    samples = [_sample(1.0, [1, 0, 1]), _sample(0.0, [1, 1])]
    old = [[-1.0, 0.0, -2.0], [-1.0, -1.5]]
    ref = [[-1.5, 0.0, -2.0], [-1.0, -1.0]]
    algo = AlgoConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1)
    adv = compute_advantages(samples, algo, old_logprobs=old, ref_logprobs=ref).advantages
    # per trained token rewards: -0.1 * k1 (+ r at the last trained token); returns with gamma 1
    r0 = [-0.1 * 0.5, 1.0 - 0.1 * 0.0]
    r1 = [-0.1 * 0.0, 0.0 - 0.1 * (-0.5)]
    g0 = [r0[0] + r0[1], r0[1]]
    g1 = [r1[0] + r1[1], r1[1]]
    flat = torch.tensor(g0 + g1)
    z = ((flat - flat.mean()) / (flat.std(unbiased=False) + 1e-8)).tolist()
    assert adv[0] == pytest.approx([z[0], 0.0, z[1]])
    assert adv[1] == pytest.approx([z[2], z[3]])
    # the baseline variant subtracts the group mean of rewards first: alone in its group, each
    # sample's final reward becomes 0 and only the KL shaping is left
    samples[1].group_id = 1
    base = compute_advantages(samples, AlgoConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1),
                              old_logprobs=old, ref_logprobs=ref).advantages
    g0b, g1b = [g0[0] - 1.0, g0[1] - 1.0], g1
    flat = torch.tensor(g0b + g1b)
    z = ((flat - flat.mean()) / (flat.std(unbiased=False) + 1e-8)).tolist()
    assert base[0] == pytest.approx([z[0], 0.0, z[1]]) and base[1] == pytest.approx(z[2:])


def test_compute_advantages_ppo_gae_over_trained_tokens():
    samples = [_sample(1.0, [1, 0, 1]), _sample(0.0, [1])]
    values = [[0.2, 9.0, 0.5], [0.1]]  # the env token's value is never used
    algo = AlgoConfig(advantage_estimator="ppo", gamma=1.0, lambd=0.95)
    out = compute_advantages(samples, algo, values=values)
    a0, ret0 = gae(torch.tensor([0.0, 1.0]), torch.tensor([0.2, 0.5]), 1.0, 0.95)
    a1, ret1 = gae(torch.tensor([0.0]), torch.tensor([0.1]), 1.0, 0.95)
    assert out.returns[0] == pytest.approx([ret0[0].item(), 0.0, ret0[1].item()])
    assert out.returns[1] == pytest.approx([ret1[0].item()])
    flat = torch.cat([a0, a1])
    z = ((flat - flat.mean()) / (flat.std(unbiased=False) + 1e-8)).tolist()
    assert out.advantages[0] == pytest.approx([z[0], 0.0, z[1]]) and out.advantages[1] == pytest.approx([z[2]])


def test_policy_objective_adds_kl_entropy_and_tis():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    ent = torch.tensor([0.3, 0.5])
    mask = torch.ones(2)
    adv = torch.tensor([1.0, -1.0])
    rollout = lp + torch.tensor([0.0, math.log(4.0)])  # weights 1 and 0.25
    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1, use_tis=True,
                      tis_clip=2.0)
    loss, stats = policy_objective(algo, logprobs=lp, old_logprobs=lp, advantages=adv, mask=mask, denom=2.0,
                                   ref_logprobs=ref, rollout_logprobs=rollout, entropy=ent)
    pg = (-1.0 * 1.0 + 1.0 * 0.25) / 2
    kl = (0.5 + 0.0) / 2
    assert stats["pg_loss"].item() == pytest.approx(pg)
    assert stats["kl_loss"].item() == pytest.approx(kl)
    assert stats["entropy"].item() == pytest.approx(0.4)
    assert stats["tis_weight"].item() == pytest.approx(1.25 / 2)
    assert loss.item() == pytest.approx(pg + 0.5 * kl - 0.1 * 0.4)


def test_check_algo_rejects_kl_reward_for_group_estimators():
    with pytest.raises(ConfigError, match="--kl-coef"):
        check_algo(AlgoConfig(advantage_estimator="grpo", kl_coef=0.1))
    check_algo(AlgoConfig(advantage_estimator="ppo", kl_coef=0.1))
    with pytest.raises(ConfigError, match="--tis-clip"):
        check_algo(AlgoConfig(use_tis=True, tis_clip=0.5, tis_clip_low=0.6))


def test_overlong_penalty_is_dapos_linear_ramp():
    from agentrl.algorithms import overlong_penalty

    ramp = [overlong_penalty(n, max_len=10, buffer_len=4, factor=0.5) for n in (5, 6, 7, 8, 10, 12)]
    assert ramp == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_overlong_shaping_moves_group_advantages_and_is_off_by_default():
    # equal rewards: without shaping no signal; with it the long response is pushed down
    short, long_ = _sample(1.0, [1] * 4), _sample(1.0, [1] * 10)
    assert compute_advantages([short, long_], AlgoConfig(advantage_estimator="dr_grpo")).advantages == [[0.0] * 4,
                                                                                                           [0.0] * 10]
    algo = AlgoConfig(advantage_estimator="dr_grpo", overlong_buffer_len=4, overlong_max_len=10,
                      overlong_penalty_factor=1.0)
    adv = compute_advantages([short, long_], algo).advantages
    assert adv[0] == [0.5] * 4 and adv[1] == [-0.5] * 10


def test_overlong_flags_resolve_against_the_response_budget():
    from agentrl.config import parse_config

    cfg, _ = parse_config(["--overlong-buffer-len", "64", "--rollout-max-response-len", "512"])
    assert (cfg.algo.overlong_buffer_len, cfg.algo.overlong_max_len) == (64, 512)
    assert parse_config([])[0].algo.overlong_buffer_len is None
    with pytest.raises(ConfigError, match="--overlong-buffer-len .*shorter"):
        parse_config(["--overlong-buffer-len", "16"])  # the default budget is 16 tokens


def test_the_old_logprob_pass_is_skipped_only_when_one_step_needs_nothing_before_it():
    from types import SimpleNamespace

    from agentrl.algorithms import reuses_training_logprobs

    samples = [object()] * 4
    plain = SimpleNamespace(critic=None, train_forward_has_dropout=False)
    assert reuses_training_logprobs(plain, samples, AlgoConfig(), 4)
    assert reuses_training_logprobs(plain, samples, AlgoConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.1), 8)
    assert reuses_training_logprobs(plain, samples, AlgoConfig(advantage_estimator="gspo", dual_clip_c=3.0), 4)
    assert not reuses_training_logprobs(plain, samples, AlgoConfig(), 3)  # two steps: the second on a moved policy
    assert not reuses_training_logprobs(plain, samples, AlgoConfig(recompute_old_logprobs=True), 4)
    kl_reward = AlgoConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1)  # old vs ref in the reward
    assert not reuses_training_logprobs(plain, samples, kl_reward, 4)
    assert not reuses_training_logprobs(plain, samples, AlgoConfig(use_opd=True), 4)  # old vs teacher in advantages
    assert not reuses_training_logprobs(SimpleNamespace(critic=object(), train_forward_has_dropout=False), samples,
                                        AlgoConfig(advantage_estimator="ppo"), 4)
    assert not reuses_training_logprobs(SimpleNamespace(critic=None, train_forward_has_dropout=True), samples,
                                        AlgoConfig(), 4)  # dropout: the training forward is not the eval pass
    assert not reuses_training_logprobs(SimpleNamespace(critic=None), samples, AlgoConfig(), 4)  # trainer unsure


def test_policy_objective_without_old_logprobs_is_the_step_with_them():
    algo = AlgoConfig(use_tis=True, tis_clip_low=0.9, tis_clip=1.1, use_kl_loss=True, kl_loss_coef=0.2)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    base = torch.tensor([[-1.0, -2.0, -0.5, -0.3], [-0.7, -1.2, -2.5, -0.1]])
    rollout = base + torch.tensor([[0.3, -0.05, 0.0, 0.02], [-0.2, 0.0, 0.04, 0.0]])
    kw = dict(advantages=torch.tensor([[1.0] * 4, [-0.5] * 4]), mask=mask, denom=5.0,
              ref_logprobs=base - 0.1, rollout_logprobs=rollout)
    lp1, lp2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss1, s1 = policy_objective(algo, logprobs=lp1, old_logprobs=None, **kw)
    loss2, s2 = policy_objective(algo, logprobs=lp2, old_logprobs=base.clone(), **kw)
    loss1.backward()
    loss2.backward()
    assert torch.equal(lp1.grad, lp2.grad) and loss1.item() == loss2.item()
    assert set(s1) - set(s2) == {"train_rollout_logprob_abs_diff"}
    assert all(s1[k].item() == s2[k].item() for k in s2)
    assert 0 < s1["tis_clipfrac"].item() < 1
    gap = sum(abs(a - b) for a, b, m in zip(base.flatten().tolist(), rollout.flatten().tolist(),
                                            mask.flatten().tolist()) if m) / 5
    assert s1["train_rollout_logprob_abs_diff"].item() == pytest.approx(gap)
