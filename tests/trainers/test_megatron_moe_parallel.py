"""Mixture-of-experts layouts on CPU: two gloo processes (megatron_worker.py) running the
Qwen3-MoE tiny model (8 experts, top-2, one dense layer of four) against the one-process
trainer, which itself matches transformers' Qwen3MoeForCausalLM. Each layout gives the same
loss, grad norm and logprobs before and after one step, and exports the same HF tensors
bit for bit: expert parallelism (EP=2 over data-parallel ranks, with the distributed
optimizer), EP=2 folded onto TP=2 with sequence parallelism (expert TP 1), expert tensor
parallelism (TP=2 + SP, ETP=2), and a pipeline of 2 stages with 2 virtual stages each."""

import json

import pytest

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from megatron_helpers import make_samples, run_ranks, tiny_family_model  # noqa: E402
from test_megatron_parallel import ALGO, compare  # noqa: E402


@pytest.fixture(scope="module")
def moe_model(tiny_model, tmp_path_factory):
    return tiny_family_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", tokenizer_from=tiny_model)


@pytest.fixture(scope="module")
def reference(moe_model):
    from agentrl.trainers.torch_trainer import TorchTrainer

    train = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2)
    trainer = megatron_trainer.MegatronTrainer(str(moe_model), train=train, algo=AlgoConfig(**ALGO), temperature=0.8,
                                               device="cpu", dtype="float32")
    samples = make_samples()
    before = trainer.compute_logprobs(samples)
    hf = TorchTrainer(str(moe_model), train=train, algo=AlgoConfig(**ALGO), temperature=0.8).compute_logprobs(samples)
    assert max(abs(x - y) for a, b in zip(before, hf) for x, y in zip(a, b)) < 1e-5  # the one-process trainer is HF's model
    metrics = trainer.train_rollout(samples)
    return {"before": before, "metrics": metrics, "after": trainer.compute_logprobs(samples),
            "names": sorted(n for n, _ in trainer.named_tensors())}


LAYOUTS = {
    "EP=2 + distributed optimizer": ({"expert_model_parallel_size": "2", "use_distributed_optimizer": None}, None),
    "TP=2 + SP, EP=2, ETP=1": ({"tensor_model_parallel_size": "2", "sequence_parallel": None,
                                "expert_model_parallel_size": "2", "expert_tensor_parallel_size": "1"}, None),
    "TP=2 + SP, ETP=2": ({"tensor_model_parallel_size": "2", "sequence_parallel": None,
                          "expert_tensor_parallel_size": "2"}, None),
    "PP=2 x 2 virtual stages": ({"pipeline_model_parallel_size": "2", "num_layers_per_virtual_pipeline_stage": "1"}, 40),
}


@pytest.mark.parametrize("label", list(LAYOUTS))
@pytest.mark.slow
def test_moe_layout_equals_one_process(reference, moe_model, tmp_path, label):
    megatron, max_tokens = LAYOUTS[label]
    args = ["--model", str(moe_model), "--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO)]
    if max_tokens:
        args += ["--max-tokens", str(max_tokens)]
    compare(run_ranks(2, args, tmp_path / "out.json"), reference, label)
