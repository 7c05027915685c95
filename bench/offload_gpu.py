"""--colocate's trainer offload on a GPU, both trainers: device memory before / while offloaded /
after the restore, seconds each way (first offload, and later ones reusing the pinned host
buffers), and how far the next training step lands from a twin trainer's that never left the GPU,
next to how far two such twins land from each other.

    python bench/offload_gpu.py --out DIR [--shape 1.5b] [--trainers torch,megatron]
    python bench/offload_gpu.py --out /tmp/off --device cpu --shape tiny   # smoke run of every path

Writes DIR/offload.json (and prints it). Random-init Qwen2-shaped checkpoint (bench/weight_sync_gpu.py's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from weight_sync_gpu import SHAPES, VOCAB, make_checkpoint  # noqa: E402


def samples(n: int, length: int, seed: int = 0):
    from agentrl.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = Sample(prompt_tokens=torch.randint(300, VOCAB - 300, (length // 4,), generator=g).tolist(), group_id=i // 4,
                   reward=float(i % 2), trajectory_id=f"t{i}")
        s.append_generated(torch.randint(300, VOCAB - 300, (length - length // 4,), generator=g).tolist(),
                           [-5.0] * (length - length // 4), 0)
        out.append(s)
    return out


def build(kind: str, model: Path, device: str, dtype: str):
    from agentrl.config import AlgoConfig, TrainConfig

    tc = TrainConfig(lr=1e-5, global_batch_size=8, micro_batch_size=2, max_tokens_per_gpu=4096 if kind == "megatron" else None)
    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.01)  # with a reference model, as colocated runs often are
    if kind == "torch":
        from agentrl.trainers.torch_trainer import TorchTrainer
        return TorchTrainer(str(model), train=tc, algo=algo, temperature=1.0, device=device, dtype=dtype)
    from agentrl.trainers.megatron import MegatronTrainer
    return MegatronTrainer(str(model), train=tc, algo=algo, temperature=1.0, device=device, dtype=dtype)


def allocated(device: str) -> float:
    if device != "cuda":
        return 0.0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**30


def measure(kind: str, model: Path, device: str, dtype: str, batch) -> dict:
    from agentrl.trainers.offload import TRAINER_PARTS, held_tensors, offload_trainer

    a = build(kind, model, device, dtype)
    for t in held_tensors([getattr(a, n, None) for n in TRAINER_PARTS]):
        if not t.untyped_storage().resizable():  # CPU weights mapped from the file (never on a GPU)
            t.data = t.data.clone()
    a.train_rollout(batch)  # grads, optimizer state and master weights exist from here on
    base = allocated(device)
    t0 = time.perf_counter()
    stash = offload_trainer(a)
    off_s, during = time.perf_counter() - t0, allocated(device)
    t0 = time.perf_counter()
    stash.restore()
    on_s, after = time.perf_counter() - t0, allocated(device)
    stash_gib = round(stash.bytes / 2**30, 3)
    t0 = time.perf_counter()  # the next iteration's offload reuses the pinned host buffers
    stash = offload_trainer(a, spare=stash.hosts)
    again_s = time.perf_counter() - t0
    stash.restore()
    m_a = a.train_rollout(batch)
    after_a = [p.detach().float().cpu() for p in a.model.parameters()]
    del a, stash
    if device == "cuda":
        torch.cuda.empty_cache()
    twins = []  # two that never leave the device: how far apart GPU kernels alone put them
    for _ in range(2):
        b = build(kind, model, device, dtype)
        b.train_rollout(batch)
        twins.append((b.train_rollout(batch), [p.detach().float().cpu() for p in b.model.parameters()]))
        del b
        if device == "cuda":
            torch.cuda.empty_cache()
    (m_b, after_b), (_, after_c) = twins
    diff = lambda x, y: max(float((p - q).abs().max()) for p, q in zip(x, y))  # noqa: E731
    same = all(torch.equal(x, y) for x, y in zip(after_a, after_b))
    return {"offloaded_gib": stash_gib, "allocated_gib_before": round(base, 3), "allocated_gib_offloaded": round(during, 3),
            "allocated_gib_restored": round(after, 3), "offload_s_first": round(off_s, 3),
            "offload_s_reused_buffers": round(again_s, 3), "restore_s": round(on_s, 3),
            "next_step_loss": [m_a["loss"], m_b["loss"]], "next_step_identical": same and m_a["loss"] == m_b["loss"],
            "param_max_abs_diff_offloaded_vs_twin": diff(after_a, after_b),
            "param_max_abs_diff_twin_vs_twin": diff(after_b, after_c)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--trainers", default="torch,megatron")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    args = p.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cpu":  # megatron-core on CPU: the test-only shim
        sys.path.insert(0, str(ROOT / "tests" / "trainers"))
        import megatron_cpu_shim

        megatron_cpu_shim.apply()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "shape": args.shape,
               "samples": args.samples, "length": args.length, "dtype": dtype}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(Path(tmp) / "model", args.shape, getattr(torch, dtype), args.device)
        batch = samples(args.samples, args.length)
        for kind in args.trainers.split(","):
            try:
                results[kind] = measure(kind, model, args.device, dtype, batch)
            except Exception as exc:  # keep the other trainer's figures
                results[kind] = {"error": f"{type(exc).__name__}: {exc}"}
            print(kind, json.dumps(results[kind]), flush=True)
            (out / "offload.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
