"""Fused rotary position embedding for megatron-core's local layer spec (no Transformer Engine).

megatron-core's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`) runs ~11 kernels for
each of q and k in every layer's forward (cos, sin, scale, casts, rotate-half by chunk + neg +
cat, two multiplies, an add, a final cat) and about as many in the backward pass: at a 1.5B
model on packed micro-batches that is ~10k small kernel launches per train step, enough to leave
the GPU idle between them. This Triton kernel does one read and one write per tensor in each
direction, computing cos and sin of the per-token angles in fp32 and rounding once.

Installed as rope_utils' `fused_apply_rotary_pos_emb` / `..._thd` (the names Transformer
Engine fills), so `apply_rope_fusion=True` routes megatron-core's attention here. Covers what
agentrl's families use: rotary over the whole head, not interleaved, no mscale; `install`
declines otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, freqs_ptr, out_ptr, heads, x_stride, x_head_stride, freqs_stride, BACKWARD: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # one program per token: all heads of x[token] ([heads, 2 * HALF]) against freqs[token]
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, HALF)[None, :]
    mask = h < heads
    f1 = tl.load(freqs_ptr + tok * freqs_stride + c)
    f2 = tl.load(freqs_ptr + tok * freqs_stride + HALF + c)
    cos1, sin1, cos2, sin2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
    base = x_ptr + tok * x_stride + h * x_head_stride + c  # q and k are strided views of the fused qkv
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:  # y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    out = out_ptr + (tok * heads + h) * (2 * HALF) + c  # contiguous
    tl.store(out, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [s, b, h, d] (any strides with d contiguous) -> a contiguous tensor of x's shape."""
    shape = x.shape
    rows = x.reshape(-1, shape[-2], shape[-1])  # a view for q/k sliced from the fused qkv
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rope_kernel[(rows.shape[0],)](rows, freqs, out, shape[-2], rows.stride(0), rows.stride(1), freqs.stride(0),
                                       BACKWARD=backward, HALF=shape[-1] // 2,
                                       BLOCK_H=triton.next_power_of_2(shape[-2]), num_warps=4)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(freqs)
        return _launch(x, freqs, backward=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _launch(grad, freqs, backward=True), None


def _per_token(freqs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """freqs [s, 1, 1, d] (or [s, b, 1, d]) -> a contiguous fp32 [s * b, d] row per token of x."""
    s, b = x.shape[0], (x.shape[1] if x.dim() == 4 else 1)
    f = freqs.float().reshape(freqs.shape[0], -1, freqs.shape[-1])
    return f.expand(s, b, f.shape[-1]).reshape(s * b, f.shape[-1]).contiguous()


def apply_rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """t [s, b, h, d], freqs [s, 1 or b, 1, d] (angles)."""
    assert not interleaved and freqs.shape[-1] == t.shape[-1]
    f = _per_token(freqs, t)
    return _Rope.apply(t, f)


def apply_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
                   cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """t [T, h, d]. agentrl passes per-token frequencies (model.enable_position_rope) and one
    segment; a per-sequence layout would need megatron's positions, which this does not rebuild."""
    if freqs.shape[0] != t.shape[0] or cp_size != 1 or interleaved:
        raise NotImplementedError("fused RoPE on packed sequences needs per-token frequencies "
                                  "(model.enable_position_rope), no context parallelism, no interleaving")
    f = freqs.float().reshape(t.shape[0], freqs.shape[-1]).contiguous()
    return _Rope.apply(t.unsqueeze(1), f).squeeze(1)


def install() -> bool:
    """Fills rope_utils' fused-RoPE slots (empty without Transformer Engine) with these kernels.
    True when `apply_rope_fusion` may be switched on."""
    from megatron.core.models.common.embeddings import rope_utils
    if rope_utils.fused_apply_rotary_pos_emb not in (None, apply_rope_bshd):
        return False  # Transformer Engine's are there
    rope_utils.fused_apply_rotary_pos_emb = apply_rope_bshd
    rope_utils.fused_apply_rotary_pos_emb_thd = apply_rope_thd
    return True
