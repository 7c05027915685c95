"""Images for vision-language models (Qwen2-VL / Qwen2.5-VL family): dataset media, the model's
HF processor, and the vision half of a forward pass.

One form travels end to end: a PNG data URL per image (``data:image/png;base64,...``). A prompt
row's media (--multimodal-keys, slime's format: ``{"image": "images"}`` reads the row's `images`
list) become image parts of the user message, ``{"type": "image", "image": URL}``, at the
prompt's ``<image>`` placeholders (slime's `_build_messages`); the agent loop renders the
template, the processor expands each image's placeholder to its tokens (the prompt ids), the
Sample keeps the URLs (`Sample.images`), every /generate request carries them as SGLang's
`image_data`, and the trainer turns them into pixel values again with the same processor.

Images live in the prompt only: an image token the model writes is text to the engine and the
trainer (the agent loop ends such a trajectory as the agent's fault, see agent_loop.py).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import re
from pathlib import Path
from typing import Any

from agentrl.errors import DatasetError, ModelLoadError
from agentrl.models import VISION_FAMILIES, load_tokenizer

PLACEHOLDER = "<image>"  # slime's MultimodalTypes.IMAGE.placeholder
MEDIA_TYPES = ("image",)  # slime also names video and audio; agentrl carries images
DATA_URL_PREFIX = "data:image/"


def _image_error(where: str, why: str) -> DatasetError:
    return DatasetError(f"{where}: {why}")


def to_data_url(item: Any, *, where: str, base_dir: Path | None = None) -> str:
    """One dataset image entry as a PNG data URL. Entries: an HF datasets image dict
    ``{"bytes": ..., "path": ...}``, slime's rich item ``{"type": "image", "image": ...}``, a file
    path (relative ones against `base_dir`, the data file's folder, when not found as given), a
    base64 data URL, raw bytes or a PIL image. URLs are not fetched. `where` names row and field."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, dict):
        if "image" in item:
            return to_data_url(item["image"], where=where, base_dir=base_dir)
        if item.get("bytes"):
            item = item["bytes"]
        elif item.get("path"):
            item = item["path"]
        else:
            raise _image_error(where, f"an image dict needs 'bytes' or 'path' (HF datasets' form), got keys "
                                      f"{sorted(item)}")
    if isinstance(item, str) and item.startswith(("http://", "https://")):
        raise _image_error(where, f"image URLs are not fetched ({item[:80]}); download the images and give file paths "
                                  "or bytes")
    try:
        if isinstance(item, Image.Image):
            image = item
        elif isinstance(item, (bytes, bytearray)):
            image = Image.open(io.BytesIO(item))
        elif isinstance(item, str) and item.startswith("data:"):
            image = open_data_url(item)
        elif isinstance(item, str):
            path = Path(item)
            if not path.is_file() and base_dir is not None and (base_dir / path).is_file():
                path = base_dir / path
            if not path.is_file():
                raise _image_error(where, f"no such image file {item!r}")
            image = Image.open(path)
        else:
            raise _image_error(where, f"an image must be a file path, bytes, a data URL, a PIL image or an HF datasets "
                                      f"image dict, got {type(item).__name__}")
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise _image_error(where, f"cannot read the image: {exc}") from None
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def open_data_url(url: str):
    """A base64 image data URL as a PIL image (ValueError when it is not one)."""
    from PIL import Image

    if not isinstance(url, str) or not url.startswith(DATA_URL_PREFIX) or ";base64," not in url:
        raise ValueError(f"not a base64 image data URL: {str(url)[:60]!r}")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1], validate=True)))
    image.load()
    return image.convert("RGB")


def prompt_with_images(prompt: Any, rows_media: dict[str, list], where: str) -> Any:
    """slime's `_build_messages` for images: each ``<image>`` of the prompt's text (a string is a
    user message) becomes the next image part, in order; every image must have its placeholder and
    every placeholder its image. `rows_media`: field name -> that row's data URLs."""
    if not rows_media:
        return prompt
    (field, images), = rows_media.items()
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    left = list(images)
    for message in messages:
        if not isinstance(message["content"], str):
            continue  # already a list of parts: taken as it is (as slime does)
        parts = []
        for segment in re.split(f"({re.escape(PLACEHOLDER)})", message["content"]):
            if segment == PLACEHOLDER:
                if not left:
                    raise DatasetError(f"{where}: more {PLACEHOLDER!r} placeholders in the prompt than the "
                                       f"{len(images)} images of {field!r}")
                parts.append({"type": "image", "image": left.pop(0)})
            elif segment:
                parts.append({"type": "text", "text": segment})
        message["content"] = parts
    if left:
        raise DatasetError(f"{where}: {field!r} has {len(images)} images but the prompt has "
                           f"{len(images) - len(left)} {PLACEHOLDER!r} placeholders (slime requires one per image)")
    return messages


