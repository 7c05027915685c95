"""Send the trainer's weights to the engines, bucketed, after every training step.

Three paths, the same for SGLang and the embedded engine (they speak one protocol):

- from tensors (`sync_weights_from_tensor`, colocated): POST /update_weights_from_tensor
  per bucket. The encoding of `serialized_named_tensors` depends on the engine, read from
  its /model_info: SGLang gets its own `MultiprocessingSerializer` pickle (CUDA IPC
  handles: the tensors must live on a GPU of the same machine), the embedded engine base64
  of torch.save with CPU tensors (see agentrl.engines.embedded). The list holds one payload
  per engine TP rank (SGLang's TP rank k reads element k). A trainer of several ranks sends
  each TP rank the copy of the trainer rank on that rank's own GPU (`sync_weights_per_rank`,
  as slime gathers them): every rank holds the full HF tensors after the export, each
  serializes its own, rank 0 gathers the payloads and posts, and no rank frees a bucket
  before the engines have loaded it.
- from a process group (`WeightUpdateGroup`, disaggregated): /init_weights_update_group
  once, then per bucket /update_weights_from_distributed while rank 0 (the trainer)
  broadcasts each tensor; NCCL for GPU tensors, gloo for CPU ones (the embedded engine).
- from disk (`sync_weights_from_disk`): the trainer writes an HF checkpoint, every engine
  loads it with /update_weights_from_disk.
- LoRA adapters only (`sync_lora_adapter`, --lora-sync adapter): the trainer writes the peft
  adapter folder (MBs, not GBs), every engine loads it with /load_lora_adapter under the
  version's name, and requests name it in /generate's `lora_path`.

Every path sends to all engines at once and gives the last request `weight_version` and
`flush_cache` (a prefix cache built under old weights is never reused).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from agentrl.engines.embedded import encode_named_tensors
from agentrl.errors import EngineError
from agentrl.rollout.client import EngineClient


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


async def _tp_size(client: EngineClient) -> int:
    info = await client.get("/server_info")
    return int(info.get("tp_size", 1)) if isinstance(info, dict) else 1


def sglang_serialize(chunk: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """SGLang's colocated encoding: MultiprocessingSerializer over CUDA tensors, once per TP rank
    (each TP rank then reads this process's GPU memory: the per-rank path avoids that)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        raise EngineError(f"weights to SGLang from tensors need sglang importable in the trainer ({exc}); "
                          "use the disk or distributed path") from None
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # CUDA IPC by device UUID, as SGLang's receiver expects
    except ImportError:
        pass
    if any(not t.is_cuda for _, t in chunk):
        raise EngineError("weights to SGLang from tensors travel as CUDA IPC handles: the trainer's tensors must be "
                          "on a GPU of this machine (colocated); use the disk or distributed path otherwise")
    data = MultiprocessingSerializer.serialize([(n, t.detach()) for n, t in chunk], output_str=True)
    return [data] * tp_size


