"""Loading the distributed optimizer's fully_reshardable state slice by slice
(trainers/megatron/optimizer_state.py).

megatron-core's load had every rank read every parameter's whole Adam state into DP-wide host
buffers and then keep its slice (DP times its shard: ~39 GB per rank at 7B, DP=2). The trainer
now asks dist_checkpointing, per parameter, for the boxes of the stored tensor that hold its
own flat slice, read in place into its optimizer state. Checked here: the boxes cover each
slice exactly; a checkpoint resumes into another data-parallel width (DP=2 -> DP=1, DP=1 ->
DP=2) with the same next step; a checkpoint written by megatron-core's own save (all ranks
gather, DP rank 0 writes) loads the same. The host memory bound of the load is
test_megatron_ckpt_memory.py's; TP -> DP resharding and EP are test_megatron_checkpoint_layouts.py's."""

import json
import math
import random

import pytest

from megatron_helpers import run_ranks

optimizer_state = pytest.importorskip("agentrl.trainers.megatron.optimizer_state")  # imports megatron-core


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 5), (2, 3, 1, 4), (1, 9), (6, 1)])
def test_flat_boxes_cover_a_flat_range_exactly_in_order(shape):
    import torch

    numel = math.prod(shape)
    full = torch.arange(numel).view(shape)
    rng = random.Random(0)
    ranges = [(0, numel), (0, 1), (numel - 1, numel)] + [tuple(sorted(rng.sample(range(numel + 1), 2)))
                                                         for _ in range(40)]
    for a, b in ranges:
        got = []
        for offset, size, flat_start in optimizer_state.flat_boxes(shape, a, b):
            assert len(offset) == len(size) == len(shape) and all(s > 0 for s in size)
            box = full[tuple(slice(o, o + s) for o, s in zip(offset, size))]
            # contiguous in the flat order, starting where it says: a view of flat[start:start + n]
            assert box.flatten().tolist() == list(range(flat_start, flat_start + box.numel()))
            got += box.flatten().tolist()
        assert got == list(range(a, b)), (shape, a, b)
        assert len(list(optimizer_state.flat_boxes(shape, a, b))) <= 2 * len(shape) - 1


# -- resume across data-parallel widths -------------------------------------------------------------

DIST_OPT = {"use_distributed_optimizer": None}


def run(model, world: int, mode: str, ckpt, out, *extra):
    return run_ranks(world, ["--model", str(model), "--megatron", json.dumps(DIST_OPT), "--ckpt", str(ckpt),
                             "--mode", mode, *extra], out, timeout=600, worker="megatron_ckpt_worker.py")


def same_next_step(saved: dict, resumed: dict, label: str, tol: float) -> None:
    a, b = saved["metrics"], resumed["metrics"]
    diff = max(abs(x - y) for ra, rb in zip(saved["after"], resumed["after"]) for x, y in zip(ra, rb))
    print(f"{label}: next-step loss {a['loss']:.7f} vs {b['loss']:.7f}, grad norm {a['grad_norm']:.6f} vs "
          f"{b['grad_norm']:.6f}, logprobs after it differ by {diff:.1e}")
    assert resumed["version"] == saved["version"] == 2
    assert resumed["optimizer_read_in_place"] == [True], "the load fell back to megatron-core's DP-wide read"
    for key in ("loss", "entropy", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=tol, abs=1e-7), key
    assert diff < tol


@pytest.mark.e2e  # four Megatron runs of one or two CPU ranks
def test_a_checkpoint_resumes_at_another_data_parallel_width(tiny_model, tmp_path):
    for saved_world, loaded_world in ((2, 1), (1, 2)):
        ckpt = tmp_path / f"dp{saved_world}"
        saved = run(tiny_model, saved_world, "save", ckpt, tmp_path / "saved.json")
        resumed = run(tiny_model, loaded_world, "load", ckpt, tmp_path / "resumed.json")
        same_next_step(saved, resumed, f"DP={saved_world} -> DP={loaded_world}", tol=1e-4)


@pytest.mark.e2e  # two two-rank Megatron runs
def test_megatron_cores_own_save_loads_the_same(tiny_model, tmp_path):
    """The format is megatron-core's: a checkpoint its own save wrote (every rank gathers the
    whole DP group's state, DP rank 0 writes each parameter) resumes with the same next step."""
    saved = run(tiny_model, 2, "save", tmp_path / "ckpt", tmp_path / "saved.json", "--megatron-core-save")
    resumed = run(tiny_model, 2, "load", tmp_path / "ckpt", tmp_path / "resumed.json")
    same_next_step(saved, resumed, "megatron-core's save -> this load", tol=1e-5)
