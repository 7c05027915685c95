"""FP8 rollout's own code (agentrl.fp8): block-fp8 quantization as SGLang's block-fp8 linear
reads it (e4m3 weight, fp32 scale per 128 x 128 block = max|w| / 448), the tensors a sync sends
(each linear weight re-quantized, with its weight_scale_inv), the fp8 checkpoint the engines
start from, and the combinations refused before anything starts. The engine side (SGLang
serving it) is the GPU scenario tests/gpu/test_fp8_gpu.py."""

import json
import shutil

import pytest
import torch

from agentrl.config import parse_config
from agentrl.errors import ConfigError
from agentrl.fp8 import (FP8, dequantize_block_fp8, engine_model_path, engine_tensors, quantize_block_fp8,
                         write_fp8_checkpoint)


def test_block_fp8_scales_each_block_by_its_max_and_round_trips_within_e4m3():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.linspace(0.01, 10, 300)  # columns of very different magnitude
    w[0, 0] = 50.0  # one outlier: only its block's scale grows
    q, scale = quantize_block_fp8(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (2, 3) and scale.dtype == torch.float32
    assert scale[0, 0].item() == pytest.approx(50.0 / 448)
    assert scale[1, 2].item() == pytest.approx(w[128:, 256:].abs().max().item() / 448)  # the partial edge block
    back = dequantize_block_fp8(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each value, plus the subnormal step near 0
    err = (back - w).abs()
    bound = w.abs() * 2 ** -4 + scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300] * 2 ** -9
    assert bool((err <= bound + 1e-7).all())
    assert q.float().abs().max().item() == 448.0  # each block's max maps to e4m3's max
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.ones(3))


def _cfg(*extra):
    cfg, _ = parse_config(["--rollout-engine", "sglang", "--sglang-quantization", "fp8", *extra])
    return cfg


def test_a_sync_sends_linear_weights_as_fp8_with_their_scales_and_the_rest_as_is():
    named = [("model.embed_tokens.weight", torch.randn(10, 128)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(128, 128)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(128)),
             ("model.layers.0.mlp.down_proj.weight", torch.randn(128, 256)),
             ("model.norm.weight", torch.ones(128)), ("lm_head.weight", torch.randn(10, 128))]
    sent = dict(engine_tensors(_cfg(), iter(named)))
    assert list(sent) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                          "model.layers.0.self_attn.q_proj.weight_scale_inv", "model.layers.0.self_attn.q_proj.bias",
                          "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv",
                          "model.norm.weight", "lm_head.weight"]
    assert sent["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert sent["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert sent["lm_head.weight"].dtype == torch.float32
    assert sent["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float32
    # the same weights twice give the same bytes; a changed weight changes its fp8 copy (re-quantized every sync)
    again = dict(engine_tensors(_cfg(), iter(named)))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again[q].view(torch.uint8), sent[q].view(torch.uint8))
    moved = dict(engine_tensors(_cfg(), iter([(q, named[1][1] * 2)])))
    assert torch.equal(moved[q + "_scale_inv"], sent[q + "_scale_inv"] * 2)
    plain, _ = parse_config([])
    assert list(engine_tensors(plain, iter(named))) == named  # no fp8: untouched


def _model(tiny_model, tmp_path, **overrides):
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **overrides}))
    return out, config


def test_the_engines_start_from_a_block_fp8_copy_and_bad_combinations_are_refused(tiny_model, tmp_path):
    from safetensors.torch import load_file

    _, config = _model(tiny_model, tmp_path / "probe")
    heads = config["num_attention_heads"]
    # the tiny model's shards are not multiples of 128 rows: refused, naming them
    with pytest.raises(ConfigError, match="multiple of 128"):
        engine_model_path(_cfg(), tiny_model, tmp_path / "run")
    model, _ = _model(tiny_model, tmp_path, head_dim=128 // heads * 2, num_key_value_heads=heads,
                      intermediate_size=256)
    with pytest.raises(ConfigError, match="--weight-sync-mode disk"):
        engine_model_path(_cfg("--weight-sync-mode", "disk"), model, tmp_path / "run")
    plain, _ = parse_config([])
    assert engine_model_path(plain, model, tmp_path / "run") == model
    # the writer: every linear weight in fp8 with its scale, config marked block fp8 (what SGLang loads)
    out = write_fp8_checkpoint(tiny_model, tmp_path / "fp8")
    tensors = load_file(str(out / "model.safetensors"))
    original = load_file(str(next(tiny_model.glob("*.safetensors"))))
    q = "model.layers.0.mlp.gate_proj.weight"
    assert tensors[q].dtype == FP8 and q.replace(".weight", ".weight_scale_inv") in tensors
    assert torch.allclose(dequantize_block_fp8(tensors[q], tensors[q.replace(".weight", ".weight_scale_inv")]),
                          original[q].float(), rtol=2 ** -4, atol=1e-3)
    assert tensors["model.norm.weight"].dtype == original["model.norm.weight"].dtype
    written = json.loads((out / "config.json").read_text())
    assert written["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}
    assert (out / "tokenizer_config.json").exists() or (out / "tokenizer.json").exists()
    with pytest.raises(ConfigError, match="already quantized"):
        engine_model_path(_cfg(), out, tmp_path / "run")
    moe, _ = _model(tiny_model, tmp_path / "moe", num_experts=4)
    with pytest.raises(ConfigError, match="mixture of experts"):
        engine_model_path(_cfg(), moe, tmp_path / "run")
    with pytest.raises(ConfigError, match="--rollout-engine sglang"):
        engine_model_path(parse_config(["--sglang-quantization", "fp8"])[0], model, tmp_path / "run")
