"""One CPU rank of a multi-process Megatron LoRA test (megatron_helpers.run_ranks): builds the
trainer with adapters on every linear and the given Megatron flags, loads the adapter of a peft
folder, computes logprobs, takes one SFT step, writes the adapter (peft) and the modules trained
whole (--whole: --lora-trainable-modules) and checks the merged export against base + scale B A of
that adapter; rank 0 writes the figures as JSON."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentrl.trainers.megatron.trainer import MegatronTrainer  # noqa: E402  (imports megatron-core)

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.models import build_tiny_model  # noqa: E402
from agentrl.trainers.megatron.weights import HFCheckpoint  # noqa: E402
from megatron_helpers import leave_together, make_samples  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--megatron", default="{}", help="megatron_args as JSON")
parser.add_argument("--adapter", required=True, help="a peft folder to start from")
parser.add_argument("--save", required=True, help="where to write the adapter after the step")
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--whole", default="none", help="--lora-trainable-modules")
args = parser.parse_args()

path = build_tiny_model()
train = TrainConfig(lr=args.lr, global_batch_size=6, micro_batch_size=2, lora_rank=4, lora_alpha=8.0,
                    target_modules=["all-linear"], lora_trainable_modules=[args.whole])
trainer = MegatronTrainer(str(path), train=train, algo=AlgoConfig(), temperature=0.8, device="cpu", dtype="float32",
                          megatron_args=json.loads(args.megatron))
trainer.load_adapter_weights(args.adapter)
samples = make_samples()
before = trainer.compute_logprobs(samples)
metrics = trainer.train_sft(samples)
after = trainer.compute_logprobs(samples)
trainer.save_adapter(args.save)
whole = {k: t.clone() for k, t in trainer.trained_module_tensors()}  # collective: every rank
if trainer.rank == 0:
    save_file(whole, str(Path(args.save) / "whole.safetensors"))
merged = dict(trainer.named_tensors())
adapter, base, scale = load_file(str(Path(args.save) / "adapter_model.safetensors")), HFCheckpoint(path), 2.0
want = {k: whole[k] if k in whole else base.get(k).clone() for k in base.keys()}
for key in adapter:
    if ".lora_A." in key:
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        want[name] += scale * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
merged_matches = sorted(merged) == sorted(want) and all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
if trainer.rank == 0:
    Path(args.out).write_text(json.dumps({"before": before, "metrics": metrics, "after": after,
                                          "merged_matches": merged_matches}))
leave_together()
