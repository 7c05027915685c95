"""The trainer actor: one Ray actor per trainer rank (`TrainerWorker`), which builds the trainer
and trains, saves, loads and offloads it; rank 0 also sends the weights to the engines
(agentrl.weight_sync.TrainerSync), straight from the trainer's memory, never through the
driver. `RemoteTrainer` is the driver's handle on all ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.cluster.node_watch import NodeLost
from agentrl.cluster.placement import Placement, trainer_ranks
from agentrl.cluster.ray_session import init_failure, node_ip, normal_priority
from agentrl.config import Config
from agentrl.errors import ConfigError

log = logging.getLogger("agentrl.cluster")


CALL_TIMEOUT_S = 120.0  # rank 0's address, asked of its bundle before the ranks start
PIN_AHEAD_TIMEOUT_S = 600.0  # the first offload's wait for the host memory pinned at start-up


class TrainerWorker:
    """The trainer inside a Ray actor (one per rank). Weight sync runs here too (`self.weights`,
    agentrl.weight_sync.TrainerSync), so the weights go from the trainer's memory straight to the
    engines, never through the driver. `dist_env`: torch.distributed's variables for this rank
    (RemoteTrainer), set before the trainer is built."""

    def __init__(self, cfg: Config, model_path: str, device: str, dist_env: dict[str, str] | None = None):
        init_at = time.time()
        import torch

        from agentrl.build import build_trainer, seed_everything
        from agentrl.weight_sync import TrainerSync

        imported_at = time.time()
        normal_priority()
        os.environ.update(dist_env or {})
        seed_everything(cfg.run.seed)
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("the trainer actor got no usable GPU")
        self.cfg = cfg
        self.trainer = build_trainer(cfg, Path(model_path), device)
        # epoch seconds of this rank's start-up: its process (Ray's worker), torch's import, the build
        # (torch.distributed / Megatron init and the HF weights), for the run's start-up timeline
        self.started = {"process": (_process_started_at(), init_at), "imports": (init_at, imported_at),
                        "build": (imported_at, time.time())}
        self.offloaded = None  # the host copy while --colocate lends the GPU to the engines
        self.host_buffers: list = []
        self.pinned_ahead: list = []  # _pin_ahead's, taken by the first offload
        self.pinning: threading.Thread | None = None
        if cfg.run.colocate and device == "cuda":  # pin the offload's host memory while the engines start
            self.pinning = threading.Thread(target=self._pin_ahead, name="pin-host-buffers", daemon=True)
            self.pinning.start()
        self.weights = TrainerSync(cfg, self.trainer, model_path=model_path)

    def engines_placed(self, urls: list[str], placement: Placement) -> None:
        self.weights.engines_placed(urls, placement)

    def startup_steps(self) -> dict[str, tuple[float, float]]:
        return self.started

    def train_rollout(self, samples) -> dict[str, float]:
        import torch

        if not str(self.trainer.device).startswith("cuda"):
            return self.trainer.train_rollout(samples)
        torch.cuda.reset_peak_memory_stats()
        try:
            out = self.trainer.train_rollout(samples)
        except torch.cuda.OutOfMemoryError as exc:
            raise ConfigError(out_of_memory_hint(self.cfg, gpu_memory(), len(samples))) from exc
        return out | {"gpu/trainer_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "gpu/trainer_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                      "gpu/used_train_gib": gpu_memory()["used_gib"]}

    def gpu_memory(self) -> dict[str, float]:
        return gpu_memory() if str(self.trainer.device).startswith("cuda") else {}

    def probe_logprobs(self, samples) -> list[list[float]]:
        return self.trainer.compute_logprobs(samples)

    def save(self, folder: str, state: dict) -> None:
        self.trainer.save(Path(folder), state)

    def load(self, folder: str) -> dict:
        return self.trainer.load(Path(folder))

    def version(self) -> int:
        return self.trainer.version

    def lead(self, others: list) -> None:
        """Rank 0 of several: the weight sync's exports run on every rank (agentrl.weight_sync.LeadingRank)."""
        self.weights.lead(others)

    def export(self, what: str, *args) -> None:
        """A rank other than 0: its part in one of rank 0's exports (TrainerSync.take_part)."""
        self.weights.take_part(what, *args)

    async def sync_weights(self, urls: list[str], version: int, fresh: bool = False) -> dict[str, Any]:
        """Bucketed weights to every engine (TrainerSync.sync)."""
        return await self.weights.sync(urls, version, fresh)

    def _pin_ahead(self) -> None:
        from agentrl.trainers.offload import host_buffers_for

        start = time.monotonic()
        self.pinned_ahead = host_buffers_for(self.trainer)
        log.info("pinned %.1f GiB of host memory for --colocate in %.1f s",
                 sum(b.numel() for b in self.pinned_ahead) / 2**30, time.monotonic() - start)

    def offload(self, engines_released: bool = True) -> dict[str, float]:
        """--colocate: give the GPU to the engines during rollout (weights, optimizer state and
        master weights, reference and critic to host memory; gradients are dropped), all of it or,
        with --colocate-offload fit, what does not fit beside the engines. `engines_released`:
        the engines gave their memory back before (they will take it again on resume)."""
        from agentrl.trainers.offload import bytes_to_keep, offload_trainer

        if self.pinning is not None:  # bounded: without the buffers the offload pins its own
            self.pinning.join(timeout=PIN_AHEAD_TIMEOUT_S)
            if not self.pinning.is_alive():
                self.host_buffers = self.host_buffers or self.pinned_ahead
            self.pinning = None
        if self.trainer.device == "cpu" or self.offloaded is not None:
            return {}
        fraction = engine_memory_fraction(self.cfg)
        keep = bytes_to_keep(self.trainer, fraction, engines_released) if fraction is not None else 0
        self.offloaded = offload_trainer(self.trainer, spare=self.host_buffers, keep_bytes=keep)
        # pinned once, reused every iteration (and those made ahead for storages still to come)
        self.host_buffers = self.offloaded.hosts + self.offloaded.spare_left
        return {"colocate/kept_gib": self.offloaded.kept_bytes / 2**30,
                "colocate/moved_gib": self.offloaded.bytes / 2**30}

    def onload(self) -> None:
        if self.offloaded is not None:
            self.offloaded.restore()
            self.offloaded = None


