"""One CPU rank of the checkpoint-layout test (test_megatron_checkpoint_layouts.py): builds the
trainer in the given Megatron layout; with --save, takes one step, saves, then takes the next
step; with --load, resumes from the saved folder and takes that next step. Rank 0 writes the
next step's loss and grad norm, and the logprobs before and after it, as JSON."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentrl.trainers.megatron.trainer import MegatronTrainer  # noqa: E402  (imports megatron-core)

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from megatron_helpers import leave_together, make_samples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--megatron", default="{}", help="megatron_args as JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--ckpt", required=True, help="checkpoint folder")
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--megatron-core-save", action="store_true",
                        help="save the distributed optimizer's state with megatron-core's own code, not the trainer's")
    args = parser.parse_args()

    trainer = MegatronTrainer(args.model, train=TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=2,
                                                            max_tokens_per_gpu=40),
                              algo=AlgoConfig(entropy_coef=0.01), temperature=0.8, device="cpu", dtype="float32",
                              megatron_args=json.loads(args.megatron))
    samples = make_samples()
    in_place = None  # load: per distributed optimizer, whether its state was read in place (slice by slice)
    if args.mode == "save":
        trainer.train_rollout(samples)  # moves the weights and fills Adam's moments, which the next step reads
        if args.megatron_core_save:
            for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
                vars(opt).pop("sharded_param_state_fully_reshardable", None)  # the class's method again
        trainer.save(Path(args.ckpt), {"rollout_id": 0})
    else:
        from agentrl.trainers.megatron import optimizer_state

        build, boxes = optimizer_state._load_boxes, []
        optimizer_state._load_boxes = lambda *a: boxes.append(build(*a)) or boxes[-1]
        trainer.load(Path(args.ckpt))
        optimizer_state._load_boxes = build
        in_place = [b is not None for b in boxes]
    before = trainer.compute_logprobs(samples)
    metrics = trainer.train_rollout(samples)
    after = trainer.compute_logprobs(samples)  # the update read Adam's moments: a lost optimizer state shows here
    if trainer.rank == 0:
        Path(args.out).write_text(json.dumps({"version": trainer.version, "before": before, "metrics": metrics,
                                              "after": after, "optimizer_read_in_place": in_place}))
    leave_together()


if __name__ == "__main__":  # dist_checkpointing's writers are spawned processes, which import this file
    main()
