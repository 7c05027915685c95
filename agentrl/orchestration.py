"""Ray placement: every trainer rank and every engine run as Ray actors placed in one
placement group; the driver holds the rollout loop (and the router).

`plan_placement` decides where: with GPUs, one bundle per GPU; trainer ranks take the first
`--actor-num-nodes x --actor-num-gpus-per-node` GPUs and the engines the next
`--rollout-num-gpus` (`--rollout-num-gpus-per-engine` each; more engines than that share
them), disjoint; `--colocate` puts the engines on the trainer's GPUs (time-shared). On the
CPU each actor gets a bundle with a sliver of a CPU. An engine actor (`EngineServer`) starts
and supervises its server process (embedded or SGLang) on its bundle's GPUs; the engine
monitor's restarts go through it.

On one machine Ray starts locally and quietly: bound to 127.0.0.1, no dashboard, no
token file written to ~/.ray (token auth is off for a loopback-only cluster), and the
light actors ask for no CPU slots so 2 cores never deadlock. Across machines,
`--ray-address HOST:PORT` joins a cluster started with `ray start --head` (then
`ray start --address HOST:PORT` on the other nodes). The CPU default goes through the
same code: the trainer actors just get no GPU (several Megatron ranks talk gloo there).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import Config
from agentrl.errors import AgentRLError, ConfigError
from agentrl.fp8 import engine_tensors  # --sglang-quantization fp8: re-quantized at every sync


def start_ray(cfg: Config) -> None:
    import ray

    from agentrl.registry import env_modules_environ

    if ray.is_initialized():
        return
    # Ray's local workers start with this process's environment: they resolve --env-module envs from it
    os.environ.update(env_modules_environ(cfg.run.env_module))
    if cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, log_to_driver=False, logging_level="ERROR")
        stop_on_signals()
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only cluster: no ~/.ray/auth_token
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at nice 15: on a shared machine the trainer and the engines
    # (its actors) would then starve behind any other work while this driver does not.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR", _node_ip_address="127.0.0.1",
             num_gpus=None)
    stop_on_signals()  # ray.init put its own SIGTERM handler (sys.exit, no cleanup) in place of ours


def stop_on_signals() -> None:
    """SIGTERM (timeout, schedulers, Kubernetes) stops a run as Ctrl-C does: KeyboardInterrupt,
    so every `finally` stops what the run started (engines, router, sandboxes, tool servers,
    Ray). A second SIGINT or SIGTERM exits at once, cleanup or not."""
    if threading.current_thread() is not threading.main_thread():
        return

    def second(signum, frame):
        os._exit(128 + signum)

    def first(signum, frame):
        signal.signal(signal.SIGINT, second)
        signal.signal(signal.SIGTERM, second)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first)
    signal.signal(signal.SIGTERM, first)


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if threading.current_thread() is threading.main_thread():  # the run is over: signals act as before it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


CPU_SLICE = 0.01  # what a bundle and an actor ask of a CPU: placed, never waiting for a core
TIMEOUT_S = 120.0  # a call into an engine actor (the server's own health waits have theirs)
PIN_AHEAD_TIMEOUT_S = 600.0  # the first offload's wait for the host memory pinned at start-up
log = logging.getLogger("agentrl.orchestration")


@dataclass
class Placement:
    """Bundles of one placement group and who sits in which. With GPUs, bundle i is GPU slot
    i; CPU-only actors get their own bundles after the GPU ones."""

    bundles: list[dict[str, float]]
    trainer_bundles: list[int]  # one per trainer rank
    trainer_gpus: list[list[int]]  # GPU slots of each rank ([] on the CPU)
    engine_bundles: list[int]  # one per engine: its first GPU's bundle
    engine_gpus: list[list[int]]  # GPU slots of each engine ([] on the CPU)
    pg: Any = None  # the reserved ray placement group
    slot_gpu_ids: list[int] = field(default_factory=list)  # physical GPU id of each slot, once reserved
    gpu_sharing: str | None = None  # why engines share the trainer's GPUs (gpu_sharing()); None: they do not
    bundle_nodes: list[tuple[str, str]] = field(default_factory=list)  # (node id, host) of each bundle, reserved

    def describe(self) -> dict:
        """Who got which physical GPU, for the run's run.json."""
        def physical(slots):
            return [self.slot_gpu_ids[g] for g in slots] if self.slot_gpu_ids else slots

        out = {"trainer_gpus": [physical(g) for g in self.trainer_gpus],
               "engine_gpus": [physical(g) for g in self.engine_gpus], "gpu_sharing": self.gpu_sharing}
        if self.bundle_nodes:
            out |= {"trainer_nodes": [self.node_of(b) for b in self.trainer_bundles],
                    "engine_nodes": [self.node_of(b) for b in self.engine_bundles]}
        return out

    def node_of(self, bundle: int) -> str:
        """'HOST (node ID…)' of a bundle, as run.json and error messages name it."""
        if bundle >= len(self.bundle_nodes):
            return "?"
        nid, host = self.bundle_nodes[bundle]
        return f"{host} (node {nid[:12]})"

    def shares(self, bundle: int) -> bool:
        """Does a trainer rank share this bundle's GPU with an engine (--colocate)?"""
        return any(bundle in gpus for gpus in self.engine_gpus)

    def strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)

    def engine_rank_sources(self, index: int, tp_size: int) -> list[int] | None:
        """For the per-rank colocated weight sync: the trainer rank on the GPU of each of engine
        `index`'s `tp_size` TP ranks (TP rank k runs on the engine's k-th GPU: SGLang's order of
        CUDA_VISIBLE_DEVICES); None when one of them has no trainer rank there (not colocated).
        On the CPU (no GPUs; an embedded engine emulating TP ranks) rank k % trainer ranks."""
        ranks = len(self.trainer_bundles)
        gpus = self.engine_gpus[index] if index < len(self.engine_gpus) else []
        if not gpus:
            return None if any(self.trainer_gpus) else [k % ranks for k in range(tp_size)]
        if len(gpus) != tp_size:
            return None
        by_slot = {g[0]: rank for rank, g in enumerate(self.trainer_gpus) if g}
        sources = [by_slot.get(g) for g in gpus]
        return None if None in sources else sources

    def rollout_gpu_ids(self) -> list[int]:
        """Physical GPU ids of the engines' slots, in slot order (for SGLang's plan)."""
        slots = sorted({g for gpus in self.engine_gpus for g in gpus})
        return [self.slot_gpu_ids[g] for g in slots]

    def release(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def plan_placement(*, gpus: int, trainer_ranks: int, trainer_on_gpu: bool, num_engines: int, gpus_per_engine: int,
                   rollout_gpus: int | None, colocate: bool) -> Placement:
    """Bundles for `trainer_ranks` trainer ranks and `num_engines` engines. `gpus`: the GPUs
    there are (0: none); `gpus_per_engine` 0: engines on the CPU. Without colocate the trainer
    gets slots [0, T) and the engines [T, T + R); with it the engines use the trainer's slots."""
    t_gpu = trainer_ranks if trainer_on_gpu else 0
    e_gpu = gpus_per_engine if num_engines else 0
    if colocate:
        r = rollout_gpus or max(t_gpu, e_gpu)
        base, slots = 0, max(t_gpu, r)
    else:
        r = rollout_gpus or (max(gpus - t_gpu, e_gpu) if e_gpu else 0)
        base, slots = t_gpu, t_gpu + (r if e_gpu else 0)
    if slots > gpus:
        raise ConfigError(f"placement needs {slots} GPUs (trainer {t_gpu}, engines {r if e_gpu else 0}"
                          f"{', colocated' if colocate else ''}) but {gpus} are available: lower "
                          "--rollout-num-gpus / --actor-num-gpus-per-node, or --colocate to share them")
    if e_gpu and (r < e_gpu or r % e_gpu):
        raise ConfigError(f"--rollout-num-gpus {r} is not a multiple of --rollout-num-gpus-per-engine {e_gpu}")
    bundles: list[dict[str, float]] = [{"GPU": 1.0, "CPU": CPU_SLICE} for _ in range(slots)]
    trainer_gpus = [[i] for i in range(t_gpu)]
    trainer_bundles = list(range(t_gpu))
    for _ in range(trainer_ranks - t_gpu):  # a trainer on the CPU
        trainer_gpus.append([])
        trainer_bundles.append(len(bundles))
        bundles.append({"CPU": CPU_SLICE})
    engine_gpus, engine_bundles = [], []
    for i in range(num_engines):
        if e_gpu:
            engine_gpus.append([base + (i * e_gpu + j) % r for j in range(e_gpu)])
            engine_bundles.append(engine_gpus[-1][0])
        else:
            engine_gpus.append([])
            engine_bundles.append(len(bundles))
            bundles.append({"CPU": CPU_SLICE})
    return Placement(bundles, trainer_bundles, trainer_gpus, engine_bundles, engine_gpus)


def engines_to_launch(cfg: Config, gpus: int, trainer_gpus: int) -> tuple[int, int]:
    """(engines, GPUs per engine) this run launches: (0, 0) when it attaches to running ones."""
    r = cfg.rollout
    if r.rollout_engine_urls:
        return 0, 0
    if r.rollout_engine == "sglang":
        avail = r.rollout_num_gpus or (gpus if cfg.run.colocate else gpus - trainer_gpus)
        return r.num_engines or max(1, avail // r.rollout_num_gpus_per_engine), r.rollout_num_gpus_per_engine
    return r.num_engines or 1, 0


def trainer_ranks(cfg: Config) -> int:
    """Trainer ranks (one Ray actor each): --actor-num-nodes x --actor-num-gpus-per-node for the
    Megatron trainer (on the CPU too: gloo ranks, as the tests run it); the plain-PyTorch
    trainer has one."""
    ranks = cfg.run.actor_num_nodes * cfg.run.actor_num_gpus_per_node
    if ranks > 1 and cfg.train.trainer != "megatron":
        raise ConfigError(f"--actor-num-nodes {cfg.run.actor_num_nodes} x --actor-num-gpus-per-node "
                          f"{cfg.run.actor_num_gpus_per_node} asks for {ranks} trainer ranks, but the plain-PyTorch "
                          "trainer runs on one device: use --trainer megatron, or leave both at 1")
    return ranks if cfg.train.trainer == "megatron" else 1


def gpu_sharing(cfg: Config, *, gpus: int, trainer_ranks: int, num_engines: int, gpus_per_engine: int) -> str | None:
    """Why the engines sit on the trainer's GPUs (None: they do not). Besides --colocate, embedded
    engines on too few GPUs share the trainer's, as on one GPU: a placement fact of this run, kept
    in its run.json (agentrl.metrics.RunContext), never written back into its config."""
    if cfg.run.colocate:
        return "--colocate"
    if gpus_per_engine and cfg.rollout.rollout_engine == "embedded" and gpus < trainer_ranks + num_engines:
        return (f"{num_engines} embedded engine(s) and {trainer_ranks} trainer rank(s) on {gpus} GPU(s): the engines "
                "share the trainer's GPUs (no handover: an embedded engine keeps its weights beside the trainer)")
    return None


def reserve_placement(cfg: Config, device: str, *, trainer: bool, engines: bool,
                      timeout_s: float = 300.0) -> Placement:
    """The run's placement group, reserved (and each GPU slot's physical id probed)."""
    import ray
    from ray.util.placement_group import placement_group

    gpus = int(ray.available_resources().get("GPU", 0))
    ranks = trainer_ranks(cfg) if trainer else 0
    n, per = engines_to_launch(cfg, gpus, ranks if device == "cuda" else 0) if engines else (0, 0)
    if n and device == "cuda" and cfg.rollout.rollout_engine == "embedded":
        per = 1  # an embedded engine on the GPU: one each
    shared = gpu_sharing(cfg, gpus=gpus, trainer_ranks=ranks, num_engines=n, gpus_per_engine=per)
    plan = plan_placement(gpus=gpus, trainer_ranks=ranks, trainer_on_gpu=device == "cuda", num_engines=n,
                          gpus_per_engine=per, rollout_gpus=cfg.rollout.rollout_num_gpus, colocate=shared is not None)
    plan.gpu_sharing = shared
    pin_to_resources(plan, trainer=cfg.run.ray_trainer_resource, engines=cfg.run.ray_engine_resource)
    plan.pg = placement_group(plan.bundles, strategy="PACK")
    try:
        ray.get(plan.pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        plan.release()
        raise ConfigError(f"Ray could not reserve the bundles {plan.bundles} within {timeout_s:.0f} s (cluster: "
                          f"{ray.cluster_resources()})") from None
    plan.bundle_nodes = bundle_nodes(plan.pg)
    try:
        check_engines_on_one_node(plan)
    except ConfigError:
        plan.release()
        raise
    gpu_slots = sum(1 for b in plan.bundles if "GPU" in b)
    if gpu_slots:  # which physical GPU each slot holds
        probe = ray.remote(num_cpus=0, num_gpus=0.01)(lambda: int(ray.get_gpu_ids()[0]))
        plan.slot_gpu_ids = ray.get([probe.options(scheduling_strategy=plan.strategy(i)).remote()
                                     for i in range(gpu_slots)], timeout=timeout_s)
    return plan


RESOURCE_SLICE = 0.001  # what a bundle asks of --ray-trainer-resource / --ray-engine-resource


def pin_to_resources(plan: Placement, *, trainer: str | None, engines: str | None) -> None:
    """Each trainer bundle asks for a sliver of `trainer`, each engine bundle (every GPU slot of
    an engine) of `engines`: custom resources that only the nodes meant for them were started
    with, so Ray puts the trainer and the engines where the operator said."""
    def ask(bundle: int, name: str | None) -> None:
        if name:
            plan.bundles[bundle] = {**plan.bundles[bundle], name: RESOURCE_SLICE}

    for b in plan.trainer_bundles:
        ask(b, trainer)
    for index, b in enumerate(plan.engine_bundles):
        for slot in plan.engine_gpus[index] or [b]:
            ask(slot, engines)


def check_engines_on_one_node(plan: Placement) -> None:
    """An engine's TP ranks talk over its node's GPUs (SGLang's one process group per engine)."""
    for index, slots in enumerate(plan.engine_gpus):
        if len({plan.node_of(g) for g in slots}) > 1:
            raise ConfigError(f"engine {index}'s {len(slots)} GPUs landed on different nodes "
                              f"({[plan.node_of(g) for g in slots]}): an engine's TP ranks share one node; give "
                              "each node a multiple of --rollout-num-gpus-per-engine GPUs")


def bundle_nodes(pg) -> list[tuple[str, str]]:
    """(node id, host) of each bundle of a reserved placement group."""
    import ray
    from ray.util.placement_group import placement_group_table

    hosts = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    where = placement_group_table(pg).get("bundles_to_node_id", {})
    return [(str(where.get(i, "?")), hosts.get(where.get(i), "?")) for i in range(len(where))]


def init_failure(who: str, ray_message: str) -> AgentRLError:
    """The exception an actor's constructor raised, from Ray's message (its last "Type: text"
    line): a ConfigError stays one (a usage error, said plainly), anything else is named."""
    lines = [line.strip() for line in ray_message.splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", line)),
                lines[-1] if lines else "")
    kind, _, text = last.partition(": ")
    if kind.split(".")[-1] == "ConfigError":
        return ConfigError(text.removesuffix(", has creation_task_exception_pb_bytes=1").strip())
    return AgentRLError(f"{who} failed to start: {last}")


class NodeLost(AgentRLError):
    """A Ray node holding the run's trainer ranks or engines left the cluster."""


class NodeWatch:
    """Ends the run, naming the node, when a Ray node holding its trainer ranks or engines dies
    (a machine lost, a raylet killed, a preempted pod): a thread polls the cluster's node table
    and raises NodeLost in the main thread (through SIGUSR1, as SIGTERM ends a run), instead of
    the run hanging on calls into actors that are gone."""

    def __init__(self, placement: Placement, interval_s: float = 2.0):
        self.interval_s, self.lost = interval_s, None
        self.held: dict[str, list[str]] = {}  # node id -> who of the run is there
        for rank, b in enumerate(placement.trainer_bundles):
            self._hold(placement, b, f"trainer rank {rank}")
        for i, b in enumerate(placement.engine_bundles):
            self._hold(placement, b, f"engine {i}")
        self.hosts = {nid: host for nid, host in placement.bundle_nodes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-node-watch", daemon=True)

    def _hold(self, placement: Placement, bundle: int, who: str) -> None:
        if bundle < len(placement.bundle_nodes):
            self.held.setdefault(placement.bundle_nodes[bundle][0], []).append(who)

    def start(self) -> "NodeWatch":
        if self.held and threading.current_thread() is threading.main_thread():
            def raise_lost(signum, frame):
                raise NodeLost(self.lost or "a Ray node of this run died")

            signal.signal(signal.SIGUSR1, raise_lost)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() or self.lost:
            self._thread.join(timeout=10)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a late report from the thread: nothing to stop

    def check(self) -> str | None:
        """What is lost: a sentence naming the node and who was on it; None while all are alive."""
        import ray

        alive = {n["NodeID"]: n.get("Alive", False) for n in ray.nodes()}
        for nid, who in self.held.items():
            if not alive.get(nid, False):
                return (f"Ray node {self.hosts.get(nid, '?')} (node id {nid}) left the cluster; it held "
                        f"{', '.join(who)}. The run stops here: resume with --load from the last checkpoint "
                        "once the cluster has the node's resources again")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.lost = self.check()
            except Exception as exc:  # the GCS itself unreachable: the driver's own Ray calls fail too
                log.warning("node watch: %r", exc)
                continue
            if self.lost:
                log.error("%s", self.lost)
                os.kill(os.getpid(), signal.SIGUSR1)
                return


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


def normal_priority() -> None:
    """Back to nice 0 in a Ray actor of a joined cluster (`--ray-address`), whose raylet started
    it at Ray's default nice 15 (start_ray's local cluster starts them at 0): the trainer and the
    engines would starve behind any other work on the node. Allowed to root (CAP_SYS_NICE)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        log.warning("this Ray worker runs at nice %d (start the cluster with RAY_worker_niceness=0)",
                    os.getpriority(os.PRIO_PROCESS, 0))


def node_ip() -> str:
    """The address of this process's node (the driver's, or an actor's)."""
    import ray

    return ray.util.get_node_ip_address()


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


class TrainerWorker:
    """The trainer inside a Ray actor (one per rank). Weight sync runs here too, so the weights
    go from the trainer's memory straight to the engines, never through the driver.
    `dist_env`: torch.distributed's variables for this rank (RemoteTrainer), set before the
    trainer is built."""

    def __init__(self, cfg: Config, model_path: str, device: str, dist_env: dict[str, str] | None = None):
        init_at = time.time()
        import torch

        from agentrl.build import build_trainer, seed_everything

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
        self.groups: dict[str, Any] = {}  # engine url -> WeightUpdateGroup (--weight-sync-mode distributed)
        self.group_count = 0
        self.saved_version: int | None = None  # what --weight-sync-mode disk last wrote
        self.lora_synced: int | None = None  # the adapter version the engines last loaded (--lora-sync adapter)
        self.engine_index: dict[str, int] = {}  # engine url -> its index in the placement (rank 0 of several)
        self.placement: Placement | None = None

    def engines_placed(self, urls: list[str], placement: "Placement") -> None:
        self.engine_index, self.placement = {u: i for i, u in enumerate(urls)}, placement

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
        """Rank 0 of several: the weight sync's exports run on every rank (LeadingRank)."""
        self.trainer = LeadingRank(self.trainer, others)

    def export(self, what: str, *args) -> None:
        """A rank other than 0: its part in one of rank 0's exports (the same TP/PP collectives);
        rank 0 alone sends the result to the engines."""
        if what in ("save_hf", "save_adapter"):
            getattr(self.trainer, what)(*args)
        elif what == "per_rank":  # its own copy of every bucket to rank 0 (agentrl.weight_sync)
            from agentrl.weight_sync import RankGather, serve_weights_per_rank

            bucket_bytes, kind = args
            serve_weights_per_rank(engine_tensors(self.cfg, self.trainer.named_tensors()), bucket_bytes=bucket_bytes,
                                   kind=kind,
                                   gather=RankGather())
        else:
            for _ in self.trainer.named_tensors():
                pass

    async def sync_weights(self, urls: list[str], version: int, fresh: bool = False) -> dict[str, Any]:
        """Bucketed weights to every engine (--weight-sync-mode); an engine that fails is named in
        "failed_engines" (the others still got the update) instead of failing the run. `fresh`:
        the engines were just (re)started, so a process group held with them is gone."""
        import aiohttp

        from agentrl.errors import EngineError
        from agentrl.rollout.client import EngineClient

        unreachable = (EngineError, OSError, aiohttp.ClientError, asyncio.TimeoutError)  # e.g. killed meanwhile
        if fresh:
            for url in urls:
                await self._drop_group(url)
        clients = [EngineClient(u, request_timeout_s=self.cfg.rollout.request_timeout_s) for u in urls]
        try:
            try:
                return {**await self._sync(clients, version), "failed_engines": []}
            except unreachable:
                failed, out = [], {}
                for c in clients:  # find the failing ones; the rest get the weights
                    try:
                        out = await self._sync([c], version)
                    except unreachable:
                        failed.append(c.base_url)
                return {**out, "failed_engines": failed}
        finally:
            await asyncio.gather(*[c.close() for c in clients])

    def weight_sync_mode(self) -> str:
        mode = self.cfg.train.weight_sync_mode
        if mode == "auto":  # CUDA IPC needs the engine on the trainer's GPU; else a process group
            apart = self.cfg.rollout.rollout_engine == "sglang" and not self.cfg.run.colocate
            mode = "distributed" if apart and str(self.trainer.device).startswith("cuda") else "tensor"
        return mode

    async def _sync(self, clients, version: int) -> dict[str, float]:
        from agentrl.weight_sync import sync_weights_from_disk, sync_weights_from_tensor

        bucket = self.cfg.train.update_weight_buffer_size or int(self.cfg.train.weight_sync_bucket_mb * 2**20)
        mode = self.weight_sync_mode()
        if self.cfg.train.lora_rank and self.cfg.train.lora_sync == "adapter":
            return await self._sync_adapter(clients, version)
        if mode == "disk":
            folder = Path(self.cfg.run.output_dir or tempfile.gettempdir()) / "weight_sync"
            t0 = time.perf_counter()
            if self.saved_version != version:  # once per version: retries and catch-ups load the same folder
                await asyncio.to_thread(self.trainer.save_hf, folder)
                self.saved_version = version
            saved = time.perf_counter() - t0
            out = await sync_weights_from_disk(clients, str(folder), version=version)
            return {**out, "weight_sync_save_s": saved}
        if mode == "distributed":
            out = {}
            for c in clients:  # a group per engine: a dead engine breaks only its own
                group = await self._group(c.base_url)
                try:
                    out = await group.sync(engine_tensors(self.cfg, self.trainer.named_tensors()), version=version,
                                           bucket_bytes=bucket)
                except BaseException:
                    await self._drop_group(c.base_url)
                    raise
            return out
        if per_rank := await self._per_rank_sources(clients):
            return await self._sync_per_rank(clients, version, bucket, *per_rank)
        return await sync_weights_from_tensor(clients, engine_tensors(self.cfg, self.trainer.named_tensors()),
                                              version=version,
                                              bucket_bytes=bucket)

    async def _per_rank_sources(self, clients) -> tuple[list[list[int]], str] | None:
        """(the trainer rank feeding each engine TP rank, the engines' kind) where every engine
        sits on the trainer's GPUs (or the CPU) and the trainer has several ranks; else None."""
        if not isinstance(self.trainer, LeadingRank) or self.placement is None:
            return None
        from agentrl.weight_sync import _tp_size

        kinds = {await c.kind() for c in clients}
        if len(kinds) != 1 or any(c.base_url not in self.engine_index for c in clients):
            return None
        sources = [self.placement.engine_rank_sources(self.engine_index[c.base_url], await _tp_size(c))
                   for c in clients]
        return None if None in sources else (sources, kinds.pop())

    async def _sync_per_rank(self, clients, version: int, bucket: int, sources, kind: str) -> dict[str, float]:
        """Every trainer rank serializes its own copy (agentrl.weight_sync.sync_weights_per_rank)."""
        import ray

        from agentrl.weight_sync import RankGather, sync_weights_per_rank

        lead: LeadingRank = self.trainer
        refs = [a.export.remote("per_rank", bucket, kind) for a in lead.others]
        try:
            return await sync_weights_per_rank(clients, engine_tensors(self.cfg, lead.inner.named_tensors()),
                                               version=version,
                                               bucket_bytes=bucket, sources=sources, kind=kind, gather=RankGather())
        finally:  # the other ranks are done once rank 0 is (the same buckets, the same verdicts)
            await asyncio.to_thread(ray.get, refs, timeout=TIMEOUT_S)

    async def _sync_adapter(self, clients, version: int) -> dict[str, float]:
        """--lora-sync adapter: the peft adapter folder of `version` (written once), loaded by every engine."""
        from agentrl.weight_sync import sync_lora_adapter

        folder = Path(self.cfg.run.output_dir or tempfile.gettempdir()) / "lora_sync" / f"v{version}"
        t0 = time.perf_counter()
        if not (folder / "adapter_config.json").exists():
            await asyncio.to_thread(self.trainer.save_adapter, folder)
        saved = time.perf_counter() - t0
        out = await sync_lora_adapter(clients, str(folder), version=version, previous=self.lora_synced)
        if self.lora_synced is not None and self.lora_synced != version:  # no engine reads the old folder again
            shutil.rmtree(folder.parent / f"v{self.lora_synced}", ignore_errors=True)
        self.lora_synced = version
        return {**out, "weight_sync_save_s": saved}

    async def _group(self, url: str):
        """The process group with one engine, made at its first distributed sync."""
        from urllib.parse import urlparse

        from agentrl.rollout.client import EngineClient
        from agentrl.weight_sync import WeightUpdateGroup

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
    given = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}.get("mem-fraction-static")
    return float(given) if given else DEFAULT_SHARED_MEM_FRACTION


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
        frac = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}.get("mem-fraction-static")
        knobs.insert(0, f"--sglang-mem-fraction-static (the engines' share of the GPU, now {frac or 'default'}; "
                        "they keep their weights and CUDA graphs while training)")
    return (f"the trainer ran out of GPU memory training {n_samples} samples: the GPU has {mem['total_gib']:.1f} "
            f"GiB, this trainer holds {mem['mine_gib']:.1f} GiB and other processes (engines) {others:.1f} GiB. "
            f"Lower {'; or '.join(knobs)}.")


class LeadingRank:
    """Rank 0 of several, as TrainerWorker's weight sync sees its trainer. Rank 0 alone talks to
    the engines, but an export (`named_tensors`, `save_hf`) is collective: TP all-gathers and
    PP broadcasts (trainers/megatron/weights.py) after which every rank holds the full HF
    tensors (the LoRA adapter's `save_adapter` too). So each export first has every other rank run the same one
    (`TrainerWorker.export`), and ends by waiting for them. The rest is the trainer's."""

    def __init__(self, trainer, others: list):
        self.inner, self.others = trainer, others

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def named_tensors(self):
        import ray

        refs = [a.export.remote("named_tensors") for a in self.others]
        stream = self.inner.named_tensors()
        try:
            for item in stream:
                yield item
        finally:  # left midway (an engine failed): finish the collectives the other ranks are in
            for _ in stream:
                pass
            ray.get(refs, timeout=TIMEOUT_S)

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
            ray.get(refs, timeout=TIMEOUT_S)


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
    while the other ranks take part in each export (LeadingRank)."""

    def __init__(self, cfg: Config, model_path: Path, device: str, placement: Placement):
        import ray

        world = trainer_ranks(cfg)
        address = None
        if world > 1:
            probe = ray.remote(num_cpus=0)(_rendezvous_address)
            rank0 = placement.strategy(placement.trainer_bundles[0])
            address = ray.get(probe.options(scheduling_strategy=rank0).remote(), timeout=TIMEOUT_S)
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