def engine_memory_fraction(cfg: Config) -> float | None:
    """The share of each GPU the colocated engines take back when they resume (SGLang sizes
    weights + KV pool to --mem-fraction-static of the whole GPU; agentrl's engines share
    --sglang-mem-fraction-static, see agentrl.engines.sglang); None where it is not known
    (--colocate-offload all, the embedded engine, engines attached by URL): keep nothing."""
    from agentrl.engines.sglang import DEFAULT_SHARED_MEM_FRACTION

    if cfg.run.colocate_offload != "fit" or cfg.rollout.rollout_engine != "sglang" or cfg.rollout.rollout_engine_urls:
        return None
    return engines_mem_fraction(cfg) or DEFAULT_SHARED_MEM_FRACTION


def engines_mem_fraction(cfg: Config) -> float | None:
    """The largest --mem-fraction-static any engine type is given (shared --sglang-* or a worker
    type's own arguments); None where none is given."""
    from agentrl.engines.sglang import engine_arg_values

    given = [float(v) for v in engine_arg_values(cfg, "mem-fraction-static").values() if v]
    return max(given) if given else None


def gpu_memory() -> dict[str, float]:
    """This process's GPU: used by every process on it (engines included), and by this one."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"used_gib": (total - free) / 2**30, "total_gib": total / 2**30,
            "mine_gib": torch.cuda.memory_reserved() / 2**30}


def out_of_memory_hint(cfg: Config, mem: dict[str, float], n_samples: int) -> str:
    """What to turn down when training does not fit next to what else holds the GPU."""
    t, others = cfg.train, mem["used_gib"] - mem["mine_gib"]
    knobs = [f"--max-tokens-per-gpu (now {t.max_tokens_per_gpu})" if t.max_tokens_per_gpu
             else f"--micro-batch-size (now {t.micro_batch_size}; or --max-tokens-per-gpu: a token budget)",
             "--rollout-max-response-len (shorter sequences)", "--recompute-granularity full (Megatron)"]
    if cfg.run.colocate:
        frac = engines_mem_fraction(cfg)
        knobs.insert(0, f"--sglang-mem-fraction-static (the engines' share of the GPU, now {frac or 'default'}; "
                        "they keep their weights and CUDA graphs while training)")
    return (f"the trainer ran out of GPU memory training {n_samples} samples: the GPU has {mem['total_gib']:.1f} "
            f"GiB, this trainer holds {mem['mine_gib']:.1f} GiB and other processes (engines) {others:.1f} GiB. "
            f"Lower {'; or '.join(knobs)}.")


def _process_started_at() -> float:
    from agentrl.metrics import process_started_at

    return process_started_at()


def _rendezvous_address() -> tuple[str, int]:
    """Run in rank 0's bundle: its node's IP and a port free there (MASTER_ADDR, MASTER_PORT),
    outside the kernel's ephemeral range: a port picked inside it could be taken as some outgoing
    connection's source port before rank 0 listens (EADDRINUSE, seen in CI under a parallel worker)."""
    from agentrl.engines.launch import server_port

    return node_ip(), server_port()


