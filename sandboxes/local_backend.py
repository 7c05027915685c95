"""Local backend (no Docker engine): bubblewrap namespaces on the host.

Each sandbox is a state directory `$AGENTRL_SANDBOX_DIR/<id>` (default
/tmp/agentrl-sandboxes) holding `owner.json` and `fs/{work,tmp}`, bound at /work and /tmp
inside. Every process (the exec server, `spawn`s) is started as:

    sh -c 'join cgroups' -> [not root: nsenter the holder, unshare --user (quota)]
       -> unshare --ipc (SysV IPC capped: base.ipc_sysctls) -> prlimit (rlimits)
       -> setpriv (drop to a host uid of its own, root only)
       -> bwrap (new user/pid/net/uts/cgroup namespaces, read-only /usr /etc /proc/sys ...,
                 private /proc /dev, clean env, no capabilities, uid 1000 inside,
                 the seccomp filter of seccomp.py)

so `spawn_argv()` is a self-contained command line. The root is the host's /usr and
/bin... mounted read-only, and an /etc of the sandbox's own (users, hostname, hosts written
per sandbox; of the host's /etc only `HOST_ETC`, what programs need to run). Nothing else
of the host shows: no /home, /root, /tmp, /var.

Limits: run as root, the workdir and /tmp share a size-capped tmpfs and the sandbox gets
memory / pids / cpu cgroups (v1 or v2). Unprivileged, the limits fall back to rlimits
(address space, RLIMIT_NPROC, per-file size), which is weaker: prefer docker. Each spawn then
runs in a user namespace of its own that holds its per-user kernel objects (`share()`; processes
and message queues: the sandbox's share, `nproc_share`, `msgqueue_share`, from the ledger of
`reserve_slots`),
and the workdir and /tmp are still one tmpfs capped in size and file count: a holder process
(`_start_holder`) keeps a user and mount namespace of the sandbox's own where it is mounted
(root of its own user namespace may), and every spawn enters it (nsenter) before the rest.
When the owner process dies, bwrap dies with it (--die-with-parent) and the kernel kills
the rest of the sandbox's pid namespace; `reap()` then removes the state dir, the tmpfs
and the cgroups.
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import time
from fractions import Fraction
from pathlib import Path
from typing import Mapping, Sequence

from . import bridge, seccomp
from .base import (OWNER_PID, OWNER_START, RUN_ID, SANDBOX_UID, WORKDIR, Sandbox, SandboxError,
                   cap_stderr, default_max_active, inodes_for, ipc_sysctls, kill_cgroup, log, owner_alive,
                   process_start_time, reap_once, state_root)

HOST_UID = 65534  # what sandboxed processes are on the host when we are not given one of their own
# As root, each sandbox runs as a host uid of its own from this range (claimed in `$state_root/.uids`):
# the kernel counts inotify instances and watches, and other per-user objects, per host uid, so one
# sandbox exhausting its share leaves the others theirs. Far above any real user or subuid range.
UID_BASE, UID_SLOTS = 1 << 30, 1 << 16
CGROOT = Path("/sys/fs/cgroup")
# Not as root, every sandbox runs as the user, and the kernel charges per-user objects (inotify
# instances and watches, RLIMIT_NPROC, RLIMIT_MSGQUEUE) to it up the user-namespace hierarchy, so a
# user namespace alone does not separate them. But each namespace level checks its own limit:
# the sandbox's holder keeps a user namespace whose root sets its inotify limits to a share of the user's
# (/proc/sys/user/max_inotify_*: the share of the sandbox as a whole), and in it each spawn runs in a
# user namespace of its own (`unshare --user --map-root-user`) with the same share, and then
# starts bubblewrap, whose nested namespace holds the agent without capabilities in the outer one
# (so it cannot raise them); the rlimits are set inside, so they are counted per namespace too.
# RLIMIT_NPROC and RLIMIT_MSGQUEUE (Linux >= 5.14: ucounts) are bounded at a namespace's parent level by
# the rlimit of the process that made the namespace: each spawn's namespace is made under the sandbox's
# share, so the holder's level (all the sandbox's processes and queues) holds at most that.
# The kernel also charges every level to the user's own count (fs.inotify.max_user_instances, 128;
# RLIMIT_MSGQUEUE, 800 KiB; RLIMIT_NPROC), which no namespace can raise: the shares of all the sandboxes
# that can be live at once must fit in it, with room left for the host. So the user's limit, less the
# host's part (1/HOST_PART of it), is cut in shares through a ledger (`reserve_slots`, a file per
# reservation in the state dir, every process of the user's): a pool reserves its max_active sandboxes'
# shares when it is made, from what the earlier ones left, and a sandbox made outside a pool its own.
MSGQUEUE_BYTES = 64 << 10  # POSIX message queues of a sandbox at most (RLIMIT_MSGQUEUE; less: `msgqueue_share`)
HOST_PART = 4  # of each per-user kernel count the sandboxes share, what is kept for the host: 1/4
# writes `share()`'s pairs (/proc/sys/user/NAME VALUE ... --) into the current user namespace's limits
_SHARE = ('while [ "$1" != -- ]; do [ ! -e "/proc/sys/user/$1" ] || echo "$2" > "/proc/sys/user/$1" || exit 125; '
          'shift 2; done; shift; ')
_QUOTA = _SHARE + 'exec "$@"'

# The holder (not as root): in a user and mount namespace of its own, the sandbox's tmpfs on its fs dir
# (only that namespace sees it), /work and /tmp in it, and that namespace's inotify limits set to the
# sandbox's share, which every spawn (nested in it) counts against: the share holds for the sandbox as
# a whole, not per process tree. Then it waits, holding both namespaces open.
_HOLD = ('mount -t tmpfs -o "size=$1,nr_inodes=$2,mode=0700" sandbox "$3" && mkdir -m 0700 "$3/work" "$3/tmp" '
         '|| exit 125; shift 3; ' + _SHARE + 'echo ready; exec sleep infinity')
HOLDER_START_S = 30.0
# SysV IPC (base.ipc_sysctls): each spawn gets an IPC namespace of its own from `unshare --ipc`, whose
# caps this sets before bubblewrap starts in it (bubblewrap's own would have the kernel's nearly unbounded
# defaults). Not as root the namespace is the quota namespace's, whose root the agent's uid maps to: the
# kernel lets that uid write these sysctls, so bubblewrap mounts /proc/sys read-only.
_IPC_CAPS = 'while [ "$1" != -- ]; do echo "$2" > "/proc/sys/$1" || exit 125; shift 2; done; shift; exec "$@"'


def local_available() -> tuple[bool, str]:
    """(True, how) if bubblewrap can make a sandbox here, else (False, why)."""
    missing = [t for t in ("bwrap", "prlimit", "python3") if shutil.which(t) is None]
    if missing:
        return False, (f"{', '.join(missing)} not found: apt-get install bubblewrap util-linux python3")
    return True, "bubblewrap (cgroups)" if cgroup_mode() and os.geteuid() == 0 else "bubblewrap (rlimits)"


def _host_limit(path: str, default: int) -> int:
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return default


def _ledger_dir() -> Path:
    return state_root() / ".slots"


@dataclasses.dataclass(frozen=True)
class Reservation:
    """Shares of the user's kernel counts held in the ledger (`reserve_slots`): `n` sandboxes that
    can be live at once (a pool's max_active, or one sandbox made outside a pool), each with `part`
    of every count the sandboxes share (the user's limit less the host's part)."""
    path: Path
    n: int
    part: Fraction


def _live_reservations(d: Path) -> list[dict]:
    """The live entries of the ledger `d` (every process's); a dead owner's is removed."""
    out = []
    for f in sorted(d.iterdir()) if d.is_dir() else ():
        if f.name.startswith("."):
            continue
        try:
            e = json.loads(f.read_text())
            e["n"], e["part"] = int(e["n"]), Fraction(e["part"])
            pid = int(e["pid"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
        if owner_alive(pid, e.get("start")):
            out.append(e)
        else:
            f.unlink(missing_ok=True)
    return out


def reserve_slots(n: int, what: str) -> Reservation:
    """Reserve the shares of `n` sandboxes that can be live at once (`what`: "a pool of max_active 8",
    "a sandbox outside a pool") in the ledger of this state dir, shared by every process using it:
    each gets 1/max(all reserved + n, `default_max_active("local")`) of every per-user count (less
    the host's part), or what the earlier reservations left, whichever is less; so the live
    sandboxes' shares together never pass the user's limits, however many pools are made. Raises
    SandboxError, naming the live reservations, where they left nothing. `release_slots` ends it
    (so does its owner process's death)."""
    n = int(n)
    if n < 1:
        raise SandboxError(f"local sandbox shares: {what} reserves {n} sandboxes; at least 1")
    d = _ledger_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(d / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ledger is read and written by one process at a time
        live = _live_reservations(d)
        left = 1 - sum((e["n"] * e["part"] for e in live), Fraction(0))
        part = min(Fraction(1, max(sum(e["n"] for e in live) + n, default_max_active("local"))), left / n)
        if live and (part <= 0 or part * _smallest_usable() < 1):
            held = "; ".join(f"{e.get('what', 'a pool')} (pid {e['pid']}: {e['n']} x {e['part']})" for e in live)
            raise SandboxError(
                f"local sandboxes, not root: no share of the user's kernel counts (processes, inotify, fanotify, "
                f"message queues; the host keeps 1/{HOST_PART}) is left for {what}: the live ones hold "
                f"{'all' if left <= 0 else f'{1 - left} (what is left would give a share under one)'}: {held}. "
                f"Close one, give the pools a smaller max_active (--sandbox-max-active) or use the docker "
                f"backend (docs/security.md).")
        path = d / f"{OWNER_PID}-{os.urandom(6).hex()}"
        path.write_text(json.dumps({"pid": OWNER_PID, "start": OWNER_START, "n": n, "part": str(part),
                                    "what": what}))
    return Reservation(path, n, part)


def release_slots(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def needs_shares() -> bool:
    """Whether local sandboxes are cut shares of the user's kernel counts: not as root (as root each
    runs as a host uid of its own, which the kernel counts apart)."""
    return os.geteuid() != 0


def reserved() -> list[dict]:
    """The live reservations of this state dir (every process's): {"pid", "n", "part", "what", ...}."""
    return _live_reservations(_ledger_dir())


def default_part() -> Fraction:
    """A sandbox's part when `default_max_active("local")` sandboxes share the counts."""
    return Fraction(1, default_max_active("local"))


def _cut(limit: int, part: Fraction, what: str) -> int:
    """A sandbox's `part` of a per-user `limit` less the host's 1/HOST_PART; at least 1 (said
    once, loudly, where that no longer fits)."""
    got = int((limit - limit // HOST_PART) * part)
    if got < 1:
        _warn_too_many(what, limit, part)
    return max(got, 1)


@functools.cache
def _warn_too_many(what: str, limit: int, part: Fraction) -> None:
    log.warning("local sandbox, not root: a sandbox's share is %s of the user's %s of %d (less the host's part), "
                "under one: the sandboxes can exhaust it for each other and for the host. Lower max_active, raise "
                "the limit (root, once) or use the docker backend (docs/security.md).", part, what, limit)


FEW_PROCESSES = 16  # a sandbox's servers take a few of its processes each: below this, say so


@functools.cache
def _warn_few_processes(n: int, limit: int) -> None:
    log.warning("local sandbox, not root: a sandbox's share of the user's %d processes (RLIMIT_NPROC) is %d, for "
                "its exec server, tool servers and the agent's commands together. Lower max_active, raise ulimit -u "
                "or use the docker backend (docs/security.md).", limit, n)


def _user_counts() -> dict[str, int]:
    """The per-user limits cut into shares in the sandboxes' user namespaces (/proc/sys/user names;
    the fanotify ones exist from Linux 5.13: a missing one is skipped where it is written)."""
    return {"max_inotify_instances": _host_limit("/proc/sys/fs/inotify/max_user_instances", 128),
            "max_inotify_watches": _host_limit("/proc/sys/fs/inotify/max_user_watches", 8192),
            "max_fanotify_groups": _host_limit("/proc/sys/user/max_fanotify_groups", 128),
            "max_fanotify_marks": _host_limit("/proc/sys/user/max_fanotify_marks", 8192)}


def _user_processes() -> int:
    """How many processes (threads included) the user may have: RLIMIT_NPROC, or the machine's
    kernel.pid_max where that is less (the pids of every user; also where there is no rlimit)."""
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    pid_max = _host_limit("/proc/sys/kernel/pid_max", 32768)
    return pid_max if soft == resource.RLIM_INFINITY else min(soft, pid_max)


def _smallest_usable() -> int:
    counts = [*_user_counts().values(), _user_processes()]
    return min(c - c // HOST_PART for c in counts)


def share(part: Fraction | None = None) -> list[str]:
    """A sandbox's `part` (default `default_part()`) of the user's inotify instances and watches
    and fanotify groups and marks (not as root), as /proc/sys/user NAME VALUE pairs, then "--".
    Each is counted per user up the user-namespace hierarchy, and the user's own count bounds them all."""
    part = default_part() if part is None else part
    return [x for name, lim in _user_counts().items() for x in (name, str(_cut(lim, part, name)))] + ["--"]


def msgqueue_share(part: Fraction | None = None) -> int:
    """A sandbox's POSIX message-queue bytes (all its spawns together) at `part`: MSGQUEUE_BYTES,
    or less where that part of the user's RLIMIT_MSGQUEUE (800 KiB by default, which bounds every
    level below it too), less the host's part, is less."""
    part = default_part() if part is None else part
    soft = resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0]
    if soft == resource.RLIM_INFINITY:
        return MSGQUEUE_BYTES
    return min(MSGQUEUE_BYTES, _cut(soft, part, "RLIMIT_MSGQUEUE"))


def nproc_share(part: Fraction | None = None) -> int:
    """A sandbox's processes (all its spawns together, threads included) at `part` of what the
    user may have (`_user_processes`), less the host's part."""
    return _cut(_user_processes(), default_part() if part is None else part, "processes (RLIMIT_NPROC)")


def nproc_per_userns() -> bool:
    """Linux >= 5.14 counts RLIMIT_NPROC per user namespace (ucounts): a namespace made by a process
    whose RLIMIT_NPROC is N holds at most N processes of its creator's uid in it and below it.
    Before, RLIMIT_NPROC was the user's count everywhere: a sandbox-wide cap cannot be set."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def userns_quota_argv(pairs: Sequence[str] | None = None) -> list[str]:
    """The prefix that runs a spawn in a user namespace of its own with a share of the user's
    inotify limits (`pairs`, default `share()`; not as root); [] where the kernel refuses (said
    once, loudly)."""
    argv = ["unshare", "--user", "--map-root-user", "/bin/sh", "-c", _QUOTA, "sh", *(pairs or share())]
    return argv if _userns_quota_works(tuple(argv)) else []


@functools.cache
def _userns_quota_works(argv: tuple[str, ...]) -> bool:
    try:
        r = subprocess.run([*argv, "true"], capture_output=True, timeout=30)
        ok, why = r.returncode == 0, r.stderr.decode(errors="replace").strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, str(e)
    if not ok:
        log.warning("local sandbox, not root: no user namespace of its own per sandbox (%s): the sandboxes share "
                    "the user's inotify instances, watches, processes and message queues, so one can exhaust "
                    "them for the others. Run as root or use the docker backend (docs/security.md).", why)
    return ok


def _start_holder(fs: Path, size_mb: int, pairs: Sequence[str]) -> subprocess.Popen | None:
    """Not as root: the process holding the sandbox's user and mount namespace, with a tmpfs of
    `size_mb` (and `inodes_for` files) at `fs` in it and the limits `pairs` (`share()`); None
    (said once, loudly) where it cannot."""
    argv = ["unshare", "--user", "--map-root-user", "--mount", "/bin/sh", "-c", _HOLD, "sh",
            str(size_mb << 20), str(inodes_for(size_mb)), str(fs), *pairs]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as e:
        _warn_no_holder(str(e))
        return None
    ready, _, _ = select.select([proc.stdout], [], [], HOLDER_START_S)
    if ready and proc.stdout.readline() == b"ready\n":
        return proc
    proc.kill()
    _, err = proc.communicate()
    _warn_no_holder(err.decode(errors="replace").strip()[-500:] or "no answer")
    return None


@functools.cache
def _warn_no_holder(why: str) -> None:
    log.warning("local sandbox, not root: no mount namespace of its own (%s): /work and /tmp are host folders "
                "with only a per-file size cap, and pids hold per spawn, not for the sandbox. Run as root or use the "
                "docker backend (docs/security.md).", why)


def _stop_holder(pid: int | None, start: int | None) -> None:
    """Kill a sandbox's holder (its tmpfs goes with its last process), if it is still that process."""
    if pid and start is not None and process_start_time(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def cgroup_mode() -> str | None:
    if os.geteuid() != 0:
        return None
    if (CGROOT / "cgroup.controllers").exists():
        return "v2"
    if (CGROOT / "memory" / "memory.limit_in_bytes").exists():
        return "v1"
    return None


def _cgroup_dirs(sid: str) -> dict[str, Path]:
    mode = cgroup_mode()
    if mode == "v2":
        return {"unified": CGROOT / "agentrl" / sid}
    if mode == "v1":
        return {c: CGROOT / c / "agentrl" / sid for c in ("memory", "pids", "cpu")
                if (CGROOT / c).is_dir()}
    return {}


def _uid_claims() -> Path:
    return state_root() / ".uids"


def claim_host_uid(sid: str) -> int:
    """A host uid no other live sandbox has: an exclusive claim file naming the sandbox."""
    claims = _uid_claims()
    claims.mkdir(parents=True, exist_ok=True, mode=0o700)
    for _ in range(256):
        n = int.from_bytes(os.urandom(4), "little") % UID_SLOTS
        try:
            fd = os.open(claims / str(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue
        os.write(fd, json.dumps({"id": sid, "pid": OWNER_PID, "start": OWNER_START}).encode())
        os.close(fd)
        return UID_BASE + n
    raise SandboxError(f"no free sandbox uid in {claims} (256 tries): remove stale claims with `agentrl sandbox reap`")


def release_host_uid(uid: int | None) -> None:
    if uid is not None and UID_BASE <= uid < UID_BASE + UID_SLOTS:
        try:
            (_uid_claims() / str(uid - UID_BASE)).unlink()
        except FileNotFoundError:
            pass


def release_orphan_claims() -> None:
    """Free the uids claimed by processes that are gone (their sandboxes are reaped with them)."""
    claims = _uid_claims()
    if not claims.is_dir():
        return
    for claim in claims.iterdir():
        try:
            owner = json.loads(claim.read_text())
            pid, start = int(owner["pid"]), owner.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            if time.time() - claim.stat().st_mtime > 60:  # half-written long ago
                claim.unlink(missing_ok=True)
            continue
        if not owner_alive(pid, start):
            claim.unlink(missing_ok=True)


def _write(path: Path, value: str) -> None:
    path.write_text(value)


# What of the host's /etc a sandbox sees (read-only): what programs need to run (the dynamic
# linker's cache, alternatives, python's and ssl's configuration, time zone, name-service
# switch); nothing that describes the host (hostname, users, daemons' configuration).
HOST_ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf",
            "protocols", "services", "host.conf", "gai.conf", "ssl", "ca-certificates", "ca-certificates.conf",
            "mime.types", "magic", "inputrc", "bash.bashrc", "profile", "terminfo", "python3", "python3.11",
            "python3.12", "python3.13")
# /etc files written for every sandbox (the agent's uid has a name; the host's users do not show)
OWN_ETC = {
    "passwd": (f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{WORKDIR}:/bin/bash\n"
               "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
    "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1 localhost\n127.0.1.1 sandbox\n::1 localhost ip6-localhost ip6-loopback\n",
}


@functools.cache
def _bwrap_has_size() -> bool:
    """bubblewrap >= 0.8 sizes a tmpfs (--size)."""
    r = subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True, text=True, timeout=30)
    return "--size" in r.stdout + r.stderr


def _rootfs_args(etc: Path) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr", "--dir", "/etc"]
    for name in HOST_ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for name in OWN_ETC:
        args += ["--ro-bind", str(etc / name), f"/etc/{name}"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        p = Path(d)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            args += ["--ro-bind", d, d]
    return args


class LocalSandbox(Sandbox):
    backend = "local"

    def __init__(self, image: str | None = None, **kw):
        super().__init__(**kw)
        if image:
            log.info("local sandbox: image %r ignored (the local backend uses the host's /usr)", image)
        ok, why = local_available()
        if not ok:
            raise SandboxError(f"local sandbox backend unavailable: {why}")
        self.root = state_root() / self.id
        self.fs = self.root / "fs"
        self.cgroups: dict[str, Path] = {}
        self.seccomp_bpf: Path | None = None  # the filter's program, written at setup
        self.bwrap_args: Path | None = None  # bubblewrap's fixed arguments (NUL-separated), written at setup
        self.host_uid = HOST_UID
        self.mounted = False
        self.holder: subprocess.Popen | None = None  # not as root: holds the namespaces of its tmpfs
        self.bridge_dir: Path | None = None  # mounted at bridge.INSIDE (see bridge.py)
        # not as root: the sandbox's share of the user's kernel counts (`share()` pairs, message-queue
        # bytes, processes), its pool's `reservation` (set by the pool before start) or one of its own
        self.reservation: Reservation | None = None
        self._own_reservation: Path | None = None
        self.quota: list[str] = []
        self.msgqueue = MSGQUEUE_BYTES
        self.nproc: int | None = None  # processes of the whole sandbox (set with a holder: its user namespace), <= pids

    async def _boot(self) -> None:
        reap_once("local", reap)
        await asyncio.to_thread(self._setup)

    def _setup(self) -> None:
        lim = self.limits
        root = os.geteuid() == 0
        self.root.mkdir(parents=True, mode=0o711)
        if root:
            self.host_uid = claim_host_uid(self.id)
        (self.root / "owner.json").write_text(json.dumps(
            {"pid": OWNER_PID, "start": OWNER_START, "run_id": RUN_ID, "id": self.id, "host_uid": self.host_uid}))
        self.fs.mkdir(mode=0o700)
        if not root:
            if self.reservation is None:  # made outside a pool: a reservation of its own, for its life
                self.reservation = reserve_slots(1, "a sandbox outside a pool")
                self._own_reservation = self.reservation.path
            part = self.reservation.part
            self.quota, self.msgqueue = share(part), msgqueue_share(part)
            self.holder = _start_holder(self.fs, lim.workdir_mb + lim.tmp_mb, self.quota)
            if self.holder is not None and nproc_per_userns():
                self.nproc = min(lim.pids, nproc_share(part))
                if self.nproc < FEW_PROCESSES:
                    _warn_few_processes(self.nproc, _user_processes())
            if self.holder is not None:
                (self.root / "owner.json").write_text(json.dumps(
                    {"pid": OWNER_PID, "start": OWNER_START, "run_id": RUN_ID, "id": self.id,
                     "host_uid": self.host_uid, "holder": self.holder.pid,
                     "holder_start": process_start_time(self.holder.pid)}))
        if seccomp.supported():
            self.seccomp_bpf = self.root / "seccomp.bpf"
            self.seccomp_bpf.write_bytes(seccomp.program())
        else:
            log.warning("local sandbox: no seccomp filter for %s (x86_64 and aarch64 only)", seccomp.machine())
        if root:
            # one tmpfs holds /work, /tmp and the sandbox's own /etc files: mounts from it show only
            # paths inside it ("/work", "/etc/passwd") in the sandbox's /proc/self/mountinfo
            size = (lim.workdir_mb + lim.tmp_mb) << 20
            subprocess.run(["mount", "-t", "tmpfs", "-o",
                            f"size={size},nr_inodes={inodes_for(lim.workdir_mb + lim.tmp_mb)},mode=0700,"
                            f"uid={self.host_uid},gid={self.host_uid},nosuid,nodev",
                            "sandbox", str(self.fs)], check=True, capture_output=True, timeout=30)
            self.mounted = True
        etc = (self.fs if root else self.root) / "etc"
        etc.mkdir(mode=0o755)
        for name, text in OWN_ETC.items():
            (etc / name).write_text(text)
            (etc / name).chmod(0o644)
        for sub in ("work", "tmp", "shm") if root else () if self.holder else ("work", "tmp"):
            (self.fs / sub).mkdir(mode=0o700)
            if root:
                os.chown(self.fs / sub, self.host_uid, self.host_uid)
        if root:
            self._stage_mounts()
        # the fixed part of bubblewrap's command line reaches it through a file descriptor (--args), so
        # its pid 1's command line, which the agent can read, names no host path
        fixed = [*_rootfs_args(etc), "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev",
                 "--bind", str(self.fs / "work"), WORKDIR, "--bind", str(self.fs / "tmp"), "/tmp"]
        if self.network:
            fixed += ["--share-net", "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        if root:  # on the sandbox's tmpfs, whose size and file count are capped (bwrap cannot cap a count)
            fixed += ["--bind", str(self.fs / "shm"), "/dev/shm", "--remount-ro", "/dev"]
        else:
            fixed += [*(["--size", str(min(lim.tmp_mb, 64) << 20)] if _bwrap_has_size() else []),
                      "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        for host, inside in self.mounts.items():
            fixed += ["--ro-bind", host, inside]
        # in the tmpfs (as root), like /etc's files: its mount shows as "/bridge", not a host path
        self.bridge_dir = bridge.make_dir((self.fs if root else self.root) / "bridge")
        fixed += ["--ro-bind", str(self.bridge_dir), bridge.INSIDE]
        self.bwrap_args = self.root / "bwrap.args"
        self.bwrap_args.write_bytes(b"".join(a.encode() + b"\0" for a in fixed))
        self.cgroups = _cgroup_dirs(self.id)
        try:
            for ctl, d in self.cgroups.items():
                if ctl == "unified":
                    parent = d.parent
                    parent.mkdir(exist_ok=True)
                    _write(CGROOT / "cgroup.subtree_control", "+memory +pids +cpu")
                    _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
                    d.mkdir()
                    _write(d / "memory.max", str(lim.memory_mb << 20))
                    if (d / "memory.swap.max").exists():
                        _write(d / "memory.swap.max", "0")
                    _write(d / "pids.max", str(lim.pids))
                    _write(d / "cpu.max", f"{int(lim.cpus * 100000)} 100000")
                else:
                    d.mkdir(parents=True)
                    if ctl == "memory":
                        _write(d / "memory.limit_in_bytes", str(lim.memory_mb << 20))
                        if (d / "memory.memsw.limit_in_bytes").exists():
                            _write(d / "memory.memsw.limit_in_bytes", str(lim.memory_mb << 20))
                    elif ctl == "pids":
                        _write(d / "pids.max", str(lim.pids))
                    elif ctl == "cpu":
                        _write(d / "cpu.cfs_period_us", "100000")
                        _write(d / "cpu.cfs_quota_us", str(int(lim.cpus * 100000)))
        except OSError as e:
            log.warning("local sandbox %s: cgroups unavailable (%s); using rlimits", self.id, e)
            _remove_cgroups(self.cgroups)
            self.cgroups = {}

    def _stage_mounts(self) -> None:
        """As root, bwrap runs as uid 65534, which may not reach a mount source (a root-only
        parent dir): bind each one read-only into the state dir first, so only the source's
        own permissions matter."""
        staged = {}
        for i, (host, inside) in enumerate(self.mounts.items()):
            target = self.root / "mnt" / str(i)
            target.parent.mkdir(exist_ok=True, mode=0o711)
            if Path(host).is_dir():
                target.mkdir()
            else:
                target.touch()
            for opts in (["--bind"], ["-o", "remount,bind,ro"]):
                r = subprocess.run(["mount", *opts, host, str(target)] if opts == ["--bind"]
                                   else ["mount", *opts, str(target)], capture_output=True, timeout=30)
                if r.returncode != 0:
                    raise SandboxError(f"local sandbox {self.id}: cannot mount {host}: "
                                       f"{r.stderr.decode().strip()}")
            staged[str(target)] = inside
        self.mounts = staged

    def spawn_argv(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                   cwd: str | None = None, server: bool = False) -> list[str]:
        lim = self.limits
        procs_files = [str(d / "cgroup.procs") for d in self.cgroups.values()]
        # Fail closed: a process that cannot join its cgroups (removed by a reap) must not run.
        # The seccomp program reaches bwrap as fd 3, opened by this script.
        bpf = self.seccomp_bpf
        join = ('for f in "$@"; do case $f in --) shift; break;; esac; echo $$ > "$f" || exit 125; shift; done; '
                'exec "$@" 4<"$BWRAP_ARGS"' + (' 3<"$SECCOMP_BPF"' if bpf else ''))
        rlimits = [f"--nofile={lim.nofile}", "--core=0", f"--msgqueue={self.msgqueue}",
                   f"--fsize={(lim.workdir_mb + lim.tmp_mb) << 20}"]
        if not self.cgroups:
            rlimits += [f"--as={max(lim.memory_mb, 256) << 20}", f"--nproc={self.nproc or lim.pids}"]
        demote, quota = [], []
        if os.geteuid() == 0:
            demote = ["setpriv", f"--reuid={self.host_uid}", f"--regid={self.host_uid}", "--clear-groups"]
        else:  # into the holder's namespaces (its tmpfs), then a user namespace of the spawn's own
            quota = userns_quota_argv(self.quota)
            if self.holder is not None:
                quota = ["nsenter", f"--target={self.holder.pid}", "--user", "--mount", "--preserve-credentials",
                         *quota]
            if quota:  # the kernel bounds the sandbox's queues and processes (all its spawns: the holder's
                # level) by the RLIMIT_MSGQUEUE and RLIMIT_NPROC of the process that makes the spawn's namespace
                quota = ["prlimit", f"--msgqueue={self.msgqueue}",
                         *([f"--nproc={self.nproc}"] if self.nproc else []), *quota]
        ipc = []  # where we may own the IPC namespace (root, or the quota namespace's root): capped
        if os.geteuid() == 0 or quota:
            caps = [x for k, v in ipc_sysctls(lim).items() for x in (k.replace(".", "/"), v)]
            ipc = ["unshare", "--ipc", "/bin/sh", "-c", _IPC_CAPS, "sh", *caps, "--"]
        # fd 4 (`bwrap_args`): the root file system, /proc, /dev, /work and /tmp, a /dev/shm of its own
        # (size-capped where bwrap can) and /dev read-only (the agent's uid owns bwrap's /dev, where
        # files would outlive a reset), the network if asked, the read-only mounts
        unshare = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                   *([] if ipc else ["--unshare-ipc"])]
        bwrap = [shutil.which("bwrap") or "bwrap", *unshare, "--die-with-parent", "--new-session",
                 "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
                 "--cap-drop", "ALL", *(["--seccomp", "3"] if bpf else []), "--args", "4",
                 "--remount-ro", "/", "--clearenv"]
        for k, v in {**self.env, **(env or {})}.items():
            bwrap += ["--setenv", k, v]
        bwrap += ["--chdir", cwd or WORKDIR, "--", *argv]
        return cap_stderr(["env", "-i", "PATH=/usr/bin:/bin:/usr/sbin:/sbin", f"BWRAP_ARGS={self.bwrap_args}",
                           *([f"SECCOMP_BPF={bpf}"] if bpf else []),
                           "/bin/sh", "-c", join, "sh", *procs_files, "--", *quota, *ipc, "prlimit", *rlimits, *demote,
                           *bwrap])

    async def _alive(self) -> bool:
        return self.fs.is_dir() and not self.closed and (self.holder is None or self.holder.poll() is None)

    async def _kill_all(self) -> bool:
        """Every process of the sandbox joined its cgroup before bwrap ran (the spawn's join
        script): empty it. Unprivileged (no cgroup) nothing proves it: the sandbox is not reused."""
        cgroup = self.cgroups.get("pids") or self.cgroups.get("unified")
        if cgroup is None:
            return False
        return await asyncio.to_thread(kill_cgroup, cgroup)

    async def _destroy(self) -> None:
        await asyncio.to_thread(self._destroy_sync)

    def _destroy_sync(self) -> None:
        cleanup_dir(self.root)
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()
        release_slots(self._own_reservation)  # its processes are gone


def _remove_cgroups(cgroups: dict[str, Path], timeout_s: float = 15.0) -> None:
    """Kill what runs in the cgroups and remove them, retrying until both hold. A spawn whose
    owner was killed mid-start may join its cgroup after a first look found it empty; the join
    fails once the cgroup is gone (the spawn then exits), or it joined before and makes rmdir
    fail with EBUSY, and the next round kills it. On a loaded machine dying takes a while."""
    left = dict(cgroups)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        for ctl, d in list(left.items()):
            try:
                pids = {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except FileNotFoundError:
                del left[ctl]
                continue
            except OSError:
                pids = set()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                d.rmdir()
                del left[ctl]
            except FileNotFoundError:
                del left[ctl]
            except OSError:
                pass  # still busy: processes dying or a late joiner
        if left:
            time.sleep(0.02)
    if left:
        log.warning("sandbox cgroups still busy after %.0f s of SIGKILL: %s", timeout_s,
                    ", ".join(str(d) for d in left.values()))


def cleanup_dir(root: Path) -> None:
    """Kill what runs in a local sandbox and remove its cgroups, tmpfs and state dir, and free its uid."""
    sid = root.name
    _remove_cgroups(_cgroup_dirs(sid))
    try:
        owner = json.loads((root / "owner.json").read_text())
    except (OSError, ValueError):
        owner = {}
    owner = owner if isinstance(owner, dict) else {}
    host_uid = owner.get("host_uid")
    _stop_holder(owner.get("holder"), owner.get("holder_start"))
    for mnt in _mounts_under(root):
        r = subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
        if r.returncode != 0:
            log.warning("local sandbox %s: umount %s failed: %s", sid, mnt, r.stderr.decode().strip())
    if _mounts_under(root):  # never rm -rf through a host bind mount
        log.warning("local sandbox %s: mounts remain under %s; not removing it", sid, root)
        return
    shutil.rmtree(root, ignore_errors=True)
    release_host_uid(host_uid)  # its processes are gone (the cgroup is): the uid is free


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root`, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root.resolve()) if root.exists() else str(root)
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        mnt = line.split()[4].replace("\\040", " ")
        if mnt == prefix or mnt.startswith(prefix + "/"):
            out.append(mnt)
    return sorted(set(out), key=len, reverse=True)


def list_dirs() -> list[tuple[Path, dict]]:
    out = []
    base = state_root()
    if not base.is_dir():
        return out
    for d in sorted(base.iterdir()):
        if d.name.startswith("."):  # .uids: the uid claims
            continue
        try:
            owner = json.loads((d / "owner.json").read_text())
        except (OSError, ValueError):
            owner = {}
        out.append((d, owner))
    return out


def reap(everything: bool = False) -> list[str]:
    """Remove local sandboxes whose owner process is gone (all but ours with everything)."""
    removed = []
    for d, owner in list_dirs():
        pid, start = owner.get("pid", 0), owner.get("start")
        if pid == OWNER_PID and start == OWNER_START:
            continue
        if not owner:
            # half-created: its owner may still be writing owner.json
            if time.time() - d.stat().st_mtime < 60 and not everything:
                continue
        elif not everything and owner_alive(pid, start):
            continue
        cleanup_dir(d)
        removed.append(d.name)
    release_orphan_claims()
    if removed:
        log.info("reaped %d local sandbox(es) of dead runs: %s", len(removed), ", ".join(removed))
    return removed
