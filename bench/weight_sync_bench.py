"""Colocated weight sync by payload layout: seconds, GB/s and where the seconds go, per layout and
bucket size, with the check that the engine then serves exactly the trainer's weights.

Layouts (`agentrl.weight_transfer.sync_weights_from_tensor`, the path `agentrl train --colocate` takes
with one trainer rank):
  flattened   SGLang's load_format "flattened_bucket": one uint8 buffer a bucket, one CUDA-IPC
              handle a bucket per engine TP rank (agentrl's default)
  per_tensor  load_format None: one IPC handle a tensor (agentrl before the flattened buckets)

Breakdown per sync (host seconds, `weight_sync_*` in the training loop's metrics too): export (the
trainer's HF export: gathers, name and layout conversion), encode (flatten + serialize), wait (the
engines' time not hidden behind the next bucket's export), finish (weight version + cache flush).

The trainer runs as agentrl's trainer ranks do on a GPU: PYTORCH_CUDA_ALLOC_CONF
expandable_segments:True (--no-expandable-segments: the allocator's default). Every sync sends
new weights (the initial ones + fresh noise); after each layout and bucket size the engine samples
2 prompts x 32 tokens and the trainer scores them (`logprob_max_diff`), and on SGLang every weight
tensor's hash is compared (/weights_checker).

    # GPU (one GPU, SGLang; what `bash scripts/gpu/run.sh weight_sync_1p5b` runs):
    python3 bench/weight_sync_bench.py --out $OUT --shape 1.5b
    # CPU (tiny model, the embedded engine, fp32):
    python bench/weight_sync_bench.py --out /tmp/wsb --engine embedded --device cpu --shape tiny --buckets-mb 0.25,4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BREAKDOWN = ("weight_sync_export_s", "weight_sync_encode_s", "weight_sync_wait_s", "weight_sync_finish_s")


async def run(args, results: dict, save) -> None:
    import torch

    import weight_sync_gpu as wsg
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_transfer import sync_weights_from_tensor

    out = Path(args.out)
    tdev = "cuda:0" if args.device == "cuda" else "cpu"
    model = wsg.make_checkpoint(Path(args.model_dir), args.shape, getattr(torch, args.dtype), tdev)
    # the engine without the trainer's allocator setting, as agentrl starts engines (and CUDA has read it here)
    conf = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    try:
        server = wsg.start_server(args, "colo", 0, args.port, args.mem, model, out)
    finally:
        if conf is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    try:
        side = wsg.MegatronSide(model, args.device, args.dtype) if args.trainer == "megatron" else \
            wsg.HFSide(model, tdev, args.dtype)
        results["trainer"] = side.kind
        named = list(side.named_tensors(256 * 2**20))
        results["sync_gb"] = sum(t.numel() * t.element_size() for _, t in named) / 1e9
        results["sync_tensors"] = len(named)
        del named
        await wsg.wait_ready(server, args.server_timeout_s)
        results["engine_ready_s"] = server.ready_s
        client = EngineClient(server.url, request_timeout_s=args.step_timeout_s)
        version = 0
        for layout in args.layouts:
            for mb in args.buckets_mb:
                for r in range(args.repeats + 1):  # the first is a warm-up
                    version += 1
                    wsg.perturb(side, version, args.noise)
                    wsg.sync_device(args.device)
                    o = await asyncio.wait_for(sync_weights_from_tensor(
                        [client], side.named_tensors(int(mb * 2**20)), version=version, bucket_bytes=int(mb * 2**20),
                        flattened=layout == "flattened"), args.step_timeout_s)
                    row = {"layout": layout, "bucket_mb": mb, "warmup": r == 0, **o,
                           "gb_per_s": results["sync_gb"] / o["weight_sync_s"]}
                    results["runs"].append(row)
                    wsg.log(json.dumps(row))
                check = await asyncio.wait_for(wsg.verify(args, client, side, version), args.step_timeout_s)
                results["checks"].append({"layout": layout, "bucket_mb": mb, **check})
                wsg.log("check", json.dumps(results["checks"][-1]))
                save()
        await client.close()
    finally:
        server.stop()


def summarize(results: dict) -> list[dict]:
    rows = []
    runs = [r for r in results["runs"] if not r["warmup"]]
    for layout in dict.fromkeys(r["layout"] for r in runs):
        for mb in dict.fromkeys(r["bucket_mb"] for r in runs if r["layout"] == layout):
            mine = [r for r in runs if r["layout"] == layout and r["bucket_mb"] == mb]
            s = [r["weight_sync_s"] for r in mine]
            rows.append({"layout": layout, "bucket_mb": mb, "buckets": mine[0]["weight_sync_buckets"],
                         "median_s": statistics.median(s), "min_s": min(s), "max_s": max(s),
                         "gb_per_s": results["sync_gb"] / statistics.median(s),
                         **{k.removeprefix("weight_sync_"): statistics.median(r[k] for r in mine) for k in BREAKDOWN}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| layout | bucket MB | buckets | s (median) | min-max | GB/s | export s | encode s | wait s | finish s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['bucket_mb']:g} | {r['buckets']} | {r['median_s']:.3f} | "
                     f"{r['min_s']:.3f}-{r['max_s']:.3f} | {r['gb_per_s']:.3g} | {r['export_s']:.3f} | "
                     f"{r['encode_s']:.3f} | {r['wait_s']:.3f} | {r['finish_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--engine", choices=["sglang", "embedded"], default="sglang")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--trainer", choices=["megatron", "hf"], default="megatron")
    p.add_argument("--shape", choices=["1.5b", "tiny"], default="1.5b")
    p.add_argument("--model-dir", default=None, help="default: /tmp/wsb-qwen2-SHAPE")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["per_tensor", "flattened"])
    p.add_argument("--buckets-mb", type=lambda s: [float(x) for x in s.split(",")], default=[512.0, 1024.0])
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per layout and bucket size (after a warm-up)")
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--port", type=int, default=31500)
    p.add_argument("--mem", type=float, default=0.45, help="SGLang --mem-fraction-static")
    p.add_argument("--sglang-extra", default="")
    p.add_argument("--no-checksum", dest="checksum", action="store_false")
    p.add_argument("--no-expandable-segments", dest="expandable", action="store_false",
                   help="the allocator's default instead of agentrl's trainer setting")
    p.add_argument("--server-timeout-s", type=float, default=240)
    p.add_argument("--step-timeout-s", type=float, default=120)
    args = p.parse_args()
    bad = set(args.layouts) - {"flattened", "per_tensor"}
    if bad:
        p.error(f"--layouts: unknown {sorted(bad)} (flattened, per_tensor)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.model_dir = args.model_dir or f"/tmp/wsb-qwen2-{args.shape}"
    if args.device == "cuda":
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        if args.expandable:  # before CUDA starts: as RemoteTrainer starts GPU ranks
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainers"))
        import megatron_cpu_shim

        megatron_cpu_shim.apply()
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
               "runs": [], "checks": []}

    def save():
        try:
            results["summary"] = summarize(results)
        except Exception as exc:  # noqa: BLE001
            results["summary"] = [{"error": repr(exc)}]
        (out / "weight_sync_bench.json").write_text(json.dumps(results, indent=1, default=str))

    t0 = time.monotonic()
    try:
        asyncio.run(run(args, results, save))
    except Exception:  # noqa: BLE001
        results["error"] = traceback.format_exc()[-3000:]
        print(results["error"], flush=True)
    results["elapsed_s"] = time.monotonic() - t0
    save()
    ok = results["summary"] and "error" not in results["summary"][0]
    text = (f"weight sync, colocated, {results.get('sync_gb', 0):.3f} GB in {results.get('sync_tensors')} tensors, "
            f"{results['device']}, trainer {results.get('trainer')}, alloc {results['alloc_conf']}\n"
            + (table(results["summary"]) if ok else str(results["summary"])))
    for c in results["checks"]:
        text += (f"\ncheck {c['layout']} {c['bucket_mb']:g} MB: logprob max diff {c['logprob_max_diff']:.2e}, version "
                 f"{'ok' if c.get('version_ok') else 'WRONG'}")
        text += f", checksum {c['checksum']}" if "checksum" in c else ""
    print(text, flush=True)
    (out / "weight_sync_bench.md").write_text(text + "\n")
    sys.stdout.flush()
    os._exit(1 if "error" in results else 0)  # no waiting on threads a failed step left behind


if __name__ == "__main__":
    main()
