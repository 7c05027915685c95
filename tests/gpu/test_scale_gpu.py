"""Scale on one 4-GPU host (nvidia-h100-x4): a Qwen2.5-7B-shaped model trained with TP=2 x DP=2
Megatron colocated with two TP=2 SGLang engines, and the same host split into two Ray nodes
(trainer on one, the engine on the other, weights over NCCL between them).

Figures go to $OUT/scale.md in bench/results/scale.md's format: the per-iteration breakdown,
train-step MFU, weight-sync seconds and GB/s, peak memory per GPU (nvidia-smi, every process on
it: trainer and engines). AGENTRL_GPU_ITERS shortens a run (the checks stay as they are);
AGENTRL_SCALE_MEGATRON_ARGS replaces the Megatron memory flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from gpu_helpers import (KIT, OUT, SGLANG, agentrl_train, iters, mean, needs_gpus, random_model, random_qwen2,
                         tiny_qwen2_config, train_mfu)

pytestmark = needs_gpus(4, "the scale scenarios need 4 GPUs (the device tool's nvidia-h100-x4)")

# Qwen2.5-7B's shape (the tiny tokenizer's 512-token vocabulary: nothing to download)
SHAPE_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4)


def random_qwen2_7b() -> Path:
    """The 7B shape, random init (seed 0), bf16, built on the GPU (minutes on the CPU), cached in the kit."""
    return random_model(KIT / "models" / "qwen2-7b-tinytok", lambda: tiny_qwen2_config(SHAPE_7B), device="cuda:0")


class GpuMemory:
    """The most memory each GPU held at any time (nvidia-smi every second: trainer and engines)."""

    def __init__(self):
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in out.strip().splitlines():
                i, used = (x.strip() for x in line.split(","))
                self.peak[int(i)] = max(self.peak.get(int(i), 0.0), float(used) / 1024)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=15)


def params_of(model: Path) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    h, f, n, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = h // c.num_attention_heads * c.num_key_value_heads
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f  # q, o; k, v; gate, up, down
    return n * per_layer + v * h * (1 if c.tie_word_embeddings else 2)


def report(name: str, command: str, rows: list[dict], params: int, gpus: int, memory: GpuMemory) -> str:
    """bench/results/scale.md's section for one run: printed and appended to $OUT/scale.md."""
    lines = [f"## {name}", "", f"`{command}`", "",
             "| iter | rollout s | train s | weight sync s | sync GB/s | tokens | train MFU | trainer peak GiB | check diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    mfus, rates = [], []
    for r in rows:
        gb = r.get("weight_sync_mb", 0) / 1024
        rate = gb / r["weight_sync_s"] if r.get("weight_sync_s") else 0.0
        mfu = train_mfu(r, params, gpus)
        mfus.append(mfu)
        rates.append(rate)
        lines.append(f"| {r['rollout_id']} | {r['rollout_s']:.1f} | {r['train_s']:.1f} | {r.get('weight_sync_s', 0):.2f} "
                     f"| {rate:.1f} | {r['generated_tokens']} | {100 * mfu:.1f}% | {r.get('gpu/trainer_peak_gib', 0):.1f} "
                     f"| {r.get('weight_check/mean_abs_diff', float('nan')):.4f} |")
    later = rows[1:] or rows
    lines += ["", f"- train-step MFU (6 N tokens / train_s / {gpus} x 989 TFLOP/s, response tokens only), mean of "
                  f"iterations 1..: {100 * mean(mfus[1:] or mfus):.1f}%",
              f"- weight sync: {mean(r['weight_sync_s'] for r in later):.2f} s, {mean(rates[1:] or rates):.1f} GB/s "
              f"({later[0].get('weight_sync_mb', 0) / 1024:.1f} GB a sync)",
              "- peak memory per GPU (nvidia-smi, all processes): " +
              ", ".join(f"GPU {i} {g:.1f} GiB" for i, g in sorted(memory.peak.items())), ""]
    text = "\n".join(lines)
    print(text, flush=True)
    with open(OUT / "scale.md", "a") as f:
        f.write(text + "\n")
    return text


TARGET = ["--env", "target-token", "--device", "cuda", "--dtype", "bfloat16", "--lr", "1e-6",
          "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "256",
          "--rollout-max-response-len", "1024", "--rollout-ignore-eos"]


def megatron_memory_args() -> list[str]:
    given = os.environ.get("AGENTRL_SCALE_MEGATRON_ARGS")
    if given is not None:
        return given.split()
    # No recompute (the first run recomputed every layer: 8 x params x tokens of work for 6 counted); with the
    # distributed optimizer the trainer's peak was 55.5 GiB at 8192 tokens a micro-batch (4x H200, 2026-11-26).
    return ["--max-tokens-per-gpu", "8192", "--use-distributed-optimizer"]


def test_7b_tp2_dp2_colocated_with_two_tp2_engines():
    """TP=2 x DP=2 Megatron on 4 GPUs, two TP=2 SGLang engines on the same GPUs (each TP rank gets
    the weights of the trainer rank on its GPU), 256 x 1024 tokens an iteration: no OOM, memory
    flat after iteration 1, the engines hold the trainer's weights (the weight check)."""
    n = iters(8)  # 10 iterations and the final checkpoint did not end within one 600-s call (2026-11-26)
    model = random_qwen2_7b()
    args = [*TARGET, "--model", str(model), "--trainer", "megatron", "--tensor-model-parallel-size", "2",
            "--actor-num-gpus-per-node", "4", *megatron_memory_args(), *SGLANG, "--colocate",
            "--sglang-enable-memory-saver", "--sglang-mem-fraction-static", "0.45",
            "--rollout-num-gpus-per-engine", "2", "--weight-check-interval", "1", "--num-rollout", str(n),
            # the final checkpoint (~100 GB with the optimizer's state) off $OUT, which the device tool sends back
            "--save", str(KIT / "checkpoints" / "scale_7b_tp2")]
    with GpuMemory() as memory:
        run, rows = agentrl_train("scale_7b_tp2", *args, timeout_s=float(os.environ.get("AGENTRL_GPU_TIMEOUT", 530)))
    report("7B shape, TP=2 x DP=2 trainer colocated with two TP=2 SGLang engines (4x H100)",
           "agentrl train " + " ".join(args), rows, params_of(model), 4, memory)
    placement = json.loads((run / "run.json").read_text())["placement"]
    assert len(placement["engine_gpus"]) == 2 and all(len(g) == 2 for g in placement["engine_gpus"]), placement
    assert len(rows) == n
    assert all(r.get("weight_sync_per_rank") == 1.0 for r in rows), "each engine TP rank from its own GPU's trainer rank"
    assert all(r["engines_used"] == 2 for r in rows)
    checked = [r["weight_check/mean_abs_diff"] for r in rows if "weight_check/mean_abs_diff" in r]
    # engine vs trainer on the same weights: a random-init 7B in bf16 differs by ~0.05 a token already before any
    # sync (iteration 0's train_rollout_logprob_abs_diff); a wrong or stale shard shows as a multiple of that
    baseline = rows[0]["train_rollout_logprob_abs_diff"]
    assert len(checked) >= n - 1 and max(checked) < max(0.05, 1.5 * baseline), (checked, baseline)
    for key in ("gpu/trainer_peak_gib", "gpu/used_train_gib"):
        later = [r[key] for r in rows[1:]]
        assert max(later) <= 1.05 * min(later), (key, later)


def ray_cli(*args: str, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], check=True, env=env, timeout=180,
                   capture_output=True, text=True)


