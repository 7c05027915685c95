"""Megatron's gradient-accumulation fusion without Apex.

With `gradient_accumulation_fusion`, megatron-core's linear layers add each micro-batch's
weight gradient straight into the parameter's fp32 `main_grad` with one GEMM (C += dY^T X,
fp32 output) through Apex's `fused_weight_gradient_mlp_cuda`. Without it, every linear layer's
backward writes a bf16 gradient tensor and Megatron's DDP hook then adds it into `main_grad`:
one more kernel, allocation and Python hook per weight per micro-batch. PyTorch's
`addmm(..., out_dtype=torch.float32)` runs the same GEMM on CUDA (bf16 inputs, fp32
accumulate and output, beta = 1 in place), so this module stands in for Apex's under its name.
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


def install() -> bool:
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