def message_images(messages: list[dict]) -> list[str]:
    """The image parts' data URLs of `messages`, in order."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def image_refs(messages: list[dict], images: list[str]) -> list[dict]:
    """`messages` with each image part's data URL replaced by "images[k]", its place in `images`
    (saved trajectories keep each image once)."""
    where = {url: k for k, url in enumerate(images)}

    def part(p):
        if isinstance(p, dict) and p.get("type") == "image" and p.get("image") in where:
            return {**p, "image": f"images[{where[p['image']]}]"}
        return p

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]


def load_processor(path: str | Path):
    """The checkpoint's HF processor (AutoProcessor, as slime loads it). Where transformers cannot
    build its video processor (they need torchvision, which a CPU install may lack), the processor
    is built without one: agentrl feeds it images only."""
    from transformers import AutoImageProcessor, AutoProcessor

    family = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    if family not in VISION_FAMILIES:
        raise ModelLoadError(f"--model {path}: model_type {family!r}: agentrl trains the vision-language families "
                             f"{', '.join(VISION_FAMILIES)} (agentrl/vision.py's forward reproduces theirs)")
    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise ModelLoadError(f"--model {path}: cannot load its processor: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"--model {path}: cannot load its processor: {exc}") from exc
    import transformers

    config = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (Path(path) / name).exists():
            config = {**json.loads((Path(path) / name).read_text()), **config}
    cls = getattr(transformers, str(config.get("processor_class")), None)
    if cls is None:
        raise ModelLoadError(f"--model {path}: no processor_class in its processor config")

    class ImagesOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = load_tokenizer(path)
    return ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(str(path)), tokenizer=tokenizer,
                      video_processor=None, chat_template=getattr(tokenizer, "chat_template", None))


def checkpoint_names(model) -> dict[str, str]:
    """A parameter's name in memory -> the name its checkpoint stores it under, where the two differ:
    transformers renames a Qwen-VL's weights when it loads them (`visual.*` -> `model.visual.*`,
    `model.layers.*` -> `model.language_model.layers.*`). Engines load checkpoint names (SGLang's
    loader, the delta sync's files), so a weight sync sends those. From transformers' own reverse
    mapping, what save_pretrained writes."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.named_parameters())
    name_of = {id(t): n for n, t in params.items()}
    return {name_of[id(t)]: name for name, t in revert_weight_conversion(model, dict(params)).items()
            if name_of.get(id(t), name) != name}


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def copy_processor_files(src: str | Path, dst: str | Path) -> None:
    """The processor's own files of checkpoint `src` into `dst` (a checkpoint the trainer saved:
    the model and tokenizer are there, and the engines and a resumed run load its processor too)."""
    import shutil

    for name in PROCESSOR_FILES:
        if (Path(src) / name).exists():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


def vision_token_ids(processor) -> set[int]:
    """The ids of the tokens that mark media in a prompt: a model that writes one has written a
    placeholder with no image behind it."""
    tok = processor.tokenizer
    ids = {getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None)}
    for text in ("<|vision_start|>", "<|vision_end|>"):
        t = tok.convert_tokens_to_ids(text)
        if isinstance(t, int) and t != tok.unk_token_id:
            ids.add(t)
    ids.discard(None)
    return ids


def pixel_inputs(processor, images: list[str]) -> dict:
    """pixel_values [patches, dim] and image_grid_thw [n, 3] of the images (data URLs). Each image
    is processed alone (Qwen-VL's processor does so in a batch too) and remembered: a group's
    samples share their prompt's image, and the trainer's passes and the engine's turns see it again."""
    import torch

    parts = [_image_pixels(processor, u) for u in images]
    return {"pixel_values": torch.cat([p for p, _ in parts]), "image_grid_thw": torch.cat([g for _, g in parts])}


@functools.lru_cache(maxsize=128)  # a rollout batch's distinct images, about; never written to by callers
def _image_pixels(processor, url: str):
    out = processor.image_processor(images=[open_data_url(url)], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def tokens_per_image(processor, grid) -> list[int]:
    """How many placeholder tokens each image expands to (its patches over the merge window)."""
    merge = processor.image_processor.merge_size ** 2
    return [int(g.prod()) // merge for g in grid]


def placeholder_runs(ids: list[int], image_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of image tokens in `ids`."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == image_id:
            j = i
            while j < len(ids) and ids[j] == image_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def forward_inputs(model, ids, attn, pixel_values, grid, image_mask):
    """The model's forward kwargs with the images in: input embeddings with each image's features at
    its placeholder tokens (`image_mask` [B, L], True there; the prompt's only), and the multimodal
    rotary positions [3, B, L] of those placeholders (as the processor's mm_token_type_ids would give
    them). Image tokens outside `image_mask` (the model's own) stay text, as the engine fed them.
    Returns (kwargs, rope_deltas [B, 1])."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA: peft's wrapper
    inner = base.model
    embeds = model.get_input_embeddings()(ids)
    feats = inner.get_image_features(pixel_values.to(embeds.dtype), grid, return_dict=True).pooler_output
    feats = torch.cat(list(feats), dim=0) if isinstance(feats, (list, tuple)) else feats
    if int(image_mask.sum()) != feats.shape[0]:
        raise ValueError(f"{int(image_mask.sum())} image placeholder tokens for {feats.shape[0]} image features")
    embeds = embeds.masked_scatter(image_mask[..., None].expand_as(embeds), feats.to(embeds.dtype))
    positions, deltas = inner.get_rope_index(ids, mm_token_type_ids=image_mask.int(), image_grid_thw=grid,
                                             attention_mask=attn)
    return {"inputs_embeds": embeds, "attention_mask": attn, "position_ids": positions}, deltas
