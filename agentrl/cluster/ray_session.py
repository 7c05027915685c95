"""The run's Ray session: started locally or joined (`--ray-address`), stopped, and the
signals that end a run; what a Ray actor of the run asks of its node (its address, nice 0);
an actor's failed start read back from Ray's message.

On one machine Ray starts locally and quietly: bound to 127.0.0.1, no dashboard, no
token file written to ~/.ray (token auth is off for a loopback-only cluster), and the
light actors ask for no CPU slots so 2 cores never deadlock. Across machines,
`--ray-address HOST:PORT` joins a cluster started with `ray start --head` (then
`ray start --address HOST:PORT` on the other nodes).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import sys
import threading

from agentrl.config import Config
from agentrl.errors import AgentRLError, ConfigError

log = logging.getLogger("agentrl.cluster")


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
    # "local": a Ray of this run's own, even where RAY_ADDRESS is set or a `ray start` on this machine left
    # its address in /tmp/ray (ray.init() would join that cluster: another run's, side by side on one host)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1", num_gpus=None)
    stop_on_signals()  # ray.init put its own SIGTERM handler (sys.exit, no cleanup) in place of ours


def stop_on_signals() -> None:
    """SIGTERM (timeout, schedulers, Kubernetes) stops a run as Ctrl-C does: KeyboardInterrupt,
    so every `finally` stops what the run started (engines, router, sandboxes, tool servers,
    Ray). A second SIGINT or SIGTERM exits at once, cleanup or not. SIGUSR2 prints every
    thread's stack and changes nothing."""
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
    # `kill -USR2 PID`: every thread's Python stack on stderr, the run going on (a hang's diagnosis);
    # the process's own stderr, as a captured sys.stderr (pytest's, an IDE's) has no file descriptor
    try:
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # no stderr descriptor at all: nothing to print to
        pass


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if threading.current_thread() is threading.main_thread():  # the run is over: signals act as before it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
