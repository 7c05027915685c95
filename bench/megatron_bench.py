"""Megatron trainer on GPUs: bf16 logprob parity against HF, train-step throughput and MFU on
packed rollouts, and the bucketed HF weight export. Not a test: it prints and saves figures.

    python bench/megatron_bench.py --out DIR                       # one GPU
    torchrun --nproc-per-node 2 bench/megatron_bench.py --out DIR --tensor-model-parallel-size 2

The model is a random-init Qwen2.5-1.5B-shaped checkpoint (28 layers, hidden 1536, GQA 12/2,
vocab 151936, tied embeddings) written first (no network on the GPU machines), unless
--model gives one. MFU = (6 N T + 6 L H sum_i s_i^2) / time / 989e12, with N the parameters
that take part in matmuls (all but the input embedding; the tied LM head counts), T the
tokens of the step and s_i each packed sequence's length (causal attention).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

PEAK_FLOPS = 989e12
QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(*a):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, flush=True)


def make_model(path: Path, shape: dict, init_std: float) -> Path:
    """A random Qwen2 checkpoint (bf16 safetensors) plus the tiny model's tokenizer files."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.models import build_tiny_model

    if (path / "config.json").exists():
        return path
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        cfg = Qwen2Config(**shape, initializer_range=init_std)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tiny = build_tiny_model()
        for f in tiny.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
                shutil.copy(f, tmp / f.name)
        tmp.rename(path)
        del model
        torch.cuda.empty_cache()
    else:
        while not (path / "config.json").exists():
            time.sleep(1)
    return path


