"""LoRA adapters on the Megatron model's linear layers (--lora-rank), in peft's terms.

Megatron fuses what peft adapts one by one (q/k/v -> `linear_qkv`, gate/up -> `linear_fc1`), so
each fused linear holds one (A, B) pair per HF module it hosts, named after it
(`linear_qkv.lora.q_proj.A`), and adds their outputs at that module's rows of the fused output.
The pairs are exactly peft's `lora_A.weight` / `lora_B.weight` (scale lora_alpha / r), so the
export is a peft adapter and the merge is W + scale B A per HF weight.

Tensor parallelism follows the base layer:
- column-parallel base (qkv, fc1; output split): A replicated, B split on its output rows the way
  the HF weight's rows are split (a contiguous chunk per rank). The small [tokens, r] activation
  x A^T goes through copy_to_tensor_model_parallel_region, so A's gradient and the input's come
  out whole and identical on every rank.
- row-parallel base (proj, fc2; input split): A split on its input columns, B replicated. x A^T is
  summed over TP (all-reduce, or reduce-scatter under sequence parallelism, as the base's output);
  under SP each rank sees only its tokens, so B is tagged `sequence_parallel` and
  finalize_model_grads sums its gradient.
The base weights are frozen (requires_grad False): DDP keeps no grad buffer and the optimizer no
state for them. The --lora-trainable-modules (HF module names, as peft's modules_to_save) are
trained whole instead: the Megatron parameters whose HF sources they are stay trainable
(`whole_trained`); a fused parameter trains only when every HF module in it is named.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch

# Megatron linear (local-spec name) -> the HF modules it hosts, in its fused order, and how it is split.
FUSED = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": (("o_proj",), "row"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": (("down_proj",), "row"),
}
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_key(layer: int, module: str, which: str) -> str:
    """peft's saved name of one adapter matrix of the HF model (which: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{HF_PARENT[module]}.{module}.lora_{which}.weight"


def hf_out_features(module: str, layout) -> int:
    d = layout.head_dim
    return {"q_proj": layout.num_heads * d, "k_proj": layout.num_groups * d, "v_proj": layout.num_groups * d,
            "o_proj": layout.hidden, "gate_proj": layout.ffn, "up_proj": layout.ffn, "down_proj": layout.hidden}[module]


def hf_in_features(module: str, layout) -> int:
    return {"o_proj": layout.num_heads * layout.head_dim, "down_proj": layout.ffn}.get(module, layout.hidden)


class LoraPair(torch.nn.Module):
    """This rank's part of one HF module's adapter: A [r, in(/tp)], B [out(/tp), r]."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)


class LoraAdapters(torch.nn.Module):
    """The adapters of one fused linear (a submodule `lora` of it; its forward is wrapped)."""

    def __init__(self, pairs: dict[str, LoraPair], *, kind: str, modules: tuple[str, ...], rank: int, scale: float,
                 dropout: float, layout, sequence_parallel: bool, norm=None):
        super().__init__()
        self.pairs = torch.nn.ModuleDict(pairs)
        self.kind, self.modules_order, self.rank, self.scale = kind, modules, rank, scale
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.layout, self.sp, self.norm = layout, sequence_parallel, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        tp = self.layout.tp
        if self.kind == "row":
            pair = next(iter(self.pairs.values()))
            h = self.dropout(x) @ pair.A.t()
            if tp > 1:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sp
                     else mappings.reduce_from_tensor_model_parallel_region(h))
            return (h @ pair.B.t()) * self.scale
        if self.sp and tp > 1:  # the base gathers the sequence too; the grad comes back whole (see copy_to below)
            x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        if self.norm is not None:  # TE's fused layernorm-linear: the adapter sees the normed input too
            x = self.norm(x)
        names = list(self.pairs)
        h = self.dropout(x) @ torch.cat([self.pairs[n].A for n in names]).t()
        if tp > 1:
            h = mappings.copy_to_tensor_model_parallel_region(h)
        deltas = {n: (part @ self.pairs[n].B.t()) * self.scale for n, part in zip(names, h.split(self.rank, dim=-1))}
        lead = h.shape[:-1]
        outs = []
        for m in self.modules_order:
            rows = hf_out_features(m, self.layout) // tp
            outs.append(deltas[m] if m in deltas else h.new_zeros(*lead, rows))
        if self.modules_order[0] == "q_proj":  # Megatron's qkv rows: per query group, its q heads, k head, v head
            ng = self.layout.num_groups // tp
            outs = [o.reshape(*lead, ng, -1) for o in outs]
            return torch.cat(outs, dim=-1).reshape(*lead, -1)
        return torch.cat(outs, dim=-1)  # fc1: [gate; up] of this rank


def _te_rms_norm(linear, config):
    weight = linear.layer_norm_weight
    zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))

    def norm(x):
        w = weight.float() + 1 if zero_centered else weight.float()
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w, config.layernorm_epsilon).to(x.dtype)
    return norm


def init_pair(key_a: str, module: str, layout, rank: int, seed: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's initial adapter in HF shapes: A kaiming-uniform (bound 1/sqrt(in)), B zero. Drawn from a
    generator seeded by the adapter's name, so every TP/DP rank and every layout draws the same A."""
    fan_in = hf_in_features(module, layout)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key_a.encode()))
    a = (torch.rand(rank, fan_in, generator=g) * 2 - 1) / math.sqrt(fan_in)
    return a.to(dtype), torch.zeros(hf_out_features(module, layout), rank, dtype=dtype)


