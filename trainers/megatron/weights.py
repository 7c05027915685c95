"""HF checkpoint <-> Megatron model weights, for any TP/PP layout.

- `load_hf_weights`: each rank reads (lazily, from safetensors) only the HF tensors its own
  parameters need and copies in its TP shard.
- `export_hf`: streams the model back in HF names and layout, in buckets of at most
  `bucket_bytes`: TP shards are all-gathered within each stage (routed experts: over the
  expert-TP group, then every EP rank's experts over the EP group), then every stage's tensors
  are broadcast over the pipeline group, so every rank sees the whole model, bucket by
  bucket, on its own device (what tensor / NCCL weight sync sends on). Tied embeddings are
  exported once, as `model.embed_tokens.weight` (what HF's named_parameters() gives).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from agentrl.trainers.megatron.families.common import (Family, Layout, expert_index, gather_dim, hf_sources,
                                                      local_spec_name, to_hf, to_megatron_shard, with_expert)
from agentrl.weight_transfer import buckets


# A Qwen-VL checkpoint saved by transformers 4.52 to 4.57 names its tensors by the module paths
# (`model.language_model.layers.*`, `model.visual.*`); published ones and transformers 5 write
# `model.layers.*`, `visual.*`, the names the trainer reads and exports (and the engines take).
_VLM_ALIASES = (("model.", "model.language_model."), ("visual.", "model.visual."))


class HFCheckpoint:
    """Lazy access to the tensors of an HF checkpoint folder (safetensors, sharded or not;
    pytorch_model.bin as a fallback)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: self.folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.folder / "model.safetensors").exists():
            from safetensors import safe_open
            with safe_open(self.folder / "model.safetensors", "pt") as f:
                self.where = {k: self.folder / "model.safetensors" for k in f.keys()}
        else:
            bins = sorted(self.folder.glob("pytorch_model*.bin"))
            if not bins:
                raise FileNotFoundError(f"{folder}: no model.safetensors(.index.json) or pytorch_model*.bin")
            self._bin = {}
            for b in bins:
                self._bin.update(torch.load(b, map_location="cpu", weights_only=True))
            self.where = {k: None for k in self._bin}
        self._open = {}

    def keys(self):
        return self.where.keys()

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            name = next((new + name[len(old):] for old, new in _VLM_ALIASES
                         if name.startswith(old) and new + name[len(old):] in self.where), name)
        if name not in self.where:
            raise KeyError(f"{self.folder}: the checkpoint has no tensor {name}")
        path = self.where[name]
        if path is None:
            return self._bin[name]
        if path not in self._open:
            from safetensors import safe_open
            self._open[path] = safe_open(path, "pt")
        return self._open[path].get_tensor(name)


def global_name(name: str, layer_offset: int) -> str:
    """A stage-local Megatron parameter name -> the same with the global layer index."""
    if name.startswith("decoder.layers."):
        _, _, idx, rest = name.split(".", 3)
        return f"decoder.layers.{int(idx) + layer_offset}.{rest}"
    return name


def layer_offset(model) -> int:
    layers = getattr(model.decoder, "layers", None)
    return (layers[0].layer_number - 1) if layers is not None and len(layers) else 0


def expert_offset(layout: Layout) -> int:
    """The global index of this EP rank's first routed expert."""
    if not layout.num_experts or layout.ep == 1:
        return 0
    from megatron.core import parallel_state as ps
    return ps.get_expert_model_parallel_rank() * layout.local_experts


def model_chunks(model) -> list:
    """A stage's GPTModels: the model, or its virtual-stage chunks (a ModuleList)."""
    return list(model) if isinstance(model, torch.nn.ModuleList) else [model]


def model_params(model, layout: Layout, *, skip_tied_output: bool = False):
    """(global local-spec name, parameter) of one stage's GPTModel (or its virtual-stage chunks),
    in module order (LoRA adapters, which have no HF counterpart in the base model, left out).
    Global: the layer index, and a routed expert's index among all experts."""
    first_expert = expert_offset(layout)
    for chunk in model_chunks(model):
        off = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            if ".lora." in name:
                continue
            name = local_spec_name(global_name(name, off))
            e = expert_index(name)
            if e is not None and first_expert:
                name = with_expert(name, e + first_expert)
            if skip_tied_output and layout.tied and name == "output_layer.weight":
                continue
            yield name, param


