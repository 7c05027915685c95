"""The local backend run by a non-root user: the README's threat-model column "local, not root",
row by row, on the real backend (bubblewrap without cgroups or a tmpfs: rlimits instead).

The suite runs as root, where the local backend takes cgroups and a tmpfs, so no other test runs
it unprivileged. Each test here runs one `check_*` function below in a child process of uid 65533
(`setpriv`; the current user where the suite is not root). The child's HOME and
AGENTRL_SANDBOX_DIR (the sandboxes' state dirs; its parent gets the staged sources, so both must
be writable by that uid) lie in a folder of that uid. What the README says holds is asserted. What
it says is NOT held for the sandbox (total memory, CPU; pids shared with the uid) is measured
and asserted as the README words it, so a change either way shows. Where an attack of
test_sandbox_security.py, test_attacks.py or tests/tools/test_tool_attacks.py covers a row, the
check calls it with backend "local"; the other attacks of the first two ("contained, root or not")
run as that uid too (`test_attack_contained_unprivileged`).

Skipped, with the reason, where bubblewrap cannot run unprivileged or the uid cannot run this
interpreter with this venv's packages. When the uid cannot execute the venv's interpreter (a
pyenv under /root, mode 0700), the child uses a venv of the uid's own over the system python of
the same version that loads this venv's site-packages, as a non-root user's install would."""
from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from agentrl.sandboxes import SandboxLimits
from agentrl.sandboxes.base import inodes_for
from agentrl.sandboxes.local_backend import HOST_ETC, OWN_ETC, local_available
from sbx_helpers import SMALL, run, sandbox

HERE = Path(__file__).resolve()
TESTS_TOOLS = HERE.parents[1] / "tools"
REPO = HERE.parents[2]
# who the checks run as when the suite is root: a uid no other test uses (local sandboxes made
# as root run as 65534 on the host, and would count against the pids rlimit measured here)
UID = 65533
SKIP_RC = 77                # a check's exit code for pytest.skip
CHECK_TIMEOUT_S = 300
# the limits the README's numbers were measured with
README_LIMITS = SandboxLimits(memory_mb=256, workdir_mb=128, tmp_mb=64, timeout_s=30)
MiB = 1 << 20


# ---- the parent: one child process of the uid per check ----------------------------------------

@dataclasses.dataclass
class NonRoot:
    prefix: list[str]  # setpriv ... (empty when the suite is not root)
    python: str        # an interpreter the uid can execute, with this venv's packages
    home: Path         # the uid's folder: HOME, AGENTRL_SANDBOX_DIR=home/sandboxes, the stages
    uid: int

    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin", "LANG": "C.UTF-8",
                "HOME": str(self.home), "TMPDIR": str(self.home),
                "AGENTRL_SANDBOX_DIR": str(self.home / "sandboxes"), "PYTHONDONTWRITEBYTECODE": "1",
                "AGENTRL_TEST_HOST_PREFIX": sys.prefix,
                "PYTHONPATH": str(REPO / "tests")}  # the tests' shared helpers (machine_lock)

    def argv(self, python: str, *args: str) -> list[str]:
        # through sh: setpriv execs its command before it drops every capability, so a path the
        # uid cannot search would still run; sh's exec is the uid's own
        return [*self.prefix, "/bin/sh", "-c", 'exec "$0" "$@"', python, *args]

    def run(self, check: str, *args: str, timeout: float = CHECK_TIMEOUT_S) -> None:
        """Run `check` (a function of this module) as the uid; its skip, failure or output is this test's."""
        proc = subprocess.Popen(self.argv(self.python, str(HERE), check, *args), cwd=self.home, env=self.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"{check} as uid {self.uid}: no answer in {timeout:.0f} s\n{out[-8000:]}", pytrace=False)
        print(out, end="")
        if proc.returncode == SKIP_RC:
            pytest.skip(out.strip().splitlines()[-1])
        if proc.returncode != 0:
            pytest.fail(f"{check} as uid {self.uid} (exit {proc.returncode}):\n{out[-8000:]}", pytrace=False)


PROBE = "import agentrl.sandboxes, mcp, pytest"


