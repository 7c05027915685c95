"""Qwen2-VL / Qwen2.5-VL: a Qwen2 decoder (q/k/v biases, RMSNorm, SwiGLU) with multimodal RoPE
(`mrope_section`: the rotary channels split over the temporal, height and width positions),
and a vision tower whose image embeddings take the place of the image tokens' word embeddings.

The decoder is megatron-core's GPTModel (position_embedding_type "mrope"); the tower is the HF
module itself (trainers/megatron/vision.py), replicated on every rank. Checkpoint names: the
decoder's are Qwen2's (`model.layers.*`, `model.embed_tokens.weight`, `lm_head.weight`), the
tower's are `visual.*`, copied as they are."""

from agentrl.models import VISION_FAMILIES
from agentrl.trainers.megatron.families.common import Family, check_dense

MODEL_TYPES = VISION_FAMILIES  # the families agentrl/vision.py serves and the torch trainer trains


def family_config(hf_config) -> Family:
    text = hf_config.text_config
    check_dense(text)
    if getattr(text, "use_sliding_window", False):
        raise NotImplementedError(f"{hf_config.model_type} with use_sliding_window=True is not supported by the "
                                  "Megatron trainer")
    return Family(name=hf_config.model_type, qkv_bias=True, qk_norm=False, vision=True)