RANK_TIMEOUT_S = 3600.0  # save / load of a rank (a rank stuck in a collective fails sooner: Megatron's
# --distributed-timeout-minutes, 30 by default, bounds every collective, train steps' included)


class RemoteTrainer:
    """The driver's handle on the trainer: one TrainerWorker actor per rank (`trainer_ranks`),
    each in its bundle, with the methods the loop calls. Several ranks form one
    torch.distributed group, as torchrun would start them: MASTER_ADDR and MASTER_PORT are rank
    0's node and a port free there, RANK, WORLD_SIZE, and LOCAL_RANK (on a GPU 0: Ray shows each
    rank its bundle's GPU alone, as CUDA_VISIBLE_DEVICES); nccl on GPUs, gloo on the CPU. Every
    call goes to every rank: the same whole rollout (the Megatron trainer splits it over its
    data-parallel ranks itself), save and load (a distributed checkpoint), offload and onload.
    Metrics and loaded state come from rank 0, which alone posts the weights to the engines
    while the other ranks take part in each export (agentrl.weight_sync.LeadingRank)."""

    def __init__(self, cfg: Config, model_path: Path, device: str, placement: Placement):
        import ray

        world = trainer_ranks(cfg)
        address = None
        if world > 1:
            probe = ray.remote(num_cpus=0)(_rendezvous_address)
            rank0 = placement.strategy(placement.trainer_bundles[0])
            address = ray.get(probe.options(scheduling_strategy=rank0).remote(), timeout=CALL_TIMEOUT_S)
        self.actors = []
        for rank in range(world):
            bundle, gpus = placement.trainer_bundles[rank], placement.trainer_gpus[rank]
            env = {}
            if gpus:  # SGLang runs NCCL with cuMem off; a trainer with it on fails the first broadcast
                # of a weight sync (bench/results/weight_sync.md). NCCL reads it at its first communicator.
                env["NCCL_CUMEM_ENABLE"] = os.environ.get("NCCL_CUMEM_ENABLE", "0")
                # Sequences of every length fragment the caching allocator: at 1.5B its reserved
                # memory swung 43-67 GiB for a 36-38 GiB peak (bench/results/gpu_e2e.md), which
                # is what ran colocated runs out of memory. Expandable segments grow in place.
                env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            if address is not None:
                env |= {"MASTER_ADDR": address[0], "MASTER_PORT": str(address[1]), "RANK": str(rank),
                        "WORLD_SIZE": str(world), "LOCAL_RANK": "0" if gpus else str(rank)}
            # Sharing its GPU with an engine (--colocate), a rank asks for a fraction of it.
            share = (0.4 if placement.shares(bundle) else 1.0) if gpus else 0
            actor_cls = ray.remote(num_cpus=0, num_gpus=share)(TrainerWorker)
            self.actors.append(actor_cls.options(scheduling_strategy=placement.strategy(bundle)).remote(
                cfg, str(model_path), device, env))
        self.actor = self.actors[0]  # rank 0: metrics, loaded state, weight sync
        if world > 1:
            self.actor.lead.remote(self.actors[1:])
        self.cfg, self.placement = cfg, placement
        self.placed = None  # engines_placed's reply, awaited by the first weight sync

    def engines_placed(self, urls: list[str]) -> None:
        """The engines' URLs in placement order: rank 0 learns which trainer rank sits on each
        engine TP rank's GPU (the per-rank colocated sync, agentrl.weight_sync)."""
        if len(self.actors) > 1:  # not waited for: the rank is still building; its next call (a sync) comes after
            self.placed = self.actor.engines_placed.remote(urls, self.placement)

    def _all(self, method: str, *args) -> list:
        """Every rank's reply; the first failure raises at once (the others may wait for it in a collective)."""
        import ray

        pending = refs = [getattr(a, method).remote(*args) for a in self.actors]
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"trainer ranks: {method} took over {RANK_TIMEOUT_S:.0f} s")
            ray.get(done)
        return ray.get(refs)

    async def train_rollout(self, samples) -> dict[str, float]:
        import ray

        shared = ray.put(samples)  # every rank trains on the whole rollout
        with self.rank_deaths_named():
            return (await asyncio.gather(*[a.train_rollout.remote(shared) for a in self.actors]))[0]

    async def sync_weights(self, urls: list[str], version: int, fresh: bool = False) -> dict[str, float]:
        with self.rank_deaths_named():
            if self.placed is not None:  # engines_placed's failure surfaces here
                await self.placed
                self.placed = None
            return await self.actor.sync_weights.remote(urls, version, fresh)

    @contextlib.contextmanager
    def rank_deaths_named(self):
        """A trainer rank's actor died (its process or its node): say which rank, on which node."""
        import ray

        try:
            yield
        except ray.exceptions.RayActorError as exc:
            dead = [rank for rank, a in enumerate(self.actors) if exc.actor_id == a._actor_id.hex()] or [0]
            bundle = self.placement.trainer_bundles[dead[0]]
            if exc.actor_init_failed:  # its build raised: say what it raised, not that it "died"
                raise init_failure(f"trainer rank {dead[0]}", str(exc)) from exc
            raise NodeLost(f"trainer rank {dead[0]} on {self.placement.node_of(bundle)} died "
                           f"({str(exc).splitlines()[0]}); resume with --load from the last checkpoint") from exc

    def save(self, folder: Path, state: dict) -> None:
        self._all("save", str(folder), state)

    def load(self, folder: Path) -> dict[str, Any]:
        return self._all("load", str(folder))[0]

    async def offload(self, engines_released: bool = True) -> dict[str, float]:
        return (await asyncio.gather(*[a.offload.remote(engines_released) for a in self.actors]))[0]

    async def onload(self) -> None:
        await asyncio.gather(*[a.onload.remote() for a in self.actors])

    async def probe_logprobs(self, samples) -> list[list[float]]:
        """The policy's logprobs of `samples`' response tokens (every rank: a collective)."""
        import ray

        shared = ray.put(samples)
        return (await asyncio.gather(*[a.probe_logprobs.remote(shared) for a in self.actors]))[0]

    async def gpu_memory(self) -> dict[str, float]:
        """Rank 0's GPU as it is now (all processes on it)."""
        return await self.actors[0].gpu_memory.remote()

    async def startup_steps(self) -> dict[str, tuple[float, float]]:
        """Rank 0's start-up steps (TrainerWorker.startup_steps), named trainer/STEP; epoch seconds."""
        return {f"trainer/{k}": v for k, v in (await self.actor.startup_steps.remote()).items()}

    def stop(self) -> None:
        """At the run's end (its checkpoint written): the rank actors killed at once, not left to
        Ray's shutdown (a rank in a CUDA/NCCL teardown can hold it up)."""
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
