"""Helpers of the GPU suite (tests/gpu): `agentrl train` as a user runs it, on a real GPU with real SGLang (behind
sglang-router) and Megatron. Skipped without CUDA; run through the device kit
(scripts/gpu/build_kit.sh here, scripts/gpu/run.sh SCENARIO there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

OUT = Path(os.environ.get("AGENTRL_GPU_OUT", "/tmp/agentrl-gpu-out"))
KIT = Path(os.environ.get("AGENTRL_KIT", "/root/agentrl-kit"))  # scripts/gpu/run.sh unpacks the kit there

# Random-init Qwen2 shapes over the built-in tiny tokenizer (vocab 512): nothing to download,
# real kernels and sizes. Names say what they stand for.
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
    "135m-tp2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                     num_key_value_heads=2),  # heads divisible by 2: SGLang's --tp-size 2 needs that
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}
def needs_gpus(n: int = 1, reason: str = "the GPU suite needs CUDA: run it with scripts/gpu/run.sh on a GPU machine"):
    """The mark (a module's pytestmark) that skips a scenario on a machine with fewer than `n` GPUs."""
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=reason)


def iters(default: int) -> int:
    """A scenario's number of iterations: AGENTRL_GPU_ITERS where set, else `default`."""
    return int(os.environ.get("AGENTRL_GPU_ITERS", default))


SGLANG = ["--rollout-engine", "sglang", "--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
          "--sglang-grammar-backend", "none"]
COLOCATE = ["--colocate", "--sglang-enable-memory-saver", "--sglang-mem-fraction-static", "0.5"]


def random_qwen2(shape: str) -> Path:
    """A random-init Qwen2 of a named shape (SHAPES) with the tiny tokenizer, bf16, seed 0 (cached)."""
    return random_model(KIT / "models" / f"qwen2-{shape}-tinytok", lambda: tiny_qwen2_config(SHAPES[shape]))


def tiny_qwen2_config(shape: dict, max_positions: int | None = 8192):
    """The built-in tiny model's Qwen2 config with `shape`'s fields, full attention on every layer."""
    from transformers import AutoConfig

    from agentrl.models import build_tiny_model

    config = AutoConfig.from_pretrained(build_tiny_model())
    for k, v in shape.items():
        setattr(config, k, v)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    if max_positions is not None:
        config.max_position_embeddings = max_positions
    return config


def random_model(out: Path, config: Callable[[], Any], build: Callable[[Any], Any] | None = None,
                 device: str = "cpu") -> Path:
    """A random-init model (seed 0, bf16) saved at `out` with the tiny tokenizer; `out` is the cache:
    an existing one is returned as it is. `config()` makes its config (only when it is built);
    `build(config)` the model (default: AutoModelForCausalLM.from_config in bf16), on `device`."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    config = config()
    torch.manual_seed(0)
    with torch.device(device):
        model = build(config) if build else AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    save_with_tiny_tokenizer(model, out)
    if device != "cpu":  # a large model built on the GPU: give its memory back before the run
        del model
        torch.cuda.empty_cache()
    return out


def save_with_tiny_tokenizer(model, out: Path) -> Path:
    """`model` saved at `out` beside the built-in tiny tokenizer's files. Written in this process's
    own folder first: scenarios run side by side build the same model (same seed) at once."""
    from agentrl.models import build_tiny_model

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in build_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, tmp / f.name)
    try:
        tmp.rename(out)
    except OSError:  # the other one finished first: the same seed, the same model
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def agentrl_train(name: str, *args: str, timeout_s: float) -> tuple[Path, list[dict]]:
    """`agentrl train ARGS` as a subprocess, its console streamed; -> (run folder, metrics rows).
    The console log and metrics are copied to the output folder under `name`."""
    run = OUT / name
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "agentrl.cli", "train", *args, "--output-dir", str(run), "--no-progress"]
    print("$ agentrl train", " ".join(args), flush=True)
    t0 = time.time()
    returncode = stream(cmd, OUT / f"{name}.log", timeout_s, what=name)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    if rows:
        shutil.copy2(run / "metrics.jsonl", OUT / f"{name}.metrics.jsonl")
    assert returncode == 0, f"{name}: agentrl train exited {returncode} (log: {OUT / (name + '.log')})"
    print(f"{name}: {len(rows)} iterations in {time.time() - t0:.0f} s", flush=True)
    return run, rows


def stream(cmd: list[str], log_path: Path, timeout_s: float | None = None, what: str = "") -> int:
    """Run `cmd`, its console printed and kept in `log_path`; -> its exit status. Past
    `timeout_s` it is stopped (SIGTERM: agentrl and the benches stop what they started) and
    TimeoutError raised."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                log.write(line)
                print(line, end="", flush=True)
                if timeout_s is not None and time.time() - t0 > timeout_s:
                    raise TimeoutError(f"{what or cmd[0]}: still running after {timeout_s:.0f} s")
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    return proc.returncode


def trajectories(run: Path, rollout_id: int) -> list[dict]:
    path = run / "trajectories" / f"rollout_{rollout_id:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


BF16_PEAK_FLOPS = 989e12  # dense bf16 peak of one H100 SXM or H200


def train_mfu(row: dict, params: float, gpus: int = 1, tokens: str = "trained_tokens",
              seconds: str = "train_s") -> float:
    """A metrics row's train-step MFU: 6 x params x tokens over its `seconds` (the whole step, or a
    part: "train/actor_s") and the GPUs' bf16 peak; 0 for a row without them. `tokens`: "trained_tokens"
    (prompts and responses: every token the passes run through; rows from before that metric fall back
    to the responses) or "generated_tokens" (the responses alone, as the first in-loop figures counted)."""
    n = row.get(tokens, row["generated_tokens"])
    return 6 * params * n / (row[seconds] * gpus * BF16_PEAK_FLOPS) if row.get(seconds) else 0.0


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def run_scale_worker(label: str, gpus: int, model: Path, megatron: dict, *, master_port: int, **opts) -> dict:
    """tests/gpu/scale_moe_worker.py (any HF checkpoint: steps, peak memory, probe logprobs) under
    `torch.distributed.run` on `gpus` GPUs, `opts` as its flags; -> its result, kept at
    $OUT/LABEL.json with the log at $OUT/LABEL.log."""
    out = OUT / f"{label}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", f"--master-port={master_port}",
           str(Path(__file__).resolve().parent / "scale_moe_worker.py"), "--out", str(out), "--model", str(model),
           "--megatron", json.dumps(megatron)]
    for k, v in opts.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    print("$", " ".join(cmd), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    rc = stream(cmd, OUT / f"{label}.log", 540, what=label)
    assert rc == 0, f"{label}: exited {rc} (log: {OUT / f'{label}.log'})"
    result = json.loads(out.read_text())
    steps = result["step_s"][1:] or result["step_s"]  # the first step compiles and warms up
    print(f"{label}: {gpus} GPU(s), step {min(steps):.2f}-{max(steps):.2f} s for {result['tokens_per_step']} tokens "
          f"({result['tokens_per_step'] / min(steps) / gpus:.0f} tok/s/GPU), peak {result['peak_gib_max_rank']:.1f} GiB "
          f"(max over ranks), grad norms {result['grad_norms']}", flush=True)
    return result
