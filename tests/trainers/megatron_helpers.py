"""Shared by the Megatron tests and their worker processes: deterministic toy rollouts and
launching N CPU ranks (gloo) of megatron_worker.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_samples(n: int = 6, vocab: int = 500, seed: int = 0):
    """Multi-turn toy trajectories: prompt, policy tokens, env tokens, policy tokens; two groups,
    rewards alternating 0/1, rollout logprobs slightly off the trainer's (so TIS has work)."""
    import torch

    from agentrl.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = Sample(prompt_tokens=torch.randint(3, vocab, (5 + i,), generator=g).tolist(), group_id=i // 3,
                   reward=float(i % 2), trajectory_id=f"t{i}")
        s.append_generated(torch.randint(3, vocab, (4,), generator=g).tolist(), [-6.0] * 4, 0)
        s.append_observation(torch.randint(3, vocab, (3,), generator=g).tolist())
        s.append_generated(torch.randint(3, vocab, (2 + i,), generator=g).tolist(), [-6.2] * (2 + i), 0)
        s.validate()
        out.append(s)
    return out


def image_url(colour: str, size=(16, 24)) -> str:
    """A one-colour PNG data URL; 16 wide, 24 high: 2 x 3 tokens of the tiny VLM's (models.build_tiny_vlm)."""
    import base64

    from vision_helpers import png

    return "data:image/png;base64," + base64.b64encode(png(colour, size)).decode()


def image_sample(processor, colour: str, response: list[int], **fields):
    """A VLM sample: a prompt with one image (the processor's ids) and a response."""
    from agentrl.types import Sample
    from agentrl.vision import open_data_url

    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Which colour?<|im_end|>\n"
            "<|im_start|>assistant\n")
    image = image_url(colour)
    ids = processor(text=[text], images=[open_data_url(image)], add_special_tokens=False)["input_ids"][0]
    s = Sample(prompt_tokens=list(ids), images=[image], **{"trajectory_id": colour, **fields})
    s.append_generated(response, [-1.0] * len(response), 0)
    return s