def _cannot_run(nr: NonRoot, python: str) -> str:
    """'' when the uid runs `python` with this venv's packages, else why not."""
    r = subprocess.run(nr.argv(python, "-c", PROBE), cwd=nr.home, env=nr.env(), capture_output=True,
                       text=True, timeout=120)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def _interpreter(nr: NonRoot) -> str:
    why = _cannot_run(nr, sys.executable)
    if not why:
        return sys.executable
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    sites = list(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]))
    tried = []
    for base in (f"/usr/bin/python{ver}", f"/usr/local/bin/python{ver}"):
        if not os.path.exists(base):
            continue
        shim = nr.home / "venv"
        shutil.rmtree(shim, ignore_errors=True)
        r = subprocess.run(nr.argv(base, "-m", "venv", "--without-pip", str(shim)), cwd=nr.home, env=nr.env(),
                           capture_output=True, text=True, timeout=120)
        site_dir = shim / "lib" / f"python{ver}" / "site-packages"
        if r.returncode != 0 or not site_dir.is_dir():
            tried.append(f"{base}: cannot make a venv ({r.stderr.strip()[-200:]})")
            continue
        (site_dir / "agentrl-host-venv.pth").write_text(
            "import site; " + "; ".join(f"site.addsitedir({s!r})" for s in sites) + "\n")
        shim_why = _cannot_run(nr, str(shim / "bin" / "python"))
        if not shim_why:
            return str(shim / "bin" / "python")
        tried.append(f"{base} with this venv's site-packages: {shim_why}")
    pytest.skip(f"uid {nr.uid} cannot run this venv's interpreter {sys.executable} ({why}), and no system "
                f"python{ver} it can run loads the venv's packages ({'; '.join(tried) or 'none found'})")


