"""MiMo (XiaomiMiMo/MiMo-7B-*, HF model_type "mimo") for transformers, which has no MiMo class
(the checkpoints ship theirs as remote code). A Qwen2 model with the checkpoint's
multi-token-prediction layers `model.mtp_layers.K.*` as modules of their own names, so that
loading, weight sync (the Megatron trainer sends them with --mtp-num-layers) and saving keep
them; the forward is Qwen2's, the MTP layers unused (the embedded engine and the torch
trainer serve and train the main model; SGLang's EAGLE draft runs the MTP layers).

`register()` makes AutoConfig / AutoModelForCausalLM know "mimo" (idempotent)."""

from __future__ import annotations

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers: int = 0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)


class MiMoMTPLayer(Qwen2DecoderLayer):
    """One MTP layer's parameters, named as MiMo's: a Qwen2 decoder layer (input_layernorm,
    self_attn, post_attention_layernorm, mlp) plus token_layernorm, hidden_layernorm,
    input_proj ([hidden; embedding] -> hidden) and final_layernorm."""

    def __init__(self, config: MiMoConfig):
        super().__init__(config, layer_idx=0)  # as MiMo's own (the layer never runs here)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = Qwen2RMSNorm(h, eps=eps)


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig):
        super().__init__(config)
        self.model.mtp_layers = nn.ModuleList(MiMoMTPLayer(config) for _ in range(config.num_nextn_predict_layers))
        self.post_init()


def register() -> None:
    try:
        AutoConfig.register("mimo", MiMoConfig)
    except ValueError:  # already registered
        return
    AutoModelForCausalLM.register(MiMoConfig, MiMoForCausalLM)
