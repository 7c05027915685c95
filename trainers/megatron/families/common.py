"""The decoder layout shared by Qwen2/2.5, Qwen3, Llama 3 and the Qwen MoE families, and its
HF <-> Megatron mapping.

Megatron (local or Transformer Engine layer spec) fuses what HF keeps apart:

- q/k/v -> `linear_qkv`, grouped by query group: for each of the `ng` KV heads, its
  `nh/ng` query heads, then its key head, then its value head (rows of head_dim each).
  Tensor parallelism splits the groups, so a TP shard is a contiguous slice of the rows.
- gate/up -> `linear_fc1`: each TP rank holds [its slice of gate; its slice of up], so the
  gathered tensor is [gate_0; up_0; gate_1; up_1; ...].
- o_proj, down_proj are row-parallel (split on the input dim); embeddings and lm_head are
  vocab-parallel (rows padded to a multiple of TP with zeros, cut off again on export).
- Norms (and Qwen3's per-head q/k norms) are replicated.
- With the TE spec the pre-attention and pre-MLP norms live inside the fused linears
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).

- Mixture-of-experts layers (`Family.moe`): the router (`mlp.router.weight`, HF `mlp.gate.weight`)
  is replicated; each expert is a gate/up + down pair like the dense MLP, split by the expert
  tensor-parallel size (ETP) instead of TP, and expert parallelism (EP) gives each EP rank a
  contiguous block of experts. Names here carry the *global* expert index
  (`mlp.experts.local_experts.E.linear_fc1.weight`, HF `mlp.experts.E.gate_proj.weight`), as
  they carry the global layer index. Qwen2-MoE's shared expert is a TP-split dense MLP
  (`mlp.shared_experts.*`) with a replicated sigmoid gate (`gate_weight`).
- Vision-language models (`Family.vision`, Qwen2-VL / Qwen2.5-VL): the vision tower is the HF
  module itself inside the Megatron model, so its parameters keep their checkpoint names
  (`visual.*`) and are copied whole (replicated on every rank).
- Multi-token-prediction layers (`Family.mtp`, MiMo: HF `model.mtp_layers.K.*`): megatron-core's
  MTP block `mtp.layers.K.*` (trainers/megatron/mtp.py). Its norms `enorm`/`hnorm`/`final_layernorm`
  are HF's `token_layernorm`/`hidden_layernorm`/`final_layernorm`; `eh_proj` (column-parallel) is
  HF's `input_proj` with the two halves of its input swapped (megatron-core concatenates
  [embedding; hidden], MiMo [hidden; embedding]); `transformer_layer.*` (megatron-core 0.19:
  `mtp_model_layer.*`) is a decoder layer named as `model.layers.*`'s, under `model.mtp_layers.K.`.

`to_megatron_shard` and `to_hf` are exact inverses (pure reshapes and slices), so an
HF -> Megatron -> HF round trip reproduces every tensor bit for bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts decoder: which layers route, and how."""
    num_experts: int
    topk: int
    ffn: int  # each routed expert's intermediate size
    norm_topk_prob: bool  # renormalise the top-k probabilities (Qwen3-MoE: yes; Qwen2-MoE: config)
    layers: tuple[int, ...]  # per decoder layer: 1 routed experts, 0 a dense MLP
    shared_ffn: int = 0  # Qwen2-MoE's shared expert (0: none)
    shared_gate: bool = False  # its sigmoid gate


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool
    qk_norm: bool
    moe: MoE | None = None
    mtp: bool = False  # the checkpoint's multi-token-prediction layers map (MiMo's model.mtp_layers.*)
    vision: bool = False  # a vision-language model: multimodal RoPE and an HF vision tower (`visual.*`)