def shard(which: str, kind: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP shard of a full HF-shaped adapter matrix (see the module doc)."""
    if kind == "column" and which == "B":
        return full.chunk(tp, dim=0)[tp_rank].contiguous()
    if kind == "row" and which == "A":
        return full.chunk(tp, dim=1)[tp_rank].contiguous()
    return full.contiguous()


def split_dim(which: str, kind: str) -> int | None:
    return 0 if (kind, which) == ("column", "B") else 1 if (kind, which) == ("row", "A") else None


def _names_module(hf_weight: str, key: str) -> bool:
    """Whether --lora-trainable-modules' `key` names a module holding `hf_weight` (peft's rule: a
    module name equal to the key or ending with "." + key)."""
    parts = hf_weight.split(".")[:-1]
    return any(m == key or m.endswith("." + key) for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)))


def whole_trained(names: list[str], family, layout, num_layers: int) -> set[str]:
    """The Megatron parameters (global local-spec names, every stage's) that the
    --lora-trainable-modules `names` train whole: those whose HF weights all lie in named modules.
    A name that matches nothing, or part of a fused parameter only, is refused."""
    from agentrl.errors import ConfigError
    from agentrl.trainers.megatron.families.common import hf_sources, megatron_names

    out, used = set(), set()
    for name in megatron_names(num_layers, family, layout):
        sources = hf_sources(name, family, layout)[1]
        hit = {s: [k for k in names if _names_module(s, k)] for s in sources}
        named = [s for s in sources if hit[s]]
        if named and len(named) < len(sources):
            raise ConfigError(f"--lora-trainable-modules {','.join(sorted({k for s in named for k in hit[s]}))}: "
                              f"the Megatron trainer holds {', '.join(named)} in one parameter ({name}) with "
                              f"{', '.join(s for s in sources if not hit[s])}; name those modules too")
        if named:
            out.add(name)
            used.update(k for s in named for k in hit[s])
    missing = [k for k in names if k not in used]
    if missing:
        tied = " (its LM head is the tied embed_tokens)" if layout.tied and "lm_head" in missing else ""
        raise ConfigError(f"--lora-trainable-modules: the model has no module {missing}{tied} (e.g. model.norm, "
                          "embed_tokens)")
    return out


def add_lora(model, train, layout, *, family, tp_rank: int, seed: int = 0) -> tuple[list[str], set[str]]:
    """Freeze `model` except the --lora-trainable-modules and put adapters on the --target-modules'
    linears; returns the HF module names adapted and the Megatron parameters trained whole
    (`whole_trained`). Call after the base weights are loaded and before DDP and the optimizer are built."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from agentrl.config import lora_target_modules, lora_trainable_modules
    from agentrl.trainers.megatron.weights import layer_offset, model_params

    targets = lora_target_modules(train.target_modules)
    whole = whole_trained(lora_trainable_modules(train.lora_trainable_modules), family, layout,
                          model.config.num_layers)
    model.requires_grad_(False)
    for name, param in model_params(model, layout):  # a tied last stage's output layer: the embedding's copy
        tied_output = name == "output_layer.weight" and layout.tied and "embedding.word_embeddings.weight" in whole
        param.requires_grad_(name in whole or tied_output)
    config = model.config
    dtype = config.params_dtype
    sp = bool(config.sequence_parallel) and layout.tp > 1
    offset = layer_offset(model)
    for local_index, layer in enumerate(getattr(model.decoder, "layers", [])):
        index = local_index + offset
        for path, (modules, kind) in FUSED.items():
            wanted = [m for m in modules if m in targets]
            if not wanted:
                continue
            linear = layer.get_submodule(path)
            device = linear.weight.device
            pairs = {}
            for m in wanted:
                a, b = init_pair(peft_key(index, m, "A"), m, layout, train.lora_rank, seed, dtype)
                pair = LoraPair(shard("A", kind, a, layout.tp, tp_rank).to(device),
                                shard("B", kind, b, layout.tp, tp_rank).to(device))
                for which in "AB":
                    p, dim = getattr(pair, which), split_dim(which, kind)
                    if dim is not None:
                        set_tensor_model_parallel_attributes(p, True, dim, 1)
                    elif kind == "row" and sp:
                        setattr(p, "sequence_parallel", True)  # its grad comes from this rank's tokens only
                pairs[m] = pair
            norm = _te_rms_norm(linear, config) if hasattr(linear, "layer_norm_weight") else None
            linear.lora = LoraAdapters(pairs, kind=kind, modules=modules, rank=train.lora_rank,
                                       scale=train.lora_alpha / train.lora_rank, dropout=train.lora_dropout,
                                       layout=layout, sequence_parallel=sp, norm=norm)
            _wrap(linear, kind)
    return targets, whole


def _wrap(linear, kind: str) -> None:
    """The linear's forward adds its adapters' output; its sharded_state_dict splits them as above."""
    base_forward, base_sharded = linear.forward, linear.sharded_state_dict

    def forward(x, *args, **kwargs):
        out, bias = base_forward(x, *args, **kwargs)
        return out + linear.lora(x).to(out.dtype), bias

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = base_sharded(prefix, sharded_offsets, metadata)
        adapters = {k: v for k, v in linear.state_dict(prefix="", keep_vars=True).items() if k.startswith("lora.")}
        axes = {k: split_dim(k[-1], kind) for k in adapters}
        extra = {} if metadata is None or "dp_cp_group" not in metadata else {
            "tp_group": getattr(linear, "tp_group", None), "dp_cp_group": metadata["dp_cp_group"]}
        out.update(make_sharded_tensors_for_checkpoint(adapters, prefix, {k: a for k, a in axes.items() if a is not None},
                                                       sharded_offsets, **extra))
        return out

    linear.forward = forward
    linear.sharded_state_dict = sharded_state_dict


def lora_layers(model):
    """(global layer index, fused path, LoraAdapters) of one stage's model."""
    from agentrl.trainers.megatron.weights import layer_offset

    offset = layer_offset(model)
    for local_index, layer in enumerate(getattr(model.decoder, "layers", [])):
        for path in FUSED:
            adapters = getattr(layer.get_submodule(path), "lora", None)
            if adapters is not None:
                yield local_index + offset, path, adapters


@torch.no_grad()
def gather_adapter(model, *, tp_group=None, pp_group=None) -> dict[str, torch.Tensor]:
    """The whole adapter in peft's names and HF shapes, on CPU, on every rank (TP shards gathered,
    pipeline stages' layers exchanged)."""
    import torch.distributed as dist

    from agentrl.trainers.megatron.weights import _tp_gather

    tp = dist.get_world_size(tp_group) if (tp_group is not None and dist.is_initialized()) else 1
    out = {}
    for index, _, adapters in lora_layers(model):
        for m, pair in adapters.pairs.items():
            for which in "AB":
                full = _tp_gather(getattr(pair, which).detach(), split_dim(which, adapters.kind), tp_group, tp)
                out[peft_key(index, m, which)] = full.to("cpu", copy=True)
    if pp_group is not None and dist.is_initialized() and dist.get_world_size(pp_group) > 1:
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for p in parts for k, v in p.items()}
    return out


