"""`weight_sync_1p5b`: the 1.5B shape's colocated weight sync on one GPU (issue 34's row: 0.13-0.21 s
in the loop, goal <= 0.1 s), by payload layout (SGLang's flattened buckets vs one IPC handle a
tensor) and bucket size, through bench/weight_sync_bench.py: the trainer is agentrl's Megatron
trainer under expandable segments, as in `agentrl train`. Figures (table with the breakdown) go to
$OUT/weight_sync_1p5b/weight_sync_bench.md; bench/results/weight_sync.md takes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpu_helpers import OUT, needs_gpus

pytestmark = needs_gpus()

BENCH = Path(__file__).resolve().parents[2] / "bench" / "weight_sync_bench.py"


def test_weight_sync_1p5b_colocated():
    out = OUT / "weight_sync_1p5b"
    proc = subprocess.run([sys.executable, str(BENCH), "--out", str(out), "--shape", "1.5b", "--buckets-mb", "512,1024",
                           "--repeats", "3"], capture_output=True, text=True, timeout=540)
    print(proc.stdout[-6000:], proc.stderr[-3000:], flush=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "weight_sync_bench.json").read_text())
    # the engine serves exactly the trainer's weights after every layout and bucket size
    assert len(results["checks"]) == 4
    for c in results["checks"]:
        assert c["version_ok"] and c["logprob_max_diff"] < 0.5, c  # bf16 kernels differ by ~0.1 at most
        if "checksum" in c and "error" not in c["checksum"]:
            assert c["checksum"]["identical"] == c["checksum"]["compared"] > 0, c["checksum"]
    rows = {(r["layout"], r["bucket_mb"]): r for r in results["summary"]}
    for mb in (512.0, 1024.0):
        flat, per_tensor = rows[("flattened", mb)], rows[("per_tensor", mb)]
        print(f"{mb:g} MB buckets: flattened {flat['median_s']:.3f} s ({flat['gb_per_s']:.1f} GB/s), per tensor "
              f"{per_tensor['median_s']:.3f} s; goal <= 0.1 s", flush=True)
        assert flat["median_s"] <= 1.1 * per_tensor["median_s"], (flat, per_tensor)
