"""The vision half of a Qwen2-VL / Qwen2.5-VL policy in the Megatron trainer (families/qwen2_vl.py).

- The vision tower is the HF module (`Qwen2VisionTransformerPretrainedModel`, the 2.5 one),
  held in the GPTModel as `visual` on every rank (replicated: its weights are loaded whole, its
  gradients are the same on every tensor-parallel rank, which sees every image).
- Images reach the trainer as the torch trainer gets them (agentrl/vision.py): each Sample's PNG
  data URLs, turned into pixel_values / image_grid_thw by the model's HF processor.
- A packed micro-batch carries its samples' pixels, the packed positions of their prompts' image
  tokens, and multimodal rotary positions [3, 1, T] from the HF model's own get_rope_index, per
  sample (text-only samples and padding: 1-D positions on all three rows).
- In the forward pass the tower's embeddings replace the word embeddings at those positions
  (`attach` wraps the GPTModel's embedding); the decoder applies megatron-core's mrope.

Image tokens outside the prompt (ones the model wrote) stay text, as the engine fed them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from agentrl.errors import ConfigError

# model_type -> (transformers module, vision tower class, model class whose get_rope_index is used)
_CLASSES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel", "Qwen2VLModel"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLModel"),
}


def _hf_class(hf_config, which: int):
    module, *names = _CLASSES[hf_config.model_type]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), names[which])


def check_layout(margs, *, lora: bool) -> None:
    """The layouts the vision tower is wired for: the whole model on every pipeline and
    context-parallel rank (the tower feeds the first stage's embedding, and sees whole sequences)."""
    if margs.pp > 1:
        raise ConfigError("--pipeline-model-parallel-size > 1 with a vision-language model: the Megatron trainer "
                          "holds the vision tower beside the embedding and runs one pipeline stage; use tensor or "
                          "data parallelism")
    if margs.cp > 1:
        raise ConfigError("--context-parallel-size > 1 with a vision-language model: the Megatron trainer's "
                          "multimodal positions and image embeddings are not split over context-parallel ranks")
    if lora:
        raise ConfigError("--lora-rank with a vision-language model and --trainer megatron: not supported; train the "
                          "VLM with LoRA by --trainer torch, or without LoRA")


def build_tower(hf_config, dtype: torch.dtype) -> torch.nn.Module:
    """The model's HF vision tower (random weights: load_hf_weights copies the checkpoint's `visual.*`)."""
    tower = _hf_class(hf_config, 0)._from_config(hf_config.vision_config, dtype=dtype)
    return tower.train()


class RopeIndex:
    """The HF model's get_rope_index, without building the model: it reads only its config (the vision
    tower's merge size) and the model's get_vision_position_ids."""

    def __init__(self, hf_config):
        model = _hf_class(hf_config, 1)
        self.config = hf_config
        self.get_vision_position_ids = model.get_vision_position_ids.__get__(self)
        self.get_rope_index = model.get_rope_index.__get__(self)


@dataclass
class ImageInputs:
    """A packed micro-batch's images, in the order of their tokens."""
    pixel_values: torch.Tensor  # [patches, dim]
    grid_thw: torch.Tensor  # [images, 3]
    mask: torch.Tensor  # [T] bool: the packed positions the image embeddings fill

    def to(self, device) -> "ImageInputs":
        self.pixel_values, self.grid_thw, self.mask = (t.to(device, non_blocking=True) for t in
                                                       (self.pixel_values, self.grid_thw, self.mask))
        return self


def add_images(batch, samples, processor, rope_index: RopeIndex) -> None:
    """Give packed `batch` (packing.PackedBatch, one segment per sample from cu_seqlens) its
    multimodal positions [3, 1, T] and its samples' images (ImageInputs, or None without any)."""
    from agentrl.vision import pixel_inputs

    positions = batch.position_ids.expand(3, -1, -1).clone()  # 1-D positions: text and padding
    mask = torch.zeros(batch.num_tokens, dtype=torch.bool)
    pixels, grids = [], []
    for k, i in enumerate(batch.indices):
        s = samples[i]
        if not s.images:
            continue
        ids = torch.tensor([s.tokens])
        in_prompt = (ids == processor.image_token_id) & (torch.arange(len(s.tokens)) < len(s.prompt_tokens))
        media = pixel_inputs(processor, s.images)
        pos, _ = rope_index.get_rope_index(ids, mm_token_type_ids=in_prompt.int(),
                                           image_grid_thw=media["image_grid_thw"])
        start = int(batch.cu_seqlens[k])
        positions[:, 0, start:start + len(s.tokens)] = pos[:, 0]
        mask[start:start + len(s.tokens)] = in_prompt[0]
        pixels.append(media["pixel_values"])
        grids.append(media["image_grid_thw"])
    batch.position_ids = positions
    batch.images = ImageInputs(torch.cat(pixels), torch.cat(grids), mask) if pixels else None


def attach(gpt, tower: torch.nn.Module) -> None:
    """`tower` into `gpt` (as `gpt.visual`, so DDP, the optimizer, checkpoints and the weight export
    see its parameters), and gpt's embedding wrapped: the micro-batch's ImageInputs, set in
    `gpt.embedding.images` before each forward, replace the word embeddings at their positions."""
    gpt.visual = tower
    embedding = gpt.embedding
    inner = embedding.forward
    embedding.images = None

    def forward(input_ids, position_ids, *args, **kwargs):
        out = inner(input_ids, position_ids, *args, **kwargs)  # [s, 1, h]; [s / tp, 1, h] under SP
        images, embedding.images = embedding.images, None  # for this call only
        if images is None:
            if torch.is_grad_enabled():
                # every tower parameter gets a (zero) gradient: DDP's overlapped grad reduce waits for all
                out = out + sum(p.view(-1)[0] for p in tower.parameters()) * 0.0
            return out
        feats = tower(images.pixel_values.to(tower.dtype), grid_thw=images.grid_thw).pooler_output
        if int(images.mask.sum()) != feats.shape[0]:
            raise ValueError(f"{int(images.mask.sum())} image placeholder tokens for {feats.shape[0]} image features")
        full = torch.zeros(images.mask.shape[0], out.shape[-1], dtype=out.dtype, device=out.device)
        full = full.index_put((images.mask.nonzero()[:, 0],), feats.to(out.dtype))[:, None, :]  # [s, 1, h]
        mask = images.mask
        if gpt.config.sequence_parallel:  # this rank's slice; the scatter's backward gathers the full gradient
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
            full = scatter_to_sequence_parallel_region(full)
            mask = mask.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
        return torch.where(mask[:, None, None], full, out)

    embedding.forward = forward