def check_dense(hf_config) -> None:
    """Refuse a dense family's model_type carrying experts (they would be silently dropped)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(hf_config, key, None):
            raise NotImplementedError(f"{hf_config.model_type} with {key}={getattr(hf_config, key)}: MoE models are not "
                                      "supported by the Megatron trainer yet (dense only)")


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)


@dataclass(frozen=True)
class Layout:
    """What the mapping needs to know about a model and its parallel split."""
    num_heads: int
    num_groups: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    padded_vocab: int
    tp: int
    tied: bool
    te_spec: bool = False
    num_experts: int = 0  # MoE: routed experts per layer, over `ep` ranks, each split over `etp`
    ep: int = 1
    etp: int = 1
    mtp_layers: int = 0  # multi-token-prediction layers built in the Megatron model (--mtp-num-layers)

    @classmethod
    def from_hf(cls, hf_config, tp: int, padded_vocab: int, te_spec: bool = False, *, ep: int = 1,
                etp: int | None = None, num_experts: int = 0, mtp_layers: int = 0) -> "Layout":
        return cls(num_heads=hf_config.num_attention_heads, num_groups=hf_config.num_key_value_heads,
                   head_dim=head_dim(hf_config), hidden=hf_config.hidden_size, ffn=hf_config.intermediate_size,
                   vocab=hf_config.vocab_size, padded_vocab=padded_vocab, tp=tp,
                   tied=bool(getattr(hf_config, "tie_word_embeddings", False)), te_spec=te_spec,
                   num_experts=num_experts, ep=ep, etp=tp if etp is None else etp, mtp_layers=mtp_layers)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep


# Megatron local-spec parameter names (layer index = global, 0-based) -> (kind, HF names).
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TE_RENAMES = {  # TE spec name -> local spec name
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LOCAL_TO_TE = {v: k for k, v in _TE_RENAMES.items()}
# routed experts, global layer and expert index: SequentialMLP's names (local spec)...
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
# ... and TEGroupedMLP's (one weight per local expert): `mlp.experts.linear_fc1.weight3`
_TE_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")
_ANY_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts)\.(\d+)\.(.+)$")
# multi-token-prediction layers: megatron-core's MTP block (0.16: `transformer_layer`, 0.19: `mtp_model_layer`)
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_OWN = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
            "final_layernorm.weight": "final_layernorm.weight"}


def expert_index(name: str) -> int | None:
    """The expert index in a routed expert's parameter name (local spec terms), else None."""
    m = _ANY_EXPERT.match(name)
    return int(m.group(2)) if m else None


def with_expert(name: str, index: int) -> str:
    """A routed expert's parameter name with another expert index."""
    m = _ANY_EXPERT.match(name)
    return f"{m.group(1)}.{index}.{m.group(3)}"