@torch.no_grad()
def load_adapter(model, tensors: dict[str, torch.Tensor], *, tp_rank: int) -> None:
    """peft-named full adapter tensors (a peft folder's, or gather_adapter's) into this rank's shards."""
    for index, _, adapters in lora_layers(model):
        for m, pair in adapters.pairs.items():
            for which in "AB":
                key = peft_key(index, m, which)
                if key not in tensors:
                    raise KeyError(f"the adapter has no {key}")
                p = getattr(pair, which)
                p.copy_(shard(which, adapters.kind, tensors[key], adapters.layout.tp, tp_rank).to(p.dtype))


def hf_deltas(adapters: "LoraAdapters", index: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """scale * B A per adapted HF weight of one fused linear, from its gathered adapter."""
    return {f"model.layers.{index}.{HF_PARENT[m]}.{m}.weight":
            (full[peft_key(index, m, "B")].float() @ full[peft_key(index, m, "A")].float()) * adapters.scale
            for m in adapters.pairs}


def write_peft(folder: str | Path, tensors: dict[str, torch.Tensor], train, targets: list[str], base_model: str,
               dtype: torch.dtype | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors as peft's save_pretrained writes them."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=train.lora_rank, lora_alpha=train.lora_alpha, lora_dropout=train.lora_dropout,
               target_modules=sorted(targets), bias="none", task_type="CAUSAL_LM",
               base_model_name_or_path=base_model).save_pretrained(str(folder))
    tensors = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder
