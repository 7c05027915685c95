"""Triton kernels for `logprobs.fused_logprobs` on CUDA: one read of each logits row in the
forward pass and one read + one write in the backward pass.

The torch chunk loop in logprobs.py makes ~6 passes over a fp32 copy of every chunk in the
forward pass (cast, scale, max, exp, sum, gather) and ~9 in the backward pass: at a 152k
vocabulary that was a large share of a 1.5B model's train step (bench/results/megatron.md).
Here one program handles one row: the forward pass keeps an online (running-max) log-sum-exp
and, for the entropy, the softmax-weighted sum of the logits, per lane, and merges the lanes
at the end; the backward pass writes d/dlogits of (g_logp * logp + g_ent * entropy) in the
logits' dtype. Same math as the torch path, in fp32, reading the logits in their own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _forward_kernel(logits_ptr, stride, rows_ptr, targets_ptr, lse_ptr, picked_ptr, mean_ptr,
                    temperature, vocab_valid: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    base = logits_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running max
    s = tl.zeros([BLOCK], tl.float32)  # sum of exp(x - m)
    w = tl.zeros([BLOCK], tl.float32)  # sum of exp(x - m) * x (entropy only)
    for start in range(0, vocab_valid, BLOCK):
        cols = start + lanes
        inside = cols < vocab_valid
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) / temperature
        new_m = tl.maximum(m, x)
        # a lane that has seen only padding keeps m = -inf: no rescale there (exp(-inf + inf) is nan)
        alpha = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
        e = tl.where(inside, tl.exp(x - new_m), 0.0)
        s = s * alpha + e
        if WITH_ENTROPY:
            w = w * alpha + e * tl.where(inside, x, 0.0)
        m = new_m
    top = tl.max(m, 0)
    scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    total = tl.sum(s * scale, 0)
    tl.store(lse_ptr + i, top + tl.log(total))
    t = tl.load(targets_ptr + i)  # this slice's column of the target, or outside [0, vocab_valid)
    here = (t >= 0) & (t < vocab_valid)
    xt = tl.load(base + tl.where(here, t, 0).to(tl.int64)).to(tl.float32) / temperature
    tl.store(picked_ptr + i, tl.where(here, xt, 0.0))
    if WITH_ENTROPY:
        tl.store(mean_ptr + i, tl.sum(w * scale, 0) / total)


@triton.jit
def _backward_kernel(logits_ptr, grad_ptr, stride, grad_stride, rows_ptr, targets_ptr, lse_ptr, entropy_ptr,
                     g_logp_ptr, g_ent_ptr, temperature, vocab_valid: tl.constexpr, n_cols: tl.constexpr,
                     WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    base = logits_ptr + row * stride
    out = grad_ptr + row * grad_stride
    lse = tl.load(lse_ptr + i)
    g = tl.load(g_logp_ptr + i)
    t = tl.load(targets_ptr + i)
    if WITH_ENTROPY:
        g_ent = tl.load(g_ent_ptr + i)
        h = tl.load(entropy_ptr + i)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        inside = cols < vocab_valid
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) / temperature
        logp = x - lse
        p = tl.where(inside, tl.exp(logp), 0.0)
        # d logp_t / dx_j = 1[j = t] - p_j;  dH/dx_j = -p_j (log p_j + H)
        gx = tl.where(cols == t, g, 0.0) - p * g
        if WITH_ENTROPY:
            gx -= g_ent * p * (logp + h)
        tl.store(out + cols, (gx / temperature).to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


def forward_stats(logits: torch.Tensor, rows: torch.Tensor, local_targets: torch.Tensor, temperature: float,
                  vocab_valid: int, with_entropy: bool):
    """Per row of `rows`: this slice's log-sum-exp, the target's logit (0 where the target is in
    another slice) and, with entropy, the softmax-weighted mean logit. All fp32 [N]."""
    assert logits.stride(-1) == 1 and vocab_valid > 0
    n = rows.numel()
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    picked = torch.empty_like(lse)
    mean_x = torch.empty_like(lse) if with_entropy else lse
    if n:
        _forward_kernel[(n,)](logits, logits.stride(0), rows, local_targets, lse, picked, mean_x,
                              float(temperature), int(vocab_valid), WITH_ENTROPY=with_entropy, BLOCK=BLOCK,
                              num_warps=8)
    return lse, picked, (mean_x if with_entropy else None)


def backward_into(grad: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, local_targets: torch.Tensor,
                  lse: torch.Tensor, entropy: torch.Tensor | None, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                  temperature: float, vocab_valid: int) -> None:
    """Writes the gradient of rows `rows` of `grad` (shaped like logits); other rows are untouched."""
    n = rows.numel()
    if not n:
        return
    with_entropy = entropy is not None
    _backward_kernel[(n,)](logits, grad, logits.stride(0), grad.stride(0), rows, local_targets, lse,
                           entropy if with_entropy else lse, g_logp.float().contiguous(),
                           (g_ent.float().contiguous() if with_entropy else lse), float(temperature),
                           int(vocab_valid), logits.shape[-1], WITH_ENTROPY=with_entropy, BLOCK=BLOCK, num_warps=8)
