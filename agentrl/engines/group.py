"""The engines a run generates with, and the one URL rollouts talk to.

`start_engines(cfg.rollout, ...)` gives an EngineGroup: `url` is where /generate goes (the
router, or the only engine), `engine_urls` every engine (weight sync, flush, abort).

- `--rollout-engine embedded` (default): `--num-engines N` embedded engines (CPU or one GPU);
  `--rollout-num-gpus-per-engine N` > 1 makes each emulate N TP ranks on its one device (the
  weight-sync protocol of a TP engine, see agentrl.engines.embedded).
- `--rollout-engine sglang`: SGLang servers placed on GPUs (see sglang.py), every
  `--sglang-*` argument passed through and validated against the installed SGLang.
- `--rollout-engine-urls URL ...`: attach to engines already running; nothing is launched
  (their kind, SGLang or embedded, is read from /model_info).
- With two or more engines (or `--use-router always`), sglang-router runs in front of them
  (see router.py) with session affinity on the trajectory id.
- `--prefill-num-servers N` (slime's; SGLang engines only): the first N engines prefill, the rest
  decode (SGLang's --disaggregation-mode), and the router runs in PD mode over them; each kind
  takes its own SGLang arguments over --sglang-* (`--prefill-sglang-args`, `--decode-sglang-args`).

Health: a monitor thread polls every engine. A dead one leaves the router's pool at once
(the router's own health checks would also drop it, more slowly); an engine this run
launched is restarted (same port and GPUs) when `--engine-restart` is on. A restarted engine
starts paused (embedded: --start-paused; SGLang: paused as soon as it answers), is given the
current weights through `EngineGroup.catch_up` (set by the training loop; it pushes the
trainer's weights and resumes the engine), and rejoins the pool once it holds the weights the
others serve (its /model_info weight_version equals theirs): a restarted engine never
serves stale weights, with or without a router. Events go to logs/engine_events.jsonl.
Engines and router stop at exit, on Ctrl-C and on SIGTERM (converted to SystemExit so
cleanup runs); children also die with their parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agentrl.config import RolloutConfig
from agentrl.engines.colocate import EngineMemory
from agentrl.engines.launch import ENGINE_ENV, ServerProcess, embedded_argv, http_ok, poll, server_port
from agentrl.errors import ConfigError, EngineError
from agentrl.http import HTTPCallError, request_json

log = logging.getLogger("agentrl.engines")

MAX_RESTARTS = 3


@dataclass
class Engine:
    url: str
    kind: str  # "embedded" | "sglang"
    server: ServerProcess | None = None  # None: attached, not ours to restart
    gpus: list[int] = field(default_factory=list)
    restart_argv: list[str] | None = None  # None: the command it was started with
    state: str = "serving"  # serving | down | starting | catching_up | failed
    failures: int = 0
    since: float = 0.0
    pending: Future | None = None  # a catch-up weight push in flight
    worker_type: str = "regular"  # --prefill-num-servers: "prefill" or "decode" (the router pairs them)
    bootstrap_port: int | None = None  # a prefill engine's


@dataclass
class EngineGroup:
    url: str  # /generate goes here: the router, or the only engine
    engine_urls: list[str]  # every engine: weight updates, flush, abort
    servers: list[ServerProcess] = field(default_factory=list)  # processes this run started
    engines: list[Engine] = field(default_factory=list)
    router: object | None = None  # agentrl.engines.router.Router
    kind: str = "embedded"
    monitor: "EngineMonitor | None" = None
    # url -> Future of a push of the current weights that also resumes the engine; None: the
    # weights never change (eval, --debug-rollout-only), a restarted engine just resumes
    catch_up: Callable[[str], Future] | None = None
    memory: EngineMemory = field(default_factory=EngineMemory)  # what each engine released (--colocate)
    # the weight check (agentrl.weight_update): prompts to probe once the engines can generate, then
    # what each engine sampled, for the trainer to recompute before its next step
    probe_prompts: list[list[int]] | None = None
    probe_images: list[list[str]] | None = None  # each probe prompt's images (a VLM's), [] for none
    probe_lora: str | None = None  # the adapter the probe names (--lora-sync adapter)
    probe_results: list | None = None

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        if self.router is not None:
            self.router.stop()
        for server in reversed(self.servers):
            server.stop()

    def serving(self) -> list[str]:
        return [e.url for e in self.engines if e.state == "serving"]

    def live(self) -> list[str]:
        """Engines that take weight updates: serving ones, and restarted ones catching up
        (they rejoin the pool once they hold the version the others serve)."""
        return [e.url for e in self.engines if e.state in ("serving", "catching_up")] or list(self.engine_urls)

    def quarantine(self, url: str) -> None:
        """An engine that missed a weight update leaves the pool until it catches up."""
        for e in self.engines:
            if e.url == url and e.state == "serving":
                e.state = "catching_up"
                if self.router is not None:
                    self.router.remove_worker(url)


def _split_urls(urls: list[str]) -> list[str]:
    return [u.strip().rstrip("/") for entry in urls for u in entry.split(",") if u.strip()]


def start_engines(cfg: RolloutConfig, *, model_path: str, device: str, seed: int, log_dir: Path,
                  sglang_args: dict | None = None, router_args: dict | None = None,
                  dtype: str = "float32", placement=None, lora_max_rank: int = 0,
                  lora_target_modules: list[str] | None = None) -> EngineGroup:
    """`placement` (agentrl.cluster.placement.Placement, reserved): each engine's server process is
    owned by a Ray actor in its bundle (as `agentrl train` runs them); None: by this process.
    `lora_max_rank` > 0: launched engines serve LoRA adapters of that rank on `lora_target_modules`
    (--lora-sync adapter; SGLang's --enable-lora --max-lora-rank --lora-target-modules, which
    --sglang-* flags override)."""
    sglang_args, router_args = dict(sglang_args or {}), dict(router_args or {})
    launch = _local_launcher
    if placement is not None:
        from agentrl.cluster.engine_actor import actor_launcher

        launch = actor_launcher(placement)
    attach = _split_urls(cfg.rollout_engine_urls)
    if cfg.prefill_num_servers and (attach or cfg.rollout_engine != "sglang"):
        raise ConfigError("--prefill-num-servers: prefill/decode engines are SGLang engines agentrl launches "
                          "(--rollout-engine sglang, no --rollout-engine-urls)")
    if attach:
        if sglang_args:
            raise ConfigError("--sglang-* arguments configure engines agentrl launches; with --rollout-engine-urls "
                              "nothing is launched (pass them to your SGLang servers)")
        engines = [Engine(url=u, kind=detect_kind(u, timeout_s=cfg.engine_startup_timeout_s)) for u in attach]
        servers: list[ServerProcess] = []
    elif cfg.rollout_engine == "sglang":
        if lora_max_rank:
            sglang_args = {"enable-lora": None, "max-lora-rank": str(lora_max_rank),
                           "lora-target-modules": " ".join(lora_target_modules or ["all"]), **sglang_args}
        engines, servers = _launch_sglang(cfg, model_path=model_path, seed=seed, log_dir=log_dir,
                                          sglang_args=sglang_args, launch=launch,
                                          gpu_ids=placement.rollout_gpu_ids() if placement is not None else None)
    else:
        if sglang_args:
            raise ConfigError("--sglang-* arguments need --rollout-engine sglang")
        engines, servers = _launch_embedded(cfg, model_path=model_path, device=device, seed=seed, log_dir=log_dir,
                                            dtype=dtype, launch=launch, enable_lora=lora_max_rank > 0)
    group = EngineGroup(url=engines[0].url, engine_urls=[e.url for e in engines], servers=list(servers),
                        engines=engines, kind=engines[0].kind)
    try:
        pd = {e.url: (e.worker_type, e.bootstrap_port) for e in engines if e.worker_type != "regular"}
        if cfg.use_router == "always" or (cfg.use_router == "auto" and len(engines) > 1) or pd:
            from agentrl.engines.router import launch_router

            group.router = launch_router(group.engine_urls, router_args=router_args, log_dir=log_dir,
                                         timeout_s=min(cfg.engine_startup_timeout_s, 300.0), pd=pd or None)
            group.url = group.router.url
        elif router_args:
            log.warning("--router-* arguments given but no router runs (one engine; --use-router always starts one)")
        if group.router is not None or (cfg.engine_restart and servers):
            group.monitor = EngineMonitor(group, restart=cfg.engine_restart,
                                          startup_timeout_s=cfg.engine_startup_timeout_s, log_dir=log_dir)
            group.monitor.start()
    except BaseException:
        group.stop()
        raise
    _stop_on_sigterm()
    return group


def _local_launcher(index: int, argv: list[str], *, url: str, name: str, env: dict | None, log_dir: Path):
    """Engine server processes owned by this process (started from this thread: PR_SET_PDEATHSIG follows it)."""
    return ServerProcess(argv, url=url, name=name, env=env, log_dir=log_dir)


def _launch_embedded(cfg: RolloutConfig, *, model_path: str, device: str, seed: int, log_dir: Path, dtype: str,
                     launch=_local_launcher, enable_lora: bool = False):
    n = cfg.num_engines or 1
    servers = []
    try:
        for i in range(n):  # all start at once
            argv, url = embedded_argv(model_path, device=device, seed=seed + i, num_threads=cfg.engine_num_threads,
                                      dtype=dtype, enable_lora=enable_lora, tp_size=cfg.rollout_num_gpus_per_engine)
            servers.append(launch(i, argv, url=url, name=f"engine-{i}" if n > 1 else "engine",
                                  env={**os.environ, **ENGINE_ENV}, log_dir=log_dir))
        for s in servers:
            s.wait_healthy(cfg.engine_startup_timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return [Engine(url=s.url, kind="embedded", server=s) for s in servers], servers


def _launch_sglang(cfg: RolloutConfig, *, model_path: str, seed: int, log_dir: Path, sglang_args: dict,
                   launch=_local_launcher, gpu_ids: list[int] | None = None):
    from agentrl.engines.sglang import (merged_args, plan_engines, sglang_log_hint, validate_sglang_args, visible_gpus,
                                        with_rollout_defaults)

    argv = with_rollout_defaults(validate_sglang_args(sglang_args))
    worker_argv = {}
    for kind, own in (("prefill", cfg.prefill_sglang_args), ("decode", cfg.decode_sglang_args)):
        if own and not cfg.prefill_num_servers:
            raise ConfigError(f"--{kind}-sglang-args: the {kind} engines' own SGLang arguments need "
                              "--prefill-num-servers (prefill/decode engines)")
        if cfg.prefill_num_servers:
            try:
                worker_argv[kind] = with_rollout_defaults(validate_sglang_args(merged_args(sglang_args, own)))
            except ConfigError as exc:
                raise ConfigError(f"--{kind}-sglang-args {json.dumps(own)}: {exc}") from None
    gpu_ids = visible_gpus() if gpu_ids is None else gpu_ids
    n = cfg.num_engines or max(1, (cfg.rollout_num_gpus or len(gpu_ids)) // cfg.rollout_num_gpus_per_engine)
    ports = [server_port() for _ in range(n)]
    prefill = cfg.prefill_num_servers or 0
    plans = plan_engines(num_engines=n, num_gpus=cfg.rollout_num_gpus or len(gpu_ids), gpus_per_engine=
                         cfg.rollout_num_gpus_per_engine, gpu_ids=gpu_ids, ports=ports, model_path=model_path,
                         sglang_argv=argv, seed=seed, prefill=prefill,
                         bootstrap_ports=[server_port() for _ in range(prefill)], worker_argv=worker_argv)
    servers: dict[int, ServerProcess] = {}
    try:
        pending = list(plans)
        while pending:  # waves: engines that share a GPU start after the one before them is up
            wave = [p for p in pending if p.start_after is None or p.start_after in servers]
            for p in wave:
                env = {**os.environ, **p.env}
                servers[p.index] = launch(p.index, p.argv, url=p.url, name=f"sglang-{p.index}", env=env,
                                          log_dir=log_dir)
                log.info("sglang engine %d on GPUs %s: %s", p.index, p.gpus, " ".join(p.argv))
            for p in wave:
                try:
                    servers[p.index].wait_healthy(cfg.engine_startup_timeout_s)
                except EngineError as exc:
                    raise EngineError(f"{exc}{sglang_log_hint(servers[p.index].log_tail())}") from None
            pending = [p for p in pending if p.index not in servers]
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    ordered = [servers[p.index] for p in plans]
    return [Engine(url=servers[p.index].url, kind="sglang", server=servers[p.index], gpus=p.gpus,
                   restart_argv=p.restart_argv, worker_type=p.worker_type, bootstrap_port=p.bootstrap_port)
            for p in plans], ordered


def _healthy(url: str, timeout: float = 10.0) -> bool:
    return http_ok(url + "/health", timeout)


def detect_kind(url: str, timeout_s: float = 60.0) -> str:
    """"embedded" or "sglang", from /model_info (the embedded engine names itself there)."""
    last: Exception | None = None

    def kind() -> str | None:
        nonlocal last
        try:
            info = request_json("GET", url + "/model_info", timeout=5.0)
        except HTTPCallError as exc:
            last = exc
            return None
        return "embedded" if (info or {}).get("engine") == "agentrl-embedded" else "sglang"

    found = poll(kind, timeout_s=timeout_s, interval_s=0.5)
    if found:
        return found
    raise EngineError(f"--rollout-engine-urls {url}: no engine answers /model_info after {timeout_s:.0f} s ({last})")


def weight_version(url: str) -> str | None:
    try:
        return str(request_json("GET", url + "/model_info", timeout=5.0)["weight_version"])
    except (HTTPCallError, KeyError, TypeError):
        return None


class EngineMonitor:
    """Keeps the router's pool to the engines that answer (see the module docstring)."""

    def __init__(self, group: EngineGroup, *, restart: bool, startup_timeout_s: float, interval_s: float = 1.0,
                 failures_to_down: int = 3, log_dir: Path | None = None):
        self.group, self.restart, self.startup_timeout_s = group, restart, startup_timeout_s
        self.events_path = Path(log_dir) / "engine_events.jsonl" if log_dir is not None else None
        self.interval_s, self.failures_to_down = interval_s, failures_to_down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-engine-monitor", daemon=True)
        self.events: list[tuple[float, str, str]] = []  # (time, url, what): for logs and tests

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _event(self, engine: Engine, what: str) -> None:
        self.events.append((time.time(), engine.url, what))
        log.warning("engine %s: %s", engine.url, what)
        if self.events_path is not None:
            with open(self.events_path, "a") as f:
                f.write(json.dumps({"time": self.events[-1][0], "engine": engine.url, "event": what}) + "\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for engine in self.group.engines:
                try:
                    self._check(engine)
                except Exception as exc:  # the monitor must outlive any one bad check
                    log.warning("engine monitor: %s: %r", engine.url, exc)

    def _check(self, e: Engine) -> None:
        router = self.group.router
        exited = e.server is not None and not e.server.alive()
        if e.state in ("serving", "catching_up"):
            ok = not exited and _healthy(e.url)
            e.failures = 0 if ok else e.failures + 1
            if exited or e.failures >= self.failures_to_down:
                e.state, e.since, e.pending = "down", time.monotonic(), None
                self._event(e, "process exited" if exited else "not answering /health")
                if router is not None:
                    router.remove_worker(e.url)
                    self._event(e, "removed from the router")
        if e.state == "down":
            if e.server is not None and self.restart and e.server.restarts < MAX_RESTARTS:
                argv = e.restart_argv or e.server.argv
                if e.kind == "embedded" and "--start-paused" not in argv:
                    argv = [*argv, "--start-paused"]  # it waits for the current weights
                e.server.restart(argv)
                self.group.memory.forget(e.url)
                e.state, e.since = "starting", time.monotonic()
                self._event(e, f"restarted ({e.server.restarts})")
            elif e.server is None and _healthy(e.url):  # attached: someone else restarted it
                e.state = "catching_up"
        if e.state == "starting":
            if _healthy(e.url):
                if e.kind == "sglang":  # SGLang cannot start paused: pause it now, before it gets the weights
                    request_json("POST", e.url + "/pause_generation", {"mode": "in_place"}, timeout=30.0)
                e.state, e.pending = "catching_up", None
            elif not e.server.alive() or time.monotonic() - e.since > self.startup_timeout_s:
                e.state = "down" if e.server is not None and e.server.restarts < MAX_RESTARTS else "failed"
                self._event(e, f"restart did not come up; last log lines:\n{e.server.log_tail(10)}")
        if e.state == "catching_up":
            if self.group.catch_up is not None:  # the current weights, then resume (under the loop's weights lock)
                if e.pending is None:
                    e.pending = self.group.catch_up(e.url)
                    return
                if not e.pending.done():
                    return
                done, e.pending = e.pending, None
                done.result(timeout=0)  # a failed push raises here (logged); the next check tries again
            else:  # the weights never change: the engine as it started is current
                request_json("POST", e.url + "/continue_generation", {}, timeout=30.0)
            others = {weight_version(o.url) for o in self.group.engines if o is not e and o.state == "serving"}
            others.discard(None)
            mine = weight_version(e.url)
            if mine is not None and (not others or others == {mine}):
                if router is not None:
                    router.add_worker(e.url)
                e.state, e.failures = "serving", 0
                self._event(e, f"back in the pool (weight version {mine})")


def _stop_on_sigterm() -> None:
    """SIGTERM -> SystemExit in the main thread, so `finally` blocks stop the engines."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
