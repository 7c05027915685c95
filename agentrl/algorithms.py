"""Advantages and losses, shared by every trainer (the plain-PyTorch one and Megatron).

Shapes: the loss functions are elementwise over token tensors of any shape ([B, T] padded,
or [N] packed); `mask` is the loss mask: 1 where the policy sampled the token, 0 for
env/tool tokens and padding. Losses are token sums divided by `denom` (the trained-token
count of the whole global batch), so micro-batches add up to the global token mean.

Estimators (`--advantage-estimator`):

- grpo: (r - group mean) / (group std + eps), one scalar per trajectory;
- dr_grpo: r - group mean (Dr. GRPO: no std normalization);
- gspo: GRPO's advantages with GSPO's sequence-level importance ratio in the loss;
- cispo: GRPO's advantages with MiniMax-M1's CISPO loss (`cispo_loss`);
- rloo: r - mean of the other members of the group;
- reinforce_plus_plus: per-token returns of the reward (at the last trained token) plus the
  per-token KL penalty (`--kl-coef`), whitened over the batch's trained tokens;
- reinforce_plus_plus_baseline: the same with r - group mean as the final reward;
- ppo: GAE(gamma, lambda) over a critic's values, whitened; the critic learns the returns.

slime's `--disable-rewards-normalization` gives the group estimators the raw rewards (no group
baseline, no std), and `--normalize-advantages` whitens the final advantages over the rollout's
trained tokens (`masked_whiten`).

`sft_loss` is the supervised warm start's loss (mean NLL of the assistant tokens).

Engine-vs-trainer mismatch (`--use-tis`): `importance_weights` gives each trained token the
ratio pi_trainer_old / pi_rollout at token, sequence (product) or geometric-mean level, clamped
(TIS, `--tis-mode truncate`) or masking what falls outside the bounds out of the loss (MIS,
`--tis-mode mask`); `--rs-veto-threshold` drops a whole sequence with one token whose ratio is
below it (`catastrophic_veto`). On-policy distillation (`--use-opd`) subtracts the per-token reverse KL to a
teacher from the advantages; the teacher runs in the trainer or is served (agentrl.teacher).

Trajectories are sequences of *trained* tokens: env/tool tokens (mask 0) are context, not
actions, so returns and GAE run over the trained tokens only and give the rest 0.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from agentrl.profiling import TrainProfiler

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus",
                        "reinforce_plus_plus_baseline", "ppo")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline")
STD_ESTIMATORS = ("grpo", "gspo", "cispo")  # the group baseline divided by the group's std
TOKEN_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def check_algo(algo) -> None:
    """Combinations of AlgoConfig fields that cannot work; raised at trainer construction."""
    from agentrl.errors import ConfigError

    if algo.kl_coef > 0 and algo.advantage_estimator not in TOKEN_ESTIMATORS:
        raise ConfigError(f"--kl-coef puts a per-token KL penalty into the reward, which only token-level estimators "
                          f"({', '.join(TOKEN_ESTIMATORS)}) use; with {algo.advantage_estimator} use --use-kl-loss "
                          "--kl-loss-coef instead")
    if algo.use_tis and algo.tis_clip <= algo.tis_clip_low:
        raise ConfigError(f"--tis-clip ({algo.tis_clip}) must exceed --tis-clip-low ({algo.tis_clip_low})")


SERVED_OPD_TYPES = ("sglang",)  # --opd-type values whose teacher is served (agentrl.teacher), not in the trainer


def teacher_is_served(algo) -> bool:
    return bool(algo.use_opd and algo.opd_type in SERVED_OPD_TYPES)


def teacher_in_trainer(algo) -> bool:
    """--use-opd with the teacher loaded beside the policy (not served by an engine group, agentrl.teacher)."""
    return bool(algo.use_opd) and not teacher_is_served(algo)


def carried_teacher_logprobs(samples) -> list[list[float]]:
    """The served teacher's logprobs that agentrl.teacher.score_with_teacher put on the samples
    (metadata["teacher_logprobs"]), as the OPD advantage reads them (zeros for an untrainable
    sample, which gets no advantage)."""
    out = []
    for s in samples:
        lps = s.metadata.get("teacher_logprobs")
        if lps is None and s.trainable:
            raise ValueError(f"--opd-type sglang: trajectory {s.trajectory_id} carries no teacher logprobs "
                             "(metadata['teacher_logprobs'], set by agentrl.teacher.score_with_teacher)")
        if lps is not None and len(lps) != s.response_length:
            raise ValueError(f"trajectory {s.trajectory_id}: {len(lps)} teacher logprobs for {s.response_length} "
                             "response tokens")
        out.append(list(lps) if lps is not None else [0.0] * s.response_length)
    return out


def needs_reference(algo) -> bool:
    return bool(algo.use_kl_loss and algo.kl_loss_coef > 0) or algo.kl_coef > 0


# -- advantages --------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """One scalar per sample from its group's rewards.  rewards, group_ids: [B]

    grpo, gspo, cispo: (r - mean) / (std + eps);  dr_grpo, reinforce_plus_plus_baseline: r - mean;
    rloo: r - mean of the other members;  reinforce_plus_plus: r (no baseline).
    """
    if estimator not in ADVANTAGE_ESTIMATORS or estimator == "ppo":
        raise ValueError(f"unknown group advantage estimator {estimator!r}; choose from {GROUP_ESTIMATORS}")
    if estimator == "reinforce_plus_plus":
        return rewards.clone()
    adv = torch.zeros_like(rewards)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx]
        n = r.numel()
        if estimator == "rloo":
            adv[idx] = (r - (r.sum() - r) / (n - 1)) if n > 1 else torch.zeros_like(r)
            continue
        centered = r - r.mean()
        if estimator in STD_ESTIMATORS:
            std = r.std(unbiased=True) if n > 1 else torch.tensor(0.0)
            centered = centered / (std + eps)
        adv[idx] = centered
    return adv


def discounted_returns(rewards: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_k gamma^k r_{t+k} over a 1-D sequence of steps."""
    out = torch.zeros_like(rewards)
    running = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a 1-D sequence of steps (terminal after the last).
    Returns (advantages, returns = advantages + values)."""
    adv = torch.zeros_like(rewards)
    last = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < values.numel() else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values


def masked_whiten(values: list[list[float]], masks: list[list[int]], eps: float = 1e-8) -> list[list[float]]:
    """--normalize-advantages (slime's distributed_masked_whiten with shift_mean): (x - mean) /
    sqrt(var + eps), the mean and the Bessel-corrected variance over the masked elements of all the
    lists together; every element is transformed (an unmasked one is not trained anyway)."""
    flat = torch.tensor([x for v in values for x in v], dtype=torch.float64)
    m = torch.tensor([float(bool(x)) for mk in masks for x in mk], dtype=torch.float64)
    n = m.sum()
    if n == 0:
        return [list(v) for v in values]
    mean = (flat * m).sum() / n
    var = (flat.pow(2) * m).sum() / n - mean**2
    if n >= 2:
        var = var * n / (n - 1)
    out = ((flat - mean) * torch.rsqrt(var + eps)).tolist()
    split, k = [], 0
    for v in values:
        split.append(out[k:k + len(v)])
        k += len(v)
    return split


def whiten(values: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """(x - mean) / std over all the given tensors' elements together."""
    flat = torch.cat([v.flatten() for v in values]) if values else torch.zeros(0)
    if flat.numel() < 2:
        return [v - flat.mean() if flat.numel() else v for v in values]
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [(v - mean) / (std + eps) for v in values]


@dataclass
class Advantages:
    advantages: list[list[float]]  # per sample, per response token (0 where not trained)
    returns: list[list[float]] | None = None  # ppo: the critic's targets, same layout


def overlong_penalty(length: int, *, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer_len tokens, then falling linearly
    to -factor at max_len, and -factor beyond it."""
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    return -factor * min(length - start, buffer_len) / buffer_len


def shaped_rewards(samples, algo) -> list[float]:
    """Each Sample's scalar reward with the configured shaping (--overlong-buffer-len) applied."""
    rewards = [s.reward_value for s in samples]
    if getattr(algo, "overlong_buffer_len", None) is None:
        return rewards
    return [r + overlong_penalty(s.response_length, max_len=algo.overlong_max_len, buffer_len=algo.overlong_buffer_len,
                                 factor=algo.overlong_penalty_factor) for r, s in zip(rewards, samples)]


POST_PROCESS_FLAG = "--custom-reward-post-process-path"


@functools.lru_cache(maxsize=8)
def _slime_function(spec: str, flag: str):
    """A slime hook named by `flag`, imported once."""
    from agentrl.plugins import load_function

    return load_function(spec, flag=flag)


def post_processed_rewards(samples, algo) -> list[float] | None:
    """slime's --custom-reward-post-process-path: fn(args, samples) -> (raw_rewards, rewards), one
    reward per sample, in place of the group normalisation (args: the algorithm's config, which
    carries slime's names; samples: the rollout's agentrl Samples); None when not set."""
    spec = getattr(algo, "custom_reward_post_process_path", None)
    if not spec:
        return None
    out = _slime_function(spec, POST_PROCESS_FLAG)(algo, samples)
    try:
        _, rewards = out
        rewards = [float(r) for r in (rewards.tolist() if hasattr(rewards, "tolist") else rewards)]
    except (TypeError, ValueError):
        raise ValueError(f"{POST_PROCESS_FLAG} {spec}: expected (raw_rewards, rewards), got {type(out).__name__}") from None
    if len(rewards) != len(samples):
        raise ValueError(f"{POST_PROCESS_FLAG} {spec}: {len(rewards)} rewards for {len(samples)} samples")
    return rewards


def compute_advantages(samples, algo, *, old_logprobs: list[list[float]] | None = None,
                       ref_logprobs: list[list[float]] | None = None,
                       values: list[list[float]] | None = None,
                       teacher_logprobs: list[list[float]] | None = None) -> Advantages:
    """Per-token advantages for each Sample (and returns for the critic under ppo).

    old_logprobs / ref_logprobs: the policy's and the reference model's logprobs of each
    response token (for the KL penalty in the reward, `--kl-coef`); values: the critic's
    value of each response position (ppo); teacher_logprobs: the --use-opd teacher's.
    """
    adv = _estimator_advantages(samples, algo, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values)
    if getattr(algo, "use_opd", False):
        if old_logprobs is None or teacher_logprobs is None:
            raise ValueError("--use-opd needs the policy's and the teacher's logprobs")
        for i, s in enumerate(samples):
            if s.trainable:  # slime's apply_opd_kl_to_advantages: after the estimator, per token
                adv.advantages[i] = [a - algo.opd_kl_coef * (o - t) if m else a for a, o, t, m in
                                     zip(adv.advantages[i], old_logprobs[i], teacher_logprobs[i], s.loss_mask)]
    if getattr(algo, "normalize_advantages", False):  # slime: last, after OPD, over the trainable samples' tokens
        idx = [i for i, s in enumerate(samples) if s.trainable]
        for i, a in zip(idx, masked_whiten([adv.advantages[i] for i in idx], [samples[i].loss_mask for i in idx])):
            adv.advantages[i] = [x if m else 0.0 for x, m in zip(a, samples[i].loss_mask)]
    return adv


def _estimator_advantages(samples, algo, *, old_logprobs, ref_logprobs, values) -> Advantages:
    est = algo.advantage_estimator
    if est not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {est!r}; choose from {ADVANTAGE_ESTIMATORS}")
    out = [[0.0] * s.response_length for s in samples]
    idx = [i for i, s in enumerate(samples) if s.trainable]  # a failed trajectory neither gets nor gives signal
    if not idx:
        return Advantages(out, [list(r) for r in out] if est == "ppo" else None)
    shaped = shaped_rewards(samples, algo)
    rewards = torch.tensor([shaped[i] for i in idx], dtype=torch.float64)
    post = post_processed_rewards(samples, algo)
    if post is not None:  # slime: the function's rewards are what the group normalisation would give
        scalar = [post[i] for i in idx]
    elif getattr(algo, "disable_rewards_normalization", False) and est in GROUP_ESTIMATORS:
        scalar = rewards.tolist()  # slime: the raw rewards, no group baseline
    elif est in GROUP_ESTIMATORS or est == "reinforce_plus_plus":
        groups = torch.tensor([samples[i].group_id for i in idx])
        scalar = group_advantages(rewards, groups, est).tolist()
    else:
        scalar = rewards.tolist()
    if est not in TOKEN_ESTIMATORS:
        for i, a in zip(idx, scalar):
            out[i] = [a if m else 0.0 for m in samples[i].loss_mask]
        return Advantages(out)

    if algo.kl_coef > 0 and (old_logprobs is None or ref_logprobs is None):
        raise ValueError("--kl-coef needs the policy's and the reference model's logprobs")
    gamma, lam = algo.gamma, algo.lambd
    per_sample_adv, per_sample_ret, positions = [], [], []
    for i, final in zip(idx, scalar):
        s = samples[i]
        pos = [t for t, m in enumerate(s.loss_mask) if m]  # the trained tokens, the steps of this trajectory
        r = torch.zeros(len(pos), dtype=torch.float64)
        if algo.kl_coef > 0:
            lp = torch.tensor([old_logprobs[i][t] for t in pos], dtype=torch.float64)
            ref = torch.tensor([ref_logprobs[i][t] for t in pos], dtype=torch.float64)
            r -= algo.kl_coef * kl_penalty(lp, ref, algo.kl_reward_type)
        r[-1] += final
        if est == "ppo":
            if values is None:
                raise ValueError("ppo needs the critic's values")
            v = torch.tensor([values[i][t] for t in pos], dtype=torch.float64)
            a, ret = gae(r, v, gamma, lam)
            per_sample_ret.append(ret)
        else:
            a = discounted_returns(r, gamma)
        per_sample_adv.append(a)
        positions.append(pos)
    per_sample_adv = whiten(per_sample_adv)
    returns = [[0.0] * s.response_length for s in samples] if est == "ppo" else None
    for k, (i, pos) in enumerate(zip(idx, positions)):
        for t, a in zip(pos, per_sample_adv[k].tolist()):
            out[i][t] = a
        if returns is not None:
            for t, g in zip(pos, per_sample_ret[k].tolist()):
                returns[i][t] = g
    return Advantages(out, returns)


def sample_advantages(samples, estimator: str) -> list[float]:
    """Group advantages over the trainable members of each group of Samples; 0 for the rest."""
    idx = [i for i, s in enumerate(samples) if s.trainable]
    out = [0.0] * len(samples)
    if idx:
        rewards = torch.tensor([samples[i].reward_value for i in idx])
        groups = torch.tensor([samples[i].group_id for i in idx])
        for i, a in zip(idx, group_advantages(rewards, groups, estimator).tolist()):
            out[i] = a
    return out


# -- KL ------------------------------------------------------------------------------------------
def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3",
               importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate of pi vs pi_ref from sampled tokens (elementwise).

    k1: log r;  k2: (log r)^2 / 2;  k3 (low variance): exp(-log r) - 1 + log r, with
    log r = logprobs - ref_logprobs. importance_ratio (--use-unbiased-kl, DeepSeek-V3.2):
    pi / pi_old of each token multiplies the estimate, which makes it unbiased for tokens
    sampled from pi_old (before k3's clamp, as slime applies it).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.pow(2)
    elif kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown KL kind {kind!r}; choose k1, k2 or k3")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(max=10.0) if kind in ("k3", "low_var_kl") else kl


# -- losses --------------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: float | torch.Tensor | None = None) -> torch.Tensor:
    return (x * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))


def _segments(mask: torch.Tensor, seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Flat segment ids (one per sequence) for tensors of mask's shape."""
    if seq_ids is None:
        if mask.dim() != 2:
            raise ValueError("sequence-level ratios need seq_ids for non-[B, T] inputs")
        seq_ids = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    seq_ids = seq_ids.reshape(-1).long()
    return seq_ids, int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                       seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """GSPO's per-token log-ratio: the sequence's mean log-ratio over its trained tokens, as a
    value, carrying each token's own gradient (GSPO-token: sg[s_i] * pi_t / sg[pi_t])."""
    ids, n = _segments(mask, seq_ids)
    lr = ((logprobs - old_logprobs) * mask).reshape(-1)
    m = mask.reshape(-1).to(lr.dtype)
    sums = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add(0, ids, lr.detach())
    counts = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add(0, ids, m).clamp(min=1)
    seq_mean = (sums / counts)[ids].reshape(mask.shape)
    return seq_mean + logprobs - logprobs.detach()


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # scalar: sum over trained tokens / denom
    clipfrac: torch.Tensor  # scalar, detached: share of trained tokens whose ratio was clipped
    ppo_kl: torch.Tensor  # scalar, detached: mean of old_logprobs - logprobs over trained tokens


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip_c: float | None = None, denom: float | None = None, ratio_level: str = "token",
                seq_ids: torch.Tensor | None = None, token_weights: torch.Tensor | None = None) -> PolicyLossOutput:
    """PPO clipped surrogate (GRPO and friends use it with their advantages).

    ratio_level "sequence" is GSPO (see sequence_log_ratio). dual_clip_c bounds the loss of
    negative advantages at -c * A. token_weights (TIS/MIS importance weights, detached)
    scale each token's loss.
    """
    log_ratio = logprobs - old_logprobs
    if ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask, seq_ids)
    elif ratio_level != "token":
        raise ValueError(f"ratio_level {ratio_level!r}: token or sequence")
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    if dual_clip_c is not None:
        pg3 = -advantages * dual_clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss, pg3), loss)
    if token_weights is not None:
        loss = loss * token_weights.detach()
    return PolicyLossOutput(
        loss=masked_mean(loss, mask, denom),
        clipfrac=masked_mean(clipped, mask, denom).detach(),
        ppo_kl=masked_mean(-(logprobs - old_logprobs), mask, denom).detach(),
    )


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               clip_low: float, clip_high: float, denom: float | None = None,
               token_weights: torch.Tensor | None = None) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, as slime's compute_cispo_loss): -sg(clip(ratio, 1 - clip_low, 1 + clip_high))
    * A * logprob on every trained token. The clipped ratio is a detached weight and the gradient
    flows through the logprob, so a clipped token still trains (PPO's clip drops its gradient).
    clipfrac: the share of trained tokens whose ratio the bounds changed."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    truncated = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -truncated * advantages * logprobs
    if token_weights is not None:
        loss = loss * token_weights.detach()
    return PolicyLossOutput(
        loss=masked_mean(loss, mask, denom),
        clipfrac=masked_mean((truncated != ratio).float(), mask, denom).detach(),
        ppo_kl=masked_mean(-(logprobs - old_logprobs), mask, denom).detach(),
    )


MISMATCH_LEVELS = ("token", "sequence", "geometric")
_MAX_LOG_RATIO = 20.0  # exp() of a sequence's summed log-ratio overflows past this; slime's SAFETY_BOUND


def mismatch_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       level: str = "token", seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log(pi_train_old / pi_rollout) per token at `level`, detached, in mask's shape:
    token: each token's own; sequence: the sum over the sequence's trained tokens (log of the
    product of its ratios); geometric: their mean (log of the geometric mean). A sequence-level
    value is given to each of the sequence's tokens. Untrained tokens count 0."""
    d = ((old_logprobs - rollout_logprobs) * mask).detach()
    if level == "token":
        return d
    if level not in MISMATCH_LEVELS:
        raise ValueError(f"tis level {level!r}: choose from {', '.join(MISMATCH_LEVELS)}")
    ids, n = _segments(mask, seq_ids)
    flat = d.reshape(-1)
    sums = torch.zeros(n, dtype=flat.dtype, device=flat.device).index_add(0, ids, flat)
    if level == "geometric":
        counts = torch.zeros(n, dtype=flat.dtype, device=flat.device).index_add(0, ids, mask.reshape(-1).to(flat.dtype))
        sums = sums / counts.clamp(min=1)
    return sums[ids].reshape(mask.shape)


@dataclass
class ISWeights:
    weights: torch.Tensor  # what scales each token's loss (0 for a masked token)
    outside: torch.Tensor  # 1.0 where the ratio fell outside [low, high] (clamped or masked)
    ratio: torch.Tensor  # the ratio before the bounds (exp of mismatch_log_ratio, itself bounded at e^20)


def importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "truncate", low: float = 0.0, high: float = 2.0, level: str = "token",
                       seq_ids: torch.Tensor | None = None) -> ISWeights:
    """Rollout/training mismatch correction: w = pi_train_old / pi_rollout, per token or per
    sequence (`level`, see mismatch_log_ratio).

    truncate (TIS): w clamped to [low, high];  mask (MIS): w where low <= w <= high, else 0, so
    the token (token level) or the whole sequence (sequence, geometric) leaves the loss.
    All detached.
    """
    log_ratio = mismatch_log_ratio(old_logprobs, rollout_logprobs, mask, level=level, seq_ids=seq_ids)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    outside = ((ratio < low) | (ratio > high)).to(ratio.dtype)
    if mode == "truncate":
        weights = ratio.clamp(min=low, max=high)
    elif mode == "mask":
        weights = ratio * (1.0 - outside)
    else:
        raise ValueError(f"tis mode {mode!r}: truncate or mask")
    return ISWeights(weights, outside, ratio)


