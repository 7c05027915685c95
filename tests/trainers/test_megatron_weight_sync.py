"""Weight sync from the Megatron trainer into an engine, both ways the loop can take it: HF-named
tensors from `named_tensors()` (bucketed, /update_weights_from_tensor) and an HF checkpoint
from `save_hf()` (/update_weights_from_disk). After each, the engine samples with the trained
weights: its logprobs equal the trainer's for the same tokens (fp32, 1e-4 per token, as in
tests/test_parity.py)."""

import asyncio

import pytest

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.rollout.client import EngineClient  # noqa: E402
from agentrl.types import Sample  # noqa: E402
from agentrl.weight_transfer import sync_weights_from_disk, sync_weights_from_tensor  # noqa: E402
from megatron_helpers import make_samples  # noqa: E402

TOLERANCE = 1e-4


async def engine_agrees(client: EngineClient, trainer, version: int) -> float:
    samples = []
    for prompt in ([5, 17, 42, 9], [100, 3, 77, 81, 64, 12]):
        out = await client.generate(prompt, {"temperature": 0.8, "max_new_tokens": 12})
        assert out.weight_version == str(version)
        s = Sample(prompt_tokens=prompt)
        s.append_generated(out.output_ids, out.logprobs, version)
        samples.append(s)
    ours = trainer.compute_logprobs(samples)
    return max(abs(a - b) for s, row in zip(samples, ours) for a, b in zip(row, s.rollout_logprobs))


def test_tensor_and_disk_sync_into_the_engine(engine, tiny_model, tmp_path):
    trainer = megatron_trainer.MegatronTrainer(
        str(tiny_model), train=TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=3),
        algo=AlgoConfig(), temperature=0.8, device="cpu", dtype="float32")
    samples = make_samples()

    async def go():
        async with EngineClient(engine.url) as client:
            trainer.train_rollout(samples)
            sync = await sync_weights_from_tensor([client], trainer.named_tensors(), version=trainer.version,
                                                  bucket_bytes=64 * 1024)
            assert sync["weight_sync_buckets"] > 3
            by_tensor = await engine_agrees(client, trainer, trainer.version)
            trainer.train_rollout(samples)
            trainer.save_hf(tmp_path / "hf")
            await sync_weights_from_disk([client], str(tmp_path / "hf"), version=trainer.version)
            by_disk = await engine_agrees(client, trainer, trainer.version)
            # leave the shared engine as other tests expect it
            await client.post("/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "0"})
            return by_tensor, by_disk

    by_tensor, by_disk = asyncio.run(go())
    print(f"engine vs trainer logprobs after sync: tensor {by_tensor:.1e}, disk {by_disk:.1e}")
    assert by_tensor < TOLERANCE and by_disk < TOLERANCE
