"""Issue 34's instruments: the start-up / stop timeline, SGLang's start-up steps read from its log,
the rollout phase's stage metrics, the breakdown against the bare client, the async repeats'
spread, the engines stopped all at once, and the weight-update gate's open fast path."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentrl.metrics import RunContext, Timeline, engine_log_steps, rollout_stage_metrics, triton_cache_kernels
from agentrl.cluster.engine_actor import stop_engines
from agentrl.rollout.control import RolloutControl
from agentrl.train import Background
from agentrl.types import Sample
from spine_helpers import agentrl_cli, run_env

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_timeline_records_steps_and_moments_in_run_json(tmp_path):
    notes = []
    t = Timeline(RunContext(tmp_path), notes.append, started_at=time.time() - 10.0)
    with t.step("startup", "engines"):
        pass
    t.add("startup", "ray", 1.0, 4.5)
    t.mark("startup", "first_rollout_request", at=t.started_at + 12.25)
    with pytest.raises(RuntimeError):
        with t.step("stop", "engines"):  # a failing step is still recorded
            raise RuntimeError("boom")
    facts = json.loads((tmp_path / "run.json").read_text())
    assert facts["startup"]["ray"] == [1.0, 4.5]
    begun, ended = facts["startup"]["engines"]
    assert 10.0 <= begun <= ended < 11.0
    assert facts["startup"]["first_rollout_request"] == 12.25
    assert "engines" in facts["stop"]
    t.report("startup")  # in the order the steps began
    assert notes[0].startswith("startup: ray 1.0-4.5s, engines 10.") and "first_rollout_request at 12.2" in notes[0]


def test_run_context_is_written_whole_from_two_threads(tmp_path):
    context = RunContext(tmp_path)
    threads = [threading.Thread(target=lambda i=i: [context.record(**{f"k{i}_{j}": j}) for j in range(50)])
               for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    facts = json.loads((tmp_path / "run.json").read_text())
    assert all(f"k{i}_{j}" in facts for i in range(2) for j in range(50))


def stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def test_sglang_start_up_steps_from_its_log(tmp_path):
    t = float(int(time.time()))
    old = t - 3600  # an earlier run's lines in the same folder: not this start's
    (tmp_path / "sglang-0.log").write_text("\n".join([
        f"[{stamp(old)} TP0] Load weight begin. avail mem=70.00 GB",
        f"[{stamp(t)} TP0] Load weight begin. avail mem=70.00 GB",
        f"[{stamp(t)} TP1] Load weight begin. avail mem=70.00 GB",
        f"[{stamp(t + 4)} TP0] Load weight end. elapsed=4.0 s, type=Qwen2ForCausalLM",
        f"[{stamp(t + 6)} TP0] KV Cache is allocated. #tokens: 100000",
        f"[{stamp(t + 7)} TP0] Capture cuda graph begin. This can take up to several minutes.",
        f"[{stamp(t + 30)} TP1] Capture cuda graph end. Time elapsed: 23.00 s.",  # rank 1: not read
        f"[{stamp(t + 31)} TP0] Capture cuda graph end. Time elapsed: 24.00 s.",
        "Loading safetensors checkpoint shards: 100%",
        f"[{stamp(t + 40)}] The server is fired up and ready to roll!",
    ]) + "\n")
    (tmp_path / "engine.log").write_text("embedded engine up\n")
    steps = engine_log_steps(tmp_path, since=t)
    assert steps == {"sglang-0/weights": (t, t + 4), "sglang-0/kv_cache": (t + 4, t + 6),
                     "sglang-0/cuda_graphs": (t + 7, t + 31), "sglang-0/warmup": (t + 31, t + 40)}


def test_sglang_0_5_15s_graph_steps_from_its_log(tmp_path):
    """SGLang 0.5.15's lines (a 1x H200 run, 2026-12-03): prefill graphs, then decode graphs."""
    t = float(int(time.time()))
    (tmp_path / "sglang-0.log").write_text("\n".join([
        f"[{stamp(t)}] Load weight begin. avail mem=136.48 GB",
        f"[{stamp(t)}] Load weight end. elapsed=0.16 s, type=LlamaForCausalLM, avail mem=136.21 GB, mem usage=0.27 GB.",
        f"[{stamp(t + 1)}] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 3165267, K size: 33.96 GB",
        f"[{stamp(t + 2)}] Capture target prefill CUDA graph begin. backend=breakable, num_tokens=[4, 8, 12]",
        f"[{stamp(t + 31)}] Capture target prefill CUDA graph end. elapsed=29.44 s, mem usage=0.46 GB",
        f"[{stamp(t + 31)}] Capture target decode CUDA graph begin. backend=full, num_tokens_per_bs=1, bs=[1, 2]",
        f"[{stamp(t + 34)}] Capture target decode CUDA graph end. elapsed=2.99 s, mem usage=0.13 GB",
        f"[{stamp(t + 41)}] The server is fired up and ready to roll!",
    ]) + "\n")
    assert engine_log_steps(tmp_path, since=t) == {
        "sglang-0/weights": (t, t), "sglang-0/kv_cache": (t, t + 1), "sglang-0/prefill_graphs": (t + 2, t + 31),
        "sglang-0/cuda_graphs": (t + 31, t + 34), "sglang-0/warmup": (t + 34, t + 41)}