def test_two_ray_nodes_trainer_and_engine_apart():
    """One host as two Ray nodes (`ray start --head` on GPUs 0,1, `ray start --address` on 2,3),
    `agentrl train --ray-address`: the TP=2 trainer on the head's GPUs, a TP=2 SGLang engine on the
    worker's, weights over NCCL from one node to the other every iteration, learning on policy."""
    n = iters(8)
    port = 6390
    base = {**os.environ, "RAY_worker_niceness": "0"}
    head = {**base, "CUDA_VISIBLE_DEVICES": "0,1"}
    worker = {**base, "CUDA_VISIBLE_DEVICES": "2,3"}
    temp = Path("/tmp/agentrl-ray-2n")
    ray_cli("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-gpus", "2",
            "--num-cpus", "8", "--resources", '{"agentrl_trainer": 1000}', "--include-dashboard", "false",
            "--temp-dir", str(temp), env=head)
    try:
        ray_cli("start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", "--num-gpus", "2",
                "--num-cpus", "8", "--resources", '{"agentrl_engine": 1000}', env=worker)
        model = random_qwen2("135m-tp2")  # the 135m shape's 9 heads do not split over 2 TP ranks
        args = ["--env", "target-token", "--device", "cuda", "--dtype", "bfloat16", "--lr", "1e-4", "--model", str(model),
                "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
                "--trainer", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
                *SGLANG, "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "2",
                "--ray-address", f"127.0.0.1:{port}", "--ray-trainer-resource", "agentrl_trainer",
                "--ray-engine-resource", "agentrl_engine", "--weight-check-interval", "1", "--num-rollout", str(n)]
        with GpuMemory() as memory:
            run, rows = agentrl_train("scale_two_nodes", *args, timeout_s=480)
        report("Two Ray nodes on one host: TP=2 trainer on the head (GPUs 0,1), a TP=2 SGLang engine on the worker "
               "(GPUs 2,3), NCCL weight sync between them", "agentrl train " + " ".join(args), rows,
               params_of(model), 2, memory)
        placement = json.loads((run / "run.json").read_text())["placement"]
        print("placement:", placement)
        assert set(placement["trainer_nodes"]).isdisjoint(placement["engine_nodes"]), placement
        assert all(r["weight_sync_nccl"] == 1.0 for r in rows), [r.get("weight_sync_nccl") for r in rows]
        checked = [r["weight_check/mean_abs_diff"] for r in rows if "weight_check/mean_abs_diff" in r]
        assert checked and max(checked) < 0.05, checked
        first, last = mean(r["reward_mean"] for r in rows[:3]), mean(r["reward_mean"] for r in rows[-3:])
        print(f"reward: first 3 iterations {first:.4f}, last 3 {last:.4f}")
    finally:
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=base, timeout=120)
