"""Start engine servers as child processes, wait for their health with a timeout, and stop
them on exit. A failed start raises with the server's last log lines."""

from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

import tenacity

from agentrl.errors import EngineError
from agentrl.http import http_ok
from agentrl.parent_death import die_with_parent


# The environment of every engine server agentrl starts. SGLang's /health runs a one-token
# generation by default, which crashes its scheduler while the KV cache is released
# (--colocate); false makes /health a liveness check (the monitor's and the router's polls).
# SGLANG_VLM_CACHE_SIZE_MB: SGLang caches a VLM's image embeddings by image (100 MB by default) and
# neither a weight update nor /flush_cache clears that cache, so after a sync it serves the old vision
# tower's features for every image it saw before (the engine drifted from the trainer until the weight
# check failed, 1x H200, 2026-12-03); SGLang itself turns it off for RL (rl_on_policy_target).
ENGINE_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false", "SGLANG_VLM_CACHE_SIZE_MB": "0"}


# its own generator, seeded by the OS: the global one is seeded by --seed, so two runs with the
# same seed would try the same ports in the same order (and could both take one: the probe's
# bind is released before the server binds)
_PORTS = random.SystemRandom()


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A free TCP port: a server's (see `server_port`) or, with `low`/`high`, one in [low, high)."""
    if low is None:
        return server_port()
    for _ in range(200):
        port = _PORTS.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in [{low}, {high})")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def server_port() -> int:
    """A free port for a server this run starts, outside the kernel's ephemeral range. A port
    inside it can be taken as the *source* port of our own health poll before the server
    listens: the poll then connects to itself (TCP self-connect) and reads its own request
    back ("BadStatusLine: GET /health HTTP/1.1"). Below 25536 also keeps SGLang's derived
    gRPC port (port + 10000) valid."""
    low, high = ephemeral_range()
    if low - 10000 >= 2000:
        return free_port(10000, min(low, 25536))
    return free_port(high + 1, 65536)  # a range that starts low: above it instead


T = TypeVar("T")


def poll(check: Callable[[], T], *, timeout_s: float, interval_s: float) -> T:
    """Call `check` every `interval_s` seconds until it returns something true, and return that;
    stop before a call that would start `timeout_s` or more after the first, and return the last
    (false) result. An exception from `check` ends the polling: it propagates."""
    return tenacity.Retrying(retry=tenacity.retry_if_result(lambda result: not result),
                             stop=tenacity.stop_before_delay(timeout_s), wait=tenacity.wait_fixed(interval_s),
                             retry_error_callback=lambda state: state.outcome.result())(check)


class ServerProcess:
    """A child HTTP server with a log file, a health URL and a guaranteed stop."""

    def __init__(self, argv: list[str], *, url: str, name: str, env: dict | None = None, log_dir: Path | None = None):
        self.url, self.name, self.argv, self.env = url, name, argv, env
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="agentrl-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.restarts = 0
        self._start()
        atexit.register(self.stop)

    def _start(self) -> None:
        self._log = open(self.log_path, "ab")
        # A new process group, so stopping it also stops anything it spawned.
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self._swept = False

    def restart(self, argv: list[str] | None = None) -> None:
        """Stop what is left of it and start it again with the same command (or `argv`; same
        port, same GPUs); the caller waits for its health. Call from a thread that outlives
        the child."""
        self.stop()
        if argv:
            self.argv = argv
        self.restarts += 1
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n--- agentrl: restart {self.restarts} ---\n".encode())
        self._log.close()
        self._start()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout_s: float = 300.0, path: str = "/health") -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name} exited with code {self.proc.returncode} while starting "
                                  f"({' '.join(self.argv)}); last log lines:\n{self.log_tail()}")
            return http_ok(self.url + path, timeout=2)

        if poll(healthy, timeout_s=timeout_s, interval_s=0.2):
            return
        self.stop()
        raise EngineError(f"{self.name} not healthy after {timeout_s:.0f} s at {self.url}{path}; "
                          f"last log lines:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        if not self._swept:  # what the server spawned may outlive it (SGLang's scheduler processes)
            self._swept = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not self._log.closed:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would (tests)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def rehost(argv: list[str], host: str, port: int) -> tuple[list[str], str]:
    """(command line, URL) of an engine server moved to host:port: an engine on another node
    of the cluster binds that node's address, on a port free there."""
    out, url = list(argv), f"http://{host}:{port}"
    for flag, value in (("--host", host), ("--port", str(port)), ("--engine-id", url)):
        if flag in out:
            out[out.index(flag) + 1] = value
        elif flag != "--engine-id":
            out += [flag, value]
    return out, url


def embedded_argv(model_path: str, *, port: int | None = None, device: str = "cpu", seed: int = 0,
                  num_threads: int = 0, dtype: str = "float32", prefix_cache_tokens: int | None = None,
                  enable_lora: bool = False, tp_size: int = 1):
    """(command line, URL) of an embedded engine server (`tp_size` > 1: emulated TP ranks)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "agentrl.engines.embedded", "--model-path", str(model_path),
            "--port", str(port), "--device", device, "--seed", str(seed), "--num-threads", str(num_threads),
            "--dtype", dtype, "--engine-id", url]
    if prefix_cache_tokens is not None:
        argv += ["--prefix-cache-tokens", str(prefix_cache_tokens)]
    if enable_lora:
        argv.append("--enable-lora")
    if tp_size > 1:
        argv += ["--tp-size", str(tp_size)]
    return argv, url


def launch_embedded_engine(model_path: str, *, port: int | None = None, device: str = "cpu", seed: int = 0,
                           num_threads: int = 0, log_dir: Path | None = None, name: str = "engine",
                           timeout_s: float = 300.0, dtype: str = "float32", prefix_cache_tokens: int | None = None,
                           env: dict | None = None, wait: bool = True) -> ServerProcess:
    """Start `python -m agentrl.engines.embedded`; its engine id is its URL. With wait=False
    the caller waits for health (so several engines can start at once)."""
    argv, url = embedded_argv(model_path, port=port, device=device, seed=seed, num_threads=num_threads, dtype=dtype,
                              prefix_cache_tokens=prefix_cache_tokens)
    server = ServerProcess(argv, url=url, name=name, log_dir=log_dir, env=env)
    if wait:
        server.wait_healthy(timeout_s)
    return server
