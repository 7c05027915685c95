"""bench/megatron_bench.py's CPU smoke run (tiny model, the CPU shim): the GPU figures come from
this script, so a trainer change that breaks it must fail here, not on the lent GPU machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_runs_every_stage_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "megatron_bench.py"), "--out", str(tmp_path),
                           "--device", "cpu", "--dtype", "float32", "--samples", "8", "--max-tokens", "128",
                           "--logprob-impls", "torch,triton"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "megatron_bench.json").read_text())
    assert "errors" not in res, res.get("errors")
    assert [r["logprob_impl"] for r in res["throughput"]] == ["torch", "triton"]
    assert all(r["train_step_s"] > 0 and r["grad_norm"] > 0 for r in res["throughput"])
    assert res["parity"]["megatron_bf16_vs_hf_fp32"]["max"] < 1e-4  # fp32 here: the names are the GPU run's
