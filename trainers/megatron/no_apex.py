"""What Apex (or Transformer Engine) gives megatron-core, from PyTorch alone.

1. Gradient-accumulation fusion. With `gradient_accumulation_fusion`, megatron-core's linear layers add each micro-batch's
weight gradient straight into the parameter's fp32 `main_grad` with one GEMM (C += dY^T X,
fp32 output) through Apex's `fused_weight_gradient_mlp_cuda`. Without it, every linear layer's
backward writes a bf16 gradient tensor and Megatron's DDP hook then adds it into `main_grad`:
one more kernel, allocation and Python hook per weight per micro-batch. PyTorch's
`addmm(..., out_dtype=torch.float32)` runs the same GEMM on CUDA (bf16 inputs, fp32
accumulate and output, beta = 1 in place), so this module stands in for Apex's under its name.

2. Multi-tensor ops. Without Apex, megatron-core's grad-norm fallback takes one norm per
parameter and reads each back to the host (~200 host syncs per optimizer step at 1.5B), and its
master-to-model weight copy is a Python loop. torch's foreach ops do both on the GPU in a few
launches.
"""

from __future__ import annotations

import sys

import torch

APEX_NAME = "fused_weight_gradient_mlp_cuda"


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    main_grad.addmm_(g.t(), x)


def _works() -> bool:
    """addmm with out_dtype exists on this torch and CUDA device, and accumulates in place."""
    try:
        g = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda", dtype=torch.bfloat16)
        acc = torch.ones(2, 2, device="cuda")
        wgrad_gemm_accum_fp32(g, g, acc)
        return torch.equal(acc, torch.tensor([[11.0, 15.0], [15.0, 21.0]], device="cuda"))
    except (RuntimeError, TypeError):
        return False


def install_wgrad_fusion() -> bool:
    """Makes megatron-core's linear layers find a `fused_weight_gradient_mlp_cuda` (Apex's if
    installed, else this module). True when gradient_accumulation_fusion can be switched on."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (Apex's own)
        return True
    except ImportError:
        pass
    if not torch.cuda.is_available() or not _works():
        return False
    shim = sys.modules[__name__]
    sys.modules[APEX_NAME] = shim
    from megatron.core.tensor_parallel import layers  # it looked for Apex when it was imported
    layers.fused_weight_gradient_mlp_cuda = shim
    layers._grad_accum_fusion_available = True
    return True


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Apex's multi_tensor_l2norm through megatron's applier: the norm of all tensors, on device."""
    tensors = [t for group in tensor_lists for t in group]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_copy(this: list[torch.Tensor], that: list[torch.Tensor], overflow_buf=None) -> None:
    """megatron's _multi_tensor_copy_this_to_that (fp32 master -> bf16 model weights)."""
    if this:
        torch._foreach_copy_(that, this)


def install_multi_tensor_ops() -> bool:
    """Swaps megatron-core's Python fallbacks for the foreach versions; only where they are the
    fallbacks (Apex or TE present: left as they are). True when swapped."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    if clip_grads.l2_norm_impl not in (utils.local_multi_tensor_l2_norm, foreach_l2_norm):
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    if optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        optimizer._multi_tensor_copy_this_to_that = foreach_copy
    return True
