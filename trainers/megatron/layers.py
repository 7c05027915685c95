"""Local-spec modules used when Transformer Engine is absent: a fused attention core and an
RMSNorm that supports sequence parallelism.

SDPAttention: megatron's local `DotProductAttention` materialises the [b, h, s, s] score matrix, so its
memory grows with S^2 (see shared/notes/megatron-on-device.md: 13% -> 31% MFU at 0.5B by
swapping it out). This module takes the same constructor and forward arguments and calls
PyTorch's fused kernels instead:

- padded batches `[s, b, h, d]` -> `scaled_dot_product_attention(is_causal=True, enable_gqa=True)`
  (flash / memory-efficient kernels on CUDA);
- packed sequences (`PackedSeqParams`, qkv_format "thd", `[t, h, d]`) -> on CUDA
  `PACKED_ATTENTION`: "flash", PyTorch's flash varlen kernel (the op behind
  `torch.nn.attention.varlen.varlen_attn`), or "cudnn", cuDNN's fused attention over the same
  ragged layout (the backend varlen_attn has but leaves switched off); else one causal SDPA
  call per sequence (also the CPU path). Both kernels take fewer key/value heads than query
  heads (GQA) as they are; `varlen_attn` has no `enable_gqa`, so calling it means repeating
  k and v per query head (6x at Qwen2.5-1.5B) and summing their gradients back.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except Exception:  # older torch
    _varlen_attn, _VARLEN_PARAMS = None, set()

PACKED_ATTENTION = "flash"  # or "cudnn" (bench/megatron_bench.py --attention-impls compares them)
NATIVE_GQA = True  # k/v go to the kernel with their own head count (False: repeated per query head)
_varlen_broken = False  # set once if the varlen kernel refuses these inputs; then the loop is used


class SDPAttention(torch.nn.Module):
    """Drop-in for `submodules.self_attention.submodules.core_attention` (causal self-attention)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_ignored):
        super().__init__()
        self.config = config
        if config.context_parallel_size > 1 and cp_comm_type not in (None, "all_gather"):
            raise NotImplementedError(f"--cp-comm-type {cp_comm_type}: the local attention core does context "
                                      "parallelism by all-gathering K/V only (all_gather)")
        kv_channels = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else (
            config.softmax_scale if getattr(config, "softmax_scale", None) else 1.0 / math.sqrt(kv_channels))
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_ignored):
        p = self.dropout if self.training else 0.0
        share = getattr(packed_seq_params, "cp_share", None)
        if share is not None:  # context parallelism (context_parallel.py)
            out = self._context_parallel(query, key, value, share, p)
            return out.reshape(out.shape[0], -1)
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism in the local attention core needs packed micro-batches "
                                      "split by context_parallel.split (PackedSeqParams.cp_share)")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._packed(query, key, value, packed_seq_params, p)  # [t, h, d]
            return out.reshape(out.shape[0], -1)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = _sdpa(q, k, v, p, self.scale)  # [b, h, s, d]
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(self, q, k, v, params, p: float):
        global _varlen_broken
        cu = params.cu_seqlens_q  # the sequences (cu_seqlens_q_padded may hold RoPE's one segment: see model.py)
        if q.is_cuda and _varlen_attn is not None and not _varlen_broken and p == 0.0:
            try:
                return _varlen(q, k, v, cu, int(params.max_seqlen_q), self.scale)
            except (RuntimeError, TypeError, NotImplementedError) as exc:  # no kernel for this dtype/arch
                if PACKED_ATTENTION != "flash":  # chosen on purpose: say it failed
                    raise
                _varlen_broken = True
                import warnings
                warnings.warn(f"varlen_attn unavailable ({exc}); packed attention falls back to per-sequence SDPA")
        bounds = cu.tolist()
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e == s:
                continue
            qi, ki, vi = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, L, d]
            outs.append(_sdpa(qi, ki, vi, p, self.scale)[0].transpose(0, 1))  # [L, h, d]
        return torch.cat(outs, dim=0)

    def _context_parallel(self, q, k, v, share, p: float):
        from agentrl.trainers.megatron.context_parallel import attention

        def attend(qh, kh, vh, cu_q, cu_k, max_q, max_k):
            if qh.is_cuda and p == 0.0 and _varlen_attn is not None:  # its op, torch_attn::_varlen_attn
                return _varlen_prefix(qh, kh, vh, cu_q, cu_k, max_q, max_k, self.scale)
            return _prefix_loop(qh, kh, vh, cu_q, cu_k, p, self.scale)

        return attention(q, k, v, share, attend)


