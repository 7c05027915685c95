"""Tensor and pipeline parallelism on CPU: two gloo processes (megatron_worker.py) against the
one-process trainer on the same rollout. TP=2 with sequence parallelism, and PP=2 with
token-budget micro-batches (plain, and interleaved with 2 virtual stages), give the TP=1 loss, grad norm and logprobs, and export the same
HF weights bit for bit."""

import json

import pytest

pytest.importorskip("agentrl.trainers.megatron.trainer")

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from megatron_helpers import one_process_reference, run_ranks  # noqa: E402

ALGO = {"entropy_coef": 0.01, "use_tis": True, "tis_clip": 1.5}  # a loss that is not ~0 on-policy


@pytest.fixture(scope="module")
def reference(tiny_model):
    return one_process_reference(tiny_model, ALGO)


def compare(result, reference, label):
    diff = lambda a, b: max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))  # noqa: E731
    m, r = result["metrics"], reference["metrics"]
    print(f"{label}: loss {m['loss']:.6f} vs TP1 {r['loss']:.6f}; grad norm {m['grad_norm']:.6f} vs "
          f"{r['grad_norm']:.6f}; logprobs before {diff(result['before'], reference['before']):.1e}, "
          f"after the step {diff(result['after'], reference['after']):.1e}")
    assert result["roundtrip"] and result["names"] == reference["names"]
    assert diff(result["before"], reference["before"]) < 1e-5
    for key in ("loss", "pg_loss", "entropy", "tis_weight", "grad_norm"):
        assert m[key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key
    assert diff(result["after"], reference["after"]) < 1e-4


@pytest.mark.slow
def test_tensor_parallel_2_with_sequence_parallel_equals_tp1(reference, tmp_path):
    megatron = {"tensor_model_parallel_size": "2", "sequence_parallel": None}
    result = run_ranks(2, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO)], tmp_path / "tp2.json")
    compare(result, reference, "TP=2 + SP")


@pytest.mark.slow
def test_pipeline_parallel_2_equals_pp1(reference, tmp_path):
    megatron = {"pipeline_model_parallel_size": "2"}
    result = run_ranks(2, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO), "--max-tokens", "40"],
                       tmp_path / "pp2.json")
    compare(result, reference, "PP=2")


@pytest.mark.slow
def test_pipeline_2_with_virtual_stages_equals_pp1(reference, tmp_path):
    """The interleaved schedule (2 model chunks per rank) on two ranks, where each rank's
    previous and next stage are the same peer: token-budget micro-batches of unequal length."""
    megatron = {"pipeline_model_parallel_size": "2", "virtual_pipeline_model_parallel_size": "2"}
    result = run_ranks(2, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO), "--max-tokens", "40"],
                       tmp_path / "vpp.json")
    compare(result, reference, "PP=2 x 2 virtual stages")
