"""The engine actor: a Ray actor (`EngineServer`) that starts and supervises one engine's server
process (embedded or SGLang) on its bundle's GPUs, and the driver's handle on it
(`ActorServer`, what agentrl.engines.group's start_engines and the engine monitor call)."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

from agentrl.cluster.placement import Placement
from agentrl.cluster.ray_session import node_ip, normal_priority


TIMEOUT_S = 120.0  # a call into an engine actor (the server's own health waits have theirs)


class EngineServer:
    """A Ray actor that owns one engine server process (agentrl.engines.launch.ServerProcess)
    on its bundle's node: it starts it, reports on it, restarts and stops it."""

    def __init__(self, argv: list[str], *, url: str, name: str, env: dict | None, log_dir: str, driver_ip: str):
        from agentrl.engines.launch import ServerProcess, rehost, server_port

        normal_priority()
        # The driver chose a loopback URL; on another node the server binds this node's address
        # (the router and the trainer reach it there) on a port free here, also after restarts.
        here = node_ip()
        self.moved_to = (here, server_port()) if here != driver_ip else None
        if self.moved_to:
            argv, url = rehost(argv, *self.moved_to)
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.server = ServerProcess(argv, url=url, name=name, env={**os.environ, **(env or {})}, log_dir=Path(log_dir))

    def url(self) -> str:
        return self.server.url

    def wait_healthy(self, timeout_s: float) -> None:
        self.server.wait_healthy(timeout_s)

    def alive(self) -> bool:
        return self.server.alive()

    def restart(self, argv: list[str] | None) -> int:
        from agentrl.engines.launch import rehost

        if argv and self.moved_to:
            argv, _ = rehost(argv, *self.moved_to)
        self.server.restart(argv)
        return self.server.restarts

    def log_tail(self, lines: int) -> str:
        return self.server.log_tail(lines)

    def pid(self) -> int:
        return self.server.proc.pid

    def kill(self) -> None:
        self.server.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.stop(timeout_s)


class ActorServer:
    """The driver's handle on an EngineServer actor, with ServerProcess's methods (what
    start_engines and the engine monitor call), each call bounded by a timeout."""

    def __init__(self, placement: Placement, index: int, argv: list[str], *, url: str, name: str,
                 env: dict | None, log_dir: Path):
        import ray

        self.name, self.argv, self.restarts = name, list(argv), 0
        gpus = placement.engine_gpus[index]
        if gpus:  # the server runs on its slots' physical GPUs
            env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ",".join(str(placement.slot_gpu_ids[g]) for g in gpus)}
        actor_cls = ray.remote(num_cpus=0, num_gpus=0)(EngineServer)
        self.actor = actor_cls.options(scheduling_strategy=placement.strategy(placement.engine_bundles[index]),
                                       name=None).remote(self.argv, url=url, name=name, env=env, log_dir=str(log_dir),
                                                         driver_ip=node_ip())
        # the actor's URL (another node's address when it runs there), asked now and read when first
        # needed: the next engine's actor is created meanwhile instead of after this one is up
        self._url, self._url_ref = None, self.actor.url.remote()

    @property
    def url(self) -> str:
        if self._url is None:
            import ray

            self._url = ray.get(self._url_ref, timeout=TIMEOUT_S)
        return self._url

    def _call(self, method: str, *args, timeout: float = TIMEOUT_S):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        self._call("wait_healthy", timeout_s, timeout=timeout_s + TIMEOUT_S)

    def alive(self) -> bool:
        import ray

        try:
            return self._call("alive")
        except ray.exceptions.RayActorError:
            return False

    def restart(self, argv: list[str] | None = None) -> None:
        if argv:
            self.argv = list(argv)
        self.restarts = self._call("restart", argv)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return self._call("log_tail", lines)
        except Exception as exc:  # the actor itself is gone
            return f"(no log: {exc!r})"

    def pid(self) -> int:
        return self._call("pid")

    def kill(self) -> None:
        self._call("kill")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, `timeout_s` for the server to exit, then SIGKILL (its whole process group)."""
        import ray

        try:  # the server's stop waits twice at most (SIGTERM, then SIGKILL): bounded here too
            self._call("stop", timeout_s, timeout=2 * timeout_s + 10)
        except Exception:
            pass
        ray.kill(self.actor)


ENGINE_STOP_GRACE_S = 5.0  # at the run's end an engine's state is worth nothing: SIGKILL soon after


def stop_engines(group, grace_s: float = ENGINE_STOP_GRACE_S) -> None:
    """EngineGroup.stop at the run's end, every engine at once: the monitor, the router, then
    each engine server (SIGTERM, `grace_s`, SIGKILL) in its own thread. One by one, each
    engine's shutdown added its own wait (SGLang's can take seconds)."""
    if group.monitor is not None:
        group.monitor.stop()
    if group.router is not None:
        group.router.stop()
    threads = []
    for server in reversed(group.servers):
        stop = functools.partial(server.stop, grace_s) if isinstance(server, ActorServer) else server.stop
        threads.append(threading.Thread(target=stop, name="agentrl-engine-stop", daemon=True))
        threads[-1].start()
    deadline = time.monotonic() + 2 * grace_s + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def actor_launcher(placement: Placement):
    """start_engines' `launcher`: engine i's server process owned by an actor in its bundle."""
    def launch(index: int, argv: list[str], *, url: str, name: str, env: dict | None, log_dir: Path) -> ActorServer:
        return ActorServer(placement, index, argv, url=url, name=name, env=env, log_dir=log_dir)

    return launch
