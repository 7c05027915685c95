"""How the trainer's weights travel to the engines: buckets, and the four paths over the
engines' HTTP endpoints (the same for SGLang and the embedded engine: they speak one protocol).
Which path a run takes, and the trainer's part in it, is agentrl.weight_sync's.

- from tensors (`sync_weights_from_tensor`, colocated): POST /update_weights_from_tensor
  per bucket, in SGLang's `load_format="flattened_bucket"`: the bucket's tensors copied into
  one uint8 buffer, sent with SGLang's FlattenedTensorMetadata per tensor, so one CUDA-IPC
  handle a bucket instead of one a tensor (`flattened=False`: the per-tensor payload, for
  comparison). The encoding of `serialized_named_tensors` depends on the engine, read from
  its /model_info: SGLang gets its own `MultiprocessingSerializer` pickle (CUDA IPC
  handles: the tensors must live on a GPU of the same machine), the embedded engine base64
  of torch.save with CPU tensors (see agentrl.engines.embedded). The list holds one payload
  per engine TP rank (SGLang's TP rank k reads element k). A trainer of several ranks sends
  each TP rank the copy of the trainer rank on that rank's own GPU (`sync_weights_per_rank`,
  as slime gathers them): every rank holds the full HF tensors after the export, each
  serializes its own, rank 0 gathers the payloads and posts, and no rank frees a bucket
  before the engines have loaded it. Either way the next bucket is exported and encoded (in
  a worker thread) while the engines load this one; then the weight version and one cache
  flush. The metrics break a sync's seconds down (weight_sync_export_s, _encode_s,
  _gather_s, _wait_s: engine time not hidden, _finish_s).
- from a process group (`WeightUpdateGroup`, disaggregated): /init_weights_update_group
  once, then per bucket /update_weights_from_distributed while rank 0 (the trainer)
  broadcasts each tensor; NCCL for GPU tensors, gloo for CPU ones (the embedded engine).
- from disk (`sync_weights_from_disk`): the trainer writes an HF checkpoint, every engine
  loads it with /update_weights_from_disk.
- by deltas (`sync_weights_from_delta`, engines far from the trainer): the trainer publishes the
  changed bytes to a shared folder (agentrl.weight_delta), every engine brings its host's local
  checkpoint up to that version with agentrl's POST /agentrl/apply_weight_delta (the embedded
  engine's, or agentrl's SGLang wrapper's, agentrl.engines.sglang_server) and loads it with
  /update_weights_from_disk.
- LoRA adapters only (`sync_lora_adapter`, --lora-sync adapter): the trainer writes the peft
  adapter folder (MBs, not GBs), every engine loads it with /load_lora_adapter under the
  version's name (`lora_adapter_name`), and requests name it in /generate's `lora_path`.

Every path sends to all engines at once and ends with the new `weight_version` and a cache
flush (a prefix cache built under old weights is never reused).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import torch

from agentrl.engines.embedded import encode_flattened_bucket, encode_named_tensors
from agentrl.errors import EngineError
from agentrl.http import HTTPCallError
from agentrl.rollout.client import EngineClient
from agentrl.weight_delta import APPLY_ROUTE


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


async def engine_tp_size(client: EngineClient) -> int:
    info = await client.get("/server_info")
    return int(info.get("tp_size", 1)) if isinstance(info, dict) else 1


async def _engine(client: EngineClient) -> tuple[str, int]:
    """(kind, TP size): the encoding an engine reads and how many payloads it takes."""
    return await client.kind(), await engine_tp_size(client)


ALIGN = 16  # each tensor's offset in a flat bucket: any dtype's view of it is aligned (SGLang views by dtype)


def flatten_bucket(chunk: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple]]:
    """One bucket as a single uint8 buffer on its tensors' device, and per tensor (name, shape,
    dtype, start, end) in bytes: SGLang's `load_format="flattened_bucket"` layout (one IPC handle
    a bucket instead of one a tensor). Offsets are ALIGN-aligned, so mixed dtypes share a buffer;
    the copies are queued on the device, nothing waits for them here."""
    if not chunk:
        raise EngineError("flatten_bucket: an empty bucket")
    meta, at = [], 0
    for name, t in chunk:
        at = -(-at // ALIGN) * ALIGN
        n = t.numel() * t.element_size()
        meta.append((name, tuple(t.shape), t.dtype, at, at + n))
        at += n
    flat = _ipc_buffer(at, chunk[0][1].device)
    for (_, t), (_, _, _, start, end) in zip(chunk, meta):
        if end > start:
            flat[start:end].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, meta


def _allocator_conf() -> str | None:
    """The allocator settings this process runs with, where they turn expandable segments on."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "")
        if re.search(r"expandable_segments:\s*true", conf, re.I):
            return conf
    return None


