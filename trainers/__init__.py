"""agentrl.trainers: the plain-PyTorch trainer (torch_trainer.TorchTrainer) and the
Megatron-core one (megatron.MegatronTrainer), both behind `Trainer`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from agentrl.types import Sample


class Trainer(Protocol):
    """What the rest of agentrl asks of a trainer (the trainer actor in agentrl.cluster.trainer_actor,
    agentrl sft, the benches). tests/trainers/test_trainer_protocol.py checks both trainers
    against it, names and parameters."""

    device: Any  # "cpu", "cuda" or a torch.device: where the weights live while training
    version: int  # optimizer steps taken; the engines' weight_version follows it

    def train_rollout(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on a batch (advantages, policy and critic updates): metrics."""

    def train_sft(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step (NLL of the loss-masked tokens): metrics."""

    def compute_logprobs(self, samples: list[Sample], model=None) -> list[list[float]]:
        """Per response token, at the rollout temperature (`model`: another model, e.g. the reference)."""

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights in Hugging Face names, as the engines load them (LoRA merged)."""

    def save_hf(self, folder: str | Path) -> Path:
        """A Hugging Face model folder (config, safetensors, tokenizer)."""

    def save_adapter(self, folder: str | Path) -> Path:
        """--lora-rank: the adapter alone, in peft's format (what --lora-sync adapter sends)."""

    def save(self, folder: Path, extra_state: dict) -> None:
        """A checkpoint --load resumes exactly: model, optimizer, RNG, `extra_state`."""

    def load(self, folder: Path) -> dict:
        """Restore a `save`d checkpoint; returns its extra_state."""


def rng_state(device) -> dict:
    """Every generator a training step may draw from (python, numpy, torch's CPU one and, on a
    GPU, the device's): what a checkpoint carries so that a resume draws the same dropout."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def set_rng_state(state: dict, device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.device(device).type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], torch.device(device))
