"""Types shared by the sandbox backends: limits, results, errors and the `Sandbox` base class.

A `Sandbox` is a long-lived isolated environment (a docker container, or a set of
bubblewrap namespaces) with a private writable workdir (`Sandbox.workdir`, "/work").
At start it launches a tiny exec server inside (see `_server.py`); `exec`, `write_file`
and `read_file` are JSON requests to it, so a warm exec costs about one fork+exec.

Failures come in two kinds:
  * the command failed (non-zero exit, timed out, output truncated): an `ExecResult`;
  * the sandbox itself failed (cannot start, container died, engine gone): `SandboxError`,
    which the trainer turns into a failed trajectory (masked out of the loss).
"""
from __future__ import annotations

import asyncio
import atexit
import base64
import json
import logging
import os
import shlex
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, Mapping, Sequence

from agentrl.errors import AgentRLError

log = logging.getLogger("agentrl.sandboxes")

SANDBOX_UID = 1000  # the uid commands run as inside every sandbox (never root)
WORKDIR = "/work"
SERVER_SOURCE = (Path(__file__).parent / "_server.py").read_text()
# What every server in a sandbox (the exec server, the MCP tool servers) runs first. Where it starts
# as root (docker: `docker exec -u 0`, the container holding only CAP_SETUID/SETGID/SETPCAP) it
# empties its capability bounding set and becomes real and saved uid 0, effective uid SANDBOX_UID:
# the files it touches belong to the agent's uid, the processes it starts are SANDBOX_UID through
# and through (no capability left), and the agent's code can neither signal it (its uid matches
# neither the server's real nor saved uid) nor ptrace it. Everywhere (local: one uid per user
# namespace) it makes itself non-dumpable: no /proc/PID/mem, /proc/PID/fd or ptrace reach.
SERVER_IDENTITY = (
    "import os, ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if os.getuid() == 0:\n"
    "    os.setgroups([])\n"
    "    for cap in range(64):\n"
    "        libc.prctl(24, cap, 0, 0, 0)\n"  # PR_CAPBSET_DROP
    f"    uid = int(os.environ.get('AGENTRL_SANDBOX_UID', '{SANDBOX_UID}'))\n"
    "    os.setresgid(0, uid, 0)\n"
    "    os.setresuid(0, uid, 0)\n"
    "if libc.prctl(4, 0, 0, 0, 0) != 0:\n"  # PR_SET_DUMPABLE
    "    raise SystemExit('cannot make the server non-dumpable')\n")
# the server's source goes in through stdin (one base64 line), so `ps` shows a short command
SERVER_BOOT = SERVER_IDENTITY + (
    "import sys, base64; exec(compile(base64.b64decode(sys.stdin.buffer.readline()), "
    "'agentrl-sandbox-server', 'exec'))")
# `-I`: no cwd, PYTHONPATH or user site on sys.path, so nothing the agent wrote is ever imported by
# the server (it starts, and restarts, with cwd "/", outside the workdir)
SERVER_ARGV = ["python3", "-I", "-c", SERVER_BOOT]
# What the host keeps of the stderr of anything it starts in a sandbox (servers, spawns): the first
# STDERR_CAP_BYTES and a note, written by a host process between the two (`cap_stderr`); the rest is
# read and dropped. The agent's code may reach a server's stderr (a child inheriting it), and the
# host's end is a file the trainer owns and reads back after a restart.
STDERR_CAP_BYTES = 1 << 20
_CAP_STDERR = ('d=$(mktemp -d) && mkfifo "$d/e" || exit 125; '
               '{ head -c "$1"; n=$(wc -c); '
               '[ "$n" -eq 0 ] || printf "\\n[agentrl: %s more bytes of stderr dropped]\\n" "$n"; } '
               '<"$d/e" >&2 & exec 2>"$d/e"; rm -rf "$d"; shift; exec "$@"')


def cap_stderr(argv: Sequence[str], limit: int = STDERR_CAP_BYTES) -> list[str]:
    """Host argv running `argv` (same pid: it is exec'd) with its stderr bounded on the host side:
    the first `limit` bytes reach the caller's stderr, the rest is drained and dropped."""
    return ["/bin/sh", "-c", _CAP_STDERR, "sh", str(int(limit)), *argv]