def catastrophic_veto(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                      threshold: float, seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """--rs-veto-threshold: 1.0 on every token of a sequence that has a trained token whose own
    ratio pi_train_old / pi_rollout is below `threshold` (the engine sampled a token the trainer
    finds all but impossible: the sequence's weights cannot be trusted, whatever the level),
    else 0; and how many sequences that vetoed. Detached."""
    below = ((old_logprobs - rollout_logprobs).detach() < math.log(threshold)) & (mask > 0)
    ids, n = _segments(mask, seq_ids)
    hits = torch.zeros(n, dtype=torch.float32, device=mask.device).index_add(0, ids, below.reshape(-1).float())
    vetoed = hits > 0
    return vetoed[ids].reshape(mask.shape).to(old_logprobs.dtype), vetoed.sum().float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None = 0.2, denom: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).
    Returns (loss, clipfrac)."""
    unclipped = (values - returns).pow(2)
    if clip is None or clip <= 0:
        return 0.5 * masked_mean(unclipped, mask, denom), torch.zeros(())
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clipped - returns).pow(2)
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return masked_mean(loss, mask, denom), masked_mean((clipped > unclipped).float(), mask, denom).detach()


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denom: float | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning (`agentrl sft`): the negative log-likelihood of the trained tokens
    (mask 1: the assistant's, end-of-turn token included), a token sum / denom like the policy
    losses, so a global batch's micro-batches add up to its mean NLL per trained token.
    logprobs at temperature 1."""
    loss = masked_mean(-logprobs, mask, denom)
    return loss, {"loss": loss.detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy.  [..., V] -> [...]"""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


TIS_FLAG = "--custom-tis-function-path"


def custom_tis_weights(algo, args, *, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's --custom-tis-function-path: fn(args, *, pg_loss, train_log_probs, rollout_log_probs,
    loss_masks, total_lengths, response_lengths) -> (pg_loss, modified_masks, metrics), with
    per-sample 1-D tensors of the response tokens. slime's functions only scale pg_loss token by
    token, so they are given pg_loss = 1 everywhere: what comes back is the weight, times the
    mask they return (rejection). Returns (weights of mask's shape, per-token metric tensors)."""
    seg, n = _segments(mask, seq_ids)
    where = [torch.nonzero(seg == k).flatten() for k in range(n)]

    def split(x: torch.Tensor) -> list[torch.Tensor]:
        flat = x.detach().reshape(-1)
        return [flat[w] for w in where]

    lengths = [len(w) for w in where]
    pg, masks, metrics = _slime_function(algo.custom_tis_function_path, TIS_FLAG)(
        args, pg_loss=torch.ones(sum(lengths), dtype=old_logprobs.dtype, device=old_logprobs.device),
        train_log_probs=split(old_logprobs), rollout_log_probs=split(rollout_logprobs), loss_masks=split(mask),
        total_lengths=lengths, response_lengths=lengths)
    if pg.numel() != sum(lengths) or len(masks) != n:
        raise ValueError(f"{TIS_FLAG} {algo.custom_tis_function_path}: expected pg_loss of {sum(lengths)} tokens and "
                         f"{n} masks, got {pg.numel()} and {len(masks)}")
    weights = torch.zeros(mask.numel(), dtype=old_logprobs.dtype, device=old_logprobs.device)
    order = torch.cat(where) if where else torch.zeros(0, dtype=torch.long, device=mask.device)
    weights[order] = pg.detach().reshape(-1).to(weights.dtype) * torch.cat([m.reshape(-1) for m in masks]).to(weights.dtype)
    token_metrics = {}
    for name, value in (metrics or {}).items():
        value = torch.cat([v.reshape(-1) for v in value]) if isinstance(value, (list, tuple)) else value
        if torch.is_tensor(value) and value.numel() == sum(lengths):  # per token: averaged over the trained ones
            full = torch.zeros(mask.numel(), dtype=old_logprobs.dtype, device=old_logprobs.device)
            full[order] = value.detach().reshape(-1).to(full.dtype)
            token_metrics[name] = full.reshape(mask.shape)
    return weights.reshape(mask.shape), token_metrics


@functools.lru_cache(maxsize=4)
def _custom_config(path: str) -> tuple:
    from agentrl.slime_args import read_custom_config

    return tuple(read_custom_config(path).items())


def tis_args(algo):
    """The `args` a --custom-tis-function-path function reads: the algorithm's config under slime's
    names, and --custom-config-path's other keys (the mis.py example's bounds live there)."""
    from types import SimpleNamespace

    extra = dict(_custom_config(algo.custom_config_path)) if getattr(algo, "custom_config_path", None) else {}
    return SimpleNamespace(**{**extra, **algo.model_dump()})


def policy_objective(algo, *, logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                     mask: torch.Tensor, denom: float, ref_logprobs: torch.Tensor | None = None,
                     rollout_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                     seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole policy loss of one micro-batch, as configured: clipped surrogate (token or
    sequence ratio, dual clip), TIS/MIS weights (token, sequence or geometric level), KL loss,
    entropy bonus, --rs-veto-threshold's vetoed sequences. Every stat is a token sum / denom (or,
    rs_veto_seqs, a count), so the global batch's stats are the sums over its micro-batches.

    old_logprobs None: the rollout is trained in one optimizer step and nothing needed the old
    policy before it (`reuses_training_logprobs`), so the old policy is this forward's own
    logprobs, detached: the ratio is 1 with the same gradient, and the engine-vs-trainer gap
    (`train_rollout_logprob_abs_diff`) is measured here instead of in a separate pass."""
    weights = None
    stats: dict[str, torch.Tensor] = {}
    measure_gap = old_logprobs is None or getattr(algo, "use_rollout_logprobs", False)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    if rollout_logprobs is not None and measure_gap:
        # no separate pass measured the engine-vs-trainer gap: this forward does (slime's, with the rollout's as old)
        stats["train_rollout_logprob_abs_diff"] = masked_mean((logprobs.detach() - rollout_logprobs).abs(), mask, denom)
    if algo.use_tis and getattr(algo, "custom_tis_function_path", None):  # slime's function replaces the built-in
        if rollout_logprobs is None:
            raise ValueError("--use-tis needs the rollout logprobs")
        weights, per_token = custom_tis_weights(algo, tis_args(algo), old_logprobs=old_logprobs,
                                                rollout_logprobs=rollout_logprobs, mask=mask, seq_ids=seq_ids)
        stats.update({f"tis/{k}": masked_mean(v, mask, denom) for k, v in per_token.items()})
        stats["tis_weight"] = masked_mean(weights, mask, denom)
    elif algo.use_tis:
        if rollout_logprobs is None:
            raise ValueError("--use-tis needs the rollout logprobs")
        iw = importance_weights(old_logprobs, rollout_logprobs, mask, mode=algo.tis_mode, low=algo.tis_clip_low,
                                high=algo.tis_clip, level=algo.tis_level, seq_ids=seq_ids)
        weights = iw.weights
        stats["tis_ratio"] = masked_mean(iw.ratio, mask, denom)  # before the bounds
        stats["tis_weight"] = masked_mean(weights, mask, denom)  # after
        # the share of trained tokens outside [low, high]: clamped (truncate) or dropped from the loss (mask)
        stats["tis_masked_frac" if algo.tis_mode == "mask" else "tis_clipfrac"] = masked_mean(iw.outside, mask, denom)
        if algo.rs_veto_threshold is not None:  # the whole sequence out of the loss, after TIS/MIS
            vetoed, count = catastrophic_veto(old_logprobs, rollout_logprobs, mask, threshold=algo.rs_veto_threshold,
                                              seq_ids=seq_ids)
            weights = weights * (1.0 - vetoed)
            stats["rs_veto_seqs"] = count  # a count: the step's micro-batches add up to the step's
            stats["rs_veto_token_frac"] = masked_mean(vetoed, mask, denom)
    clip_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip
    if algo.advantage_estimator == "cispo":
        out = cispo_loss(logprobs, old_logprobs, advantages, mask, clip_low=algo.eps_clip, clip_high=clip_high,
                         denom=denom, token_weights=weights)
    else:
        out = policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=algo.eps_clip, clip_high=clip_high,
                          dual_clip_c=algo.dual_clip_c, denom=denom,
                          ratio_level="sequence" if algo.advantage_estimator == "gspo" else "token",
                          seq_ids=seq_ids, token_weights=weights)
    loss = out.loss
    stats.update(pg_loss=out.loss.detach(), clipfrac=out.clipfrac, ppo_kl=out.ppo_kl)
    if algo.use_kl_loss and ref_logprobs is not None:
        # --use-unbiased-kl: weighted by pi / pi_old (the policy loss's old), the gradient through both, as slime
        ratio = torch.exp(logprobs - old_logprobs) if getattr(algo, "use_unbiased_kl", False) else None
        kl = masked_mean(kl_penalty(logprobs, ref_logprobs, algo.kl_loss_type, importance_ratio=ratio), mask, denom)
        loss = loss + algo.kl_loss_coef * kl
        stats["kl_loss"] = kl.detach()
    if entropy is not None:
        ent = masked_mean(entropy, mask, denom)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * ent
        stats["entropy"] = ent.detach()
    stats["loss"] = loss.detach()
    return loss, stats


def rollout_logprobs_as_old(samples) -> list[list[float]]:
    """--use-rollout-logprobs: each sample's engine logprobs stand for the old policy's."""
    for s in samples:
        if s.trainable and len(s.rollout_logprobs) != s.response_length:
            raise ValueError(f"--use-rollout-logprobs: trajectory {s.trajectory_id} has {len(s.rollout_logprobs)} "
                             f"rollout logprobs for {s.response_length} response tokens")
    return [list(s.rollout_logprobs) for s in samples]


def reuses_training_logprobs(trainer, samples, algo, global_batch_size: int) -> bool:
    """Whether the old-policy logprob pass before the step can be skipped with identical
    advantages, loss and gradient (slime's can_reuse_log_probs_in_loss, verl's on-policy
    shortcut): the rollout is one optimizer step (a second step would train a policy that has
    moved), nothing reads the old logprobs before the step (--kl-coef's penalty in the reward,
    --use-opd's reverse KL in the advantages; ppo kept with its critic, as slime does), and the
    training forward computes what the eval-mode pass would (no dropout). The trainer says
    the last (`train_forward_has_dropout`); a trainer that does not say keeps the pass."""
    return (getattr(trainer, "train_forward_has_dropout", True) is False
            and not getattr(algo, "recompute_old_logprobs", False)
            and len(samples) <= global_batch_size
            and algo.kl_coef == 0 and not getattr(algo, "use_opd", False)
            and trainer.critic is None)


@torch.no_grad()
def copy_parameters(target: torch.nn.Module, named: Iterator[tuple[str, torch.Tensor]], where: str) -> None:
    """--ref-update-interval: the (name, tensor) pairs into target's parameters of those names;
    every parameter of target must be given (the reference and the policy share an architecture)."""
    params = dict(target.named_parameters())
    done = set()
    for name, tensor in named:
        if name not in params:
            raise ValueError(f"{where}: the policy's {name} has no parameter of that name in the reference")
        params[name].copy_(tensor)
        done.add(name)
    if missing := sorted(set(params) - done):
        raise ValueError(f"{where}: the policy gave no weights for the reference's {missing[:3]}")


def has_dropout(modules, attention_dropout: float = 0.0) -> bool:
    """Whether a training-mode forward of `modules` drops anything (then it differs from the
    eval-mode logprob pass): a Dropout module with p > 0, or attention dropout inside kernels."""
    return attention_dropout > 0 or any(isinstance(m, torch.nn.Dropout) and m.p > 0
                                        for module in modules for m in module.modules())


def train_iteration(trainer, samples, algo, global_batch_size: int) -> dict[str, float]:
    """One RL iteration, the same for every trainer: logprobs (policy and reference) and values
    over the whole rollout, advantages, then one optimizer step per global batch (the critic's
    too, for ppo). The trainer supplies compute_logprobs / compute_values / policy_step /
    critic_step and its ref_model and critic (None when unused). Metrics are batch means plus
    the mean |trainer - rollout| logprob over the trainable samples' trained tokens (0 when
    exactly on-policy). When `reuses_training_logprobs`, the policy's own pass is skipped:
    policy_step gets old=None and its loss takes the old logprobs (and that metric) from the
    training forward."""
    profiler = getattr(trainer, "profiler", None) or TrainProfiler()  # --use-pytorch-profiler
    profiler.begin_step()
    with profiler.section("train_overall"):
        metrics = _train_iteration(trainer, samples, algo, global_batch_size, profiler)
    if lines := profiler.take_summaries():  # not a metric: train_step prints and drops it
        metrics["profile_summaries"] = lines
    return metrics


def _train_iteration(trainer, samples, algo, global_batch_size: int, profiler: TrainProfiler) -> dict[str, float]:
    rollout_old = getattr(algo, "use_rollout_logprobs", False)  # slime's: the engine's logprobs are the old policy's
    reuse = not rollout_old and reuses_training_logprobs(trainer, samples, algo, global_batch_size)
    t0 = time.perf_counter()
    with profiler.section("train_log_probs"):
        with profiler.label("old_logprobs"):
            old = (rollout_logprobs_as_old(samples) if rollout_old
                   else None if reuse else trainer.compute_logprobs(samples))
        with profiler.label("ref_logprobs"):
            ref = trainer.compute_logprobs(samples, trainer.ref_model) if trainer.ref_model is not None else None
        with profiler.label("values"):
            values = trainer.compute_values(samples) if trainer.critic is not None else None
        teacher_model = getattr(trainer, "teacher_model", None)
        with profiler.label("teacher_logprobs"):
            teacher = trainer.compute_logprobs(samples, teacher_model) if teacher_model is not None else None
    if teacher is None and getattr(algo, "use_opd", False):  # the served teacher's, carried on the samples
        teacher = carried_teacher_logprobs(samples)
    with profiler.label("advantages"):
        adv = compute_advantages(samples, algo, old_logprobs=old, ref_logprobs=ref, values=values,
                                 teacher_logprobs=teacher)
    t_logprobs = time.perf_counter() - t0
    metrics: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    with profiler.section("train_actor"):
        for start in range(0, len(samples), global_batch_size):
            idx = list(range(start, min(start + global_batch_size, len(samples))))
            with profiler.label("policy_step"):
                step = trainer.policy_step(idx, samples, adv.advantages, old, ref)
            if trainer.critic is not None:
                with profiler.label("critic_step"):
                    step |= trainer.critic_step(idx, samples, values, adv.returns)
            for k, v in step.items():
                metrics.setdefault(k, []).append(v)
    # the step's parts (each ends reading its results back, so wall clock is device time): the passes
    # before the optimizer steps (old, reference, values, teacher; advantages) and the steps themselves
    out = {k: sum(v) / len(v) for k, v in metrics.items()} | {
        "train/logprobs_s": t_logprobs, "train/actor_s": time.perf_counter() - t0}
    if "rs_veto_seqs" in metrics:  # a count: the rollout's vetoed sequences, over all its steps
        out["rs_veto_seqs"] = sum(metrics["rs_veto_seqs"])
    if old is not None and not rollout_old:  # else the steps' losses measured it (a token mean over the same tokens)
        mismatch = [abs(a - b) for s, o in zip(samples, old) if s.trainable
                    for a, b, m in zip(o, s.rollout_logprobs, s.loss_mask) if m]
        out["train_rollout_logprob_abs_diff"] = sum(mismatch) / len(mismatch) if mismatch else 0.0
    out.setdefault("train_rollout_logprob_abs_diff", 0.0)
    out["old_logprob_pass"] = 0.0 if reuse or rollout_old else 1.0  # 1: the separate forward ran (several steps, --kl-coef, ...)
    if teacher is not None:  # the reverse KL to the teacher on the trained tokens: a token mean, and a response's
        # sum (the sequence-level KL the loss minimizes; the token mean can rise while it falls, when the student's
        # responses shorten toward the teacher's and keep their high-KL first tokens)
        per_seq = [[o - t for o, t, m in zip(lo, lt, s.loss_mask) if m]
                   for s, lo, lt in zip(samples, old, teacher) if s.trainable]
        tokens, kl_sum = sum(len(k) for k in per_seq), sum(map(sum, per_seq))
        out["opd_reverse_kl"] = kl_sum / tokens if tokens else 0.0
        out["opd_reverse_kl_seq"] = kl_sum / len(per_seq) if per_seq else 0.0
    if getattr(algo, "ref_update_interval", None):
        # slime: after rollout k's training, the reference becomes the policy when (k + 1) % N == 0; the
        # trainer counts its rollouts (a resumed run from the checkpoint's rollout id)
        trainer.rollouts_trained = getattr(trainer, "rollouts_trained", 0) + 1
        out["ref_updated"] = 0.0
        if trainer.rollouts_trained % algo.ref_update_interval == 0:
            trainer.update_reference()
            out["ref_updated"] = 1.0
    if getattr(algo, "overlong_buffer_len", None) is not None:
        penalties = [r - s.reward_value for r, s in zip(shaped_rewards(samples, algo), samples) if s.trainable]
        out["overlong_penalty_mean"] = sum(penalties) / len(penalties) if penalties else 0.0
        out["overlong_frac"] = sum(p < 0 for p in penalties) / len(penalties) if penalties else 0.0
    return out
