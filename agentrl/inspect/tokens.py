"""The run's tokenizer, found and loaded, to show every token's text."""

from __future__ import annotations

from pathlib import Path

from .run_folder import InspectError


class Decoder:
    """Token id -> text with the run's tokenizer (the fast `tokenizers` library when the folder
    has tokenizer.json, transformers' AutoTokenizer otherwise)."""

    def __init__(self, path: Path):
        self.path = path
        self._tok = None
        self._hf = None
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(path))

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(list(ids), skip_special_tokens=False)
        return self._hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def piece(self, token_id: int) -> str | None:
        """The vocabulary entry itself (e.g. byte-level 'Ã'), for tokens that decode to no whole character."""
        try:
            if self._tok is not None:
                return self._tok.id_to_token(int(token_id))
            return self._hf.convert_ids_to_tokens(int(token_id))
        except Exception:
            return None


def tokenizer_candidates(run_dir: Path, config: dict, explicit: str | None) -> list[tuple[Path, str]]:
    out: list[tuple[Path, str]] = []
    if explicit:
        out.append((Path(explicit), "--tokenizer"))
    ckpt_roots = [run_dir / "checkpoints"]
    save = (config.get("run") or {}).get("save")
    if save:
        ckpt_roots.append(Path(save))
    for root in ckpt_roots:
        for model_dir in sorted(root.glob("*/model"), reverse=True):  # the latest checkpoint first
            out.append((model_dir, f"checkpoint {model_dir}"))
    model = (config.get("model") or {}).get("model")
    if model:
        out.append((Path(model), f"the run's model (config.yaml model: {model})"))
    elif config:
        try:
            from agentrl.models import tiny_model_dir

            out.append((tiny_model_dir(), "the built-in tiny model (config.yaml model: null)"))
        except Exception:
            pass
    return out


def load_decoder(run_dir: Path, config: dict, explicit: str | None) -> tuple[Decoder | None, str]:
    """(decoder, where it came from) or (None, why none could be loaded)."""
    tried = []
    for path, source in tokenizer_candidates(run_dir, config, explicit):
        if not path.is_dir():
            tried.append(f"{source}: no such folder")
            continue
        files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((path / f).exists() for f in files):
            tried.append(f"{source}: no tokenizer files")
            continue
        try:
            return Decoder(path), source if str(path) in source else f"{source} ({path})"
        except Exception as exc:
            tried.append(f"{source}: {type(exc).__name__}: {exc}")
    if explicit:
        raise InspectError(f"--tokenizer {explicit}: cannot load a tokenizer ({'; '.join(tried)})")
    return None, "; ".join(tried) or "no config.yaml and no checkpoint with a tokenizer in the run folder"