def inodes_for(size_mb: int) -> int:
    """A tmpfs's file count for its size: one per 4 KiB page (no more files than pages could hold
    data). The default, half the host's RAM pages, lets empty files pin kernel memory (about 1 KiB
    each, outside the size cap) by the gigabyte."""
    return max(1024, (size_mb << 20) // 4096)


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MAX_STRAY_LINES = 64  # answers with a wrong id skipped per request before the channel counts as broken
RUN_ID = os.environ.get("AGENTRL_RUN_ID") or f"run-{uuid.uuid4().hex[:12]}"


ANSWER_WAIT_S = 30.0  # how long a sandbox whose operation failed gets to answer a ping


async def still_answers(sandbox) -> bool:
    """Whether `sandbox`, after one of its operations failed, still answers a ping (which restarts
    an exec server that was killed, or that could not restart at first). True: the sandbox lives
    and works, so what broke the operation was the agent's own doing (reward 0, never a FAILED
    trajectory the policy could use to veto its group). False: the sandbox (container,
    namespaces) is gone or silent for ANSWER_WAIT_S: infrastructure. A host-side hiccup that
    passes within the wait counts as the agent's: the price of that rule."""
    if sandbox is None:
        return False
    try:
        await asyncio.wait_for(sandbox.ping(), ANSWER_WAIT_S)
    except Exception:  # noqa: BLE001 - any failure to answer: the sandbox is what broke
        return False
    return True


class SandboxError(AgentRLError):
    """Infrastructure failure: the sandbox cannot start, died, or its engine is gone.
    Not a failed command (that is an `ExecResult` with a non-zero exit code). `sandbox_id`: the
    sandbox it is about, where one is ("" otherwise), so a caller holding several can tell."""

    def __init__(self, message: str = "", sandbox_id: str = ""):
        super().__init__(message)
        self.sandbox_id = sandbox_id


class SandboxFileError(Exception):
    """A file operation that the sandbox answered with a refusal: the file is missing, not a
    regular file, too large, on a read-only path, or the disk is full. What is in the sandbox,
    not the sandbox failing. Raised as FileNotFoundError, OSError or ValueError too (what
    `read_file`/`write_file` raised before), with `sandbox_id` set."""

    sandbox_id = ""


class SandboxFileMissing(SandboxFileError, FileNotFoundError):
    pass


class SandboxFileRefused(SandboxFileError, OSError):
    pass


class SandboxFileTooLarge(SandboxFileError, ValueError):
    pass


def _file_error(cls: type[SandboxFileError], sandbox_id: str, message: str) -> SandboxFileError:
    exc = cls(message)
    exc.sandbox_id = sandbox_id
    return exc


class ImageNotFoundError(SandboxError):
    """The docker image is not present (there is no registry to pull from)."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandbox. Every field is enforced by both backends, except
    where the local backend runs unprivileged (no cgroups, no tmpfs on the host): then memory
    is a per-process address-space rlimit, pids an RLIMIT_NPROC counted in the sandbox's own
    user namespace (all its spawns together, and at most its share of the user's processes:
    local_backend.nproc_share; Linux >= 5.14, else per spawn), cpus unenforced, and
    workdir_mb + tmp_mb one tmpfs in a mount namespace of the sandbox's own (where the kernel
    lets a user make one; else only a per-file size rlimit).
    /dev/shm is min(tmp_mb, 64) MiB everywhere (local: bubblewrap >= 0.8)."""
    memory_mb: int = 1024        # RAM of all processes together (tmpfs pages included)
    cpus: float = 1.0            # CPU share (cores)
    pids: int = 256              # processes + threads
    workdir_mb: int = 512        # size of the private writable /work
    tmp_mb: int = 128            # size of /tmp
    timeout_s: float = 60.0      # default wall-time of one exec
    output_bytes: int = 1 << 20  # per stream (stdout, stderr) kept of one exec; the rest is dropped
    nofile: int = 1024           # open files per process
    ipc_mb: int = 64             # SysV shared memory, all segments of one IPC namespace (ipc_sysctls)
    ipc_objects: int = 64        # SysV shared memory segments, message queues, semaphore sets: each
    # (one IPC namespace: docker's per container, local's per spawn)


def default_max_active(backend: str, memory_mb: int | None = None) -> int:
    """How many sandboxes of `backend` this machine holds at once: a docker container costs the
    daemon seconds of CPU to start and keeps a server process, so 2 per core (4 on a 2-core
    machine); a local one (bubblewrap) 4 per core; never more than half the RAM holds at their
    memory cap, at least 2 and at most 64."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    by_ram = ram_mb // 2 // max(memory_mb or SandboxLimits.memory_mb, 1)
    return max(2, min((2 if backend == "docker" else 4) * cpus, by_ram, 64))


def ipc_sysctls(limits: SandboxLimits) -> dict[str, str]:
    """The SysV IPC caps of a sandbox's own IPC namespace, as namespaced sysctls. The kernel's
    defaults are per namespace and nearly unbounded (shmall 2^64 pages, 4096 segments, 32000
    queues and semaphore sets): shared memory outlives its maker and is charged to the sandbox's
    memory, so without a cap one command pins all of it for the rest of the trajectory."""
    pages = max(1, (limits.ipc_mb << 20) // PAGE_BYTES)
    n = max(1, limits.ipc_objects)
    return {"kernel.shmmax": str(limits.ipc_mb << 20), "kernel.shmall": str(pages), "kernel.shmmni": str(n),
            "kernel.msgmni": str(n), "kernel.msgmnb": "16384", "kernel.msgmax": "8192",
            # per set, in all, per semop call, sets
            "kernel.sem": f"250 {250 * n} 32 {n}"}


@dataclass
class ExecResult:
    """What one command did. `exit_code` is 128+N when killed by signal N (137: SIGKILL,
    which is what a timeout, the OOM killer or the pids limit usually leads to)."""
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    stdout_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (guards against pid reuse)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[19])


# Empties every place a sandboxed uid can write, and the SysV IPC namespace (python: the images
# need not have ipcrm); exit 0 only when a check after it finds nothing left.
WRITABLE = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")
RESET_SCRIPT = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for kind, rmid in (("shm", libc.shmctl), ("msg", libc.msgctl), ("sem", libc.semctl)):
    try:
        rows = open("/proc/sysvipc/" + kind).read().splitlines()[1:]
    except OSError:
        continue
    for row in rows:
        rmid(int(row.split()[1]), 0, None)  # IPC_RMID
left = []
for top in {WRITABLE!r}:
    if not os.path.isdir(top):
        continue
    for root, dirs, files in os.walk(top):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700)
            except OSError:
                pass
    for root, dirs, files in os.walk(top, topdown=False):
        for name in files + dirs:
            path = os.path.join(root, name)
            try:
                os.rmdir(path) if name in dirs and not os.path.islink(path) else os.unlink(path)
            except OSError:
                pass
    left += [os.path.join(top, n) for n in os.listdir(top)]
for kind in ("shm", "msg", "sem"):
    try:
        left += ["sysvipc " + r for r in open("/proc/sysvipc/" + kind).read().splitlines()[1:]]
    except OSError:
        pass
if left:
    sys.exit("not clean: " + ", ".join(left[:20]))
"""

def proc_status_number(pid: int, field: str) -> int | None:
    """The first number of /proc/PID/status's FIELD line ("Tgid", "Uid": the real uid, ...); None
    when the process (or thread) is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def kill_cgroup(cgroup: Path, keep: frozenset[int] = frozenset(), timeout_s: float = 10.0) -> bool:
    """SIGKILL every thread group in `cgroup` (host pids) but those in `keep`; True once the
    cgroup lists no thread outside `keep`. It reads the kernel's list of threads (v1 `tasks`, v2
    `cgroup.threads`), so a process whose main thread exited while another runs (a zombie in
    /proc) is there; a kill of any of its threads ends them all. Bounded: a fork bomb is capped
    by the cgroup's pids limit and what is SIGKILLed forks no more."""
    listing = next((cgroup / f for f in ("tasks", "cgroup.threads", "cgroup.procs") if (cgroup / f).exists()), None)
    if listing is None:
        return False
    if not keep and (cgroup / "cgroup.kill").exists():
        try:
            (cgroup / "cgroup.kill").write_text("1")
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tids = [int(t) for t in listing.read_text().split()]
        except (OSError, ValueError):
            return False
        doomed = [t for t in tids if not keep or proc_status_number(t, "Tgid") not in keep]
        if not doomed:
            return True
        if time.monotonic() > deadline:
            log.warning("cgroup %s: %d thread(s) still there after %.0f s of SIGKILL", cgroup, len(doomed), timeout_s)
            return False
        for tid in doomed:
            try:
                os.kill(tid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


_reaped: set[str] = set()


def reap_once(backend: str, reap: Callable[[], object]) -> None:
    """Reap dead runs' sandboxes of one backend, once per process (at its first sandbox)."""
    if backend in _reaped:
        return
    _reaped.add(backend)
    try:
        reap()
    except SandboxError:
        raise
    except Exception as e:
        log.warning("reaping dead %s sandboxes failed: %s", backend, e)


def owner_alive(pid: int, start: int | None) -> bool:
    now = process_start_time(pid)
    return now is not None and (start is None or now == start)


OWNER_PID = os.getpid()
OWNER_START = process_start_time(OWNER_PID)

_live: dict[str, "Sandbox"] = {}  # this process's open sandboxes, closed at exit


class Sandbox:
    """One isolated environment. Use `async with create(...) as sb:` or `sb = await create(...)`.

    Methods (all async): exec, write_file, read_file, spawn, reset, close.
    `spawn_argv(argv)` gives the host command line that runs argv inside with piped stdio
    (hand it to an MCP stdio client). Concurrent calls on one sandbox are serialized.
    """
    backend = "base"
    workdir = WORKDIR

    def __init__(self, *, limits: SandboxLimits | None = None, network: bool = False,
                 mounts: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 60.0):
        self.id = f"sbx-{uuid.uuid4().hex[:12]}"
        self.uid = SANDBOX_UID  # the agent's uid inside (docker: one per container, see docker_backend)
        self.limits = limits or SandboxLimits()
        self.network = network
        self.mounts = {str(Path(h).resolve()): s for h, s in (mounts or {}).items()}
        for host, inside in self.mounts.items():
            if not Path(host).exists():
                raise SandboxError(f"mount source {host} (for {inside}) does not exist")
        self.env = {"HOME": WORKDIR, "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
                    "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.started = False
        self.closed = False
        self.tainted = ""  # why this sandbox may not be reused (a server in it was restarted), or ""
        self.shell = "/bin/sh"
        self._chan: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None
        self._spawned: list[asyncio.subprocess.Process] = []
        self._req = 0

    # ---- backend hooks -------------------------------------------------------------
    async def _boot(self) -> None:
        """Create the environment (container, dirs, cgroups)."""
        raise NotImplementedError

    def spawn_argv(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                   cwd: str | None = None, server: bool = False) -> list[str]:
        """Host command line that runs `argv` inside this sandbox, stdin/stdout piped.
        server=True: argv starts with `SERVER_IDENTITY` (docker runs it as root, which it
        leaves at once); never for a command that does not."""
        raise NotImplementedError

    async def _alive(self) -> bool:
        raise NotImplementedError

    async def _destroy(self) -> None:
        raise NotImplementedError

    async def _kill_all(self) -> bool:
        """SIGKILL every process of the sandbox (servers included; the container's own init and
        main process excepted) and prove it from the kernel's view: True only once the sandbox's
        cgroup lists no other thread. False where that cannot be proven (the sandbox is then
        destroyed instead of reused)."""
        return False

    def _destroy_sync(self) -> None:
        """Best-effort synchronous teardown (interpreter exit)."""
        raise NotImplementedError

    # ---- lifecycle -----------------------------------------------------------------
    def __await__(self):
        return self.start().__await__()

    async def __aenter__(self) -> "Sandbox":
        if not self.started:
            await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> "Sandbox":
        if self.started:
            return self
        self._lock = asyncio.Lock()
        _live[self.id] = self
        try:
            # a cancelled start still lets the boot (a thread creating a container or mounts) finish,
            # so that close() below removes what it made instead of leaking it
            boot = asyncio.ensure_future(self._boot())
            try:
                await asyncio.shield(boot)
            except asyncio.CancelledError:
                await asyncio.gather(boot, return_exceptions=True)
                raise
            await self._start_server()
        except BaseException:
            await self.close()
            raise
        self.started = True
        return self

    async def close(self) -> None:
        """Kill everything in the sandbox and remove it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for proc in [self._chan, *self._spawned]:
            await _kill_proc(proc)
        self._chan = None
        try:
            await asyncio.wait_for(self._destroy(), 60)
        except Exception as e:  # the reaper will get it later
            log.warning("sandbox %s: teardown failed: %s", self.id, e)
        _live.pop(self.id, None)

    def taint(self, why: str) -> None:
        """Mark this sandbox as not to be reused (a pool destroys it at release)."""
        if not self.tainted:
            log.info("sandbox %s: tainted, will not be reused: %s", self.id, why)
            self.tainted = why

    async def _start_server(self) -> None:
        argv = self.spawn_argv(SERVER_ARGV, cwd="/", server=True)
        limit = 8 * self.limits.output_bytes + (64 << 20)  # bounded response line
        try:
            self._chan = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, limit=limit, start_new_session=True)
            self._chan.stdin.write(base64.b64encode(SERVER_SOURCE.encode()) + b"\n")
            line = await asyncio.wait_for(self._chan.stdout.readline(), self.start_timeout_s)
            hello = json.loads(line) if line else {}
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            hello = {"error": repr(e)}
        if not hello.get("ready"):
            err = await self._chan_stderr()
            hint = ""
            if "python3" in err and ("not found" in err or "No such file" in err):
                hint = " (the image has no python3: the sandbox needs it; build from the base image)"
            raise SandboxError(f"{self.backend} sandbox {self.id}: exec server did not start{hint}: "
                               f"{hello.get('error', '')} {err.strip()[-2000:]}", self.id)
        self.shell = "/bin/bash"  # the base image and Debian hosts have it; fall back below
        res = await self._request({"op": "exec", "argv": ["/bin/sh", "-c", "command -v bash"],
                                   "timeout": 10}, 20)
        if not res or res.get("exit_code") != 0:
            self.shell = "/bin/sh"

    async def _chan_stderr(self) -> str:
        if self._chan is None:
            return ""
        await _kill_proc(self._chan)
        try:
            return (await asyncio.wait_for(self._chan.stderr.read(1 << 16), 5)).decode(errors="replace")
        except Exception:
            return ""

    async def _request(self, req: dict, timeout: float) -> dict | None:
        """One request/answer with the server; None when the channel broke or hung."""
        assert self._lock is not None
        async with self._lock:
            if self._chan is None or self._chan.returncode is not None:
                return None
            self._req += 1
            req["id"] = self._req
            try:
                self._chan.stdin.write(json.dumps(req).encode() + b"\n")
                await asyncio.wait_for(self._chan.stdin.drain(), timeout)
                for _ in range(MAX_STRAY_LINES):
                    line = await asyncio.wait_for(self._chan.stdout.readline(), timeout)
                    if not line:
                        return None
                    resp = json.loads(line)
                    if isinstance(resp, dict) and resp.get("id") == req["id"]:
                        return resp
                raise ValueError(f"{MAX_STRAY_LINES} answers to no request")
            except (OSError, asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError) as e:
                log.warning("sandbox %s: exec channel broke: %r", self.id, e)
                await _kill_proc(self._chan)
                return None

    async def _recover(self, what: str) -> None:
        """The server is gone. If the sandbox still runs, restart it; else SandboxError."""
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed", self.id)
        await _kill_proc(self._chan)
        if not await self._alive():
            raise SandboxError(f"{self.backend} sandbox {self.id} died during {what}", self.id)
        self.taint(f"its exec server died during {what}")
        log.warning("sandbox %s: exec server died during %s; restarting it", self.id, what)
        try:
            await self._start_server()
        except SandboxError as e:
            raise SandboxError(f"sandbox {self.id}: cannot restart after {what}: {e}", self.id) from None

    def _check_open(self) -> None:
        if not self.started or self.closed:
            raise SandboxError(f"sandbox {self.id} is {'closed' if self.closed else 'not started'}", self.id)

    # ---- API -----------------------------------------------------------------------
    async def exec(self, cmd: str | Sequence[str], timeout: float | None = None, *,
                   stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
                   cwd: str | None = None, output_limit: int | None = None,
                   as_server: bool = False, sweep: bool = False) -> ExecResult:
        """Run `cmd` (a shell string for bash, or an argv list) in the workdir. Processes it
        leaves behind are killed when it returns. Never raises for a failing command;
        raises SandboxError when the sandbox itself is broken. as_server: with the servers'
        identity (it can signal them; for the host's own cleanup, never for the agent's code).
        sweep: kill every other process in the sandbox (the servers of other sessions too) before
        and after the command (a reset: nothing may write after the wipe)."""
        self._check_open()
        timeout = float(timeout if timeout is not None else self.limits.timeout_s)
        argv = [self.shell, "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if isinstance(stdin, str):
            stdin = stdin.encode()
        req = {"op": "exec", "argv": argv, "timeout": timeout, "cwd": cwd or WORKDIR,
               "limit": output_limit or self.limits.output_bytes, "env": dict(env or {}),
               "stdin": base64.b64encode(stdin).decode() if stdin else "", "as_server": as_server,
               "sweep": sweep}
        t0 = time.perf_counter()
        resp = await self._request(req, timeout + 30)
        if resp is None:
            await self._recover(f"exec of {shlex.join(argv)[:200]!r}")
            return ExecResult(137, "", "sandbox: the command killed the sandbox's exec server "
                              "(it was restarted)\n", duration_s=time.perf_counter() - t0)
        if "error" in resp:
            raise SandboxError(f"sandbox {self.id}: exec server error: {resp['error']}", self.id)
        out = base64.b64decode(resp["stdout"])
        return ExecResult(resp["exit_code"], out.decode(errors="replace"),
                          base64.b64decode(resp["stderr"]).decode(errors="replace"),
                          resp["timed_out"], resp["truncated"], time.perf_counter() - t0, out)

    async def ping(self) -> None:
        """Check the sandbox answers; SandboxError if it is dead (restarts a killed server)."""
        self._check_open()
        if await self._request({"op": "ping"}, 20) is None:
            await self._recover("ping")

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file (parents created); relative paths are under the workdir.
        Raises SandboxFileRefused (an OSError) when the sandbox refuses (read-only path, full disk)."""
        self._check_open()
        if isinstance(data, str):
            data = data.encode()
        resp = await self._request({"op": "write", "path": self._abs(path), "mode": mode,
                                    "data": base64.b64encode(data).decode()}, 60)
        if resp is None:
            await self._recover("write_file")
            raise SandboxError(f"sandbox {self.id}: exec server died during write_file", self.id)
        if "error" in resp:
            raise _file_error(SandboxFileRefused, self.id, f"sandbox write_file({path!r}): {resp['error']}")

    async def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """Read a file from the sandbox. SandboxFileMissing/SandboxFileRefused (FileNotFoundError/
        OSError) if it cannot be read, SandboxFileTooLarge (ValueError) if larger than max_bytes."""
        self._check_open()
        resp = await self._request({"op": "read", "path": self._abs(path), "limit": max_bytes}, 60)
        if resp is None:
            await self._recover("read_file")
            raise SandboxError(f"sandbox {self.id}: exec server died during read_file", self.id)
        if "error" in resp:
            err = resp["error"]
            cls = SandboxFileMissing if err.startswith("FileNotFoundError") else SandboxFileRefused
            raise _file_error(cls, self.id, f"sandbox read_file({path!r}): {err}")
        if resp["truncated"]:
            raise _file_error(SandboxFileTooLarge, self.id,
                              f"sandbox read_file({path!r}): larger than max_bytes={max_bytes}")
        return base64.b64decode(resp["data"])

    async def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, stderr: int | None = asyncio.subprocess.PIPE
                    ) -> asyncio.subprocess.Process:
        """Start a long-running process inside (e.g. an MCP stdio tool server) and return an
        asyncio Process whose stdin/stdout are its pipes. It survives `exec` calls and is
        killed by `close()`."""
        self._check_open()
        proc = await asyncio.create_subprocess_exec(
            *self.spawn_argv(argv, env, cwd), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=stderr, start_new_session=True)
        self._spawned.append(proc)
        return proc

    async def reset(self) -> bool:
        """Make the sandbox as new for the next trajectory: kill every process in it (the exec
        server too), prove from its cgroup that none is left (`_kill_all`: a process whose main
        thread exited, a double-forked daemon, a renamed one all count), start a fresh exec
        server, then wipe every writable place (/work, /tmp, /dev/shm, /dev/mqueue) and the SysV
        IPC objects and check they are empty. False if any step fails, or the sandbox is
        tainted: then discard it."""
        self._check_open()
        for proc in self._spawned:
            await _kill_proc(proc)
        self._spawned.clear()
        if self.tainted:
            return False
        await _kill_proc(self._chan)
        self._chan = None
        if not await self._kill_all():
            log.info("sandbox %s: cannot prove that no process of its last user is left; not reused", self.id)
            return False
        try:
            await self._start_server()
        except SandboxError as e:
            log.warning("sandbox %s: exec server did not restart after the reset's kill: %s", self.id, e)
            return False
        res = await self.exec(["python3", "-I", "-c", RESET_SCRIPT], timeout=60, sweep=True)
        if res.exit_code != 0:
            log.warning("sandbox %s: reset failed: %s", self.id, res.stderr[-500:])
        return res.exit_code == 0 and not self.tainted

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else f"{WORKDIR}/{path}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {'closed' if self.closed else 'open'}>"


async def _kill_proc(proc: asyncio.subprocess.Process | None) -> None:
    if proc is None or proc.returncode is not None:
        return
    try:
        proc.kill()
    except ProcessLookupError:
        return
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except asyncio.TimeoutError:
        log.warning("process %s did not exit after SIGKILL", proc.pid)


# ---- sync use ----------------------------------------------------------------------
# not anyio's blocking portal: a context manager, where this loop must outlive every call (the process's life)
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def run_sync(coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
    """Run a coroutine on the sandboxes' background event loop (a daemon thread), so sync
    code, and code already inside another event loop, can use sandboxes."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="agentrl-sandboxes", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop).result(timeout)


class SyncSandbox:
    """Blocking wrapper: `with create_sync(backend="local") as sb: sb.exec("ls")`."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.id, self.backend, self.workdir = sandbox.id, sandbox.backend, sandbox.workdir

    def exec(self, cmd, timeout: float | None = None, **kw) -> ExecResult:
        budget = (timeout or self.sandbox.limits.timeout_s) + 120
        return run_sync(self.sandbox.exec(cmd, timeout, **kw), budget)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        run_sync(self.sandbox.write_file(path, data, mode), 180)

    def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        return run_sync(self.sandbox.read_file(path, max_bytes), 180)

    def reset(self) -> bool:
        return run_sync(self.sandbox.reset(), 180)

    def spawn_argv(self, argv, env=None, cwd=None, server=False) -> list[str]:
        return self.sandbox.spawn_argv(argv, env, cwd, server)

    def close(self) -> None:
        run_sync(self.sandbox.close(), 180)

    def __enter__(self) -> "SyncSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all_at_exit() -> None:
    for sb in list(_live.values()):
        try:
            sb._destroy_sync()
        except Exception as e:
            log.warning("sandbox %s: cleanup at exit failed: %s", sb.id, e)
    _live.clear()


def state_root() -> Path:
    """Where sandboxes keep their host-side state (local sandboxes' roots, uid claims; the
    staging and bridge folders sit next to it)."""
    return Path(os.environ.get("AGENTRL_SANDBOX_DIR", "/tmp/agentrl-sandboxes"))