@pytest.fixture(scope="module")
def nonroot():
    ok, why = local_available()
    if not ok:
        pytest.skip(f"local backend unavailable: {why}")
    root = os.geteuid() == 0
    if root and shutil.which("setpriv") is None:
        pytest.skip(f"setpriv (util-linux) not found: cannot run the checks as uid {UID}")
    prefix = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"] if root else []
    # in /tmp: pytest's tmp_path lies under a 0700 folder of root
    home = Path(tempfile.mkdtemp(prefix="agentrl-nonroot-"))
    try:
        if root:
            os.chown(home, UID, UID)
        nr = NonRoot(prefix, sys.executable, home, UID if root else os.geteuid())
        r = subprocess.run([*prefix, "bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"],
                           cwd=home, env=nr.env(), capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            pytest.skip(f"bubblewrap cannot run as uid {nr.uid} here (unprivileged user namespaces "
                        f"disabled?): {r.stderr.strip()[-300:]}")
        nr.python = _interpreter(nr)
        yield nr
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---- the child: the checks, run as the uid ------------------------------------------------------

def _attack(module: str, name: str) -> None:
    """Call an attack of test_sandbox_security.py, test_attacks.py or tests/tools/test_tool_attacks.py
    with backend "local", its other fixtures stood in for (tmp_path: a fresh folder of the uid)."""
    if str(TESTS_TOOLS) not in sys.path:
        sys.path.append(str(TESTS_TOOLS))
    fn = getattr(importlib.import_module(module), name)
    kw, patch, loop = {}, pytest.MonkeyPatch(), None
    for param in inspect.signature(fn).parameters:
        if param == "backend":
            kw[param] = "local"
        elif param == "tmp_path":
            kw[param] = Path(tempfile.mkdtemp(dir=os.environ["HOME"]))
        elif param == "monkeypatch":
            kw[param] = patch
        elif param == "arun":
            loop = asyncio.new_event_loop()
            kw[param] = loop.run_until_complete
        else:
            raise TypeError(f"{module}.{name}: no stand-in for its fixture {param!r}")
    try:
        fn(**kw)
    finally:
        patch.undo()
        if loop is not None:
            loop.close()


async def _rlimits(sb) -> dict[str, tuple[str, str]]:
    """{'Max address space': (soft, hard), ...} of a process in the sandbox."""
    out = (await sb.exec("cat /proc/self/limits")).stdout.splitlines()[1:]
    rows = [line[:26].strip() for line in out], [line[26:].split() for line in out]
    return {name: (vals[0], vals[1]) for name, vals in zip(*rows)}


# servers' identity ------------------------------------------------------------------------------

PTRACE_PARENT = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
r = libc.ptrace(16, os.getppid(), None, None)  # PTRACE_ATTACH
print("attached" if r == 0 else "refused " + os.strerror(ctypes.get_errno()))
"""


def check_exec_server_not_dumpable() -> None:
    _attack("test_attacks", "test_servers_memory_and_pipes_out_of_reach")    # /proc/PID/mem, fd, environ
    _attack("test_sandbox_security", "test_killing_the_exec_server_is_survivable")  # killed: tainted

    async def go():
        async with sandbox("local") as sb:
            r = await sb.exec("ps -o uid= -p $PPID; id -u")
            server_uid, agent_uid = r.stdout.split()
            assert server_uid == agent_uid == "1000", ("README: the servers run as the agent's uid", r)
            r = await sb.exec(["python3", "-c", PTRACE_PARENT])
            assert r.stdout.startswith("refused"), r
    run(go())


def check_tool_server_not_dumpable_kill_is_agent_fault() -> None:
    _attack("test_tool_attacks", "test_tool_server_cannot_be_forged_or_hijacked")  # fd/mem, planted modules
    _attack("test_tool_attacks", "test_killing_the_tool_server_is_the_agents_fault")


def check_exec_server_out_of_the_agents_pid_namespace() -> None:
    sys.path.append(str(TESTS_TOOLS))
    from test_tool_attacks import AttackEnv, _bash

    loop = asyncio.new_event_loop()
    arun = loop.run_until_complete
    env = AttackEnv(sandbox="local")
    try:
        arun(env.areset(options={"prompt": "hi"}))
        sb = env.sandbox_instance
        server_pid = sb._chan.pid
        server_ns = arun(sb.exec("readlink /proc/self/ns/pid")).stdout.strip()
        obs, *_ = _bash(arun, env, "readlink /proc/self/ns/pid; ps -eo args")
        seen = obs[0]["content"]
        assert seen.split("\n", 1)[0] != server_ns, (server_ns, seen)  # the bash tool's is another
        assert "agentrl-sandbox-server" not in seen, seen  # the exec server's command line
        print(f"pid namespaces: exec server {server_ns}, bash tool {seen.split(chr(10), 1)[0]}")
        _bash(arun, env, "kill -9 -1")  # what the agent's uid can reach in its namespace
        r = arun(sb.exec("echo exec-server-alive"))
        assert r.stdout == "exec-server-alive\n" and sb._chan.pid == server_pid, r  # never restarted
    finally:
        arun(env.aclose())
        loop.close()


# memory, pids, CPU ------------------------------------------------------------------------------

def check_address_space_rlimit_per_process() -> None:
    async def go():
        async with sandbox("local", limits=README_LIMITS) as sb:
            assert (await _rlimits(sb))["Max address space"] == (str(256 * MiB),) * 2
            r = await sb.exec(["python3", "-c", "x = bytearray(300 << 20); print('ALLOCATED')"])
            assert "ALLOCATED" not in r.stdout and "MemoryError" in r.stderr, r
    run(go())
    _attack("test_sandbox_security", "test_memory_bomb_contained")


HOLD = r"""
import os, sys
n, mb = int(sys.argv[1]), int(sys.argv[2])
held_r, held_w = os.pipe()
go_r, go_w = os.pipe()
kids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        try:
            x = bytearray(mb * 1000 * 1000)
            x[::4096] = b"1" * len(range(0, len(x), 4096))  # every page touched: resident
            os.write(held_w, b"1")
        except MemoryError:
            os.write(held_w, b"0")
        os.read(go_r, 1)
        os._exit(0)
    kids.append(pid)
held = sum(os.read(held_r, 1) == b"1" for _ in kids)  # all of them at once: none has exited
rss = 0
for pid in kids:
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            rss += int(line.split()[1]) * 1024
os.write(go_w, b"x" * n)
for pid in kids:
    os.waitpid(pid, 0)
print(held, rss)
"""


def check_memory_not_held_for_the_sandbox() -> None:
    async def go():
        async with sandbox("local", limits=README_LIMITS) as sb:
            r = await sb.exec(["python3", "-c", HOLD, "4", "240"])
            held, rss = map(int, r.stdout.split())
            print(f"memory: 4 processes held {rss / 1e6:.0f} MB at once under memory_mb=256")
            assert held == 4 and rss >= 4 * 230e6, (
                "README (local, not root): memory 'not held for the sandbox: an address-space rlimit per "
                "process, so `pids` processes may hold `pids x memory_mb` (measured: 4 processes held "
                f"240 MB each under a 256 MB cap)'; now {held} of 4 held, {rss / 1e6:.0f} MB resident", r)
    run(go())


def check_pids_rlimit() -> None:
    async def go():
        async with sandbox("local") as sb:
            assert (await _rlimits(sb))["Max processes"] == (str(SMALL.pids),) * 2
    run(go())
    _attack("test_sandbox_security", "test_fork_bomb_contained")


FORKS = r"""
import os, signal
kids = []
try:
    while len(kids) < 500:
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
except OSError:
    pass  # EAGAIN: RLIMIT_NPROC
for pid in kids:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(len(kids))
"""


def check_pids_not_shared_with_the_uid() -> None:
    """RLIMIT_NPROC is set inside the spawn's own user namespace, where the kernel counts it: the
    user's other processes on the host take none of the sandbox's."""
    extra = 8

    async def go():
        async with sandbox("local", limits=dataclasses.replace(SMALL, pids=32)) as sb:
            alone = int((await sb.exec(["python3", "-c", FORKS])).stdout)
            host = [subprocess.Popen(["sleep", "60"]) for _ in range(extra)]  # the uid's, outside the sandbox
            try:
                shared = int((await sb.exec(["python3", "-c", FORKS])).stdout)
            finally:
                for p in host:
                    p.kill()
                    p.wait()
            print(f"pids: the sandbox forked {alone} processes, {shared} with {extra} more of its uid on the host")
            assert 0 < alone < 32 and shared == alone, (
                "docs/security.md (local, not root): 'pids an RLIMIT_NPROC counted in the sandbox's own user "
                f"namespace'; {extra} processes of the uid on the host took {alone - shared} of the sandbox's")
    run(go())


# Forks all it can (at most 400) and says how many; every process of it dies within 40 s whatever happens
BOMB = r"""
import os, signal
signal.alarm(40)
n = 0
try:
    while n < 400:
        if os.fork() == 0:
            signal.pause()
            os._exit(0)
        n += 1
except OSError:
    pass
print(n, flush=True)
signal.pause()
"""
BOMB_SPAWNS = 3  # per sandbox: its exec server's commands and tool servers are spawns of their own
NPROC = 400  # the check's RLIMIT_NPROC: low, so that the shares are below pids and a bomb of the user's would show


def _host_forks(n: int = 16) -> int:
    """How many processes this (host) process starts, one after the other, of `n`."""
    done = 0
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        done += 1
    return done


def check_fork_bombs_leave_the_other_sandboxes_and_the_host_processes() -> None:
    """Processes are a share like the kernel objects: under an RLIMIT_NPROC of 400, a sandbox forking all
    it can from three spawns holds at most its share of the user's processes (the limit less the host's
    quarter, cut by the ledger), counted in its holder's user namespace, and another sandbox and the host
    (this process) can still start processes; with every sandbox of the pool bombing, the host still can.
    Before, RLIMIT_NPROC held per spawn only (pids each): three spawns of one sandbox took the user's 400,
    and the other sandboxes and the host got EAGAIN."""
    import resource
    from agentrl.sandboxes import SandboxPool
    from agentrl.sandboxes import local_backend as lb
    if not lb.nproc_per_userns():
        pytest.skip(f"Linux {os.uname().release} < 5.14 counts RLIMIT_NPROC per user, not per user namespace")
    resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))
    n = 3

    async def bomb(sb) -> list[int]:
        out = []
        for _ in range(BOMB_SPAWNS):
            proc = await sb.spawn(["python3", "-c", BOMB], cwd="/")
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            out.append(int(line) if line.strip() else 0)  # no line: the spawn could not start a process
        return out

    async def go():
        async with SandboxPool("local", warm=0, max_active=n, limits=SMALL) as pool:
            sbs = [await pool.get() for _ in range(n)]
            if sbs[0].holder is None:
                pytest.skip("no holder namespace per sandbox here: processes are capped per spawn only")
            share = (NPROC - NPROC // lb.HOST_PART) * pool._reservation.part
            assert all(sb.nproc == min(SMALL.pids, int(share)) < SMALL.pids for sb in sbs), ([sb.nproc for sb in sbs], share)
            first = await bomb(sbs[0])
            r = await sbs[1].exec(["python3", "-c", "import os\nfor _ in range(16):\n    pid = os.fork()\n"
                                   "    if pid == 0: os._exit(0)\n    os.waitpid(pid, 0)\nprint('forked')"])
            host = _host_forks()
            rest = [await bomb(sb) for sb in sbs[1:]]
            host_all = _host_forks()
            for sb in sbs:
                await pool.release(sb)
        print(f"processes: share {sbs[0].nproc} per sandbox (RLIMIT_NPROC {NPROC}, pids {SMALL.pids}); the first "
              f"sandbox's bomb held {first} from {BOMB_SPAWNS} spawns; then a second sandbox: {r.stdout.strip()!r}, "
              f"the host forked {host}/16; all {n} bombing ({rest}): the host forked {host_all}/16")
        assert sbs[0].nproc - 12 <= sum(first) < sbs[0].nproc, first  # its whole share, no more
        assert r.stdout == "forked\n" and host == 16, (r, host)
        assert all(sum(b) < sbs[0].nproc for b in rest) and host_all == 16, (rest, host_all)
    run(go(), timeout=200)


# Takes all it can of the user's kernel counts the kernel charges up the user-namespace hierarchy
# (inotify instances, fanotify groups, POSIX message-queue bytes) and says how much, then holds it.
KERNEL_HOG = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("cur", ctypes.c_long),
                ("pad", ctypes.c_long * 4)]
ino = fan = mq = 0
while ino < 4096 and libc.inotify_init() >= 0:
    ino += 1
while fan < 4096 and libc.fanotify_init(0x200, 0) >= 0:  # FAN_REPORT_FID: what a user may, unprivileged
    fan += 1
tag = os.urandom(4).hex()
while mq < 4096:
    attr = Attr(0, 1, 1024, 0)  # about 1 KiB of the user's RLIMIT_MSGQUEUE each
    if rt.mq_open(b"/q%s-%d" % (tag.encode(), mq), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(attr)) < 0:
        break
    mq += 1
print(ino, fan, mq, flush=True)
time.sleep(300)
"""
HOG_SPAWNS = 2  # per sandbox: its share holds for all its processes together


