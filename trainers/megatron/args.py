"""Megatron's pass-through flags (Config.megatron_args, raw strings) -> typed keyword
arguments for megatron-core's TransformerConfig, OptimizerConfig and
DistributedDataParallelConfig, plus the trainer-level ones (flags.TRAINER_FLAGS)."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from dataclasses import dataclass, field

from agentrl.errors import ConfigError
from agentrl.trainers.megatron.flags import TRAINER_FLAGS, TRAINING_FLAGS


@dataclass
class MegatronArgs:
    transformer: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    ddp: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return int(self.transformer.get("tensor_model_parallel_size", 1))

    @property
    def pp(self) -> int:
        return int(self.transformer.get("pipeline_model_parallel_size", 1))

    @property
    def cp(self) -> int:
        return int(self.transformer.get("context_parallel_size", 1))

    @property
    def ep(self) -> int:
        return int(self.transformer.get("expert_model_parallel_size", 1))

    @property
    def etp(self) -> int:
        """Expert tensor parallel size (megatron-core's default: the TP size)."""
        value = self.transformer.get("expert_tensor_parallel_size")
        return self.tp if value is None else int(value)

    def check_context_parallel(self, te: bool) -> None:
        """--context-parallel-size > 1 as the trainer does it (context_parallel.py: the local
        attention core, K/V all-gathered); the other forms of megatron-core's CP are refused."""
        if self.cp <= 1:
            return
        if te:
            raise ConfigError("--context-parallel-size > 1 runs with the local spec only (--transformer-impl local): "
                              "Transformer Engine's context-parallel attention is not wired to the trainer's packing")
        comm = self.transformer.get("cp_comm_type")
        if any(c not in (None, "all_gather") for c in (comm if isinstance(comm, list) else [comm])):
            raise ConfigError(f"--cp-comm-type {comm}: the trainer's context parallelism all-gathers K/V "
                              "(all_gather); p2p / a2a are Transformer Engine's")
        for name in ("hierarchical_context_parallel_sizes", "hybrid_context_parallel"):
            if self.transformer.get(name) or self.trainer.get(name):
                raise ConfigError(f"--{name.replace('_', '-')}: not supported by the trainer's context parallelism")

    def flag(self, name: str) -> bool:
        """A trainer-level on/off flag: absent -> False; bare or true/1/yes -> True."""
        if name not in self.trainer:
            return False
        value = self.trainer[name]
        if value is None or isinstance(value, bool):
            return value is None or value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"--{name.replace('_', '-')}: expected true/false, got {value!r}")

    def vpp(self, num_layers: int) -> int | None:
        """Virtual pipeline stages per rank: --virtual-pipeline-model-parallel-size, or
        --num-layers-per-virtual-pipeline-stage (slime's) turned into it; None without either."""
        per_stage = self.trainer.get("num_layers_per_virtual_pipeline_stage")
        size = self.transformer.get("virtual_pipeline_model_parallel_size")
        if per_stage is not None:
            per_stage = int(per_stage)
            if per_stage <= 0 or num_layers % (self.pp * per_stage):
                raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: the {num_layers} layers do not "
                                  f"split into {self.pp} pipeline stages of chunks of {per_stage}")
            derived = num_layers // (self.pp * per_stage)
            if size is not None and int(size) != derived:
                raise ConfigError(f"--virtual-pipeline-model-parallel-size {size} contradicts "
                                  f"--num-layers-per-virtual-pipeline-stage {per_stage} ({derived} chunks)")
            size = derived
        if size is None or int(size) <= 1:
            return None
        if self.pp == 1:
            raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        return int(size)


def _coerce(name: str, raw, annotation):
    """A flag's raw value (str, or None for a bare flag) -> the field's type."""
    if not isinstance(raw, str) and raw is not None:
        return raw  # already typed (YAML)
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        if raw is None or raw.lower() in ("none", "null"):
            if bool not in args:
                return None
        annotation, origin = args[0], typing.get_origin(args[0])
    if annotation is bool:
        if raw is None:
            return True
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"--{name.replace('_', '-')}: expected true/false, got {raw!r}")
    if raw is None:
        raise ConfigError(f"--{name.replace('_', '-')}: needs a value")
    try:
        if annotation is int:
            return int(raw)
        if annotation is float:
            return float(raw)
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return annotation[raw] if raw in annotation.__members__ else annotation(raw)
        if origin in (list, tuple) or annotation in (list, tuple):
            if raw.startswith("["):
                return json.loads(raw)
            inner = typing.get_args(annotation)
            items = raw.replace(",", " ").split()
            return [int(x) if inner and inner[0] is int else x for x in items]
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"--{name.replace('_', '-')}: cannot read {raw!r} as {annotation}: {exc}") from None
    return raw


def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:
        return {f.name: f.type for f in dataclasses.fields(cls)}


def parse_megatron_args(raw: dict) -> MegatronArgs:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    targets = {"transformer": _hints(TransformerConfig), "optimizer": _hints(OptimizerConfig),
               "ddp": _hints(DistributedDataParallelConfig)}
    out = MegatronArgs()
    for key, value in raw.items():
        name = key.lstrip("-").replace("-", "_")
        if name in TRAINING_FLAGS:
            name, fixed = TRAINING_FLAGS[name]
            if fixed is not None:
                value = fixed
        hit = False
        if name in TRAINER_FLAGS:
            out.trainer[name] = value
            hit = True
        for section, hints in targets.items():
            if name in hints:
                getattr(out, section)[name] = _coerce(name, value, hints[name])
                hit = True
        if not hit:
            raise ConfigError(f"--{name.replace('_', '-')}: not a megatron-core config field")
    return out
