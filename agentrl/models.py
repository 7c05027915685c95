"""Models and tokenizers: a local HF checkpoint, or the built-in tiny default.

The default (used when --model is not given) is a small Qwen2-architecture causal LM
initialised from a fixed seed, with a byte-level BPE tokenizer trained offline on a
corpus generated here and a Qwen-style chat template (tools supported). Nothing is
downloaded; the result is cached under ~/.cache/agentrl/models/ and rebuilt only when
the recipe changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from agentrl.errors import ModelLoadError

TINY_MODEL_RECIPE = {
    "version": 2,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "seed": 0,
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-style template. Tools are listed in the system turn; tool results come back as
# `tool` role messages. Rendering is append-only: earlier turns never change, which the
# agent loop's drift check relies on.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nYou may call one or more tools. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from his her which or an be this are "
    "it not have had were one all their there been has more who when will would can no out "
    "what about up into only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against "
    "go came right used take three answer question search information think tool call result "
    "python bash file read write list edit code test pass fail error true false none return def "
    "import print if else elif for while in range len sum max min int str float dict set "
    "city river mountain capital country born founded invented painter author year number "
    "plus minus times divided equals total apple orange banana red green blue alpha beta gamma"
).split()


def _tokenizer_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    tags = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
            "<information>", "</information>", "<tool_call>", "</tool_call>", "\\boxed{", "}"]
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(tags))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        if rng.random() < 0.15:
            words.append(json.dumps({"name": rng.choice(_WORDS), "arguments": {"code": rng.choice(_WORDS)}}))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ",", ""]))
    return lines


def tiny_model_dir() -> Path:
    digest = hashlib.sha1(json.dumps(TINY_MODEL_RECIPE, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    return root / "models" / f"tiny-qwen2-{digest}"


def build_tiny_model(path: Path | None = None) -> Path:
    """Build (or reuse) the default tiny model and tokenizer; returns its folder."""
    path = Path(path or tiny_model_dir())
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    r = TINY_MODEL_RECIPE
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=r["vocab_size"], special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(r["seed"]), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE

    torch.manual_seed(r["seed"])
    config = Qwen2Config(
        vocab_size=len(hf_tok), hidden_size=r["hidden_size"], intermediate_size=r["intermediate_size"],
        num_hidden_layers=r["num_hidden_layers"], num_attention_heads=r["num_attention_heads"],
        num_key_value_heads=r["num_key_value_heads"], max_position_embeddings=r["max_position_embeddings"],
        tie_word_embeddings=True, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    _quiet_transformers()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a half-built folder is never mistaken for a model
    except OSError:  # another process built it first (the same recipe: the same model)
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# The tiny VLM's template: the tiny one, with a message's image parts as Qwen2-VL writes them
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ message.content }}",
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tiny_vlm(path: Path, *, seed: int = 0, text: dict | None = None, vision: dict | None = None) -> Path:
    """A tiny random Qwen2-VL and its processor in `path`: the tiny tokenizer plus the vision
    tokens, a small vision tower (4-pixel patches, 2x2 merge: a 16x16 image is 4 tokens), a
    2-layer text model. Nothing is downloaded (tests, CPU demos). `text` / `vision`: config
    entries over those (the GPU scenario's shape, with SGLang's head sizes); the processor
    follows the vision tower's patch and merge sizes (images of 2 to 8 merged patches a side)."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _quiet_transformers()
    tok = AutoTokenizer.from_pretrained(str(build_tiny_model()))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    torch.manual_seed(seed)
    vision = {**dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                     spatial_merge_size=2, temporal_patch_size=2, in_channels=3), **(vision or {})}
    config = Qwen2VLConfig(
        text_config={**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=True,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None),
                     **(text or {})},
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen2VLForConditionalGeneration(config)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    # the published Qwen2-VL config.json names the channels `in_chans` (transformers 5 writes `in_channels`,
    # and SGLang 0.5.15's qwen2_vl reads vision_config.in_chans): both, as a real checkpoint loads everywhere
    saved = json.loads((tmp / "config.json").read_text())
    saved["vision_config"]["in_chans"] = saved["vision_config"].get("in_channels", 3)
    (tmp / "config.json").write_text(json.dumps(saved, indent=2))
    tok.save_pretrained(tmp)
    side = vision["patch_size"] * vision["spatial_merge_size"]  # one image token's pixels a side
    Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                             temporal_patch_size=vision["temporal_patch_size"], min_pixels=(2 * side) ** 2,
                             max_pixels=(8 * side) ** 2).save_pretrained(tmp)
    for name in ("preprocessor_config.json", "processor_config.json"):  # what AutoProcessor builds
        file = tmp / name
        config = json.loads(file.read_text()) if file.exists() else {}
        file.write_text(json.dumps({**config, "processor_class": "Qwen2VLProcessor"}, indent=2))
    tmp.rename(path)
    return path


def check_model_dir(path: str | Path) -> Path:
    """Fail early, naming what is missing, before any process tries to load the folder."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"--model {path}: no such folder")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"--model {path}: no config.json; expected a Hugging Face causal-LM checkpoint folder")
    tokenizer_files = ["tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"]
    if not any((path / f).exists() for f in tokenizer_files):
        raise ModelLoadError(
            f"--model {path}: no tokenizer (looked for {', '.join(tokenizer_files)}); "
            "copy the tokenizer files of the base model into this folder"
        )
    return path


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars would drown the run's own progress
    hf_logging.set_verbosity_error()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    from agentrl import hf_mimo

    _quiet_transformers()
    hf_mimo.register()

    path = check_model_dir(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"--model {path}: cannot load its tokenizer: {exc}") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# the vision-language families agentrl trains: those whose forward agentrl/vision.py reproduces (image features
# at the placeholders, multimodal rotary positions); Qwen3-VL adds deepstack features inside the language
# model, which it would skip
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def is_vision_model(path: str | Path) -> bool:
    """Whether agentrl runs the checkpoint as a vision-language model: its config.json has a vision
    tower (`vision_config`) and its family is one of VISION_FAMILIES. Other multimodal checkpoints
    (Gemma 3, Llama 4, Qwen3.5, ...) load as their text model, as before."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config and config.get("model_type") in VISION_FAMILIES


def load_model(path: str | Path, *, device: str = "cpu", dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl import hf_mimo

    _quiet_transformers()
    hf_mimo.register()  # model_type "mimo": transformers has no class of its own
    path = check_model_dir(path)
    auto = AutoModelForCausalLM
    if is_vision_model(path):  # a vision-language model: its image-text class (the vision tower included)
        from transformers import AutoModelForImageTextToText as auto
    try:
        model = auto.from_pretrained(str(path), dtype=getattr(torch, dtype))
    except Exception as exc:
        raise ModelLoadError(f"--model {path}: cannot load the model: {exc}") from exc
    return model.to(device)