def _host_can() -> tuple[bool, bool, bool]:
    """Whether this (host) process can still make an inotify instance, a fanotify group, a message queue."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    ino, fan = libc.inotify_init(), libc.fanotify_init(0x200, 0)
    q = rt.mq_open(b"/agentrl-host-%d" % os.getpid(), os.O_CREAT | os.O_RDWR, 0o600, None)
    for fd in (ino, fan):
        if fd >= 0:
            os.close(fd)
    if q >= 0:
        rt.mq_unlink(b"/agentrl-host-%d" % os.getpid())
        os.close(q)
    return ino >= 0, fan >= 0, q >= 0


def check_a_full_pool_leaves_the_host_its_kernel_objects_and_refuses_one_more() -> None:
    """A pool's max_active sandboxes, each taking all it can of the user's inotify instances, fanotify
    groups and message queues in two spawns, each get their whole share, and the host (this process)
    can still make each; one more sandbox is refused (the ledger holds no share for it), and after
    the pool one can make each."""
    from agentrl.sandboxes import SandboxError, SandboxPool, create
    from agentrl.sandboxes import local_backend as lb
    from agentrl.sandboxes.base import default_max_active
    n_max = 8  # the kernel's default max_user_instances (128) cut in eighths was exhausted by eight
    floor = default_max_active("local")  # the shares are cut for this many at least: the rest held elsewhere
    rest = lb.reserve_slots(floor - n_max, "the rest of the default") if floor > n_max else None

    async def hog(sb) -> list[tuple[int, int, int]]:
        out = []
        for _ in range(HOG_SPAWNS):
            proc = await sb.spawn(["python3", "-c", KERNEL_HOG], cwd="/")
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            out.append(tuple(int(x) for x in line.split()))
        return out

    async def go():
        async with SandboxPool("local", warm=0, max_active=n_max, limits=SMALL) as pool:
            sbs = [await pool.get() for _ in range(n_max)]
            held = [await hog(sb) for sb in sbs]
            shares = [dict(zip(sb.quota[:-1:2], map(int, sb.quota[1:-1:2]))) for sb in sbs]
            host = _host_can()
            # the pool holds every share there is (max_active = the machine's default): one more is refused
            with pytest.raises(SandboxError) as refused:
                await create("local", limits=SMALL)
            for sb in sbs:
                await pool.release(sb)
        async with create("local", limits=SMALL) as extra:  # the pool's shares are free again
            r = await extra.exec(["python3", "-c", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                                  "print(libc.inotify_init() >= 0, libc.fanotify_init(0x200, 0) >= 0)"])
        ino = [sum(h[0] for h in hs) for hs in held]
        fan = [sum(h[1] for h in hs) for hs in held]
        mq = [sum(h[2] for h in hs) for hs in held]
        print(f"kernel objects of {n_max} sandboxes at their share (inotify {shares[0]['max_inotify_instances']}, "
              f"fanotify {shares[0].get('max_fanotify_groups')}): inotify {ino}, fanotify {fan}, 1-KiB queues {mq}; "
              f"the host can (inotify, fanotify, mq): {host}; one more sandbox: {refused.value}; after the pool "
              f"(inotify, fanotify): {r.stdout.split()}")
        assert f"a pool of max_active {n_max}" in str(refused.value), refused.value
        assert ino == [s["max_inotify_instances"] for s in shares], (ino, shares)  # none starved by the others
        assert min(mq) >= 16 and max(mq) - min(mq) <= 2, mq  # each its whole share (64 KiB, less overhead)
        assert host[0] and host[2], ("the host lost its inotify instances or message queues to the sandboxes", host)
        assert r.stdout.split()[0] == "True", r
        if fan[0]:  # fanotify_init allowed here (Linux >= 5.13)
            assert fan == [s["max_fanotify_groups"] for s in shares] and host[1], (fan, shares, host)
            assert r.stdout.split()[1] == "True", r
    try:
        run(go(), timeout=240)
    finally:
        lb.release_slots(rest and rest.path)


SPIN = "import time\nt0 = time.monotonic()\nwhile time.process_time() < 0.6: pass\nprint(time.monotonic() - t0)"


def check_cpu_not_capped() -> None:
    async def go():
        async with sandbox("local", limits=dataclasses.replace(SMALL, cpus=0.2)) as sb:
            wall = float((await sb.exec(["python3", "-c", SPIN])).stdout)
            print(f"cpu: 0.6 s of CPU in {wall:.2f} s of wall time under cpus=0.2")
            # held, 0.2 of a core would take at least 3 s
            assert wall < 2.4, ("README (local, not root): 'CPU not capped'; a spinning process under "
                                f"cpus=0.2 took {wall:.2f} s for 0.6 s of CPU, as if capped")
    run(go())


# /work + /tmp size ------------------------------------------------------------------------------

def check_per_file_size_cap() -> None:
    limits = dataclasses.replace(SMALL, workdir_mb=8, tmp_mb=4)  # a 12 MiB cap

    async def go():
        async with sandbox("local", limits=limits) as sb:
            assert (await _rlimits(sb))["Max file size"] == (str(12 * MiB),) * 2
            for where in ("/work", "/tmp"):
                r = await sb.exec(f"head -c {12 * MiB} /dev/zero > {where}/at-cap && echo at-cap; rm {where}/at-cap; "
                                  f"head -c {12 * MiB + 1} /dev/zero > {where}/past-cap && echo past-cap; "
                                  f"rm -f {where}/past-cap")  # (one 12 MiB tmpfs holds both: room for the next)
                assert r.stdout == "at-cap\n", (where, r)
            with pytest.raises(OSError):  # the exec server is under the rlimit too
                await sb.write_file("/work/big", b"x" * (12 * MiB + 1))
    run(go())
    _attack("test_sandbox_security", "test_workdir_size_capped")


COUNT_FILES = r"""
import itertools, os, sys
for i in itertools.count():
    try:
        open("/work/n%d" % i, "w").close()
    except OSError as e:
        print(i, e.strerror)
        break
