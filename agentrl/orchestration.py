"""Ray placement: the trainer runs as a Ray actor on its own GPUs (or time-shares the
engines' GPUs with --colocate); the driver holds the rollout loop.

On one machine Ray starts locally and quietly: bound to 127.0.0.1, no dashboard, no
token file written to ~/.ray (token auth is off for a loopback-only cluster), and the
light actors ask for no CPU slots so 2 cores never deadlock. Across machines,
`--ray-address HOST:PORT` joins a cluster started with `ray start --head` (then
`ray start --address HOST:PORT` on the other nodes). The CPU default goes through the
same code: the trainer actor just gets no GPU.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from agentrl.config import Config
from agentrl.errors import ConfigError


def start_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, log_to_driver=False, logging_level="ERROR")
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only cluster: no ~/.ray/auth_token
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR", _node_ip_address="127.0.0.1",
             num_gpus=None)


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


class TrainerWorker:
    """The trainer inside a Ray actor. Weight sync runs here too, so the weights go from
    the trainer's memory straight to the engines, never through the driver."""

    def __init__(self, cfg: Config, model_path: str, device: str):
        import torch

        from agentrl.train import build_trainer, seed_everything

        seed_everything(cfg.run.seed)
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("the trainer actor got no usable GPU")
        self.cfg = cfg
        self.trainer = build_trainer(cfg, Path(model_path), device)
        self.offloaded = False

    def train_rollout(self, samples) -> dict[str, float]:
        return self.trainer.train_rollout(samples)

    def save(self, folder: str, state: dict) -> None:
        self.trainer.save(Path(folder), state)

    def load(self, folder: str) -> dict:
        return self.trainer.load(Path(folder))

    def version(self) -> int:
        return self.trainer.version

    async def sync_weights(self, urls: list[str], version: int) -> dict[str, Any]:
        """Bucketed weights to every engine; an engine that fails is named in "failed_engines"
        (the others still got the update) instead of failing the run."""
        from agentrl.errors import EngineError
        from agentrl.rollout.client import EngineClient
        from agentrl.weight_sync import sync_weights_from_tensor

        bucket = int(self.cfg.train.weight_sync_bucket_mb * 2**20)
        clients = [EngineClient(u, request_timeout_s=self.cfg.rollout.request_timeout_s) for u in urls]
        try:
            try:
                out = await sync_weights_from_tensor(clients, self.trainer.named_tensors(), version=version,
                                                     bucket_bytes=bucket)
                return {**out, "failed_engines": []}
            except EngineError:
                failed, out = [], {}
                for c in clients:  # find the failing ones; the rest get the weights
                    try:
                        out = await sync_weights_from_tensor([c], self.trainer.named_tensors(), version=version,
                                                             bucket_bytes=bucket)
                    except EngineError:
                        failed.append(c.base_url)
                if len(failed) == len(clients):
                    raise
                return {**out, "failed_engines": failed}
        finally:
            await asyncio.gather(*[c.close() for c in clients])

    def offload(self) -> None:
        """--colocate: give the GPU to the engines during rollout (model and optimizer to host memory)."""
        self._move("cpu")

    def onload(self) -> None:
        self._move(self.trainer.device)

    def _move(self, device: str) -> None:
        import torch

        if self.trainer.device == "cpu":
            return
        self.trainer.model.to(device)
        for state in self.trainer.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(device)
        if device == "cpu":
            torch.cuda.empty_cache()


class RemoteTrainer:
    """The driver's handle on the trainer actor: the methods the loop calls, awaitable."""

    def __init__(self, cfg: Config, model_path: Path, device: str):
        import ray

        gpus = cfg.run.actor_num_nodes * cfg.run.actor_num_gpus_per_node if device == "cuda" else 0
        if gpus > 1:
            raise ConfigError("the plain-PyTorch trainer runs on one GPU; multi-GPU training needs --trainer megatron")
        # Colocated, the trainer shares its GPU with an engine: ask for a fraction of it.
        share = 0.4 if cfg.run.colocate and gpus else gpus
        actor_cls = ray.remote(num_cpus=0, num_gpus=share)(TrainerWorker)
        self.actor = actor_cls.remote(cfg, str(model_path), device)
        self.cfg = cfg

    async def train_rollout(self, samples) -> dict[str, float]:
        return await self.actor.train_rollout.remote(samples)

    async def sync_weights(self, urls: list[str], version: int) -> dict[str, float]:
        return await self.actor.sync_weights.remote(urls, version)

    def save(self, folder: Path, state: dict) -> None:
        import ray

        ray.get(self.actor.save.remote(str(folder), state))

    def load(self, folder: Path) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.load.remote(str(folder)))

    async def offload(self) -> None:
        await self.actor.offload.remote()

    async def onload(self) -> None:
        await self.actor.onload.remote()