@torch.no_grad()
def load_hf_weights(model, ckpt: HFCheckpoint, family: Family, layout: Layout, tp_rank: int,
                    *, value_head: bool = False) -> None:
    """Copy this rank's shard of every parameter from the HF checkpoint. value_head: the
    critic (its `output_layer` is a fresh value head, left as initialised)."""
    etp_rank = 0
    if layout.num_experts and layout.etp > 1:
        from megatron.core import parallel_state as ps
        etp_rank = ps.get_expert_tensor_parallel_rank()
    cache: dict[str, torch.Tensor] = {}
    for name, param in model_params(model, layout):
        if value_head and name == "output_layer.weight":
            continue
        kind, sources = hf_sources(name, family, layout)
        tensors = [cache[s] if s in cache else ckpt.get(s) for s in sources]
        if name == "embedding.word_embeddings.weight" and layout.tied:
            cache[sources[0]] = tensors[0]  # a tied last stage (PP > 1) reads it again
        shard = to_megatron_shard(kind, tensors, layout, etp_rank if kind.startswith("expert_") else tp_rank)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: HF {[tuple(t.shape) for t in tensors]} gives shard {tuple(shard.shape)}, "
                             f"the Megatron parameter is {tuple(param.shape)}")
        param.data.copy_(shard.to(param.dtype))


def _ep_gather(t: torch.Tensor, ep_group, ep: int) -> list[torch.Tensor]:
    """The same local expert's tensor from every EP rank, in EP rank order."""
    import torch.distributed as dist
    if ep == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(ep)]
    dist.all_gather(parts, t.contiguous(), group=ep_group)
    return parts


def _tp_gather(t: torch.Tensor, dim: int | None, tp_group, tp: int) -> torch.Tensor:
    import torch.distributed as dist
    if dim is None or tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def export_hf(model, family: Family, layout: Layout, *, bucket_bytes: int, tp_group=None, pp_group=None,
              dtype: torch.dtype | None = None, delta=None, only: set[str] | None = None
              ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (HF name, full tensor) on the model's device, every rank the same. delta: HF name ->
    a tensor added to that weight, or None (LoRA's merge: scale B A; called in the same order on
    every rank of a stage, as it may gather over TP). only: these Megatron parameters (global
    local-spec names) alone (the LoRA modules trained whole)."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if (tp_group is not None and dist.is_initialized()) else 1
    pp = dist.get_world_size(pp_group) if (pp_group is not None and dist.is_initialized()) else 1
    etp_group = ep_group = None
    if layout.num_experts and (layout.etp > 1 or layout.ep > 1):
        from megatron.core import parallel_state as ps
        etp_group, ep_group = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    first_expert = expert_offset(layout)

    def full_tensors(name, kind, param):
        """(Megatron name, full tensor) pairs: one, or one per EP rank for a routed expert."""
        if not kind.startswith("expert_"):
            yield name, _tp_gather(param.detach(), gather_dim(kind), tp_group, tp)
            return
        full = _tp_gather(param.detach(), gather_dim(kind), etp_group, layout.etp)
        local = expert_index(name) - first_expert
        for r, t in enumerate(_ep_gather(full, ep_group, layout.ep)):
            yield with_expert(name, r * layout.local_experts + local), t

    def local_tensors():
        for mname, param in model_params(model, layout, skip_tied_output=True):
            if only is not None and mname not in only:
                continue
            kind, _ = hf_sources(mname, family, layout)
            for name, full in full_tensors(mname, kind, param):
                yield from hf_named(name, kind, full)

    def hf_named(name, kind, full):
        _, sources = hf_sources(name, family, layout)
        for hf_name, t in zip(sources, to_hf(kind, full, layout)):
            if name == "output_layer.weight" and layout.tied:
                continue
            d = delta(hf_name) if delta is not None else None
            if d is not None:
                t = (t.float() + d.to(t.device)).to(t.dtype)
            yield hf_name, (t if dtype is None else t.to(dtype))

    def local_buckets():
        return buckets(local_tensors(), bucket_bytes)

    if pp == 1:
        yield from local_buckets()
        return
    # Pipeline stages take turns: the stage whose turn it is broadcasts its buckets (names,
    # shapes and dtypes first) over the pipeline group.
    me = dist.get_rank(pp_group)
    ranks = dist.get_process_group_ranks(pp_group)
    device = next(model.parameters()).device
    for stage in range(pp):
        src = ranks[stage]
        mine = local_buckets() if me == stage else None
        while True:
            bucket = next(mine, None) if mine is not None else None
            meta = [None if bucket is None else [(n, tuple(t.shape), t.dtype) for n, t in bucket]]
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            if meta[0] is None:
                break
            if bucket is None:
                bucket = [(n, torch.empty(shape, dtype=dt, device=device)) for n, shape, dt in meta[0]]
            for _, t in bucket:
                dist.broadcast(t if t.is_contiguous() else t.contiguous(), src=src, group=pp_group)
            yield bucket