def _ipc_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A bucket's buffer. On a GPU with expandable segments (agentrl's trainer ranks run so), a
    block goes out over CUDA IPC as one file descriptor per 20 MB of its segment, each imported
    and mapped by every engine rank (which also reserves address space for the whole GPU per
    import, pytorch/pytorch#186213): for a view into Megatron's parameter buffer that is the whole
    buffer, every bucket. So the buffer is a plain cudaMalloc block of its own, one IPC handle,
    allocated with expandable segments off for the moment (PyTorch's advice for IPC)."""
    conf = _allocator_conf() if device.type == "cuda" else None
    if conf is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    set_settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    try:  # the whole setting string each time: a parse may reset what it does not name
        set_settings(re.sub(r"expandable_segments:\s*true", "expandable_segments:False", conf, flags=re.I))
    except Exception:  # noqa: BLE001 - an older or newer PyTorch: an expandable block still works, slower
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        set_settings(conf)


def unflatten_bucket(flat: torch.Tensor, meta: list[tuple]) -> list[tuple[str, torch.Tensor]]:
    """flatten_bucket's inverse (views into `flat`), as SGLang's FlattenedTensorBucket rebuilds them."""
    return [(name, flat[start:end].view(dtype).reshape(shape)) for name, shape, dtype, start, end in meta]


def _sglang_serializer():
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
    return MultiprocessingSerializer


def sglang_serialize(chunk: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """SGLang's per-tensor colocated encoding (load_format None): MultiprocessingSerializer over CUDA
    tensors, one IPC handle a tensor, once per TP rank."""
    serializer = _sglang_serializer()
    if any(not t.is_cuda for _, t in chunk):
        raise EngineError("weights to SGLang from tensors travel as CUDA IPC handles: the trainer's tensors must be "
                          "on a GPU of this machine (colocated); use the disk or distributed path otherwise")
    data = serializer.serialize([(n, t.detach()) for n, t in chunk], output_str=True)
    return [data] * tp_size


def sglang_serialize_flat(flat: torch.Tensor, meta: list[tuple]) -> str:
    """SGLang's flattened-bucket payload: {"flattened_tensor", "metadata": [FlattenedTensorMetadata]}
    (sglang/srt/weight_sync/tensor_bucket.py, what ModelRunner._update_weights_from_flattened_bucket reads)."""
    serializer = _sglang_serializer()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if not flat.is_cuda:
        raise EngineError("weights to SGLang from tensors travel as CUDA IPC handles: the trainer's tensors must be "
                          "on a GPU of this machine (colocated); use the disk or distributed path otherwise")
    metadata = [FlattenedTensorMetadata(name=n, shape=torch.Size(s), dtype=d, start_idx=a, end_idx=b, numel=b - a)
                for n, s, d, a, b in meta]
    return serializer.serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)


class Encoded:
    """One trainer rank's payload of one bucket: what it is (meta: names, shapes, dtypes), the
    string a TP rank reads, and the tensors the payload points at (held until the engines load them)."""

    def __init__(self, meta, payload: str, keep=None, nbytes: int = 0):
        self.meta, self.payload, self.keep, self.nbytes = meta, payload, keep, nbytes


def encode_bucket(kind: str, chunk: list[tuple[str, torch.Tensor]], *, flattened: bool = True) -> Encoded:
    """One TP rank's payload of a bucket in the encoding of an engine `kind` ("sglang", "embedded"),
    flattened (one buffer, load_format "flattened_bucket") or a tensor at a time (load_format None)."""
    meta = _chunk_meta(chunk)
    nbytes = sum(t.numel() * t.element_size() for _, t in chunk)
    if not flattened:
        payload = sglang_serialize(chunk, 1)[0] if kind == "sglang" else encode_named_tensors(chunk)
        return Encoded(meta, payload, [t for _, t in chunk], nbytes)
    flat, flat_meta = flatten_bucket(chunk)
    if kind == "sglang":
        return Encoded(meta, sglang_serialize_flat(flat, flat_meta), flat, nbytes)
    return Encoded(meta, encode_flattened_bucket(flat, flat_meta), None, nbytes)


def load_format(flattened: bool) -> str | None:
    return "flattened_bucket" if flattened else None


async def _all(clients: list[EngineClient], path: str, payloads: list[dict]) -> None:
    replies = await asyncio.gather(*[c.post(path, p) for c, p in zip(clients, payloads)])
    for client, reply in zip(clients, replies):
        if not (isinstance(reply, dict) and reply.get("success")):
            raise EngineError(f"{path} rejected by {client.base_url}: {reply}")


class _Timing:
    """Where one sync's seconds go (host time; the export's GPU work shows where something waits for it)."""

    def __init__(self):
        self.export = self.encode = self.gather = self.wait = 0.0

    def metrics(self) -> dict[str, float]:
        return {"weight_sync_export_s": self.export, "weight_sync_encode_s": self.encode,
                "weight_sync_gather_s": self.gather, "weight_sync_wait_s": self.wait}


def _worker() -> ThreadPoolExecutor:
    """One thread for a sync's export side: its collectives keep their order (and the thread its CUDA
    device), and the event loop stays free to carry the bucket in flight meanwhile."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-weight-sync")


def _release_ipc() -> None:
    """A block that went out as a CUDA IPC handle and is dropped before the engine let go of it
    waits in PyTorch's IPC limbo until collected: after each bucket, as slime does (cheap)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


async def _finish(clients: list[EngineClient], version: int) -> None:
    """After every bucket: the new weight version, then one cache flush (the buckets flush nothing)."""
    await _all(clients, "/update_weight_version", [{"new_version": str(version), "abort_all_requests": False}]
               * len(clients))
    await asyncio.gather(*[c.post("/flush_cache", {}) for c in clients])


async def sync_weights_from_tensor(clients: list[EngineClient], named: Iterable[tuple[str, torch.Tensor]], *,
                                   version: int, bucket_bytes: int, flattened: bool = True) -> dict[str, float]:
    """POST /update_weights_from_tensor per bucket to every engine (each in its own encoding),
    then the weight version and a cache flush. Bucket k+1 is exported and encoded while bucket k
    is in the engines. Returns timing (with its breakdown) and size."""
    t0 = time.perf_counter()
    engines = await asyncio.gather(*[_engine(c) for c in clients])  # (kind, tp) each
    kinds = sorted({k for k, _ in engines})
    timing, chunks, loop, pool = _Timing(), buckets(named, bucket_bytes), asyncio.get_running_loop(), _worker()

    def prepare() -> dict[str, Encoded] | None:
        t = time.perf_counter()
        chunk = next(chunks, None)
        timing.export += time.perf_counter() - t
        if chunk is None:
            return None
        t = time.perf_counter()
        out = {k: encode_bucket(k, chunk, flattened=flattened) for k in kinds}  # once per encoding, not per engine
        timing.encode += time.perf_counter() - t
        return out

    total, count, pending = 0, 0, None
    try:
        while True:
            encoded = await loop.run_in_executor(pool, prepare)
            if pending is not None:
                t = time.perf_counter()
                await pending[0]
                timing.wait += time.perf_counter() - t
                pending = None  # the engines hold their copy: the bucket may go
                _release_ipc()
            if encoded is None:
                break
            payloads = [{"serialized_named_tensors": [encoded[kind].payload] * tp,
                         "load_format": load_format(flattened), "flush_cache": False} for kind, tp in engines]
            pending = (asyncio.ensure_future(_all(clients, "/update_weights_from_tensor", payloads)), encoded)
            total += next(iter(encoded.values())).nbytes
            count += 1
    except BaseException:
        if pending is not None:
            await asyncio.gather(pending[0], return_exceptions=True)
        # the rest of the export still runs: a trainer of several ranks has them in its collectives
        await loop.run_in_executor(pool, lambda: collections.deque(chunks, maxlen=0))
        raise
    finally:
        pool.shutdown(wait=False)
        _release_ipc()
    t = time.perf_counter()
    await _finish(clients, version)
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_mb": total / 2**20, "weight_sync_buckets": count,
            "weight_sync_flattened": float(flattened), "weight_sync_finish_s": time.perf_counter() - t,
            **timing.metrics()}


_OBJECT_GROUP: tuple = (None, None)  # (the default group, a gloo group of its ranks), made at the first per-rank sync


class RankGather:
    """The trainer's ranks around one bucket of the per-rank path: `collect` gathers every rank's
    (names, payload) on rank 0, `verdict` sends rank 0's outcome of the post to all (an error
    string or None), which is also when the others may let go of the bucket's tensors. Over a
    gloo group of all ranks: over NCCL each object collective copies to and from the GPU, so the
    host would wait there for the export's queued work every bucket. Made by every rank at the
    start of each per-rank sync (the first one creates the group, a collective of all ranks)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        global _OBJECT_GROUP
        world = dist.distributed_c10d._get_default_group()
        if _OBJECT_GROUP[0] is not world:  # the first sync, or the trainer's group was made anew
            _OBJECT_GROUP = (world, dist.new_group(backend="gloo"))
        self.dist, self.rank, self.world, self.group = dist, dist.get_rank(), dist.get_world_size(), _OBJECT_GROUP[1]

    def collect(self, item):
        out = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(item, out, dst=0, group=self.group)
        return out

    def verdict(self, error: str | None) -> str | None:
        box = [error]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def _chunk_meta(chunk) -> list[tuple[str, tuple, str]]:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in chunk]


def _encoded(kind: str, chunk, flattened: bool) -> tuple[tuple, Encoded | None, BaseException | None]:
    """((meta, payload) for the gather, the encoding (its tensors held), None), or ((why, None), None,
    the error): what a rank gives the gather either way."""
    try:
        enc = encode_bucket(kind, chunk, flattened=flattened)
        return (enc.meta, enc.payload), enc, None
    except Exception as exc:
        return (f"{type(exc).__name__}: {exc}", None), None, exc


# The per-rank protocol, the same on every rank, bucket k: export k and encode it; then (k > 0) the
# verdict on bucket k-1, after which bucket k-1 may go (a failed one: every rank only finishes the
# export); then the gather of bucket k, and rank 0 posts it. After the last bucket, its verdict. So
# bucket k is exported and encoded while bucket k-1 is in the engines, and no rank holds more than two.


async def sync_weights_per_rank(clients: list[EngineClient], named: Iterable[tuple[str, torch.Tensor]], *,
                                version: int, bucket_bytes: int, sources: list[list[int]], kind: str,
                                gather: RankGather, flattened: bool = True) -> dict[str, float]:
    """Rank 0 of the per-rank path: engine i's TP rank k gets the payload of trainer rank
    `sources[i][k]` (the one on its GPU). Every other rank runs `serve_weights_per_rank`
    meanwhile (the protocol above); then the weight version and a cache flush."""
    t0 = time.perf_counter()
    timing, chunks, loop, pool = _Timing(), buckets(named, bucket_bytes), asyncio.get_running_loop(), _worker()
    failed = False

    def prepare():
        t = time.perf_counter()
        chunk = next(chunks, None)
        timing.export += time.perf_counter() - t
        if chunk is None or failed:  # after a failure only the export runs (the other ranks are in it)
            return chunk is not None
        t = time.perf_counter()
        out = _encoded(kind, chunk, flattened) + (sum(x.numel() * x.element_size() for _, x in chunk),)
        timing.encode += time.perf_counter() - t
        return out

    def settle(error: BaseException | None) -> None:
        t = time.perf_counter()
        gather.verdict(None if error is None else f"{type(error).__name__}: {error}")
        timing.gather += time.perf_counter() - t

    def collect(mine):
        t = time.perf_counter()
        items = gather.collect(mine)
        timing.gather += time.perf_counter() - t
        return items

    async def post(items, local: BaseException | None, index: int) -> None:
        if local is not None:
            raise local
        for rank, (meta, payload) in enumerate(items):
            if payload is None:
                raise EngineError(f"trainer rank {rank} could not serialize bucket {index}: {meta}")
            if meta != items[0][0]:
                raise EngineError(f"trainer rank {rank} exported other weights than rank 0 in bucket {index} "
                                  f"({meta[:2]}... vs {items[0][0][:2]}...): the per-rank sync needs every rank "
                                  "to hold the full HF tensors")
        payloads = [{"serialized_named_tensors": [items[r][1] for r in ranks], "load_format": load_format(flattened),
                     "flush_cache": False} for ranks in sources]
        await _all(clients, "/update_weights_from_tensor", payloads)

    total, count, error, pending = 0, 0, None, None
    try:
        while True:
            got = await loop.run_in_executor(pool, prepare)
            if pending is not None:
                t = time.perf_counter()
                try:
                    await pending[0]
                except BaseException as exc:  # noqa: BLE001 - every rank hears of it in the verdict
                    error = exc
                timing.wait += time.perf_counter() - t
                await loop.run_in_executor(pool, settle, error)
                pending, failed = None, error is not None
                _release_ipc()
            if got is False:  # the export's end
                break
            if got is True or failed:  # a bucket after a failure: exported, not gathered
                continue
            mine, enc, local, nbytes = got
            items = await loop.run_in_executor(pool, collect, mine)
            pending = (asyncio.ensure_future(post(items, local, count)), enc)
            total += nbytes
            count += 1
    finally:
        pool.shutdown(wait=False)
        _release_ipc()
    if error is not None:
        raise error
    t = time.perf_counter()
    await _finish(clients, version)
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_mb": total / 2**20, "weight_sync_buckets": count,
            "weight_sync_per_rank": 1.0, "weight_sync_flattened": float(flattened),
            "weight_sync_finish_s": time.perf_counter() - t, **timing.metrics()}


def serve_weights_per_rank(named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, kind: str,
                           gather: RankGather, flattened: bool = True) -> None:
    """A rank other than 0 in the per-rank path (the protocol above): its payload of each bucket
    to rank 0, each bucket held until rank 0's verdict on it."""
    failed, held = None, None
    try:
        for chunk in buckets(named, bucket_bytes):
            if failed is not None:
                continue
            mine, enc, _ = _encoded(kind, chunk, flattened)  # a failure goes to rank 0 as the payload's absence
            if held is not None:
                failed, held = gather.verdict(None), None
                _release_ipc()
                if failed is not None:
                    continue
            gather.collect(mine)
            held = (enc,)
        if held is not None and failed is None:
            gather.verdict(None)
    finally:
        _release_ipc()


async def sync_weights_from_disk(clients: list[EngineClient], model_path: str, *, version: int) -> dict[str, float]:
    """Every engine loads the HF checkpoint at `model_path` (the trainer has written it)."""
    t0 = time.perf_counter()
    payload = {"model_path": str(model_path), "weight_version": str(version), "flush_cache": True}
    await _all(clients, "/update_weights_from_disk", [payload] * len(clients))
    return {"weight_sync_s": time.perf_counter() - t0}


async def sync_weights_from_delta(clients: list[EngineClient], delta_dir: str, local_dir: str, *,
                                  version: int) -> dict[str, float]:
    """Every engine brings its host's local checkpoint `local_dir` to delta version `version` of
    `delta_dir` (engines of one host share it: the first applies, the others find it done), then
    loads it."""
    t0 = time.perf_counter()
    payload = {"delta_dir": str(delta_dir), "local_dir": str(local_dir), "version": version}
    try:
        await _all(clients, APPLY_ROUTE, [payload] * len(clients))
    except HTTPCallError as exc:
        if exc.status != 404:
            raise
        raise EngineError(f"{exc.url}: HTTP 404, not served: --weight-sync-mode delta needs engines started by "
                          "agentrl (the embedded engine, or SGLang through `python -m agentrl.engines.sglang_server`, "
                          "which takes SGLang's arguments)") from None
    applied = time.perf_counter() - t0
    out = await sync_weights_from_disk(clients, local_dir, version=version)
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_apply_s": applied,
            "weight_sync_load_s": out["weight_sync_s"]}


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
        tps = [await engine_tp_size(c) for c in self.clients]
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
