"""Host memory of MegatronTrainer.save and .load, on CPU (gloo ranks, the CPU shim).

A 7B model at TP=2 x DP=2 on GPUs grew every trainer process to ~113 GB of host memory in the
final save: megatron-core builds the distributed optimizer's fully_reshardable state by
all-gathering the whole DP group's Adam state on every rank (then cloning each slice it writes).
The trainer now gathers each parameter's state onto one DP rank only (optimizer_state.py,
_owned_save_state). bench/ckpt_memory.py measures each rank's peak growth per save phase; here
it must stay under 2.5x the rank's own shard (bf16 params + fp32 main params and Adam moments)
plus a fixed margin (the HF export's 256 MB bucket for save_hf). Before the fix the optimizer
phase reached 3.75x on every rank.

The load had the same cause: megatron-core read every parameter's whole Adam state on every
rank into DP-wide buffers, then kept its slice (at DP=2: 3.3x the rank's optimizer shard above
its RSS before the load). Each rank now reads only the boxes of each stored tensor that hold
its own slice, in place into its optimizer state (trainers/megatron/optimizer_state.py): the
load's growth must stay under half its optimizer shard plus the margin (a DP-wide copy is at
least DP - 1 shards). That the checkpoint still loads into other layouts is
test_megatron_checkpoint_layouts.py's and test_megatron_ckpt_load.py's; save_hf's shards
written as they fill is checked here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MB = 2**20
MARGIN = 64 * MB
HF_BUCKET = 256 * MB  # save_hf's export bucket: every rank holds one


@pytest.mark.e2e  # four Megatron ranks, a ~120M-parameter model, ~2 minutes
def test_each_rank_saves_and_loads_within_about_its_own_shard(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ckpt_memory.py"), "--tp", "2", "--dp", "2",
                           "--hidden", "1024", "--layers", "8", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("rank")))
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 4
    for r in rows:
        assert r["roundtrip"], f"rank {r['rank']}: the optimizer state did not load back as saved"
        shard = sum(r["shard_bytes"].values())
        assert shard > 400 * MB  # large enough that the margin cannot hide a DP-wide gather
        for phase, growth in r["growth"].items():
            bound = 2.5 * shard + MARGIN + (HF_BUCKET if phase == "save_hf" else 0)
            assert growth < bound, (f"rank {r['rank']} {phase}: peak host growth {growth / MB:.0f} MB "
                                    f"over {bound / MB:.0f} MB (its shard: {shard / MB:.0f} MB)")
        optimizer_shard = r["shard_bytes"]["optimizer"]
        for phase, growth in r["load_growth"].items():
            bound = 0.5 * optimizer_shard + MARGIN
            assert growth < bound, (f"rank {r['rank']} load, {phase}: peak host growth {growth / MB:.0f} MB over "
                                    f"{bound / MB:.0f} MB (its optimizer shard: {optimizer_shard / MB:.0f} MB)")


def test_save_hf_writes_each_shard_as_it_fills(tiny_model, tmp_path):
    from safetensors.torch import load_file

    trainer = megatron_trainer.MegatronTrainer(str(tiny_model), train=TrainConfig(lr=1e-3, global_batch_size=6),
                                               algo=AlgoConfig(), temperature=1.0, device="cpu", dtype="float32")
    folder = trainer.save_hf(tmp_path / "hf", max_shard_bytes=300_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 3 and files == sorted(set(index["weight_map"].values()))
    assert all(name.endswith(f"-of-{len(files):05d}.safetensors") for name in files)
    saved = {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    exported = dict(trainer.named_tensors())
    assert sorted(saved) == sorted(exported) == sorted(index["weight_map"])
    assert all(saved[k].equal(exported[k]) for k in exported)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values())
    assert trainer.save_hf(tmp_path / "hf").joinpath("model.safetensors").exists()  # one shard: its plain name
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]  # the old shards are gone