def hf_sources(name: str, family: Family, layout: Layout) -> tuple[str, list[str]]:
    """(kind, HF names) for one Megatron parameter named with its *global* layer index.
    kind: replicated | column | row | vocab | qkv | qkv_bias | gate_up | eh_proj."""
    if name == "embedding.word_embeddings.weight":
        return "vocab", ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return "vocab", ["model.embed_tokens.weight" if layout.tied else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return "replicated", ["model.norm.weight"]
    if family.vision and name.startswith("visual."):
        return "replicated", [name]
    e = _EXPERT.match(name)
    if e:
        i, x, which = int(e.group(1)), int(e.group(2)), e.group(3)
        p = f"model.layers.{i}.mlp.experts.{x}."
        if which == "linear_fc1":
            return "expert_gate_up", [p + "gate_proj.weight", p + "up_proj.weight"]
        return "expert_row", [p + "down_proj.weight"]
    mtp = _MTP.match(name)
    if mtp and family.mtp:
        k, rest = int(mtp.group(1)), mtp.group(2)
        p = f"model.mtp_layers.{k}."
        if rest in _MTP_OWN:
            return "replicated", [p + _MTP_OWN[rest]]
        if rest == "eh_proj.weight":
            return "eh_proj", [p + "input_proj.weight"]
        rest = rest.removeprefix("transformer_layer.")
        return _layer_sources(name, _TE_RENAMES.get(rest, rest), p, family)
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF counterpart for Megatron parameter {name}")
    i, rest = int(m.group(1)), m.group(2)
    return _layer_sources(name, _TE_RENAMES.get(rest, rest), f"model.layers.{i}.", family)


def _layer_sources(name: str, rest: str, p: str, family: Family) -> tuple[str, list[str]]:
    """(kind, HF names) of a decoder layer's parameter `rest` (local spec terms), HF prefix p."""
    table = {
        "input_layernorm.weight": ("replicated", [p + "input_layernorm.weight"]),
        "pre_mlp_layernorm.weight": ("replicated", [p + "post_attention_layernorm.weight"]),
        "self_attention.linear_qkv.weight": ("qkv", [p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
        "self_attention.linear_proj.weight": ("row", [p + "self_attn.o_proj.weight"]),
        "mlp.linear_fc1.weight": ("gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
        "mlp.linear_fc2.weight": ("row", [p + "mlp.down_proj.weight"]),
    }
    if family.moe is not None:
        table["mlp.router.weight"] = ("replicated", [p + "mlp.gate.weight"])
        s = p + "mlp.shared_expert."
        table["mlp.shared_experts.linear_fc1.weight"] = ("gate_up", [s + "gate_proj.weight", s + "up_proj.weight"])
        table["mlp.shared_experts.linear_fc2.weight"] = ("row", [s + "down_proj.weight"])
        table["mlp.shared_experts.gate_weight"] = ("replicated", [p + "mlp.shared_expert_gate.weight"])
    if family.qkv_bias:
        table["self_attention.linear_qkv.bias"] = ("qkv", [p + f"self_attn.{x}_proj.bias" for x in "qkv"])
    if family.qk_norm:
        table["self_attention.q_layernorm.weight"] = ("replicated", [p + "self_attn.q_norm.weight"])
        table["self_attention.k_layernorm.weight"] = ("replicated", [p + "self_attn.k_norm.weight"])
    if rest not in table:
        raise KeyError(f"no HF counterpart for Megatron parameter {name} ({family.name})")
    return table[rest]


def megatron_names(num_layers: int, family: Family, layout: Layout, *, first: bool = True, last: bool = True,
                   layers: range | None = None) -> list[str]:
    """The Megatron parameter names (global layer indices) of one pipeline stage."""
    names = ["embedding.word_embeddings.weight"] if first else []
    for i in (layers if layers is not None else range(num_layers)):
        p = f"decoder.layers.{i}."
        names += _attention_names(p, family)
        moe = family.moe
        if moe is None or not moe.layers[i]:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
            continue
        names.append(p + "mlp.router.weight")
        for x in range(moe.num_experts):
            names += [p + f"mlp.experts.local_experts.{x}.linear_fc{k}.weight" for k in (1, 2)]
        if moe.shared_ffn:
            names += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"]
            if moe.shared_gate:
                names.append(p + "mlp.shared_experts.gate_weight")
    if last:
        names.append("decoder.final_layernorm.weight")
        if not layout.tied:
            names.append("output_layer.weight")
        for k in range(layout.mtp_layers):  # megatron-core's MTP block sits on the last stage
            p = f"mtp.layers.{k}."
            names += [p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight"]
            names += _attention_names(p + "transformer_layer.", family)
            names += [p + f"transformer_layer.mlp.linear_fc{j}.weight" for j in (1, 2)]
            names.append(p + "final_layernorm.weight")
    return names


def _attention_names(p: str, family: Family) -> list[str]:
    """A decoder layer's names (prefix p) up to and with its pre-MLP norm."""
    names = [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
    if family.qkv_bias:
        names.append(p + "self_attention.linear_qkv.bias")
    if family.qk_norm:
        names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    return names + [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]


def local_spec_name(name: str) -> str:
    """A TE-spec parameter name in the local spec's terms (identity for local names)."""
    e = _TE_EXPERT.match(name)
    if e:
        return f"{e.group(1)}.local_experts.{e.group(3)}.{e.group(2)}.weight"
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_RENAMES:
        return f"decoder.layers.{m.group(1)}.{_TE_RENAMES[m.group(2)]}"
    mtp = _MTP.match(name)
    if mtp:
        rest = mtp.group(2).replace("mtp_model_layer.", "transformer_layer.", 1)
        inner = rest.removeprefix("transformer_layer.")
        if inner != rest and inner in _TE_RENAMES:
            rest = "transformer_layer." + _TE_RENAMES[inner]
        return f"mtp.layers.{mtp.group(1)}.{rest}"
    return name


def spec_name(name: str, layout: Layout) -> str:
    """A local-spec name in the terms of the spec in use."""
    if not layout.te_spec:
        return name
    m = _LAYER.match(name)
    if m and m.group(2) in _LOCAL_TO_TE:
        return f"decoder.layers.{m.group(1)}.{_LOCAL_TO_TE[m.group(2)]}"
    return name


# -- full HF tensors -> this TP rank's Megatron shard -----------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's group-interleaved rows."""
    ng, d = layout.num_groups, layout.head_dim
    per = layout.num_heads // ng
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(ng, per * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1)
    return fused.reshape(ng * (per + 2) * d, *tail)


def split_qkv(fused: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, d = layout.num_groups, layout.head_dim
    per = layout.num_heads // ng
    tail = fused.shape[1:]
    g = fused.reshape(ng, (per + 2) * d, *tail)
    q, k, v = g.split([per * d, d, d], dim=1)
    return (q.reshape(ng * per * d, *tail).contiguous(), k.reshape(ng * d, *tail).contiguous(),
            v.reshape(ng * d, *tail).contiguous())


def split_size(kind: str, layout: Layout) -> int:
    """How many ranks share a tensor of this kind: ETP for routed experts, TP for the rest."""
    return layout.etp if kind.startswith("expert_") else layout.tp


def to_megatron_shard(kind: str, hf: list[torch.Tensor], layout: Layout, tp_rank: int) -> torch.Tensor:
    """tp_rank: the rank within split_size(kind) (the expert-TP rank for routed experts)."""
    tp = split_size(kind, layout)
    kind = kind.removeprefix("expert_")
    if kind == "replicated":
        return hf[0]
    if kind == "column":
        return hf[0].chunk(tp, dim=0)[tp_rank]
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if kind == "vocab":
        w = hf[0]
        if layout.padded_vocab > w.shape[0]:
            w = torch.cat([w, w.new_zeros(layout.padded_vocab - w.shape[0], *w.shape[1:])])
        return w.chunk(tp, dim=0)[tp_rank]
    if kind == "qkv":
        return fuse_qkv(*hf, layout).chunk(tp, dim=0)[tp_rank]
    if kind == "gate_up":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    if kind == "eh_proj":
        return swap_halves(hf[0]).chunk(tp, dim=0)[tp_rank]
    raise ValueError(kind)


def swap_halves(w: torch.Tensor) -> torch.Tensor:
    """An MTP input projection's [out, 2 h] weight with its input halves swapped: MiMo's
    [hidden; embedding] <-> megatron-core's [embedding; hidden] (its own inverse)."""
    a, b = w.chunk(2, dim=1)
    return torch.cat([b, a], dim=1)


def gather_dim(kind: str) -> int | None:
    """The dimension TP shards are concatenated along (None: replicated)."""
    return {"replicated": None, "column": 0, "row": 1, "vocab": 0, "qkv": 0, "gate_up": 0,
            "eh_proj": 0}[kind.removeprefix("expert_")]


def to_hf(kind: str, full: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """A Megatron tensor with its TP shards concatenated (see gather_dim) -> the HF tensors."""
    tp = split_size(kind, layout)
    kind = kind.removeprefix("expert_")
    if kind in ("replicated", "column", "row"):
        return [full]
    if kind == "vocab":
        return [full[:layout.vocab]]
    if kind == "qkv":
        return list(split_qkv(full, layout))
    if kind == "eh_proj":
        return [swap_halves(full)]
    if kind == "gate_up":
        parts = full.reshape(tp, 2, full.shape[0] // (2 * tp), *full.shape[1:])
        return [parts[:, 0].reshape(-1, *full.shape[1:]).contiguous(),
                parts[:, 1].reshape(-1, *full.shape[1:]).contiguous()]
    raise ValueError(kind)
