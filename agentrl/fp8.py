"""FP8 rollout with a bf16 trainer (`--rollout-engine sglang --sglang-quantization fp8`).

Why not SGLang's online quantization as it is: given a bf16 checkpoint and `--quantization fp8`,
SGLang's Fp8LinearMethod.process_weights_after_loading quantizes each linear weight once, at
load, and replaces the layer's `weight` Parameter by a new fp8 one (transposed, per-channel
scale) that no longer carries the `weight_loader` SGLang's model.load_weights uses.
update_weights_from_tensor then runs model.load_weights on the bf16 tensors we send and never
runs process_weights_after_loading again: the weights are not re-quantized (and stacked qkv /
gate_up shards find no loader). A block-fp8 *serialized* checkpoint keeps fp8 Parameters with
their loaders (`weight` e4m3, `weight_scale_inv` fp32 per 128 x 128 block, loaded as they
come), so that is what the engine serves, as slime does for fp8 checkpoints
(slime/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py):

- at start, `engine_model_path` writes a block-fp8 copy of the starting weights
  (`quantization_config` {quant_method fp8, e4m3, dynamic activations, weight_block_size
  [128, 128]}) under the run folder, and the engines load that;
- at every sync, `engine_tensors` quantizes the trainer's weights the same way before they
  are sent (each linear layer's `weight` becomes its fp8 `weight` plus `weight_scale_inv`;
  embeddings, norms and the LM head stay in the trainer's dtype).

Per block: scale = max|w| / 448 (at least 1e-10 / 448), q = clamp(w / scale, -448, 448) in
e4m3, w ~ q x scale; a partial block at an edge has its own scale. SGLang's block-fp8 linear
needs every output shard of a merged layer (q, k, v; gate, up) to be a multiple of 128 rows:
`check_fp8_model` refuses a model where one is not (SmolLM2-135M's k/v at 192 rows), naming it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from agentrl.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = (128, 128)
# the linear layers SGLang's Fp8LinearMethod serves (HF names of the Qwen2/Qwen3/Llama families)
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def fp8_requested(cfg) -> bool:
    """Whether the engines serve fp8 (--sglang-quantization, or every worker type's own
    --prefill/--decode-sglang-args). One weight sync feeds every engine one format: a
    quantization given to one worker type only, or different per type, is refused."""
    from agentrl.engines.sglang import engine_arg_values, engine_types

    values = engine_arg_values(cfg, "quantization")
    given = {kind: str(values.get(kind) or "").lower() for kind in engine_types(cfg)}
    if len(set(given.values())) > 1:
        raise ConfigError("SGLang quantization differs between worker types ("
                          + ", ".join(f"{k}: {v or 'none'}" for k, v in given.items()) + "): one weight sync "
                          "sends every engine the same format; give --sglang-quantization to all of them")
    return set(given.values()) == {"fp8"}


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (e4m3 weight of its shape, fp32 scale per block [ceil(M/bm), ceil(N/bn)])."""
    if w.dim() != 2:
        raise ValueError(f"block fp8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    (m, n), (bm, bn) = w.shape, block
    mb, nb = -(-m // bm), -(-n // bn)
    padded = torch.zeros(mb * bm, nb * bn, dtype=torch.float32, device=w.device)
    padded[:m, :n] = w.float()
    blocks = padded.view(mb, bm, nb, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX  # [mb, nb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(mb * bm, nb * bn)[:m, :n].contiguous(), scale


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    (m, n), (bm, bn) = q.shape, block
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :n]
    return q.float() * full


def quantized_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every linear weight as its block-fp8 `weight` and `weight_scale_inv`; the rest as it is."""
    for name, t in named:
        if LINEAR.match(name):
            q, scale = quantize_block_fp8(t)
            yield name, q
            yield name.removesuffix(".weight") + ".weight_scale_inv", scale
        else:
            yield name, t


def engine_tensors(cfg, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """What a weight sync sends: the trainer's tensors, re-quantized to block fp8 when the
    engines serve fp8 (every sync: the trainer's bf16 weights are the truth); unchanged otherwise."""
    return quantized_tensors(named) if fp8_requested(cfg) else named


def check_fp8_model(cfg, model_path: Path) -> None:
    """Refuse, naming the reason, what the fp8 engine path cannot serve."""
    if cfg.rollout.rollout_engine != "sglang":
        raise ConfigError("--sglang-quantization fp8 needs --rollout-engine sglang")
    if cfg.train.weight_sync_mode in ("disk", "delta"):
        raise ConfigError("--sglang-quantization fp8 re-quantizes the weights at every sync in the trainer; "
                          f"--weight-sync-mode {cfg.train.weight_sync_mode} would load the trainer's bf16 files into "
                          "the fp8 engine: use tensor or distributed")
    if cfg.train.lora_rank and cfg.train.lora_sync == "adapter":
        raise ConfigError("--sglang-quantization fp8 with --lora-sync adapter: the adapters would run on fp8 "
                          "base weights that are never re-quantized; use --lora-sync merged")
    config = json.loads((Path(model_path) / "config.json").read_text())
    if config.get("quantization_config"):
        raise ConfigError(f"--sglang-quantization fp8: {model_path} is already quantized "
                          f"({config['quantization_config'].get('quant_method')}); give the bf16 checkpoint")
    if config.get("num_experts") or config.get("num_local_experts"):
        raise ConfigError(f"--sglang-quantization fp8: {model_path} is a mixture of experts, whose expert weights "
                          "agentrl does not quantize (dense Qwen2/Qwen3/Llama only)")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rows = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim,
            "gate_proj": config["intermediate_size"], "up_proj": config["intermediate_size"]}
    bad = {k: v for k, v in rows.items() if v % BLOCK[0]}
    if bad:
        raise ConfigError(f"--sglang-quantization fp8: SGLang's block-fp8 linear needs each merged shard's rows to "
                          f"be a multiple of {BLOCK[0]}; {model_path} has {bad}")


def write_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """A block-fp8 copy of the HF checkpoint `src` (its tokenizer and configs too) in `dst`."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(Path(src).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--sglang-quantization fp8: {src} has no .safetensors weights to quantize")
    for f in files:
        for name, t in load_file(str(f)).items():
            tensors.update({n: v.contiguous() for n, v in quantized_tensors([(name, t)])})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = dict(QUANT_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def engine_model_path(cfg, model_path: Path, run_dir: Path) -> Path:
    """The checkpoint the engines load: `model_path`, or its block-fp8 copy when they serve fp8."""
    if not fp8_requested(cfg):
        return model_path
    check_fp8_model(cfg, model_path)
    return write_fp8_checkpoint(Path(model_path), Path(run_dir) / "engine_fp8")
