"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (qkv bias) with routed experts
(softmax over all, top-k, renormalised only when `norm_topk_prob`) plus one shared expert of
`shared_expert_intermediate_size` whose output is scaled by a sigmoid gate."""

from agentrl.trainers.megatron.families.common import Family, MoE
from agentrl.trainers.megatron.families.qwen3_moe import moe_layers, num_experts

MODEL_TYPES = ("qwen2_moe",)


def family_config(hf_config) -> Family:
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("Qwen2-MoE with use_sliding_window=True is not supported by the Megatron trainer")
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    moe = MoE(num_experts=num_experts(hf_config), topk=int(hf_config.num_experts_per_tok),
              ffn=int(hf_config.moe_intermediate_size), norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
              layers=moe_layers(hf_config), shared_ffn=shared, shared_gate=bool(shared))
    return Family(name="qwen2_moe", qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), qk_norm=False, moe=moe)
