"""Peak host memory of each rank during MegatronTrainer.save, on CPU (gloo ranks, the test CPU shim):
the distributed optimizer, TP x DP, a Qwen2-shaped random model (bf16 params, fp32 Adam state).
Not a test: it prints one line per rank and phase; tests/trainers/test_megatron_ckpt_memory.py
holds the bound. Each phase's peak is read from VmHWM, reset (/proc/self/clear_refs 5) as it starts.

    python bench/ckpt_memory.py --tp 2 --dp 2 --hidden 1024 --layers 8     # 4 ranks, ~120M params
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "trainers"))

MB = 2**20


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.models import build_tiny_model

    if (folder / "config.json").exists():
        return folder
    tiny = build_tiny_model()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(2, hidden // 256),
                      max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


def _peak_recorder(peaks: dict[str, int]):
    """timed(name, fn): fn wrapped to record, under name, this rank's peak RSS while it runs."""
    def timed(name, fn):
        def wrapper(*a, **kw):
            _reset_peak()
            try:
                return fn(*a, **kw)
            finally:
                peaks[name] = max(peaks.get(name, 0), _status("VmHWM"))
        return wrapper
    return timed


def measure(trainer, folder: Path) -> dict:
    """Save the checkpoint; per phase, this rank's peak RSS above its RSS before the save."""
    import torch
    from megatron.core import dist_checkpointing

    peaks: dict[str, int] = {}
    timed = _peak_recorder(peaks)

    sharded, dist_save, save_hf = trainer._sharded_state, dist_checkpointing.save, trainer.save_hf
    trainer._sharded_state = timed("sharded_state", sharded)
    dist_checkpointing.save = timed("dist_save", dist_save)
    trainer.save_hf = timed("save_hf", save_hf)
    import gc
    gc.collect()
    base = _status("VmRSS")
    try:
        trainer.save(folder, {"rollout_id": 0})
    finally:
        trainer._sharded_state, dist_checkpointing.save, trainer.save_hf = sharded, dist_save, save_hf
    shard = {"params": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
             "optimizer": 0}
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                shard["optimizer"] += sum(t.numel() * t.element_size()
                                          for t in [p, *opt.optimizer.state[p].values()]
                                          if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"rank": trainer.rank, "base": base, "growth": {k: v - base for k, v in peaks.items()},
            "shard_bytes": shard}


def measure_load(trainer, folder: Path) -> dict:
    """Load the checkpoint back; per phase, this rank's peak RSS above its RSS before the load."""
    import gc

    from megatron.core import dist_checkpointing

    peaks: dict[str, int] = {}
    timed = _peak_recorder(peaks)

    sharded, dist_load, load_state = trainer._sharded_state, dist_checkpointing.load, trainer.optimizer.load_state_dict
    trainer._sharded_state = timed("load_sharded_state", sharded)
    dist_checkpointing.load = timed("dist_load", dist_load)
    trainer.optimizer.load_state_dict = timed("optimizer_load_state_dict", load_state)
    gc.collect()
    base = _status("VmRSS")
    try:
        trainer.load(folder)
    finally:
        trainer._sharded_state, dist_checkpointing.load = sharded, dist_load
        del trainer.optimizer.load_state_dict
    return {k: v - base for k, v in peaks.items()}


def worker(args) -> None:
    import megatron_cpu_shim

    megatron_cpu_shim.apply()
    import torch

    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainers.megatron.trainer import MegatronTrainer
    from megatron_helpers import make_samples

    margs = {"tensor_model_parallel_size": str(args.tp), "use_distributed_optimizer": None}
    trainer = MegatronTrainer(args.model, train=TrainConfig(lr=1e-4, global_batch_size=6, micro_batch_size=2),
                              algo=AlgoConfig(), temperature=1.0, device="cpu", dtype="bfloat16",
                              megatron_args=margs)
    trainer.train_rollout(make_samples())  # fills Adam's moments
    result = measure(trainer, Path(args.ckpt))
    # the saved optimizer state reads back as it was (the save gathers it in pieces, by owner)
    states = [t for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
              for group in opt.optimizer.param_groups for p in group["params"]
              for t in (p, *opt.optimizer.state[p].values()) if t.dim() > 0]
    saved = [t.clone() for t in states]
    for t in states:
        t.zero_()
    result["load_growth"] = measure_load(trainer, Path(args.ckpt))
    result["roundtrip"] = all(torch.equal(a, b) for a, b in zip(saved, states))
    Path(args.out).with_suffix(f".rank{trainer.rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", default="/tmp/ckpt_memory")
    parser.add_argument("--model"), parser.add_argument("--ckpt"), parser.add_argument("--out")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work / f"qwen2_h{args.hidden}_l{args.layers}", args.hidden, args.layers)
    result = report(model, args.tp, args.dp, work)
    print(json.dumps(result))


def report(model: Path, tp: int, dp: int, work: Path, timeout: float = 900) -> list[dict]:
    """Run tp x dp ranks of this script's worker; each rank's figures (MB)."""
    import shutil

    from megatron_helpers import run_ranks

    out = work / "result.json"
    for old in work.glob("result.rank*.json"):
        old.unlink()
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    out.write_text("{}")
    run_ranks(tp * dp, ["--model", str(model), "--ckpt", str(work / "ckpt"), "--tp", str(tp), "--dp", str(dp)],
              out, timeout=timeout, worker=str(Path(__file__).resolve()))
    rows = [json.loads((work / f"result.rank{r}.json").read_text()) for r in range(tp * dp)]
    for r in rows:
        shard = sum(r["shard_bytes"].values())
        print(f"rank {r['rank']}: shard {shard / MB:.0f} MB (params {r['shard_bytes']['params'] / MB:.0f}, "
              f"optimizer {r['shard_bytes']['optimizer'] / MB:.0f}); peak growth above {r['base'] / MB:.0f} MB: "
              + ", ".join(f"{k} {v / MB:.0f} MB" for k, v in {**r["growth"], **r["load_growth"]}.items()),
              flush=True)
    return rows


if __name__ == "__main__":
    main()
