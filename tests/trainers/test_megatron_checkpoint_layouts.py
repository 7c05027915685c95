"""Megatron distributed checkpoints in every parallel layout, on CPU (two gloo ranks of
megatron_ckpt_worker.py, the Qwen3-MoE tiny model): a run takes a step, saves, and takes the
next step; a second run resumes the checkpoint and takes that next step. Resumed, the next
step is the same: its loss and grad norm (the weights) and the logprobs after it (the update
read Adam's moments, so a lost or misplaced optimizer state shows there).

- in the layout it was saved in: 2 virtual pipeline stages (their save failed: the optimizer
  was given the chunks' state dicts merged into one, where equal local names collide), the
  distributed optimizer over data parallelism, and over expert parallelism;
- in another layout: megatron-core's dist_checkpointing reshards model weights and the
  optimizer state by sharded key (the distributed optimizer is saved in its fully_reshardable
  format), so TP=2 + SP resumes as PP=2 with virtual stages, and TP=2 + SP with the
  distributed optimizer as DP=2 with it. Loading the distributed optimizer's resumed state
  also met a megatron-core bug: every parameter got one shared Adam `step` tensor, advanced
  once per parameter (the trainer gives each its own)."""

import json

import pytest

from megatron_helpers import run_ranks, tiny_family_model

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.e2e  # eleven two-rank Megatron runs

LAYOUTS = {
    "PP=2 x 2 virtual stages": {"pipeline_model_parallel_size": "2", "num_layers_per_virtual_pipeline_stage": "1"},
    "DP=2 + distributed optimizer": {"use_distributed_optimizer": None},
    "EP=2 + distributed optimizer": {"expert_model_parallel_size": "2", "use_distributed_optimizer": None},
    "TP=2 + SP": {"tensor_model_parallel_size": "2", "sequence_parallel": None},
    "TP=2 + SP + distributed optimizer": {"tensor_model_parallel_size": "2", "sequence_parallel": None,
                                          "use_distributed_optimizer": None},
}


@pytest.fixture(scope="module")
def moe_model(tiny_model, tmp_path_factory):
    return tiny_family_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", tokenizer_from=tiny_model)


def run(model, layout: str, mode: str, ckpt, out):
    return run_ranks(2, ["--model", str(model), "--megatron", json.dumps(LAYOUTS[layout]), "--ckpt", str(ckpt),
                         "--mode", mode], out, timeout=600, worker="megatron_ckpt_worker.py")


def same_next_step(saved: dict, resumed: dict, label: str, tol: float = 1e-5) -> None:
    """tol: another layout sums in another order (float32)."""
    a, b = saved["metrics"], resumed["metrics"]
    diff = max(abs(x - y) for ra, rb in zip(saved["after"], resumed["after"]) for x, y in zip(ra, rb))
    print(f"{label}: next-step loss {a['loss']:.7f} vs {b['loss']:.7f}, grad norm {a['grad_norm']:.6f} vs "
          f"{b['grad_norm']:.6f}, logprobs after it differ by {diff:.1e}")
    assert resumed["version"] == saved["version"] == 2
    for key in ("loss", "entropy", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=tol, abs=1e-7), key
    assert diff < tol


@pytest.mark.parametrize("layout", ["PP=2 x 2 virtual stages", "DP=2 + distributed optimizer",
                                    "EP=2 + distributed optimizer"])
def test_a_checkpoint_resumes_in_its_layout(moe_model, tmp_path, layout):
    saved = run(moe_model, layout, "save", tmp_path / "ckpt", tmp_path / "saved.json")
    same_next_step(saved, run(moe_model, layout, "load", tmp_path / "ckpt", tmp_path / "resumed.json"), layout)


def test_a_checkpoint_resumes_in_another_layout(moe_model, tmp_path):
    """The optimizer kind stays (megatron-core keeps Adam's state in one format per kind): a
    checkpoint of the other kind is refused, naming it."""
    for saved_in, loaded_in in (("TP=2 + SP", "PP=2 x 2 virtual stages"),
                                ("TP=2 + SP + distributed optimizer", "DP=2 + distributed optimizer")):
        ckpt = tmp_path / saved_in.replace(" ", "")
        saved = run(moe_model, saved_in, "save", ckpt, tmp_path / "saved.json")
        resumed = run(moe_model, loaded_in, "load", ckpt, tmp_path / "resumed.json")
        same_next_step(saved, resumed, f"{saved_in} -> {loaded_in}", tol=1e-4)
    with pytest.raises(AssertionError, match="saved with --use-distributed-optimizer; resume it with it too"):
        run(moe_model, "TP=2 + SP", "load", ckpt, tmp_path / "refused.json")
