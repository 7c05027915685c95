"""The Megatron trainer's Triton kernels, run by Triton's interpreter on CPU (TRITON_INTERPRET=1):
the logprob kernels (logprob_kernels.py) against plain log_softmax autograd in float64 and the
torch chunk loop they replace on CUDA; the fused RoPE (rope_kernels.py) against megatron-core's
unfused RoPE. tests/gpu/test_kernels_gpu.py runs them compiled on a GPU at real sizes."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where no GPU is
    pytest.skip("Triton's interpreter is off (a GPU machine): tests/gpu/test_kernels_gpu.py runs the kernels",
                allow_module_level=True)


@pytest.fixture
def kernels(monkeypatch):
    """logprob_kernels with small blocks (several per row, the last one partial), and
    fused_logprobs routed to it whatever the device."""
    from agentrl.trainers.megatron import logprobs

    from agentrl.trainers.megatron import logprob_kernels as mod
    monkeypatch.setattr(mod, "BLOCK", 16)
    monkeypatch.setattr(logprobs, "_kernels", lambda logits, vocab_valid: mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_kernels_equal_plain_autograd(kernels, dtype, padded):
    from agentrl.trainers.megatron import logprobs as lp

    g = torch.Generator().manual_seed(1)
    vocab = 37 if padded else 40  # 40 columns: 3 blocks of 16, the last partial
    logits = (torch.randn(50, 40, generator=g) * 3).to(dtype)
    rows = torch.randperm(50, generator=g)[:33]
    targets = torch.randint(0, vocab, (33,), generator=g)
    w1, w2 = torch.randn(33, generator=g), torch.randn(33, generator=g)
    a = logits.clone().requires_grad_(True)
    logp, ent = lp.fused_logprobs(a, rows, targets, temperature=0.7, vocab_size=vocab, with_entropy=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()

    b = logits.double().requires_grad_(True)
    ref_logp, ref_ent = lp.reference_logprobs(b[rows] / 0.7, targets, vocab, None, 0, with_entropy=True)
    ((ref_logp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    # the kernel writes the gradient in the logits' dtype: bf16 keeps 8 bits of mantissa
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=8e-3)
    assert a.grad.dtype == dtype
    torch.testing.assert_close(a.grad.double(), b.grad, **tol)
    assert (a.grad[~torch.isin(torch.arange(50), rows)] == 0).all()


def test_logprobs_without_entropy_and_targets_of_another_slice(kernels):
    """The last tensor-parallel rank's view: targets outside this slice pick nothing (the all-reduce adds
    the owner's); the statistics equal the torch loop's, and so does the gradient."""
    from agentrl.trainers.megatron import logprobs as lp

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(20, 48, generator=g) * 2
    rows = torch.arange(3, 17)
    # the last slice (the one with padding columns): other slices' targets are below it
    local = torch.randint(-90, 45, (14,), generator=g)
    for with_entropy in (False, True):
        ours = kernels.forward_stats(logits, rows, local, 1.3, 45, with_entropy)
        torch_loop = lp._forward_stats(logits, rows, local, 1.3, 45, with_entropy)
        for x, y in zip(ours, torch_loop):
            if y is not None:
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-6)
    lse = torch_loop[0]
    g_logp = torch.randn(14, generator=g)
    grad = torch.full_like(logits, float("nan"))
    kernels.backward_into(grad, logits, rows, local, lse, None, g_logp, None, 1.3, 45)
    x = logits[rows] / 1.3
    x[:, 45:] = float("-inf")
    p = (x - lse[:, None]).exp()
    expect = -p * g_logp[:, None]
    inside = (local >= 0) & (local < 45)
    expect[inside, local[inside]] += g_logp[inside]
    torch.testing.assert_close(grad[rows], expect / 1.3, atol=1e-6, rtol=1e-5)  # every column written
    assert grad[:3].isnan().all() and grad[17:].isnan().all()  # other rows left alone


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_fused_rope_equals_megatron_unfused(layout):
    """Values and gradients of q/k after RoPE, per-token angles as agentrl passes them (thd, one
    segment) and a padded [s, b, h, d] batch; 3 heads (the kernel's head block is padded to 4)."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from agentrl.trainers.megatron import rope_kernels as rope
    g = torch.Generator().manual_seed(3)
    shape = (40, 3, 16) if layout == "thd" else (10, 2, 3, 16)
    # a strided view, as q is of the fused qkv projection (5 heads' worth per token, 3 taken)
    x = torch.randn(*shape[:-2], 5, 16, generator=g)[..., 1:4, :]
    angles = torch.rand(shape[0], 1, 1, 8, generator=g) * 50
    freqs = torch.cat([angles, angles], dim=-1)  # megatron's layout: the half-width angles twice
    w = torch.randn(*shape, generator=g)

    assert not x.is_contiguous()
    a = x.detach().requires_grad_(True)
    if layout == "thd":
        ours = rope.apply_rope_thd(a, torch.tensor([0, shape[0]], dtype=torch.int32), freqs)
    else:
        ours = rope.apply_rope_bshd(a, freqs)
    (ours * w).sum().backward()
    b = x.detach().clone().requires_grad_(True)
    ref = _apply_rotary_pos_emb_bshd(b if layout == "bshd" else b[:, None], freqs)
    ref = ref if layout == "bshd" else ref[:, 0]
    (ref * w).sum().backward()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
