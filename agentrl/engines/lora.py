"""LoRA adapters served by the embedded engine, as SGLang serves them (`--enable-lora`).

An adapter is a peft folder (adapter_config.json, adapter_model.safetensors), loaded with
/load_lora_adapter {lora_name, lora_path} and named per request by /generate's `lora_path`.
The base model is never changed: a forward hook on each adapted nn.Linear adds
scale * B(A(x)) while that adapter is active, so requests with different adapters (or none)
share the engine and full-weight updates keep working on the base weights' own names.
What SGLang refuses is refused here too: DoRA, adapters that add tokens, and modules the
base model does not have.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."


@dataclass
class LoraAdapter:
    name: str
    path: str
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])

    @classmethod
    def load(cls, name: str, path: str, model: torch.nn.Module) -> "LoraAdapter":
        from safetensors.torch import load_file

        folder = Path(path)
        config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise ValueError(f"{path}: not a peft adapter folder (adapter_config.json, adapter_model.safetensors)")
        config = json.loads(config_file.read_text())
        if config.get("use_dora"):
            raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        param = next(model.parameters())
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(str(weights_file)).items():
            if ".lora_A." not in key and ".lora_B." not in key:
                raise ValueError(f"{path}: {key}: only lora_A / lora_B weights can be served (no modules_to_save, "
                                 "no added tokens)")
            module, which = key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)
            pairs.setdefault(module, {})[which[0]] = tensor.to(param.device, param.dtype)
        weights = {}
        for module, ab in pairs.items():
            try:
                layer = model.get_submodule(module)
            except AttributeError:
                raise ValueError(f"{path}: the base model has no module {module}") from None
            if not isinstance(layer, torch.nn.Linear) or set(ab) != {"A", "B"}:
                raise ValueError(f"{path}: {module}: needs lora_A and lora_B on a linear layer")
            a, b = ab["A"], ab["B"]
            if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
                raise ValueError(f"{path}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                                 f"a rank-{rank} adapter of {layer.in_features} -> {layer.out_features}")
            weights[module] = (a, b)
        return cls(name=name, path=str(path), scale=scale, weights=weights)


class LoraServing:
    """The adapters loaded into one model, and which one the next forward uses."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.adapters: dict[str, LoraAdapter] = {}
        self.ever_loaded: dict[str, str] = {}  # name -> path: SGLang reloads an unloaded name from its path
        self.active: LoraAdapter | None = None
        self._hooked: set[str] = set()

    def load(self, name: str, path: str) -> LoraAdapter:
        if name in self.adapters:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        adapter = LoraAdapter.load(name, path, self.model)
        for module in adapter.weights:
            if module not in self._hooked:
                self.model.get_submodule(module).register_forward_hook(self._hook(module))
                self._hooked.add(module)
        self.adapters[name] = adapter
        self.ever_loaded[name] = str(path)
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
        del self.adapters[name]

    def resolve(self, name: str) -> LoraAdapter:
        """The adapter a request names; an unloaded one is reloaded from its path, as SGLang does."""
        if name in self.adapters:
            return self.adapters[name]
        if name not in self.ever_loaded:
            raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {list(self.adapters)}.")
        return self.load(name, self.ever_loaded[name])

    def _hook(self, module: str):
        def add_adapter(layer, inputs, output):
            adapter = self.active
            if adapter is None or module not in adapter.weights:
                return output
            a, b = adapter.weights[module]
            return output + adapter.scale * (inputs[0] @ a.T) @ b.T

        return add_adapter