"""


def check_total_disk_capped() -> None:
    async def go():
        async with sandbox("local", limits=README_LIMITS) as sb:  # one 192 MiB tmpfs for /work and /tmp
            r = await sb.exec(f"stat -f -c %T /work /tmp; for f in /work/a /work/b /tmp/c; do "
                              f"head -c {70 * MiB} /dev/zero > $f 2>/dev/null || echo failed $f; done; "
                              f"du -cm /work /tmp | tail -1")
            fs, total = r.stdout.split("\n")[:2], int(r.stdout.split()[-2])  # file systems, MiB written
            print(f"disk: {total} MiB written in 70 MiB files under a 192 MiB cap, on {fs}")
            assert fs == ["tmpfs", "tmpfs"] and "failed /tmp/c" in r.stdout and total <= 192, r
            await sb.exec("rm -f /work/a /work/b /tmp/c")
            r = await sb.exec(["python3", "-c", COUNT_FILES], timeout=120)
            made, why = r.stdout.split(maxsplit=1)
            assert int(made) < inodes_for(192) and "No space left" in why, r  # the file count is capped too
    run(go())


# /dev/shm ---------------------------------------------------------------------------------------

FILL_SHM = r"""
import os
st = os.statvfs("/dev/shm")
written = 0
chunk = b"x" * (1 << 20)
with open("/dev/shm/fill", "wb", buffering=0) as f:  # one file, under the 192 MiB per-file cap
    try:
        while written < 256 << 20:
            written += f.write(chunk)
    except OSError as e:
        print(e.strerror)