def _varlen_prefix(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """Flash varlen over (query chunk, key prefix) pairs; its causal mask is aligned bottom-right
    when a pair's query and key lengths differ, which is what a chunk ending its prefix needs."""
    global NATIVE_GQA
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    if q.shape[1] != k.shape[1] and not NATIVE_GQA:
        k, v = _repeat_kv(k, v, q.shape[1])
    try:
        return torch.ops.torch_attn._varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, True, scale, [-1, 0])[0]
    except RuntimeError:
        if q.shape[1] == k.shape[1]:
            raise
        NATIVE_GQA = False  # a kernel that wants equal head counts
        k, v = _repeat_kv(k, v, q.shape[1])
        return torch.ops.torch_attn._varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, True, scale, [-1, 0])[0]


def _prefix_loop(q, k, v, cu_q, cu_k, p: float, scale: float):
    """The same, one SDPA call per pair with an explicit bottom-right causal mask (CPU)."""
    outs = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for (sq, eq), (sk, ek) in zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:])):
        if eq == sq:
            continue
        lq, lk = eq - sq, ek - sk
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)  # query i sees keys <= lk-lq+i
        qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q[sq:eq], k[sk:ek], v[sk:ek]))  # [1, h, L, d]
        if ki.shape[1] != qi.shape[1]:
            rep = qi.shape[1] // ki.shape[1]
            ki, vi = ki.repeat_interleave(rep, dim=1), vi.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, dropout_p=p, scale=scale)[0]
                    .transpose(0, 1))
    return torch.cat(outs, dim=0)


def _sdpa(q, k, v, p, scale):
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scale, enable_gqa=True)
        except (TypeError, RuntimeError):
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scale)


def _varlen(q, k, v, cu, max_len: int, scale: float):
    global NATIVE_GQA
    cu = cu.to(torch.int32)
    if PACKED_ATTENTION == "cudnn":
        if not NATIVE_GQA and q.shape[1] != k.shape[1]:
            k, v = _repeat_kv(k, v, q.shape[1])
        return _CudnnVarlen.apply(q, k, v, cu, max_len, scale)
    if NATIVE_GQA and q.shape[1] != k.shape[1] and hasattr(torch.ops.torch_attn, "_varlen_attn"):
        try:  # varlen_attn's own op (its autograd included), causal, with k/v unrepeated
            return torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, max_len, max_len, True, scale, [-1, 0])[0]
        except RuntimeError as exc:  # a kernel that wants equal head counts: repeat k/v from now on
            NATIVE_GQA = False
            import warnings
            warnings.warn(f"flash varlen refused {k.shape[1]} key/value heads for {q.shape[1]} query heads ({exc}); "
                          "repeating them")
    kwargs = {"scale": scale}
    if "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, v, q.shape[1])
    return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _repeat_kv(k, v, heads: int):
    rep = heads // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class _CudnnVarlen(torch.autograd.Function):
    """Causal attention over packed sequences `[t, h, d]` (cu_seqlens `cu`) by cuDNN's fused
    kernels, through the aten ops varlen_attn's (switched-off) cuDNN branch would call. Arguments
    go by the ops' schema names: torch 2.11's own positional call to the backward has them in an
    older order (philox state before attn_bias now)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):
        out, lse, _cu_q, _cu_k, _max_q, _max_k, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            **cudnn_forward_args(q, k, v, cu, max_len, scale))
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            **cudnn_backward_args(grad_out.contiguous(), q, k, v, out, lse, seed, offset, cu, ctx.max_len, ctx.scale))
        return dq, dk, dv, None, None, None


def cudnn_forward_args(q, k, v, cu, max_len: int, scale: float) -> dict:
    return dict(query=q, key=k, value=v, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=max_len, max_k=max_len,
                compute_log_sumexp=True, dropout_p=0.0, is_causal=True, return_debug_mask=False, scale=scale)


def cudnn_backward_args(grad_out, q, k, v, out, lse, seed, offset, cu, max_len: int, scale: float) -> dict:
    return dict(grad_out=grad_out, query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed,
                philox_offset=offset, attn_bias=q.new_empty(0), cum_seq_q=cu, cum_seq_k=cu, max_q=max_len,
                max_k=max_len, dropout_p=0.0, is_causal=True, scale=scale)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as HF's Qwen2/Qwen3/Llama RMSNorm does (in fp32, cast back, then scaled),
    so logprobs match the HF model; on CUDA PyTorch's fused rms_norm (the same math in fp32,
    rounded once at the end). Unlike megatron-core's WrappedTorchNorm it allows
    sequence parallelism: the weight is tagged `sequence_parallel`, so
    `finalize_model_grads` all-reduces its gradient over the TP group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_ignored):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype,
                                                    device="cpu" if config.use_cpu_initialization else None))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        if x.is_cuda:  # one fused kernel (fp32 inside, one rounding instead of HF's two)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
