"""LoRA vs full fine-tuning with agentrl's PyTorch trainer, and the adapter-only weight sync
into a real SGLang server. Not a test: it prints and saves figures (`--out DIR/lora_gpu.json`,
written after every phase). Figures of its run on an H100: bench/results/lora_gpu.md.

Phases:
  train    trainer GPU memory (peak allocated, reserved) and step time of `train_rollout` on the
           same synthetic batch (--batch samples x --seq-len tokens), full fine-tuning vs
           --lora-rank (all-linear), after one warm-up step;
  sync     the adapter (`save_adapter` + `sync_lora_adapter`: /load_lora_adapter, the version's
           name, the previous one unloaded) into an engine started with --enable-lora: bytes and
           seconds per sync, against the merged full-weight sync (`sync_weights_from_disk`);
  parity   after each adapter sync the engine samples 2 prompts x 32 tokens with `lora_path`
           naming the adapter, and its logprobs are compared with the trainer's recomputed ones
           (the on-policy check; bf16 on GPU, so the tolerance is looser than the CPU's 1e-4).

The model: bench/weight_sync_gpu.py's random-init Qwen2.5-1.5B-shaped checkpoint (no network).

    # GPU machine, one GPU, .sgl carried (as bench/weight_sync_gpu.py):
    python3 bench/lora_gpu.py --out $OUT
    # CPU smoke run: tiny shape, the embedded engine, fp32:
    python bench/lora_gpu.py --out /tmp/lora --engine embedded --device cpu --dtype float32 --shape tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync_gpu import Server, log, make_checkpoint, start_server, sync_device, wait_ready  # noqa: E402


def synthetic_batch(n: int, seq_len: int, vocab: int, seed: int = 0):
    from agentrl.types import Sample

    g = torch.Generator().manual_seed(seed)
    half = seq_len // 2
    return [Sample(prompt_tokens=torch.randint(300, vocab - 300, (half,), generator=g).tolist(),
                   response_tokens=torch.randint(300, vocab - 300, (seq_len - half,), generator=g).tolist(),
                   loss_mask=[1] * (seq_len - half), rollout_logprobs=[-5.0] * (seq_len - half),
                   reward=float(i % 2), group_id=i // 4) for i in range(n)]


def build_trainer(model: Path, args, lora_rank: int):
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainers.torch_trainer import TorchTrainer

    train = TrainConfig(lr=1e-5, global_batch_size=args.batch, micro_batch_size=args.micro_batch,
                        lora_rank=lora_rank, lora_alpha=2.0 * max(lora_rank, 1), lora_sync="adapter")
    return TorchTrainer(str(model), train=train, algo=AlgoConfig(), temperature=1.0, device=args.device,
                        dtype=args.dtype)


def measure_training(model: Path, args, lora_rank: int) -> dict:
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(model, args, lora_rank)
    samples = synthetic_batch(args.batch, args.seq_len, trainer.model.config.vocab_size)
    trainer.train_rollout(samples)  # warm-up (optimizer state is created here)
    sync_device(args.device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_rollout(samples)
        sync_device(args.device)
        times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    out = {"lora_rank": lora_rank, "step_s": sorted(times)[len(times) // 2], "trainable_params": trainable,
           "optimizer_state_tensors": len(trainer.optimizer.state_dict()["state"])}
    if cuda:
        out |= {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    log(f"train lora_rank={lora_rank}: {out}")
    del trainer
    return out


async def measure_sync(model: Path, args, out: Path) -> dict:
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_transfer import lora_adapter_name, sync_lora_adapter, sync_weights_from_disk

    rank = args.lora_rank
    if args.engine == "sglang":
        args.sglang_extra += f" --enable-lora --max-lora-rank {rank} --lora-target-modules all"
        server = start_server(args, "engine", 0, 30100, args.mem_fraction, model, out)
    else:
        argv = [sys.executable, "-m", "agentrl.engines.embedded", "--model-path", str(model), "--port", "30100",
                "--device", args.device, "--dtype", args.dtype, "--num-threads", "1", "--enable-lora"]
        server = Server("engine", argv, 30100, out / "server_engine.log")
    trainer = build_trainer(model, args, rank)
    results: dict = {"adapter": [], "merged_disk": [], "parity": []}
    try:
        await wait_ready(server, 900)
        async with EngineClient(server.url) as client:
            prompts = [[1000 + i for i in range(16)], [5000 + 3 * i for i in range(16)]]
            for version in range(1, args.syncs + 1):
                with torch.no_grad():  # new adapter weights every version (B starts at zero)
                    for name, p in trainer.model.named_parameters():
                        if "lora_" in name:
                            p.normal_(0, 0.02)
                folder = out / "adapters" / f"v{version}"
                t0 = time.perf_counter()
                trainer.save_adapter(folder)
                saved = time.perf_counter() - t0
                stats = await sync_lora_adapter([client], str(folder), version=version,
                                                previous=version - 1 if version > 1 else None)
                results["adapter"].append({**stats, "save_s": saved})
                log(f"adapter sync v{version}: {results['adapter'][-1]}")
                results["parity"].append(await parity(client, trainer, prompts, lora_adapter_name(version)))
                log(f"parity v{version}: {results['parity'][-1]}")
            t0 = time.perf_counter()
            trainer.save_hf(out / "merged")
            saved = time.perf_counter() - t0
            stats = await sync_weights_from_disk([client], str(out / "merged"), version=args.syncs + 1)
            size = sum(f.stat().st_size for f in (out / "merged").iterdir() if f.is_file())
            results["merged_disk"].append({**stats, "save_s": saved, "weight_sync_mb": size / 2**20})
            log(f"merged sync (disk): {results['merged_disk'][-1]}")
    finally:
        server.stop()
    return results


async def parity(client, trainer, prompts, adapter: str) -> dict:
    from agentrl.types import Sample

    samples = []
    for prompt in prompts:
        result = await client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 32, "ignore_eos": True},
                                       lora_path=adapter)
        samples.append(Sample(prompt_tokens=prompt, response_tokens=result.output_ids,
                              loss_mask=[1] * len(result.output_ids), rollout_logprobs=result.logprobs))
    recomputed = trainer.compute_logprobs(samples)
    diffs = [abs(a - b) for s, r in zip(samples, recomputed) for a, b in zip(r, s.rollout_logprobs)]
    return {"tokens": len(diffs), "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--engine", choices=["sglang", "embedded"], default="sglang")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--shape", default="1.5b", choices=["1.5b", "tiny"])
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--sglang-extra", default="")
    p.add_argument("--phases", default="train,sync")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = make_checkpoint(out / f"model-{args.shape}", args.shape, dtype, args.device)
    results: dict = {"args": vars(args)}

    def save():
        (out / "lora_gpu.json").write_text(json.dumps(results, indent=1))

    if "train" in args.phases:
        results["train"] = [measure_training(model, args, 0)]
        save()
        results["train"].append(measure_training(model, args, args.lora_rank))
        save()
    if "sync" in args.phases:
        results["sync"] = asyncio.run(measure_sync(model, args, out))
        save()
    log(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
