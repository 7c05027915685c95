"""One CPU rank of a multi-process Megatron test (see megatron_helpers.run_ranks): builds the
trainer with the given Megatron flags, checks the HF -> Megatron -> HF round trip, computes
logprobs, takes one training step, and (rank 0) writes the figures as JSON."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: vision_helpers

from agentrl.trainers.megatron.trainer import MegatronTrainer  # noqa: E402  (imports megatron-core)

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

import torch  # noqa: E402

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.models import build_tiny_model  # noqa: E402
from agentrl.trainers.megatron.weights import HFCheckpoint  # noqa: E402
from megatron_helpers import leave_together, make_samples, make_vlm_samples  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--megatron", default="{}", help="megatron_args as JSON")
parser.add_argument("--algo", default="{}", help="AlgoConfig fields as JSON")
parser.add_argument("--max-tokens", type=int, default=None)
parser.add_argument("--train", default="{}", help="more TrainConfig fields as JSON")
parser.add_argument("--model", default=None, help="an HF checkpoint folder (default: the tiny Qwen2)")
parser.add_argument("--vision", action="store_true", help="--model is a VLM: make_vlm_samples' rollout")
args = parser.parse_args()

path = args.model or build_tiny_model()
trainer = MegatronTrainer(str(path), train=TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2,
                                                       max_tokens_per_gpu=args.max_tokens, **json.loads(args.train)),
                          algo=AlgoConfig(**json.loads(args.algo)), temperature=0.8, device="cpu", dtype="float32",
                          megatron_args=json.loads(args.megatron))
ckpt = HFCheckpoint(path)
exported = {n: t for b in trainer.hf_buckets(bucket_bytes=64 * 1024) for n, t in b}
roundtrip = sorted(exported) == sorted(ckpt.keys()) and all(torch.equal(exported[k], ckpt.get(k)) for k in exported)
if args.vision:
    from agentrl.vision import load_processor
    samples = make_vlm_samples(load_processor(path))
else:
    samples = make_samples()
before = trainer.compute_logprobs(samples)
metrics = trainer.train_rollout(samples)
after = trainer.compute_logprobs(samples)
if trainer.rank == 0:
    Path(args.out).write_text(json.dumps({"roundtrip": roundtrip, "names": sorted(exported), "before": before,
                                          "metrics": metrics, "after": after}))
leave_together()