def rollout(n: int, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int = 0):
    """Multi-turn-shaped samples: prompt, policy tokens, an env chunk, policy tokens."""
    from agentrl.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(*prompt), rng.randint(*response)
        s = Sample(prompt_tokens=[rng.randrange(vocab) for _ in range(p)], group_id=i // 8, reward=float(rng.random()))
        a = r * 2 // 5
        s.append_generated([rng.randrange(vocab) for _ in range(a)], [-2.0] * a, 0)
        env = min(128, r // 10)
        s.append_observation([rng.randrange(vocab) for _ in range(env)])
        b = r - a - env
        s.append_generated([rng.randrange(vocab) for _ in range(b)], [-2.0] * b, 0)
        out.append(s)
    return out


def matmul_params(hf_config) -> int:
    h, f, L, v = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers, hf_config.vocab_size
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    qkv = h * d * (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads)
    per_layer = qkv + hf_config.num_attention_heads * d * h + 3 * h * f
    return L * per_layer + v * h  # + the LM head (tied or not, it is a matmul)


def flops(hf_config, samples, passes: int) -> float:
    """passes: 3 for forward + backward, 1 for forward only."""
    n = matmul_params(hf_config)
    t = sum(len(s.tokens) for s in samples)
    attn = sum(len(s.tokens) ** 2 for s in samples)
    return passes * (2 * n * t + 2 * hf_config.num_hidden_layers * hf_config.hidden_size * attn)


def hf_logprobs(model, samples, temperature: float):
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device=DEVICE)
            logits = model(input_ids=ids).logits[0].float() / temperature
            p = len(s.prompt_tokens)
            lp = torch.log_softmax(logits[p - 1:p - 1 + s.response_length], -1)
            out.append(lp.gather(-1, torch.tensor(s.response_tokens, device=DEVICE)[:, None]).squeeze(-1).cpu())
    return out


def stage_parity(args, path, results):
    from transformers import AutoModelForCausalLM

    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainers.megatron import MegatronTrainer

    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    samples = rollout(8, vocab, *(((64, 512), (256, 1536)) if DEVICE == "cuda" else ((8, 16), (16, 32))), seed=1)
    trainer = MegatronTrainer(str(path), train=TrainConfig(lr=1e-6, global_batch_size=8, max_tokens_per_gpu=8192),
                              algo=AlgoConfig(), temperature=1.0, device=DEVICE, dtype=args.dtype,
                              megatron_args=args.megatron)
    ours = [torch.tensor(x) for x in trainer.compute_logprobs(samples)]
    del trainer
    import gc
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    if int(os.environ.get("RANK", 0)) != 0:
        return
    res = {}
    for dtype in ("bfloat16", "float32"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        res[dtype] = hf_logprobs(model.to(DEVICE), samples, 1.0)
        del model

    def err(a, b):
        d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
        return {"max": d.max().item(), "mean": d.mean().item()}

    out = {"tokens": int(sum(len(x) for x in ours)),
           "megatron_bf16_vs_hf_bf16": err(ours, res["bfloat16"]),
           "megatron_bf16_vs_hf_fp32": err(ours, res["float32"]),
           "hf_bf16_vs_hf_fp32": err(res["bfloat16"], res["float32"]),
           "logprob_mean": torch.cat(res["float32"]).mean().item(), "logprob_std": torch.cat(res["float32"]).std().item()}
    results["parity"] = out
    log("PARITY", json.dumps(out))


def stage_throughput(args, path, results):
    import torch.distributed as dist
    from transformers import AutoConfig

    from agentrl.algorithms import compute_advantages
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainers.megatron import MegatronTrainer

    hf_config = AutoConfig.from_pretrained(path)
    lengths = ((256, 1024), (512, 3584)) if DEVICE == "cuda" else ((8, 24), (16, 48))
    samples = rollout(args.samples, hf_config.vocab_size, *lengths, seed=2)
    tokens = sum(len(s.tokens) for s in samples)
    trainer = MegatronTrainer(str(path), train=TrainConfig(lr=1e-6, global_batch_size=len(samples),
                                                           max_tokens_per_gpu=args.max_tokens[0]),
                              algo=AlgoConfig(), temperature=1.0, device=DEVICE, dtype=args.dtype,
                              megatron_args=args.megatron)
    world = dist.get_world_size()
    gpus = world
    runs = []
    from agentrl.trainers.megatron import layers, logprobs, model as megatron_model
    for attention, impl, head, budget in [(a, i, h, b) for a in args.attention_impls for i in args.logprob_impls
                                          for h in args.head_impls for b in args.max_tokens]:
        logprobs.USE_TRITON = impl == "triton"  # A/B: the Triton kernels or the torch chunk loop
        megatron_model.RESPONSE_HEAD = head == "response"  # A/B: the LM head over response positions or all
        # packed attention: flash with k/v repeated per query head (before), flash or cuDNN with GQA
        layers.PACKED_ATTENTION, layers.NATIVE_GQA = attention.split("-")[0], not attention.endswith("-repeated")
        trainer.max_tokens = budget
        try:
            sync()
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            old = trainer.compute_logprobs(samples)
            sync()
            t_fwd = time.perf_counter() - t0
            adv = compute_advantages(samples, trainer.algo, old_logprobs=old).advantages
            idx = list(range(len(samples)))
            times, stats = [], None
            for step in range(args.steps + 1):  # the first is a warm-up
                sync()
                t0 = time.perf_counter()
                stats = trainer.policy_step(idx, samples, adv, old, None)
                sync()
                if step:
                    times.append(time.perf_counter() - t0)
            t_step = sum(times) / len(times)
            f_step, f_fwd = flops(hf_config, samples, 3), flops(hf_config, samples, 1)
            run = {"attention_impl": attention, "attention_gqa_kept": layers.NATIVE_GQA, "logprob_impl": impl,
                   "lm_head_rows": head,
                   "max_tokens_per_gpu": budget, "samples": len(samples), "tokens": tokens,
                   "micro_batches": len(trainer._batches(samples, idx)), "gpus": gpus,
                   "train_step_s": t_step, "train_tokens_per_s": tokens / t_step,
                   "train_tflops_per_gpu": f_step / t_step / gpus / 1e12,
                   "train_mfu": f_step / t_step / gpus / PEAK_FLOPS,
                   "logprob_pass_s": t_fwd, "logprob_tokens_per_s": tokens / t_fwd,
                   "logprob_mfu": f_fwd / t_fwd / gpus / PEAK_FLOPS,
                   "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None,
                   "grad_norm": stats["grad_norm"], "loss": stats["loss"], "step_times_s": times}
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # (a kernel this build lacks: the next run goes on)
            kind = "OOM" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
            run = {"attention_impl": attention, "logprob_impl": impl, "lm_head_rows": head,
                   "max_tokens_per_gpu": budget,
                   "error": f"{kind}: {str(exc)[:200]}"}
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        runs.append(run)
        log("THROUGHPUT", json.dumps(run))
    results["throughput"] = runs
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        logprobs.USE_TRITON = args.logprob_impls[-1] == "triton"
        megatron_model.RESPONSE_HEAD = args.head_impls[-1] == "response"
        attention = args.attention_impls[-1]
        layers.PACKED_ATTENTION, layers.NATIVE_GQA = attention.split("-")[0], not attention.endswith("-repeated")
        fitted = [r["max_tokens_per_gpu"] for r in runs if "error" not in r and r["logprob_impl"] == args.logprob_impls[-1]
                  and r["attention_impl"] == attention]
        trainer.max_tokens = max(fitted or args.max_tokens[:1])
        results["profile_max_tokens"] = trainer.max_tokens
        old = trainer.compute_logprobs(samples)
        adv = compute_advantages(samples, trainer.algo, old_logprobs=old).advantages
        idx = list(range(len(samples)))
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            trainer.policy_step(idx, samples, adv, old, None)
            sync()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        gpu_total = sum(e.self_device_time_total for e in events) / 1e6
        table = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
        cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
        kernels = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = {e.key: e.count for e in events if "Synchronize" in e.key or e.key == "aten::_local_scalar_dense"}
        results["profile"] = {"wall_s": wall, "kernel_launches": kernels, "syncs": syncs}
        if int(os.environ.get("RANK", 0)) == 0:
            (Path(args.out) / "profile.txt").write_text(
                f"wall {wall:.3f} s, summed GPU kernel time {gpu_total:.3f} s, {kernels} kernel launches, "
                f"syncs {syncs}\n{table}\nby CPU time:\n{cpu_table}")
        log(f"PROFILE wall {wall:.3f} s, summed GPU kernel time {gpu_total:.3f} s")
        log(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))

    # weight export: every HF-named tensor, bucketed, on the GPU (what tensor/NCCL sync sends)
    for bucket_mb in (256,):
        sync()
        t0 = time.perf_counter()
        nbytes, nb = 0, 0
        for bucket in trainer.hf_buckets(bucket_bytes=bucket_mb * 2**20):
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            nb += 1
        sync()
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        host = 0
        for bucket in trainer.hf_buckets(bucket_bytes=bucket_mb * 2**20):
            host += sum(t.to("cpu").numel() for _, t in bucket)
        t_host = time.perf_counter() - t0
        exp = {"bucket_mb": bucket_mb, "buckets": nb, "gb": nbytes / 1e9, "export_on_gpu_s": t_export,
               "export_gb_per_s": nbytes / 1e9 / t_export, "export_to_host_s": t_host,
               "to_host_gb_per_s": nbytes / 1e9 / t_host}
        results.setdefault("export", []).append(exp)
        log("EXPORT", json.dumps(exp))
    if args.save:
        sync()
        t0 = time.perf_counter()
        trainer.save_hf(Path(args.save))
        results["save_hf_s"] = time.perf_counter() - t0
        log("SAVE_HF", results["save_hf_s"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="an HF checkpoint; default: a random Qwen2.5-1.5B-shaped one")
    p.add_argument("--model-dir", default="/tmp/bench-qwen2.5-1.5b")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--stages", default="parity,throughput")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 16384])
    p.add_argument("--save", default=None, help="also time save_hf into this folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true", help="profile one train step (torch.profiler; the last "
                   "--logprob-impls at its largest --max-tokens that fitted)")
    p.add_argument("--attention-impls", type=lambda s: s.split(","), default=["flash"],
                   help="packed attention kernels to compare: flash (GQA kept), flash-repeated (k/v repeated per "
                        "query head: before), cudnn, cudnn-repeated; the profile uses the last")
    p.add_argument("--logprob-impls", type=lambda s: s.split(","), default=["triton"],
                   help="comma list of triton (the kernels, what the trainer uses on CUDA) and torch (the chunk loop)")
    p.add_argument("--head-impls", type=lambda s: s.split(","), default=["response"],
                   help="the LM head over response positions only (response: what the trainer does) or every "
                        "position (full: before); MFU counts every position's head FLOPs either way")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run on the tiny model (tests/trainers shim)")
    args, rest = p.parse_known_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":  # megatron-core on CPU: the test-only shim
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainers"))
        import megatron_cpu_shim

        megatron_cpu_shim.apply()
    from agentrl.config import _split_passthrough
    _, passthrough = _split_passthrough(rest)
    args.megatron = passthrough["megatron_args"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"argv": sys.argv[1:], "megatron_args": args.megatron,
               "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__}
    try:
        import megatron.core
        results["megatron_core"] = megatron.core.__version__
    except Exception:
        pass
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        results["varlen_attn"] = True
    except Exception:
        results["varlen_attn"] = False
    if args.model:
        path = Path(args.model)
    elif DEVICE == "cpu":
        from agentrl.models import build_tiny_model
        path = build_tiny_model()
    else:
        path = make_model(Path(args.model_dir), QWEN25_15B, args.init_std)
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            {"parity": stage_parity, "throughput": stage_throughput}[stage](args, path, results)
        except Exception:
            results.setdefault("errors", {})[stage] = traceback.format_exc()[-3000:]
            log(f"STAGE {stage} FAILED\n" + traceback.format_exc()[-3000:])
        results.setdefault("stage_s", {})[stage] = time.perf_counter() - t0
        if int(os.environ.get("RANK", 0)) == 0:
            (out / "megatron_bench.json").write_text(json.dumps(results, indent=1))
    from agentrl.trainers.megatron import layers
    results["varlen_fallback"] = layers._varlen_broken
    if int(os.environ.get("RANK", 0)) == 0:
        (out / "megatron_bench.json").write_text(json.dumps(results, indent=1))
        log("DONE", json.dumps({k: results.get(k) for k in ("stage_s", "varlen_fallback")}))


if __name__ == "__main__":
    main()
