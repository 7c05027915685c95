"""The trainer's side of every weight sync, run in its Ray actor (agentrl.cluster.trainer_actor):
`TrainerSync` picks the path for --weight-sync-mode, holds the process groups with the engines
and what was last written, and with several trainer ranks has the others take part in each
export (`LeadingRank`). How the weights travel (buckets, CUDA IPC, NCCL, disk, LoRA adapters):
agentrl.weight_transfer; the delta path's format: agentrl.weight_delta.

With --lora-sync adapter, modules trained whole beside the adapters (--lora-trainable-modules:
the tiny model's embeddings and final norm by default) go first by the tensor or distributed path
in the same sync: SGLang's adapters carry only lora_A/lora_B.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.errors import EngineError
from agentrl.fp8 import engine_tensors  # --sglang-quantization fp8: re-quantized at every sync
from agentrl.rollout.client import EngineClient
from agentrl.weight_delta import DeltaPublisher
from agentrl.weight_transfer import (RankGather, WeightUpdateGroup, engine_tp_size, serve_weights_per_rank,
                                     sync_lora_adapter, sync_weights_from_delta, sync_weights_from_disk,
                                     sync_weights_from_tensor, sync_weights_per_rank)


CALL_TIMEOUT_S = 120.0  # rank 0's wait for the other ranks' part in an export, once its own is done


class LeadingRank:
    """Rank 0 of several, as its weight sync (TrainerSync) sees its trainer. Rank 0 alone talks to
    the engines, but an export (`named_tensors`, `save_hf`) is collective: TP all-gathers and
    PP broadcasts (trainers/megatron/weights.py) after which every rank holds the full HF
    tensors (the LoRA adapter's `save_adapter` too). So each export first has every other rank run the same one
    (`TrainerSync.take_part`, through the rank's actor), and ends by waiting for them. The rest is the trainer's."""

    def __init__(self, trainer, others: list):
        self.inner, self.others = trainer, others

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def named_tensors(self):
        return self._stream("named_tensors")

    def trained_module_tensors(self):  # --lora-sync adapter's modules trained whole: gathered as named_tensors
        return self._stream("trained_module_tensors")

    def _stream(self, what: str):
        import ray

        refs = [a.export.remote(what) for a in self.others]
        stream = getattr(self.inner, what)()
        try:
            for item in stream:
                yield item
        finally:  # left midway (an engine failed): finish the collectives the other ranks are in
            for _ in stream:
                pass
            ray.get(refs, timeout=CALL_TIMEOUT_S)

    def save_hf(self, folder, *args, **kwargs):
        return self._collective("save_hf", folder, *args, **kwargs)

    def save_adapter(self, folder):  # --lora-sync adapter: TP gathers and PP exchanges the adapters
        return self._collective("save_adapter", folder)

    def _collective(self, what: str, folder, *args, **kwargs):
        import ray

        refs = [a.export.remote(what, str(folder)) for a in self.others]
        try:
            return getattr(self.inner, what)(folder, *args, **kwargs)
        finally:
            ray.get(refs, timeout=CALL_TIMEOUT_S)


class TrainerSync:
    """The trainer's side of every weight sync, in its Ray actor (agentrl.cluster.trainer_actor),
    so the weights go from the trainer's memory straight to the engines: which path
    (--weight-sync-mode), the process groups held with the engines (distributed), what was last
    written (disk, delta, --lora-sync adapter). Rank 0 of several leads the others (`lead`), which
    take part in each of its exports (`take_part`). `model_path`: the checkpoint the engines
    started from, the base of the delta path's first version."""

    def __init__(self, cfg, trainer, model_path: str | None = None):
        self.cfg = cfg
        self.model_path = model_path
        self.delta: DeltaPublisher | None = None  # --weight-sync-mode delta: the bytes last published
        self.trainer = trainer  # what the exports read: a LeadingRank once rank 0 leads others
        self.groups: dict[str, Any] = {}  # engine url -> WeightUpdateGroup (--weight-sync-mode distributed)
        self.group_count = 0
        self.saved_version: int | None = None  # what --weight-sync-mode disk last wrote
        self.lora_synced: int | None = None  # the adapter version the engines last loaded (--lora-sync adapter)
        self.engine_index: dict[str, int] = {}  # engine url -> its index in the placement (rank 0 of several)
        self.placement = None  # agentrl.cluster.placement.Placement, for the per-rank colocated sync

    def lead(self, others: list) -> None:
        """Rank 0 of several (`others`: the other ranks' actors): every export runs on every rank."""
        self.trainer = LeadingRank(self.trainer, others)

    def engines_placed(self, urls: list[str], placement) -> None:
        self.engine_index, self.placement = {u: i for i, u in enumerate(urls)}, placement

    def take_part(self, what: str, *args) -> None:
        """A rank other than 0: its part in one of rank 0's exports (the same TP/PP collectives);
        rank 0 alone sends the result to the engines."""
        if what in ("save_hf", "save_adapter"):
            getattr(self.trainer, what)(*args)
        elif what == "per_rank":  # its own copy of every bucket to rank 0
            bucket_bytes, kind = args
            serve_weights_per_rank(engine_tensors(self.cfg, self.trainer.named_tensors()), bucket_bytes=bucket_bytes,
                                   kind=kind,
                                   gather=RankGather())
        elif what in ("named_tensors", "trained_module_tensors"):
            for _ in getattr(self.trainer, what)():  # read to the end: the collectives rank 0's export is in
                pass
        else:
            raise ValueError(f"take_part: no export {what!r}")

    async def sync(self, urls: list[str], version: int, fresh: bool = False) -> dict[str, Any]:
        """Bucketed weights to every engine (--weight-sync-mode); an engine that fails is named in
        "failed_engines" (the others still got the update) instead of failing the run. `fresh`:
        the engines were just (re)started, so a process group held with them is gone."""
        import aiohttp

        unreachable = (EngineError, OSError, aiohttp.ClientError, asyncio.TimeoutError)  # e.g. killed meanwhile
        if fresh:
            for url in urls:
                await self._drop_group(url)
        clients = [EngineClient(u, request_timeout_s=self.cfg.rollout.request_timeout_s) for u in urls]
        try:
            try:
                return {**await self._send(clients, version), "failed_engines": []}
            except unreachable:
                failed, out = [], {}
                for c in clients:  # find the failing ones; the rest get the weights
                    try:
                        out = await self._send([c], version)
                    except unreachable:
                        failed.append(c.base_url)
                return {**out, "failed_engines": failed}
        finally:
            await asyncio.gather(*[c.close() for c in clients])

    def mode(self) -> str:
        """--weight-sync-mode, `auto` resolved for this trainer and its engines."""
        mode = self.cfg.train.weight_sync_mode
        if mode == "auto":  # CUDA IPC needs the engine on the trainer's GPU; else a process group
            apart = self.cfg.rollout.rollout_engine == "sglang" and not self.cfg.run.colocate
            mode = "distributed" if apart and str(self.trainer.device).startswith("cuda") else "tensor"
        return mode

    async def _send(self, clients, version: int) -> dict[str, float]:
        bucket = self.cfg.train.update_weight_buffer_size or int(self.cfg.train.weight_sync_bucket_mb * 2**20)
        mode = self.mode()
        if self.cfg.train.lora_rank and self.cfg.train.lora_sync == "adapter":
            return await self._sync_adapter(clients, version, bucket)
        if mode == "delta":
            return await self._sync_delta(clients, version)
        if mode == "disk":
            folder = Path(self.cfg.train.weight_sync_dir or Path(self.cfg.run.output_dir or tempfile.gettempdir())
                          / "weight_sync")
            t0 = time.perf_counter()
            if self.saved_version != version:  # once per version: retries and catch-ups load the same folder
                await asyncio.to_thread(self.trainer.save_hf, folder)
                self.saved_version = version
            saved = time.perf_counter() - t0
            out = await sync_weights_from_disk(clients, str(folder), version=version)
            return {**out, "weight_sync_save_s": saved}
        if mode == "tensor" and (per_rank := await self._per_rank_sources(clients)):
            return await self._sync_per_rank(clients, version, bucket, *per_rank)
        return await self._send_tensors(clients, version, bucket, self.trainer.named_tensors)

    async def _sync_delta(self, clients, version: int) -> dict[str, float]:
        """--weight-sync-mode delta: the bytes changed since the last version into the shared folder
        (once per version: retries and catch-ups apply the same one), then every engine brings its
        host's local checkpoint up to it and loads it (agentrl.weight_delta)."""
        t = self.cfg.train
        run_dir = Path(self.cfg.run.output_dir or tempfile.gettempdir())
        shared = t.weight_sync_dir or str(run_dir / "weight_delta")
        local = t.weight_sync_local_dir or str(run_dir / "weight_delta_local")
        if self.delta is None:
            if self.model_path is None:
                raise EngineError("--weight-sync-mode delta needs the engines' model path (the first delta's base)")
            self.delta = DeltaPublisher(shared, seed=self.model_path, encoding=t.weight_delta_encoding,
                                        checksum_name=t.weight_delta_checksum, keep=t.weight_delta_keep_versions)
        published = {}
        if self.delta.published != version:
            published = await asyncio.to_thread(self.delta.publish,
                                                engine_tensors(self.cfg, self.trainer.named_tensors()), version)
        out = await sync_weights_from_delta(clients, shared, local, version=version)
        return {**out, **published}

    async def _send_tensors(self, clients, version: int, bucket: int, named) -> dict[str, float]:
        """The tensors `named()` yields, by the distributed or the tensor path (--weight-sync-mode)."""
        if self.mode() == "distributed":
            out = {}
            for c in clients:  # a group per engine: a dead engine breaks only its own
                group = await self._group(c.base_url)
                try:
                    out = await group.sync(engine_tensors(self.cfg, named()), version=version, bucket_bytes=bucket)
                except BaseException:
                    await self._drop_group(c.base_url)
                    raise
            return out
        return await sync_weights_from_tensor(clients, engine_tensors(self.cfg, named()), version=version,
                                              bucket_bytes=bucket)

    async def _per_rank_sources(self, clients) -> tuple[list[list[int]], str] | None:
        """(the trainer rank feeding each engine TP rank, the engines' kind) where every engine
        sits on the trainer's GPUs (or the CPU) and the trainer has several ranks; else None."""
        if not isinstance(self.trainer, LeadingRank) or self.placement is None:
            return None
        kinds = {await c.kind() for c in clients}
        if len(kinds) != 1 or any(c.base_url not in self.engine_index for c in clients):
            return None
        sources = [self.placement.engine_rank_sources(self.engine_index[c.base_url], await engine_tp_size(c))
                   for c in clients]
        return None if None in sources else (sources, kinds.pop())

    async def _sync_per_rank(self, clients, version: int, bucket: int, sources, kind: str) -> dict[str, float]:
        """Every trainer rank serializes its own copy (sync_weights_per_rank)."""
        import ray

        lead: LeadingRank = self.trainer
        refs = [a.export.remote("per_rank", bucket, kind) for a in lead.others]
        try:
            return await sync_weights_per_rank(clients, engine_tensors(self.cfg, lead.inner.named_tensors()),
                                               version=version,
                                               bucket_bytes=bucket, sources=sources, kind=kind, gather=RankGather())
        finally:  # the other ranks are done once rank 0 is (the same buckets, the same verdicts)
            await asyncio.to_thread(ray.get, refs, timeout=CALL_TIMEOUT_S)

    async def _sync_adapter(self, clients, version: int, bucket: int) -> dict[str, float]:
        """--lora-sync adapter: the peft adapter folder of `version` (written once), loaded by every
        engine. The --lora-trainable-modules (trained whole: the tiny model's embeddings and final
        norm by default) go first by the full-weight path, as SGLang's adapters carry only
        lora_A/lora_B: the engines' base then holds the trained modules, under the adapter, before
        any request names the new version."""
        whole = {}
        if self.cfg.train.lora_trainable_modules:
            whole = await self._send_tensors(clients, version, bucket, self.trainer.trained_module_tensors)
        folder = Path(self.cfg.run.output_dir or tempfile.gettempdir()) / "lora_sync" / f"v{version}"
        t0 = time.perf_counter()
        if not (folder / "adapter_config.json").exists():
            await asyncio.to_thread(self.trainer.save_adapter, folder)
        saved = time.perf_counter() - t0
        out = await sync_lora_adapter(clients, str(folder), version=version, previous=self.lora_synced)
        if self.lora_synced is not None and self.lora_synced != version:  # no engine reads the old folder again
            shutil.rmtree(folder.parent / f"v{self.lora_synced}", ignore_errors=True)
        self.lora_synced = version
        out["weight_sync_s"] += whole.get("weight_sync_s", 0.0)  # the whole sync: modules and adapter
        return {**out, "weight_sync_save_s": saved,
                **{f"weight_sync_modules_{k.removeprefix('weight_sync_')}": v for k, v in whole.items()}}

    async def _group(self, url: str):
        """The process group with one engine, made at its first distributed sync."""
        from urllib.parse import urlparse

        from agentrl.cluster.ray_session import node_ip

        if url not in self.groups:
            client = EngineClient(url, request_timeout_s=self.cfg.rollout.request_timeout_s)
            self.group_count += 1
            # an engine on another node connects back to this node's address
            local = urlparse(url).hostname in ("127.0.0.1", "localhost")
            group = WeightUpdateGroup([client], group_name=f"agentrl-weights-{self.group_count}",
                                      master_address="127.0.0.1" if local else node_ip(),
                                      timeout_s=self.cfg.rollout.request_timeout_s)
            try:
                await group.init(str(self.trainer.device))
            except BaseException:
                await client.close()
                raise
            self.groups[url] = group
        return self.groups[url]

    async def _drop_group(self, url: str) -> None:
        from agentrl.engines.distributed import destroy

        group = self.groups.pop(url, None)
        if group is not None:  # the engine side is gone or will be replaced: only ours to undo
            if group.group is not None:
                destroy(group.group)
            await asyncio.gather(*[c.close() for c in group.clients])
