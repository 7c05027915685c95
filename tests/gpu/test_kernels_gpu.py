"""The Megatron trainer's GPU kernels compiled on a GPU at Qwen2.5-1.5B's sizes: the Triton
logprob kernels (padded 152k vocabulary) against the torch chunk loop they replace and float64
autograd; the fused RoPE against megatron-core's unfused RoPE; the Apex-free wgrad accumulation
(no_apex.py) against an fp64 GEMM. Each faster than what it replaces. Figures go to
$AGENTRL_GPU_OUT/kernels_*.json. Needs torch, Triton and (RoPE) megatron-core; no kit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gpu_helpers import needs_gpus

pytestmark = needs_gpus(1, "needs CUDA")


def _fwd_bwd(lp, logits, rows, targets, w1, w2, vocab):
    x = logits.detach().requires_grad_(True)
    logp, ent = lp.fused_logprobs(x, rows, targets, temperature=0.9, vocab_size=vocab, with_entropy=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _save(name: str, figures: dict) -> None:
    figures["device"] = torch.cuda.get_device_name()
    out = Path(os.environ.get("AGENTRL_GPU_OUT", "/tmp/agentrl-gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernels_{name}.json").write_text(json.dumps(figures, indent=1))
    print(name.upper(), json.dumps(figures))


def _time_ms(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat + 1):  # the first compiles / warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[1:])[len(times[1:]) // 2]


def test_logprob_kernels_match_the_torch_loop_and_float64():
    from agentrl.trainers.megatron import logprobs as lp

    torch.manual_seed(0)
    tokens, padded_vocab, vocab = 8192, 151936, 151665  # Qwen2.5: 151,665 real ids, padded to 151,936
    logits = (torch.randn(tokens, padded_vocab, device="cuda") * 2).to(torch.bfloat16)
    rows = torch.randperm(tokens, device="cuda")[:6000].sort().values
    targets = torch.randint(0, vocab, (6000,), device="cuda")
    w1, w2 = torch.randn(6000, device="cuda"), torch.randn(6000, device="cuda")
    results = {}
    try:
        for impl in ("torch", "triton"):
            lp.USE_TRITON = impl == "triton"
            results[impl] = _fwd_bwd(lp, logits, rows, targets, w1, w2, vocab)
            results[impl + "_ms"] = _time_ms(lambda: _fwd_bwd(lp, logits, rows, targets, w1, w2, vocab))
            with torch.no_grad():
                results[impl + "_forward_ms"] = _time_ms(lambda: lp.fused_logprobs(
                    logits, rows, targets, temperature=0.9, vocab_size=vocab))
    finally:
        lp.USE_TRITON = True
    assert lp._kernels(logits, vocab) is not None, "Triton did not load: the kernels were not tested"
    (t_logp, t_ent, t_grad), (k_logp, k_ent, k_grad) = results["torch"], results["triton"]
    torch.testing.assert_close(k_logp, t_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k_ent, t_ent, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k_grad.float(), t_grad.float(), atol=1e-7, rtol=1.6e-2)  # one bf16 rounding apart
    untouched = torch.ones(tokens, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert (k_grad[untouched] == 0).all() and (k_grad[:, vocab:] == 0).all()

    few = slice(0, 64)  # float64 autograd on a few rows
    x = logits[rows[few]].double().requires_grad_(True)
    ref_logp, ref_ent = lp.reference_logprobs(x / 0.9, targets[few], vocab, None, 0, with_entropy=True)
    ((ref_logp * w1[few].double()).sum() + (ref_ent * w2[few].double()).sum()).backward()
    torch.testing.assert_close(k_logp[few].double(), ref_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k_ent[few].double(), ref_ent, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k_grad[rows[few]].double(), x.grad.to(torch.bfloat16).double(), atol=1e-7, rtol=1.6e-2)

    figures = {k: v for k, v in results.items() if k.endswith("_ms")}
    figures.update(rows=6000, vocab=padded_vocab,
                   speedup_forward_backward=figures["torch_ms"] / figures["triton_ms"],
                   speedup_forward=figures["torch_forward_ms"] / figures["triton_forward_ms"])
    _save("logprobs", figures)
    assert figures["triton_ms"] < figures["torch_ms"]


def test_fused_rope_matches_megatron_unfused_and_is_faster():
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from agentrl.trainers.megatron import rope_kernels

    torch.manual_seed(0)
    tokens, heads, d = 16384, 12, 128
    x = torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16)
    angles = torch.arange(tokens, device="cuda").float()[:, None] * (1e6 ** (-torch.arange(0, d, 2, device="cuda") / d))
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # positions 0..T-1, Qwen's base
    w = torch.randn_like(x)

    def ours():
        a = x.clone().requires_grad_(True)
        y = rope_kernels.apply_rope_thd(a, None, freqs)
        (y * w).sum().backward()
        return y.detach(), a.grad

    def unfused(dtype=torch.bfloat16):
        b = x.detach().to(dtype).clone().requires_grad_(True)
        y = _apply_rotary_pos_emb_bshd(b[:, None], freqs.to(torch.float64) if dtype == torch.float64 else freqs)[:, 0]
        (y * w.to(dtype)).sum().backward()
        return y.detach(), b.grad

    (y, gx), (y_ref, g_ref), (y64, g64) = ours(), unfused(), unfused(torch.float64)
    err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    figures = {"ours_vs_fp64": err(y, y64), "megatron_unfused_vs_fp64": err(y_ref, y64),
               "grad_ours_vs_fp64": err(gx, g64), "grad_megatron_unfused_vs_fp64": err(g_ref, g64),
               "ours_ms": _time_ms(ours), "megatron_unfused_ms": _time_ms(unfused), "tokens": tokens, "heads": heads}
    _save("rope", figures)
    # one bf16 rounding (ours) against megatron's several: at least as close to float64
    assert figures["ours_vs_fp64"] <= figures["megatron_unfused_vs_fp64"] + 1e-4 < 1e-2
    assert figures["grad_ours_vs_fp64"] <= figures["grad_megatron_unfused_vs_fp64"] + 1e-4 < 1e-2
    assert figures["ours_ms"] < figures["megatron_unfused_ms"]


def test_wgrad_accumulates_in_place_in_fp32():
    from agentrl.trainers.megatron import no_apex

    torch.manual_seed(0)
    x = torch.randn(4, 4096, 1536, device="cuda", dtype=torch.bfloat16)  # [b, s, in] as megatron passes it
    g = torch.randn(4, 4096, 8960, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(8960, 1536, device="cuda")
    want = main_grad.double() + g.reshape(-1, 8960).double().t() @ x.reshape(-1, 1536).double()
    ptr = main_grad.data_ptr()
    no_apex.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert main_grad.data_ptr() == ptr and main_grad.dtype == torch.float32
    rel = ((main_grad.double() - want).norm() / want.norm()).item()

    def fused():
        no_apex.wgrad_gemm_accum_fp32(x, g, main_grad)

    def unfused():  # what megatron does without the fusion: a bf16 weight gradient, then add_
        main_grad.add_(g.reshape(-1, 8960).t().matmul(x.reshape(-1, 1536)))

    figures = {"relative_error_vs_fp64": rel, "fused_ms": _time_ms(fused), "unfused_ms": _time_ms(unfused)}
    _save("wgrad", figures)
    assert rel < 1e-4  # fp32 accumulation (a bf16 product would be ~1e-3 off)


def _packed(lengths, heads, kv_heads, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    q, k, v, w = (torch.randn(t, h, d, device="cuda", generator=g).to(torch.bfloat16)
                  for h in (heads, kv_heads, kv_heads, heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q, k, v, w, cu, max(lengths)


def _attention(impl: str, native_gqa: bool, q, k, v, w, cu, max_len):
    from agentrl.trainers.megatron import layers

    layers.PACKED_ATTENTION, layers.NATIVE_GQA = impl, native_gqa
    a, b, c = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = layers._varlen(a, b, c, cu, max_len, q.shape[-1] ** -0.5)
    (out.float() * w.float()).sum().backward()
    return out.detach(), a.grad, b.grad, c.grad


def test_packed_attention_kernels_match_float32_and_their_speed():
    """Packed causal attention at Qwen2.5-1.5B's heads (12 query, 2 key/value, d 128): PyTorch's
    flash varlen with k/v repeated per query head (the old path), the same kernel with k/v as
    they are (GQA), and cuDNN's fused attention (repeated and GQA). Each as close to a float32
    per-sequence reference as the old path; times for a 32k-token micro-batch of rollout lengths."""
    from agentrl.trainers.megatron import layers

    impls = [("flash", False), ("flash", True), ("cudnn", False), ("cudnn", True)]
    q, k, v, w, cu, max_len = _packed([700, 1500, 300, 2600, 1], 12, 2)
    ref = []  # float32 SDPA per sequence
    bounds = cu.tolist()
    a, b, c = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (a, b, c))
        ki, vi = ki.repeat_interleave(6, dim=1), vi.repeat_interleave(6, dim=1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
    out = torch.cat(outs)
    (out * w.float()).sum().backward()
    ref = (out.detach(), a.grad, b.grad, c.grad)
    err = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()  # noqa: E731
    figures, errors = {}, {}
    lengths = [2700, 4100, 1800, 3500, 900, 2600, 5200, 3000, 2400, 3300, 1700, 1568]  # 32,768 tokens
    big = _packed(lengths, 12, 2, seed=1)
    try:
        for impl, native in impls:
            name = f"{impl}_{'gqa' if native else 'repeated'}"
            try:
                got = _attention(impl, native, q, k, v, w, cu, max_len)
                if native and not layers.NATIVE_GQA:  # the kernel refused unrepeated k/v; _varlen repeated them
                    figures[name + "_error"] = "refused key/value heads fewer than query heads"
                    continue
                errors[name] = [err(x, y) for x, y in zip(got, ref)]
                figures[name + "_ms"] = _time_ms(lambda: _attention(impl, native, *big))
            except Exception as exc:  # cuDNN's ragged path may be missing from this build: say so, go on
                figures[name + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        layers.PACKED_ATTENTION, layers.NATIVE_GQA = "flash", True
    figures["relative_error_vs_fp32 (out, dq, dk, dv)"] = errors
    figures["tokens"] = sum(lengths)
    _save("attention", figures)
    base = errors["flash_repeated"]
    for name, e in errors.items():  # every kernel that ran is as accurate as the old path
        assert all(x <= 1.5 * y + 1e-3 for x, y in zip(e, base)), (name, e, base)
    assert "flash_gqa" in errors, figures  # the default path ran
