"""One rank of tests/gpu/test_scale_moe_gpu.py (started by torchrun, one process per GPU): the
Megatron trainer on a random-init Qwen3-MoE-shaped model with the given Megatron flags; a few
training steps timed, peak memory, and the logprobs of a fixed probe batch before training;
rank 0 writes the figures as JSON."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# Qwen3-30B-A3B's router (128 experts, top-8, renormalised, softmax) and attention layout
# (32 query / 4 KV heads of 128), depth and width cut to fit: 2048 -> 1024 hidden, 48 -> 8 layers.
SHAPES = {
    "a3b-cut": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128, intermediate_size=3072, moe_intermediate_size=384, num_experts=128,
                    num_experts_per_tok=8),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
                  num_experts_per_tok=4),
}


def random_qwen3_moe(folder: Path, shape: str, max_positions: int) -> Path:
    """A random-init Qwen3-MoE of a named shape with the tiny tokenizer, bf16, seed 0 (cached)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gpu_helpers import random_model

    def build(config):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():  # routers with clear preferences (HF may start them at zero)
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.02)
        return model

    return random_model(folder, lambda: Qwen3MoeConfig(vocab_size=512, norm_topk_prob=True,
                                                       max_position_embeddings=max_positions, tie_word_embeddings=False,
                                                       rms_norm_eps=1e-6, **SHAPES[shape]), build)


def samples(n: int, length: int, seed: int):
    from agentrl.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = length // 8
        s = Sample(prompt_tokens=torch.randint(3, 512, (prompt,), generator=g).tolist(), group_id=i // 8,
                   reward=float(i % 2), trajectory_id=f"t{i}")
        s.append_generated(torch.randint(3, 512, (length - prompt,), generator=g).tolist(), [-6.0] * (length - prompt), 0)
        out.append(s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True, help="the HF checkpoint (rank 0 of the test built it)")
    parser.add_argument("--megatron", default="{}", help="megatron_args as JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--probe-length", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8192)
    args = parser.parse_args()

    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainers.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(args.model, train=TrainConfig(lr=1e-5, global_batch_size=args.samples,
                                                            max_tokens_per_gpu=args.max_tokens),
                              algo=AlgoConfig(), temperature=1.0, device="cuda", dtype="bfloat16",
                              megatron_args=json.loads(args.megatron))
    probe = samples(8, args.probe_length, seed=1)
    logprobs = trainer.compute_logprobs(probe)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rollout = samples(args.samples, args.length, seed=2)
    times, metrics = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics.append(trainer.train_rollout(rollout))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if trainer.rank == 0:
        Path(args.out).write_text(json.dumps({
            "megatron": json.loads(args.megatron), "world": torch.distributed.get_world_size(),
            "step_s": times, "peak_gib_max_rank": float(peak.item()), "probe_logprobs": logprobs,
            "grad_norms": [m.get("grad_norm") for m in metrics], "tokens_per_step": args.samples * args.length}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
