"""Qwen3 (dense): per-head RMSNorm on queries and keys (q_norm/k_norm), no qkv bias by
default, explicit head_dim."""

from agentrl.trainers.megatron.families.common import Family, check_dense

MODEL_TYPES = ("qwen3",)


def family_config(hf_config) -> Family:
    check_dense(hf_config)
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("Qwen3 with use_sliding_window=True is not supported by the Megatron trainer")
    return Family(name="qwen3", qkv_bias=bool(getattr(hf_config, "attention_bias", False)), qk_norm=True)