def test_the_triton_cache_is_counted(tmp_path, monkeypatch):
    """A cold cache (the engines compiled their kernels while starting) is told from a warm one."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none"))
    assert triton_cache_kernels() is None
    for name in ("a1", "b2", "c3"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_kernels() == 3


def sample(stages: dict) -> Sample:
    return Sample(prompt_tokens=[1], metadata={"stages": stages})


def test_rollout_stage_metrics_split_the_phase():
    t = 1000.0
    samples = [sample({"first_request_at": t + 2.0, "last_reply_at": t + 6.0, "generate_s": 3.0, "requests": 2,
                       "render_s": 0.5, "decode_s": 0.1, "env_s": 0.4}),
               sample({"first_request_at": t + 2.5, "last_reply_at": t + 9.0, "generate_s": 5.0, "requests": 3,
                       "render_s": 0.3, "prompt_s": 0.1, "slot_wait_s": 1.0}),
               Sample(prompt_tokens=[1])]  # failed before any request: not counted
    m = rollout_stage_metrics(samples, t, t + 10.0)
    assert m["stage/first_request_after_s"] == 2.0 and m["stage/after_last_reply_s"] == 1.0
    assert m["stage/requests_span_s"] == 7.0 and m["stage/requests"] == 5
    assert m["stage/generate_s_mean"] == 4.0 and m["stage/slot_wait_s_mean"] == 0.5
    assert m["stage/loop_busy_frac"] == pytest.approx((0.5 + 0.1 + 0.3 + 0.1) / 7.0)
    # the trajectory that replied last: 6.5 s between its first request and its last reply, 5 of them generating
    assert m["stage/critical_generate_s"] == 5.0 and m["stage/critical_other_s"] == pytest.approx(1.5)
    assert m["stage/critical_first_request_after_s"] == 2.5
    assert rollout_stage_metrics([Sample(prompt_tokens=[1])], t, t + 1) == {}


def test_breakdown_parts_add_up_to_the_rollout_seconds():
    bench = load("rollout_breakdown")
    row = {"rollout_id": 1, "rollout_s": 10.0, "colocate/offload_s": 0.5, "colocate/resume_s": 0.25,
           "colocate/release_s": 0.2, "colocate/onload_s": 0.4, "stage/first_request_after_s": 1.0,
           "stage/after_last_reply_s": 0.75, "stage/requests_span_s": 8.25, "stage/loop_busy_frac": 0.1,
           "stage/critical_other_s": 0.3, "stage/requests": 64}
    it = bench.iteration_breakdown(row, {"rollout_id": 1, "bare_s": [7.5, 8.0, 7.0]})
    assert it["bare_s"] == 7.5 and it["gap_s"] == 2.5 and it["ratio"] == 0.75
    assert it["parts_s"] == pytest.approx({"switch_in": 0.75, "switch_out": 0.6, "ramp": 0.25, "tail": 0.15,
                                           "requests_over_bare": 0.75})
    assert sum(it["parts_s"].values()) + it["bare_s"] == pytest.approx(row["rollout_s"])
    assert it["event_loop_busy_s"] == pytest.approx(0.825)
    with pytest.raises(bench.BreakdownError, match="no stage"):
        bench.iteration_breakdown({"rollout_id": 0, "rollout_s": 1.0}, {"bare_s": [1.0]})


def test_async_repeats_median_spread_and_what_varied():
    bench = load("async_repeats")

    def result(sync_s, async_s, async_train):
        its = lambda total, n=4: [{"iteration_s": 9.0}] + [{"iteration_s": total / n}] * n  # noqa: E731
        return {"warmup_iterations": 1, "configs": {"sync": {}, "async": {"equal_work_speedup": sync_s / async_s}},
                "runs": {"sync": {"at_target": {"seconds": sync_s, "rollout_s": 10, "train_s": 10, "sync_s": 1,
                                                "iterations": 5}, "per_iteration": its(sync_s)},
                         "async": {"at_target": {"seconds": async_s, "rollout_s": 1, "train_s": async_train,
                                                 "sync_s": 1, "iterations": 5}, "per_iteration": its(async_s)}}}

    repeats = [{"speedups": {"async": r["configs"]["async"]["equal_work_speedup"]}, "runs": bench.run_figures(r, 1)}
               for r in (result(24, 8, 6), result(24, 12, 10), result(24, 10, 8))]
    assert repeats[0]["runs"]["sync"]["timed_iteration_s"] == [6.0] * 4  # the warm-up iteration left out
    assert repeats[0]["runs"]["sync"]["slowest_share"] == 0.25
    s = bench.spread([r["speedups"]["async"] for r in repeats])
    assert s["median"] == 2.4 and s["min"] == 2.0 and s["max"] == 3.0 and s["spread"] == pytest.approx(0.417, abs=1e-3)
    varied = bench.attribution(repeats)
    assert varied["sync"]["seconds"] == 0.0 and varied["async"]["seconds"] == pytest.approx(0.2)
    assert varied["async"]["train_s"] > varied["async"]["rollout_s"] == 0.0  # the async side's train steps moved


def test_engines_stop_at_once():
    class Slow:
        def __init__(self):
            self.stopped = False

        def stop(self):
            time.sleep(1.0)
            self.stopped = True

    servers = [Slow() for _ in range(4)]
    group = SimpleNamespace(monitor=None, router=None, servers=servers)
    t0 = time.monotonic()
    stop_engines(group)
    assert all(s.stopped for s in servers) and time.monotonic() - t0 < 3.0  # one by one: 4 s


def test_open_gate_passes_without_suspending():
    control = RolloutControl()
    coro = control.wait()
    with pytest.raises(StopIteration):  # finished at its first step: no trip through the event loop
        coro.send(None)
    control.pause()

    async def closed():
        control.wait_timeout_s = 0.05
        with pytest.raises(asyncio.TimeoutError):
            await control.wait()

    asyncio.run(closed())


def test_background_result_and_failure():
    ok = Background(lambda: 5)
    assert ok.result() == 5
    gate = threading.Event()

    def fail():
        gate.wait(5)
        raise ValueError("bad data file")

    bad = Background(fail)
    bad.raise_if_failed()  # still running: never waits, never raises
    gate.set()
    with pytest.raises(ValueError, match="bad data file"):
        bad.result()
    with pytest.raises(ValueError, match="bad data file"):
        bad.raise_if_failed()


@pytest.mark.e2e
def test_train_records_start_up_stop_and_rollout_stages(tmp_path):
    run = tmp_path / "run"
    # with slime's profiler on the second train step (tests/trainers/test_profiling.py has the rest);
    # small batches (4 prompts x 2 samples, one optimizer step): the stages are there at any size
    proc = subprocess.run([agentrl_cli(), "train", "--num-rollout", "2", "--no-progress", "--output-dir", str(run),
                           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
                           "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2"],
                          capture_output=True, text=True, timeout=300, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["train_overall_rank0_step1.json.gz",
                                                                    "train_overall_rank0_step1.txt"]
    assert "profile of train step 1 (train_overall, rank 0)" in proc.stderr and "most self CPU time: " in proc.stderr
    facts = json.loads((run / "run.json").read_text())
    start, stop = facts["startup"], facts["stop"]
    for key in ("python", "checks", "data_env", "ray", "placement", "engines", "trainer/build"):
        assert isinstance(start[key], list) and start[key][0] <= start[key][1], (key, start)
    # the driver's set-up ran beside Ray's start, not after it
    assert start["data_env"][0] < start["ray"][1]
    assert start["engines"][1] <= start["first_rollout_request"] < start["first_iteration_done"]
    for key in ("final_checkpoint", "rollout_close", "engines", "trainer", "ray"):
        assert key in stop, (key, stop)
    assert "startup: python 0.0-" in proc.stderr and "stop: final_checkpoint" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["stage/requests"] >= r["num_samples"] and 0 <= r["stage/first_request_after_s"] < r["rollout_s"]
        assert r["stage/generate_s_mean"] > 0
