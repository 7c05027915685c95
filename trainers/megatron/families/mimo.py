"""MiMo (XiaomiMiMo/MiMo-7B-*: HF `MiMoForCausalLM`): a Qwen2 decoder (q/k/v biases, RMSNorm,
SwiGLU, RoPE) plus `num_nextn_predict_layers` multi-token-prediction layers
(`model.mtp_layers.K.*`: token/hidden norms, an input projection, a Qwen2 decoder layer and a
final norm), which SGLang's EAGLE draft for MiMo runs. The trainer builds them with
--mtp-num-layers and trains them with --enable-mtp-training (trainers/megatron/mtp.py)."""

from agentrl.trainers.megatron.families.common import Family, check_dense

MODEL_TYPES = ("mimo",)


def mtp_layers(hf_config) -> int:
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def family_config(hf_config) -> Family:
    check_dense(hf_config)
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("MiMo with use_sliding_window=True is not supported by the Megatron trainer")
    return Family(name="mimo", qkv_bias=True, qk_norm=False, mtp=True)