print(st.f_blocks * st.f_frsize, written)
"""


def check_dev_shm_capped() -> None:
    from agentrl.sandboxes.local_backend import _bwrap_has_size
    if not _bwrap_has_size():
        pytest.skip("bubblewrap < 0.8 (no --size): /dev/shm is not capped; the README says bwrap >= 0.8")

    async def go():
        async with sandbox("local", limits=README_LIMITS) as sb:
            r = await sb.exec(["python3", "-c", FILL_SHM])
            size, written = map(int, r.stdout.split()[-2:])
            print(f"/dev/shm: {written / MiB:.0f} of {size / MiB:.0f} MiB written")
            assert size == 64 * MiB and size - MiB <= written <= size and "No space" in r.stdout, (
                "README (local, not root): /dev/shm 'as root (measured with bwrap 0.8: 64 MiB written, "
                "then ENOSPC)'", r)
            r = await sb.exec("touch /dev/agentrl-probe || echo refused")
            assert r.stdout == "refused\n", r  # /dev read-only
        async with sandbox("local", limits=dataclasses.replace(README_LIMITS, tmp_mb=8)) as sb:
            r = await sb.exec("stat -f -c '%b %S' /dev/shm")
            blocks, bsize = map(int, r.stdout.split())
            assert blocks * bsize == 8 * MiB, r  # min(tmp_mb, 64) MiB
    run(go())


# what of the host shows -------------------------------------------------------------------------

def check_only_staged_sources() -> None:
    _attack("test_attacks", "test_nothing_of_the_grader_or_host_is_visible")  # no .jsonl, no venv, no repo
    from agentrl.tools.spec import tool_sandbox_options
    tasks = REPO / "envs" / "code_env" / "data" / "tasks.jsonl"
    host_prefix = os.environ["AGENTRL_TEST_HOST_PREFIX"]  # the suite's venv, not the child's
    mounts, env = tool_sandbox_options()

    async def go():
        async with sandbox("local", mounts=mounts, env=env) as sb:
            r = await sb.exec(f"ls -d {tasks} {REPO} {host_prefix} 2>/dev/null; cat /proc/self/mountinfo; "
                              "find /opt/agentrl -type f ! -name '*.py'")
            for host_path in (str(tasks), str(REPO), host_prefix):
                assert host_path not in r.stdout, (host_path, r.stdout)
            assert not [line for line in r.stdout.splitlines() if line.startswith("/opt/agentrl/")], r.stdout
    run(go())


def check_no_host_etc() -> None:
    _attack("test_attacks", "test_local_etc_is_the_sandbox_own")

    async def go():
        async with sandbox("local") as sb:
            inside = set((await sb.exec("ls -A /etc")).stdout.split())
            assert inside <= set(HOST_ETC) | set(OWN_ETC), sorted(inside - set(HOST_ETC) - set(OWN_ETC))
            assert set(os.listdir("/etc")) - inside  # the host's /etc has more
    run(go())


TOP_MOUNTS = {"", "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "work", "tmp",
              "agentrl"}  # the bridge dir (sandboxes/bridge.py)


def check_only_host_usr_shows() -> None:
    _attack("test_sandbox_security", "test_writes_outside_workdir_fail")
    _attack("test_sandbox_security", "test_host_files_and_env_hidden")

    async def go():
        async with sandbox("local") as sb:
            lines = (await sb.exec("cat /proc/self/mountinfo")).stdout.splitlines()
            points = {line.split()[4]: line.split()[5] for line in lines}
            for point in points:
                top, _, rest = point.lstrip("/").partition("/")
                assert top in TOP_MOUNTS or (top == "etc" and rest in (*HOST_ETC, *OWN_ETC)), (point, lines)
            assert points["/usr"].startswith("ro"), points["/usr"]
            r = await sb.exec("ls -d /home /root /var /run /srv /opt /mnt /media /boot 2>/dev/null; "
                              "touch /usr/agentrl-probe || echo refused")
            assert r.stdout == "refused\n", r
    run(go())


def check_host_path_names_shown() -> None:
    from agentrl.tools.spec import tool_sandbox_options
    mounts, env = tool_sandbox_options()

    async def go():
        async with sandbox("local", mounts=mounts, env=env) as sb:
            state = f"{os.environ['AGENTRL_SANDBOX_DIR']}/{sb.id}"
            mountinfo = (await sb.exec("cat /proc/self/mountinfo")).stdout
            pid1 = (await sb.exec("tr '\\0' ' ' < /proc/1/cmdline")).stdout
            print(f"host paths: pid 1 is {pid1.split()[0]!r}; mountinfo shows {state}")
            readme = ("docs/security.md (local, not root): no tmpfs, so host paths show in mountinfo: the "
                      "sandbox's state dir ($AGENTRL_SANDBOX_DIR) and the staging folders; bubblewrap's pid 1 gets "
                      "them through a file descriptor, its command line names none")
            assert state in mountinfo and "bwrap" in pid1.split()[0], (readme, mountinfo, pid1)
            assert state not in pid1 and os.environ["AGENTRL_SANDBOX_DIR"] not in pid1, (readme, pid1)
            for stage in mounts:
                assert stage in mountinfo, (readme, stage, mountinfo)
            for host_path in (str(REPO), os.environ["AGENTRL_TEST_HOST_PREFIX"]):
                assert host_path not in mountinfo + pid1, (host_path, mountinfo, pid1)
    run(go())


# ---- the tests ----------------------------------------------------------------------------------

def test_exec_server_not_dumpable(nonroot):
    """servers' identity: the exec server runs as the agent's uid, but its memory, pipes and environ are
    closed and ptrace is refused; killing it restarts it and taints the sandbox."""
    nonroot.run("check_exec_server_not_dumpable")


@pytest.mark.e2e
def test_tool_server_not_dumpable_kill_is_agent_fault(nonroot):
    """servers' identity: the agent cannot forge the tool server's answers or rewrite it; killing it is
    the agent's fault (reward 0), and the sandbox is tainted."""
    nonroot.run("check_tool_server_not_dumpable_kill_is_agent_fault")