def text_sample(processor, response: list[int], **fields):
    """A VLM sample with no image."""
    from agentrl.types import Sample

    ids = processor.tokenizer("<|im_start|>user\nthe red city<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    s = Sample(prompt_tokens=list(ids), **{"trajectory_id": "text", **fields})
    s.append_generated(response, [-1.0] * len(response), 0)
    return s


def make_vlm_samples(processor):
    """make_samples' shape for a VLM: 6 samples in two groups, rewards alternating 0/1, two of each
    group's three with an image (red or blue), rollout logprobs off the trainer's (TIS has work)."""
    out = []
    for i in range(6):
        response = [40 + i, 41, 42 + i % 3][:2 + i % 2]
        fields = dict(group_id=i // 3, reward=float(i % 2), trajectory_id=f"t{i}")
        s = text_sample(processor, response, **fields) if i % 3 == 2 else \
            image_sample(processor, ("red", "blue")[i % 2], response, **fields)
        s.rollout_logprobs = [-6.0] * len(response)
        out.append(s)
    return out


def leave_together() -> None:
    """A worker's last line: every rank reaches the barrier, then the process group goes. A rank
    that exits while another still holds its gloo connection can abort at exit ("terminate
    called without an active exception": CI saw it on a CP x EP run whose results were fine)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, args: list[str], out: Path, timeout: float = 420, worker: str = "megatron_worker.py") -> dict:
    """Start `world` gloo ranks of `worker` (a script here); return rank 0's JSON result. A rank
    that fails stops the others at once (they would wait for it in a collective until the
    timeout) and the error shows its log; at the timeout every rank's log tail is shown."""
    import time

    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        logs.append(open(out.with_name(f"{out.stem}.rank{rank}.log"), "w+"))
        procs.append(subprocess.Popen([sys.executable, str(HERE / worker), "--out", str(out), *args],
                                      env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True))

    def tails(ranks) -> str:
        parts = []
        for rank in ranks:
            logs[rank].seek(0)
            parts.append(f"--- rank {rank} (exit {procs[rank].poll()}):\n{logs[rank].read()[-4000:]}")
        return "\n".join(parts)

    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [rank for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
            assert not failed, f"rank {failed[0]} failed:\n{tails(failed)}"
            assert time.monotonic() < deadline, f"ranks still running after {timeout:.0f} s:\n{tails(range(world))}"
            time.sleep(0.2)
        failed = [rank for rank, p in enumerate(procs) if p.returncode != 0]
        assert not failed, f"rank {failed[0]} failed:\n{tails(failed)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in logs:
            f.close()
    return json.loads(out.read_text())


def tiny_family_model(folder: Path, family: str, tokenizer_from: Path | None = None) -> Path:
    """A random tiny HF checkpoint of another family (Qwen3: qk-norm, tied, explicit head_dim;
    Llama 3: llama3 RoPE scaling, untied; Qwen3-MoE: 8 experts top-2 renormalised, 4 layers,
    the third dense (mlp_only_layers); Qwen2-MoE: qkv bias, shared expert with its gate, top-2
    not renormalised), saved with safetensors."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(1)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    elif family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16, tie_word_embeddings=False, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[2]))
    elif family == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False))
    else:
        raise ValueError(family)
    with torch.no_grad():  # norms away from 1 so a missed mapping would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # routers: clear preferences, no near-ties
                p.normal_(0.0, 0.5)
            elif "bias" in name or "experts" in name or "shared_expert" in name:  # HF may start these at 0
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_from, folder)
    return folder


def one_process_reference(model, algo: dict, samples=None) -> dict:
    """The one-process Megatron trainer on make_samples(): logprobs before and after one step,
    the step's metrics and the exported tensor names (what the multi-rank layouts are held to).
    The caller has applied megatron_cpu_shim."""
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainers.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(str(model), train=TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2),
                              algo=AlgoConfig(**algo), temperature=0.8, device="cpu", dtype="float32")
    samples = samples or make_samples()
    before = trainer.compute_logprobs(samples)
    metrics = trainer.train_rollout(samples)
    return {"before": before, "metrics": metrics, "after": trainer.compute_logprobs(samples),
            "names": sorted(n for n, _ in trainer.named_tensors())}


def assert_same_step(a: dict, b: dict) -> None:
    """Two run_ranks results took the same optimizer step: loss, gradient norm and weights after."""
    import pytest

    for key in ("loss", "pg_loss", "grad_norm"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    diff = max(abs(x - y) for ra, rb in zip(a["after"], b["after"]) for x, y in zip(ra, rb))
    assert diff < 1e-5, diff


def tiny_mimo_model(folder: Path, tokenizer_from: Path | None = None, *, mtp_layers: int = 1, seed: int = 1,
                    dtype=None, **shape) -> Path:
    """A random tiny MiMo checkpoint: a Qwen2 (HF's Qwen2 classes, untied like MiMo-7B) plus
    `mtp_layers` multi-token-prediction layers written by MiMo's tensor names
    (`model.mtp_layers.K.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}` and a
    decoder layer's), config.json with model_type mimo / MiMoForCausalLM (transformers has no
    MiMo class). `shape`: Qwen2Config fields over the small default."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=640000.0,
                  tie_word_embeddings=False)
    fields.update(shape)
    model = Qwen2ForCausalLM(Qwen2Config(**fields))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a missed mapping would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.to(dtype or torch.float32).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    h = fields["hidden_size"]
    for k in range(mtp_layers):
        p = f"model.mtp_layers.{k}."
        for name, t in list(tensors.items()):
            if name.startswith("model.layers.0."):  # a decoder layer's tensors, fresh values
                rest = name.removeprefix("model.layers.0.")
                fresh = torch.rand_like(t.float()) + 0.5 if "norm" in rest else torch.randn_like(t.float()) * 0.05
                tensors[p + rest] = fresh.to(t.dtype)
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            tensors[p + norm + ".weight"] = (torch.rand(h) + 0.5).to(tensors["model.norm.weight"].dtype)
        tensors[p + "input_proj.weight"] = (torch.randn(h, 2 * h) * 0.05).to(tensors["model.norm.weight"].dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=mtp_layers)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_from, folder)
    return folder


def copy_tokenizer(source: Path | None, folder: Path) -> None:
    """The tokenizer files of `source` (an HF folder) into `folder`; nothing when `source` is None."""
    import shutil

    if source is None:
        return
    for f in source.glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    for f in ("special_tokens_map.json", "chat_template.jinja"):
        if (source / f).exists():
            shutil.copy(source / f, folder / f)
