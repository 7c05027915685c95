"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, no qkv bias) with
routed experts in every `decoder_sparse_step`-th layer not listed in `mlp_only_layers` (those
keep a dense MLP of `intermediate_size`). The router is a softmax over all experts, top-k,
renormalised when `norm_topk_prob`; no shared expert."""

from agentrl.trainers.megatron.families.common import Family, MoE

MODEL_TYPES = ("qwen3_moe",)


def moe_layers(hf_config) -> tuple[int, ...]:
    """Per layer: 1 routed experts, 0 dense (HF's Qwen2/3-MoE decoder layer rule)."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers))


def num_experts(hf_config) -> int:
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def family_config(hf_config) -> Family:
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("Qwen3-MoE with use_sliding_window=True is not supported by the Megatron trainer")
    moe = MoE(num_experts=num_experts(hf_config), topk=int(hf_config.num_experts_per_tok),
              ffn=int(hf_config.moe_intermediate_size), norm_topk_prob=bool(hf_config.norm_topk_prob),
              layers=moe_layers(hf_config))
    return Family(name="qwen3_moe", qkv_bias=bool(getattr(hf_config, "attention_bias", False)), qk_norm=True, moe=moe)
