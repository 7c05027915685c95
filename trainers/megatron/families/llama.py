"""Llama 3 / 3.1 / 3.2 (dense): no biases, RMSNorm, SwiGLU, RoPE with "llama3" frequency
scaling (the trainer copies HF's inv_freq, so any scaling HF computes with attention factor 1
is reproduced exactly)."""

from agentrl.trainers.megatron.families.common import Family, check_dense

MODEL_TYPES = ("llama",)


def family_config(hf_config) -> Family:
    check_dense(hf_config)
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        # Megatron's add_bias_linear would put biases on every linear, o_proj and the MLP included.
        raise NotImplementedError("Llama with attention_bias or mlp_bias is not supported by the Megatron trainer")
    return Family(name="llama", qkv_bias=False, qk_norm=False)
