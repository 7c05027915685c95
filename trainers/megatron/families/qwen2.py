"""Qwen2 / Qwen2.5 (dense): biases on q/k/v only, RMSNorm, SwiGLU, RoPE, optional tied embeddings."""

from agentrl.trainers.megatron.families.common import Family, check_dense

MODEL_TYPES = ("qwen2",)


def family_config(hf_config) -> Family:
    check_dense(hf_config)
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("Qwen2 with use_sliding_window=True is not supported by the Megatron trainer")
    return Family(name="qwen2", qkv_bias=True, qk_norm=False)
