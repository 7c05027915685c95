"""HF <-> Megatron weight mapping, one small module per model family.

A family module exports `MODEL_TYPES` (the HF `config.model_type` values it takes) and
`family_config(hf_config) -> Family`, saying what differs from the shared dense
decoder layout in `common.py` (qkv bias, qk-norm, ...). Adding a family is adding a module
here and listing it in `FAMILIES`.
"""

from __future__ import annotations

from agentrl.trainers.megatron.families import llama, mimo, qwen2, qwen2_moe, qwen2_vl, qwen3, qwen3_moe
from agentrl.trainers.megatron.families.common import Family

FAMILIES = (qwen2, qwen3, llama, qwen3_moe, qwen2_moe, mimo, qwen2_vl)


def family_for(hf_config) -> Family:
    model_type = getattr(hf_config, "model_type", None)
    for module in FAMILIES:
        if model_type in module.MODEL_TYPES:
            return module.family_config(hf_config)
    known = sorted(t for m in FAMILIES for t in m.MODEL_TYPES)
    raise NotImplementedError(f"the Megatron trainer has no weight mapping for model_type {model_type!r}; "
                              f"supported: {', '.join(known)} (add a module to agentrl/trainers/megatron/families/)")


def language_config(hf_config):
    """The decoder's config: a vision-language model's `text_config`, else the config itself."""
    return hf_config.text_config if getattr(hf_config, "model_type", None) in qwen2_vl.MODEL_TYPES else hf_config