@pytest.mark.e2e
def test_exec_server_out_of_the_agents_pid_namespace(nonroot):
    """servers' identity: from the bash tool, the exec server is in another pid namespace: not listed,
    and `kill -9 -1` does not reach it."""
    nonroot.run("check_exec_server_out_of_the_agents_pid_namespace")


def test_address_space_rlimit_per_process(nonroot):
    """memory: each process gets an address-space rlimit of max(memory_mb, 256) MiB; one cannot allocate past it."""
    nonroot.run("check_address_space_rlimit_per_process")


def test_memory_not_held_for_the_sandbox(nonroot):
    """memory, NOT held (as the README measures it): 4 processes hold 240 MB each at once under a 256 MB cap."""
    nonroot.run("check_memory_not_held_for_the_sandbox")


def test_pids_rlimit(nonroot):
    """pids: RLIMIT_NPROC is `pids`; a fork bomb is contained."""
    nonroot.run("check_pids_rlimit")


def test_pids_not_shared_with_the_uid(nonroot):
    """pids, held per sandbox: the uid's processes on the host do not count against the sandbox's RLIMIT_NPROC."""
    nonroot.run("check_pids_not_shared_with_the_uid")


def test_fork_bombs_leave_the_other_sandboxes_and_the_host_processes(nonroot):
    nonroot.run("check_fork_bombs_leave_the_other_sandboxes_and_the_host_processes")


