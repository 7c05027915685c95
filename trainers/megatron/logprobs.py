"""Log-probabilities and entropies of chosen tokens from vocab-parallel logits, chunked and
recomputed, so memory stays at the logits themselves.

A straightforward `log_softmax(logits.float() / T)` keeps [N, V] fp32 tensors alive for the
backward pass (two of them with entropy): at N = 16k response tokens and a 152k vocabulary
that is ~10 GB each. `fused_logprobs` reads the (bf16) logits chunk by chunk in fp32, keeps
only per-row statistics (log-sum-exp, entropy), and recomputes each chunk's softmax in the
backward pass, writing the gradient straight into a tensor shaped like the logits. On CUDA
the per-row work runs as the Triton kernels of logprob_kernels.py (one read of each row
forward, one read and write backward); elsewhere as the torch chunk loop below.

Tensor parallelism: each rank holds a vocab slice; the slices' log-sum-exps are all-gathered
and the target logit and the entropy's weighted sum all-reduced over the TP group in the
forward pass; the backward pass needs no communication (each rank's gradient is its slice's).
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 2048


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, targets, temperature, vocab_start, vocab_valid, with_entropy, group):
        # logits: [T, Vp] (this rank's slice, any float dtype); rows: [N] rows of logits to use;
        # targets: [N] global token ids; vocab_valid: how many of this slice's columns are real.
        # One pass over the logits (Triton kernels or the chunk loop): this slice's log-sum-exp, the
        # target's logit and the slice's softmax-weighted mean logit; slices are combined after it.
        import torch.distributed as dist

        n, dev = rows.numel(), logits.device
        local_t = targets - vocab_start
        kernels = _kernels(logits, vocab_valid)
        stats = kernels.forward_stats if kernels is not None else _forward_stats
        lse, picked, mean_x = stats(logits, rows, local_t, temperature, vocab_valid, with_entropy)
        tp = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
        if tp > 1:
            every = torch.empty(tp * n, dtype=torch.float32, device=dev)
            dist.all_gather_into_tensor(every, lse, group=group)
            total = torch.logsumexp(every.view(tp, n), dim=0)
            if with_entropy:
                mean_x = mean_x * (lse - total).exp()  # this slice's share of the softmax mass
                dist.all_reduce(mean_x, group=group)
            dist.all_reduce(picked, group=group)
            lse = total
        logp = picked - lse
        entropy = (lse - mean_x) if with_entropy else None
        ctx.save_for_backward(logits, rows, local_t, lse, entropy if with_entropy else lse)
        ctx.meta = (temperature, vocab_valid, with_entropy)
        return logp, entropy if with_entropy else logp.new_zeros(n)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, rows, local_t, lse, entropy = ctx.saved_tensors
        temperature, vocab_valid, with_entropy = ctx.meta
        grad = torch.zeros_like(logits)
        kernels = _kernels(logits, vocab_valid)
        if kernels is not None:
            kernels.backward_into(grad, logits, rows, local_t, lse, entropy if with_entropy else None, g_logp,
                                  g_ent if with_entropy else None, temperature, vocab_valid)
            return grad, None, None, None, None, None, None, None
        part, n = logits.shape[-1], rows.numel()
        inside = (local_t >= 0) & (local_t < vocab_valid)
        for s in range(0, n, CHUNK_ROWS):
            e = slice(s, s + CHUNK_ROWS)
            x = _chunk(logits, rows[e], temperature, vocab_valid)
            logp_all = x - lse[e, None]
            p = logp_all.exp()  # 0 on padding columns
            # d logp_t / dx_j = 1[j = t] - p_j
            gx = -p * g_logp[e, None]
            idx = local_t[e].clamp(0, part - 1)
            gx.scatter_add_(-1, idx[:, None], (g_logp[e] * inside[e])[:, None])
            if with_entropy:
                # dH/dx_j = -p_j (log p_j + H)
                gx -= g_ent[e, None] * p * (logp_all.masked_fill(torch.isinf(logp_all), 0.0) + entropy[e, None])
            grad[rows[e]] = (gx / temperature).to(grad.dtype)
        return grad, None, None, None, None, None, None, None


USE_TRITON = True  # on CUDA; False forces the torch chunk loop (set when Triton does not import; benches A/B it)


def _kernels(logits, vocab_valid):
    """The Triton kernels module for CUDA logits when Triton imports, else None (torch loop)."""
    global USE_TRITON
    if not logits.is_cuda or USE_TRITON is False or logits.stride(-1) != 1 or vocab_valid == 0:
        return None
    try:
        from agentrl.trainers.megatron import logprob_kernels
    except ImportError:
        USE_TRITON = False
        return None
    return logprob_kernels


def _forward_stats(logits, rows, local_t, temperature, vocab_valid, with_entropy):
    """The torch version of logprob_kernels.forward_stats: chunk by chunk in fp32."""
    n, part = rows.numel(), logits.shape[-1]
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    picked = torch.zeros_like(lse)
    mean_x = torch.zeros_like(lse) if with_entropy else None
    inside = (local_t >= 0) & (local_t < vocab_valid)
    for s in range(0, n, CHUNK_ROWS):
        e = slice(s, s + CHUNK_ROWS)
        x = _chunk(logits, rows[e], temperature, vocab_valid)
        m = x.max(dim=-1, keepdim=True).values
        ex = (x - m).exp()
        se = ex.sum(-1)
        lse[e] = m.squeeze(-1) + se.log()
        idx = local_t[e].clamp(0, part - 1)
        picked[e] = x.gather(-1, idx[:, None]).squeeze(-1) * inside[e]
        if with_entropy:
            mean_x[e] = (ex * x.masked_fill(torch.isinf(x), 0.0)).sum(-1) / se
    return lse, picked, mean_x


def _chunk(logits, rows, temperature, vocab_valid):
    x = logits.index_select(0, rows).float() / temperature
    if vocab_valid < x.shape[-1]:
        x[:, vocab_valid:] = float("-inf")
    return x


def fused_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   vocab_size: int, tp_group=None, tp_rank: int = 0, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) at `rows` of vocab-parallel `logits` [T, V/tp],
    scaled by 1/temperature; vocab ids >= vocab_size (padding) are left out. Differentiable
    with respect to logits; fp32 results [N]."""
    part = logits.shape[-1]
    start = tp_rank * part
    valid = max(0, min(part, vocab_size - start))
    logp, ent = _FusedLogprobs.apply(logits, rows, targets, float(temperature), start, valid, with_entropy, tp_group)
    return logp, (ent if with_entropy else None)


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_group, tp_rank: int,
                       *, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain-autograd version of fused_logprobs (kept as its test reference; holds [N, V] fp32
    tensors for the backward pass). log p(target) and (optionally) the entropy per row.
    logits: [N, V/tp] float (this rank's vocab slice); targets: [N] global ids. Differentiable.
    Padded vocab rows (ids >= vocab_size) are excluded from the softmax."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    part = logits.shape[-1]
    start = tp_rank * part
    if start + part > vocab_size:  # this rank holds padding columns
        valid = max(0, vocab_size - start)
        logits = torch.cat([logits[:, :valid], torch.full_like(logits[:, valid:], float("-inf"))], dim=-1)
    if tp == 1 and not with_entropy:
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        return logp, None
    if not with_entropy:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        return -vocab_parallel_cross_entropy(logits[:, None, :].clone(), targets[:, None]).squeeze(1), None
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def tp_sum(x):
        return reduce_from_tensor_model_parallel_region(x) if tp > 1 else x

    with torch.no_grad():
        m = logits.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    # Every all-reduced value is used identically on all TP ranks (reduce_from_... has an identity
    # backward, right only for replicated uses): H = log Z - (sum_v e^s_v s_v) / Z, s = logits - max.
    shifted = logits - m[:, None]
    exp = shifted.exp()
    z = tp_sum(exp.sum(-1))
    lse = z.log()
    local = targets - start
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1)[:, None]).squeeze(-1) * inside
    logp = tp_sum(picked) - lse
    weighted = tp_sum((exp * shifted.masked_fill(torch.isinf(shifted), 0.0)).sum(-1))
    entropy = lse - weighted / z
    return logp, entropy