def encode_bucket(kind: str, chunk: list[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's payload of a bucket in the encoding of an engine `kind` ("sglang", "embedded")."""
    return sglang_serialize(chunk, 1)[0] if kind == "sglang" else encode_named_tensors(chunk)


async def _encoder(client: EngineClient) -> tuple[tuple, callable]:
    """(a key naming the encoding, the encoder): engines sharing a key share one encoding."""
    tp = await _tp_size(client)
    if await client.kind() == "embedded":
        return ("embedded", tp), lambda chunk: [encode_named_tensors(chunk)] * tp
    return ("sglang", tp), lambda chunk: sglang_serialize(chunk, tp)


async def _all(clients: list[EngineClient], path: str, payloads: list[dict]) -> None:
    replies = await asyncio.gather(*[c.post(path, p) for c, p in zip(clients, payloads)])
    for client, reply in zip(clients, replies):
        if not (isinstance(reply, dict) and reply.get("success")):
            raise EngineError(f"{path} rejected by {client.base_url}: {reply}")


async def sync_weights_from_tensor(clients: list[EngineClient], named: Iterable[tuple[str, torch.Tensor]], *,
                                   version: int, bucket_bytes: int) -> dict[str, float]:
    """POST /update_weights_from_tensor per bucket to every engine (each in its own encoding);
    the last bucket carries the new weight_version and flushes the cache. Returns timing and size."""
    t0 = time.perf_counter()
    total = 0
    encoders = [await _encoder(c) for c in clients]
    chunks = list(buckets(named, bucket_bytes))
    for i, chunk in enumerate(chunks):
        total += sum(t.numel() * t.element_size() for _, t in chunk)
        last = i == len(chunks) - 1
        payloads = []
        encoded: dict[tuple, list[str]] = {}  # each encoding is made once per bucket, whatever the engine count
        for key, enc in encoders:
            if key not in encoded:
                encoded[key] = enc(chunk)
            payload = {"serialized_named_tensors": encoded[key], "load_format": None, "flush_cache": last}
            if last:
                payload["weight_version"] = str(version)
            payloads.append(payload)
        await _all(clients, "/update_weights_from_tensor", payloads)
    seconds = time.perf_counter() - t0
    return {"weight_sync_s": seconds, "weight_sync_mb": total / 2**20, "weight_sync_buckets": len(chunks)}


class RankGather:
    """The trainer's ranks around one bucket of the per-rank path, over torch.distributed's
    default group (the trainer's own: gloo on the CPU, NCCL on GPUs): `collect` gathers every
    rank's (names, payload) on rank 0, `verdict` sends rank 0's outcome of the post to all (an
    error string or None), which is also when the others may let go of the bucket's tensors."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()

    def collect(self, item):
        out = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(item, out, dst=0)
        return out

    def verdict(self, error: str | None) -> str | None:
        box = [error]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


def _chunk_meta(chunk) -> list[tuple[str, tuple, str]]:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in chunk]


async def sync_weights_per_rank(clients: list[EngineClient], named: Iterable[tuple[str, torch.Tensor]], *,
                                version: int, bucket_bytes: int, sources: list[list[int]], kind: str,
                                gather: RankGather) -> dict[str, float]:
    """Rank 0 of the per-rank path: engine i's TP rank k gets the payload of trainer rank
    `sources[i][k]` (the one on its GPU). Buckets go one at a time, each gathered from every
    rank (which runs `serve_weights_per_rank` meanwhile); then the weight version and a cache
    flush. The trainer's export is a collective too, so nothing here reads ahead of it."""
    t0 = time.perf_counter()
    total, count, error = 0, 0, None
    for chunk in buckets(named, bucket_bytes):
        if error is not None:
            continue  # the rest of the export runs (the other ranks are in it), nothing is sent
        mine, error = _encoded(kind, chunk)  # a failure here still takes part in this bucket's gather
        items = gather.collect(mine)
        try:
            if error is not None:
                raise error
            for rank, (meta, payload) in enumerate(items):
                if payload is None:
                    raise EngineError(f"trainer rank {rank} could not serialize bucket {count}: {meta}")
                if meta != items[0][0]:
                    raise EngineError(f"trainer rank {rank} exported other weights than rank 0 in bucket {count} "
                                      f"({meta[:2]}... vs {items[0][0][:2]}...): the per-rank sync needs every rank "
                                      "to hold the full HF tensors")
            payloads = [{"serialized_named_tensors": [items[r][1] for r in ranks], "load_format": None,
                         "flush_cache": False} for ranks in sources]
            await _all(clients, "/update_weights_from_tensor", payloads)
        except BaseException as exc:
            error = exc
        gather.verdict(None if error is None else f"{type(error).__name__}: {error}")
        total += sum(t.numel() * t.element_size() for _, t in chunk)
        count += 1
    if error is not None:
        raise error
    await _all(clients, "/update_weight_version", [{"new_version": str(version), "abort_all_requests": False}]
               * len(clients))
    await asyncio.gather(*[c.post("/flush_cache", {}) for c in clients])
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_mb": total / 2**20, "weight_sync_buckets": count,
            "weight_sync_per_rank": 1.0}


def serve_weights_per_rank(named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, kind: str,
                           gather: RankGather) -> None:
    """A rank other than 0 in the per-rank path: its payload of each bucket to rank 0, then it
    holds the bucket until rank 0 says the engines have it. After a failure it only finishes
    the export (its collectives), as rank 0 does."""
    failed = None
    for chunk in buckets(named, bucket_bytes):
        if failed is None:
            gather.collect(_encoded(kind, chunk)[0])  # a failure goes to rank 0 as the payload's absence
            failed = gather.verdict(None)


def _encoded(kind: str, chunk) -> tuple[tuple, BaseException | None]:
    """((meta, payload), None), or ((why, None), the error): what a rank gives the gather either way."""
    try:
        return (_chunk_meta(chunk), encode_bucket(kind, chunk)), None
    except Exception as exc:
        return (f"{type(exc).__name__}: {exc}", None), exc


async def sync_weights_from_disk(clients: list[EngineClient], model_path: str, *, version: int) -> dict[str, float]:
    """Every engine loads the HF checkpoint at `model_path` (the trainer has written it)."""
    t0 = time.perf_counter()
    payload = {"model_path": str(model_path), "weight_version": str(version), "flush_cache": True}
    await _all(clients, "/update_weights_from_disk", [payload] * len(clients))
    return {"weight_sync_s": time.perf_counter() - t0}


def lora_adapter_name(version: int) -> str:
    """The name each engine serves policy version `version`'s adapter under (requests' lora_path)."""
    return f"agentrl-lora-v{version}"


async def _lora_call(client: EngineClient, path: str, payload: dict, *, tolerate: str) -> None:
    try:
        reply = await client.post(path, payload)
    except EngineError as exc:  # SGLang answers a refused adapter call with HTTP 400
        if tolerate in str(exc):
            return
        raise
    if not (isinstance(reply, dict) and reply.get("success")):
        raise EngineError(f"{path} rejected by {client.base_url}: {reply}")


async def sync_lora_adapter(clients: list[EngineClient], folder: str, *, version: int,
                            previous: int | None = None) -> dict[str, float]:
    """LoRA (--lora-sync adapter): every engine loads the peft adapter folder the trainer wrote, as
    `lora_adapter_name(version)` (SGLang's /load_lora_adapter; a name is never reloaded with new
    weights, so each version has its own), takes `version` as its weight_version, then drops the
    previous version's adapter (one an engine never had, after a restart, is not an error)."""
    t0 = time.perf_counter()
    name = lora_adapter_name(version)
    load = {"lora_name": name, "lora_path": str(folder)}
    # a retry after a partial failure finds the version loaded (the same folder): not an error
    await asyncio.gather(*[_lora_call(c, "/load_lora_adapter", load, tolerate="already loaded") for c in clients])
    version_payload = {"new_version": str(version), "abort_all_requests": False}
    await _all(clients, "/update_weight_version", [version_payload] * len(clients))
    if previous is not None and previous != version:  # an engine restarted since never had it
        gone = {"lora_name": lora_adapter_name(previous)}
        await asyncio.gather(*[_lora_call(c, "/unload_lora_adapter", gone, tolerate="does not exist") for c in clients])
    size = sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_mb": size / 2**20}


class WeightUpdateGroup:
    """The trainer as rank 0 of a process group with every engine (SGLang's protocol:
    engine i's ranks start at rank_offset = 1 + the TP sizes of the engines before it)."""

    def __init__(self, clients: list[EngineClient], *, backend: str | None = None, master_address: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = "weight_update_group", timeout_s: float = 300.0):
        from agentrl.engines.launch import free_port

        self.clients, self.backend, self.group_name = clients, backend, group_name
        self.master_address, self.master_port = master_address, master_port or free_port()
        self.timeout_s = timeout_s
        self.group = None

    async def init(self, device: str = "cpu") -> None:
        from agentrl.engines.distributed import init_custom_process_group

        self.backend = self.backend or ("nccl" if str(device).startswith("cuda") else "gloo")
        if self.backend == "nccl":
            # SGLang runs with NCCL_CUMEM_ENABLE=0 unless told otherwise; a trainer on NCCL's default (cuMem
            # on) fails the first broadcast in NCCL's P2P transport ("Cuda failure 'invalid argument'", seen
            # on 2x H200, bench/results/weight_sync.md). NCCL reads it once per process, at its first
            # communicator, and the Megatron trainer makes one when it is built: a trainer process must have
            # it in its environment from the start (RemoteTrainer starts GPU ranks so). This line covers only
            # other callers with no NCCL yet (bench/weight_sync_gpu.py).
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        tps = [await _tp_size(c) for c in self.clients]
        world = 1 + sum(tps)
        offsets = [1 + sum(tps[:i]) for i in range(len(tps))]
        init_method = f"tcp://{self.master_address}:{self.master_port}"
        local = asyncio.create_task(asyncio.to_thread(
            init_custom_process_group, backend=self.backend, init_method=init_method, world_size=world, rank=0,
            group_name=self.group_name, timeout_s=self.timeout_s))
        payloads = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": off,
                     "world_size": world, "group_name": self.group_name, "backend": self.backend} for off in offsets]
        try:
            await _all(self.clients, "/init_weights_update_group", payloads)
        except BaseException:
            local.cancel()
            raise
        self.group = await local

    async def sync(self, named: Iterable[tuple[str, torch.Tensor]], *, version: int,
                   bucket_bytes: int) -> dict[str, float]:
        import torch.distributed as dist

        if self.group is None:
            raise EngineError("WeightUpdateGroup.sync before init()")
        t0 = time.perf_counter()
        total, chunks = 0, list(buckets(named, bucket_bytes))
        for i, chunk in enumerate(chunks):
            if self.backend == "gloo":
                chunk = [(n, t.detach().cpu()) for n, t in chunk]
            total += sum(t.numel() * t.element_size() for _, t in chunk)
            last = i == len(chunks) - 1
            payload = {"names": [n for n, _ in chunk], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                       "shapes": [list(t.shape) for _, t in chunk], "group_name": self.group_name,
                       "flush_cache": last}
            if last:
                payload["weight_version"] = str(version)
            posts = asyncio.create_task(_all(self.clients, "/update_weights_from_distributed",
                                             [payload] * len(self.clients)))

            def send(chunk=chunk):
                for _, t in chunk:
                    dist.broadcast(t.detach().contiguous(), src=0, group=self.group)

            await asyncio.to_thread(send)
            await posts
        return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_mb": total / 2**20,
                "weight_sync_buckets": len(chunks), "weight_sync_nccl": float(self.backend == "nccl")}

    async def close(self) -> None:
        from agentrl.engines.distributed import destroy

        if self.group is not None:
            await asyncio.gather(*[c.post("/destroy_weights_update_group", {"group_name": self.group_name})
                                   for c in self.clients], return_exceptions=True)
            destroy(self.group)
            self.group = None