@pytest.mark.slow
def test_a_full_pool_leaves_the_host_its_kernel_objects_and_refuses_one_more(nonroot):
    """inotify, fanotify, message queues, held per sandbox by a share of the user's count cut for the
    pool's max_active: eight sandboxes each at their share leave the host and a ninth their own."""
    nonroot.run("check_a_full_pool_leaves_the_host_its_kernel_objects_and_refuses_one_more")


def test_cpu_not_capped(nonroot):
    """CPU, NOT held: a process under cpus=0.2 gets 0.6 s of CPU well within 3 s."""
    nonroot.run("check_cpu_not_capped")


def test_per_file_size_cap(nonroot):
    """/work + /tmp: RLIMIT_FSIZE is workdir_mb + tmp_mb, for commands and the exec server alike."""
    nonroot.run("check_per_file_size_cap")


def test_total_disk_capped(nonroot):
    """/work + /tmp: one tmpfs of workdir_mb + tmp_mb in the sandbox's own mount namespace (a holder
    process keeps it): 3 files of 70 MiB do not fit 192 MiB, and the file count is capped too."""
    nonroot.run("check_total_disk_capped")


def test_dev_shm_capped(nonroot):
    """/dev/shm: a tmpfs of min(tmp_mb, 64) MiB (64 MiB fit, then ENOSPC), and /dev read-only."""
    nonroot.run("check_dev_shm_capped")


@pytest.mark.slow
def test_only_staged_sources(nonroot):
    """what of the host shows: staged tool sources and the mcp closure only; no task data, repo or venv."""
    nonroot.run("check_only_staged_sources")


def test_no_host_etc(nonroot):
    """what of the host shows: /etc is the sandbox's own plus HOST_ETC."""
    nonroot.run("check_no_host_etc")


def test_only_host_usr_shows(nonroot):
    """what of the host shows: only /usr and the libraries (read-only), /etc's few files, /proc, /dev,
    /work, /tmp are mounted; host files and env stay hidden, writes outside /work and /tmp fail."""
    nonroot.run("check_only_host_usr_shows")


def test_host_path_names_shown(nonroot):
    """host paths' names (documented leak): mountinfo shows the state dir and the staging folders (pid 1's
    command line no longer does), and not the repo or the venv."""
    nonroot.run("check_host_path_names_shown")


# ---- the other attacks ("contained, root or not"), as the uid -----------------------------------

# what a check above already runs
IN_A_CHECK = {"test_servers_memory_and_pipes_out_of_reach", "test_killing_the_exec_server_is_survivable",
              "test_memory_bomb_contained", "test_fork_bomb_contained", "test_workdir_size_capped",
              "test_nothing_of_the_grader_or_host_is_visible", "test_local_etc_is_the_sandbox_own",
              "test_writes_outside_workdir_fail", "test_host_files_and_env_hidden"}
SLOW = {"test_gigabytes_of_output_truncated"}


def _attacks() -> list:
    out = []
    for module in ("test_sandbox_security", "test_attacks"):
        tree = ast.parse((HERE.parent / f"{module}.py").read_text())
        for fn in tree.body:
            if (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and fn.name not in IN_A_CHECK
                    and any(a.arg == "backend" for a in fn.args.args)):
                out.append(pytest.param(module, fn.name, id=f"{module}::{fn.name}",
                                        marks=[pytest.mark.e2e] if fn.name in SLOW else []))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("module,name", _attacks())
def test_attack_contained_unprivileged(nonroot, module, name):
    """An attack the README says is contained on both backends "root or not" holds as the uid."""
    nonroot.run("_attack", module, name)


if __name__ == "__main__":  # a child: run one check as this uid
    import traceback
    from agentrl.sandboxes.local_backend import cgroup_mode
    check, *args = sys.argv[1:]
    try:
        assert os.geteuid() != 0 and cgroup_mode() is None, "the checks must run unprivileged (rlimits, no cgroups)"
        globals()[check](*args)
    except pytest.skip.Exception as e:
        print(f"SKIP: {e.msg}")
        sys.exit(SKIP_RC)
    except BaseException:  # noqa: BLE001 - reported to the parent whole
        traceback.print_exc()
        sys.exit(1)
