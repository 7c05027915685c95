"""Attacks of a policy that wants reward without solving, on both backends: read what the
grader knows, hijack or forge the servers, leave state for the next trajectory, wedge the
host's reads. Each must fail, or be caught and leave the sandbox out of reuse."""
from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

import agentrl
from agentrl.sandboxes import RUN_ID, SandboxPool
from agentrl.sandboxes.base import WRITABLE
from agentrl.tools.spec import tool_sandbox_options
from sbx_helpers import SMALL, run, sandbox
from waiting import await_until


def _tool_sandbox(backend):
    mounts, env = tool_sandbox_options()
    return sandbox(backend, mounts=mounts, env=env)


FIND_SECRETS = r"""
import os
hits = []
for root, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/dev")]
    hits += [os.path.join(root, n) for n in files if n.endswith(".jsonl") or n in ("pyvenv.cfg", "daemon.json")]
print("\\n".join(hits))
"""
# what the project's venv holds and a sandbox's python has no business importing
VENV_ONLY = ("gymnasium", "agentrl.envs", "agentrl.rollout", "transformers", "torch")
SERVER_IMPORT = ("import sys, importlib.util as u; sys.path[:0] = ['/opt/agentrl', '/opt/agentrl-site']; "
                 f"import agentrl.tools.builtin_server, mcp; print([m for m in {VENV_ONLY!r} if u.find_spec(m)])")


def test_nothing_of_the_grader_or_host_is_visible(backend):
    repo = str(Path(agentrl.__file__).resolve().parents[1])
    host_name = socket.gethostname()
    host_nameservers = [line.split()[1] for line in Path("/etc/resolv.conf").read_text().splitlines()
                        if line.startswith("nameserver") and not line.split()[1].startswith("127.")]
    # (a host with only a local resolver, 127.0.0.53, has nothing to hide here)

    async def go():
        async with _tool_sandbox(backend) as sb:
            r = await sb.exec(["python3", "-c", FIND_SECRETS], timeout=60)
            assert r.exit_code == 0 and r.stdout.strip() == "", r.stdout[-2000:]
            # no task file, reference solution or host venv anywhere
            r = await sb.exec("grep -rl canonical_solution /opt /usr/lib/python3* 2>/dev/null | head -3", timeout=60)
            assert r.stdout == "", r
            mountinfo = (await sb.exec("cat /proc/self/mountinfo")).stdout
            for host_path in {repo, sys.prefix, str(Path(sys.prefix).resolve())}:
                assert host_path not in mountinfo, (host_path, mountinfo)
            etc = await sb.exec("cat /etc/hostname; ls /etc/docker /etc/hostname.host 2>&1 | head -2")
            assert etc.stdout.splitlines()[0] == "sandbox" and host_name not in etc.stdout, etc
            resolv = (await sb.exec("cat /etc/resolv.conf 2>/dev/null")).stdout  # no network: no host DNS
            for server in host_nameservers:
                assert server not in resolv, (server, resolv)
            # what the tool servers need is there; nothing else of agentrl or of the venv
            r = await sb.exec(["python3", "-I", "-c", SERVER_IMPORT], timeout=60)
            assert r.stdout == "[]\n", r
    run(go())


def test_local_etc_is_the_sandbox_own(backend):
    if backend != "local":
        pytest.skip("docker: /etc is the image's")
    host_users = {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines() if line}

    async def go():
        async with sandbox(backend) as sb:
            users = {line.split(":")[0] for line in (await sb.exec("cat /etc/passwd")).stdout.splitlines()}
            assert users == {"root", "sandbox", "nobody"}, users
            assert host_users - users  # the host has users the sandbox does not show
            r = await sb.exec("whoami; python3 -c 'import ssl, json; print(1)'; awk 'BEGIN{print 2}'")
            assert r.stdout == "sandbox\n1\n2\n", r
    run(go())


PLANT = "open('/work/HIJACKED', 'a').write(__name__ + '\\n')\n"


def test_restarted_server_imports_nothing_planted_and_taints(backend):
    async def go():
        async with _tool_sandbox(backend) as sb:
            for mod in ("base64", "json", "argparse", "runpy", "ctypes", "selectors", "subprocess", "signal"):
                await sb.write_file(f"{mod}.py", PLANT)
            await sb.write_file("sitecustomize.py", PLANT)
            sb._chan.kill()  # the server dies (what `kill -9` from inside does on local)
            await sb._chan.wait()  # dead before the next request: a dying client could still forward it
            r = await sb.exec("echo honest-output; exit 3")
            assert r.exit_code == 137 and sb.tainted  # reported, then restarted
            r = await sb.exec("echo honest-output; exit 3")
            assert (r.exit_code, r.stdout) == (3, "honest-output\n"), r
            assert (await sb.exec("ls /work/HIJACKED")).exit_code != 0
            assert await sb.reset() is False  # a tainted sandbox is never proven clean
    run(go())


PROBE_SERVER = r"""
import os
ppid = os.getppid()
for path, mode in ((f"/proc/{ppid}/mem", "r+b"), (f"/proc/{ppid}/fd/1", "wb"), (f"/proc/{ppid}/fd/0", "rb"),
                   (f"/proc/{ppid}/environ", "rb")):
    try:
        with open(path, mode) as f:
            f.write(b'{"id": 1, "exit_code": 0}\n') if "b" in mode and "w" in mode else f.read(1)
        print("OPENED", path)
    except OSError as e:
        print("refused", path, e.errno)
print("fds", sorted(os.listdir("/proc/self/fd")))
"""


def test_servers_memory_and_pipes_out_of_reach(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec(["python3", "-c", PROBE_SERVER])
            assert "OPENED" not in r.stdout and r.stdout.count("refused") == 4, r
            assert "fds ['0', '1', '2', '3']" in r.stdout, r  # nothing inherited (3: the listdir)
            r = await sb.exec("kill -STOP $PPID; kill -9 $PPID; echo sent")
            if backend == "docker":  # a uid pair the agent's uid cannot signal
                assert "Operation not permitted" in r.stderr and not sb.tainted, r
                r = await sb.exec("echo still; exit 4")
                assert (r.exit_code, r.stdout) == (4, "still\n")
            else:  # its parent and uid: killed, then restarted, and the sandbox is tainted
                await sb.exec("true")
                assert sb.tainted
    run(go())


IPC_PLANT = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x5EC, 4096, 0o1666)           # IPC_CREAT | 0666
libc.shmat.restype = ctypes.c_void_p
addr = libc.shmat(shm, None, 0)
ctypes.memmove(addr, b"secret-of-trajectory-1", 22)
msq = libc.msgget(0x5ED, 0o1666)
sem = libc.semget(0x5EE, 1, 0o1666)
mq = -1
if os.path.isdir("/dev/mqueue"):
    mq = libc.mq_open(b"/agentrl-secret", os.O_CREAT | os.O_RDWR, 0o666, None)
open("/dev/shm/secret", "w").write("s")
print(shm >= 0, msq >= 0, sem >= 0, mq)
"""
IPC_READ = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(0x5EC, 0, 0), libc.msgget(0x5ED, 0), libc.semget(0x5EE, 0, 0),
      os.listdir("/dev/mqueue") if os.path.isdir("/dev/mqueue") else [], os.listdir("/dev/shm"))
"""


def test_reset_clears_ipc_and_every_writable_place(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec(["python3", "-c", IPC_PLANT])
            assert r.stdout.startswith("True True True"), r
            if backend == "docker":
                assert int(r.stdout.split()[3]) >= 0, r  # a POSIX queue was made
            assert "-1 -1 -1" not in (await sb.exec(["python3", "-c", IPC_READ])).stdout
            if not await sb.reset():
                assert not _reset_provable(sb)  # nothing proves it empty: a pool destroys it
                return
            r = await sb.exec(["python3", "-c", IPC_READ])
            assert r.stdout == "-1 -1 -1 [] []\n", r
    run(go())


LINGER = ("import time\n"
          "for _ in range(60):\n"
          "    time.sleep(0.1)\n"
          "    open('/work/left-by-the-last-trajectory', 'w').write('x')\n")


def test_reset_ends_what_spawns_left_running(backend):
    """On docker, killing a spawn's host client (`docker exec`) leaves its process running in the
    container: an MCP server whose ToolSet was never closed, with the agent's interpreter under it.
    A reset must end it before the wipe, or it writes into the next trajectory's clean /work."""
    async def go():
        async with sandbox(backend) as sb:
            await sb.spawn(["python3", "-c", LINGER], cwd="/")
            await asyncio.sleep(0.5)
            if not await sb.reset():
                assert not _reset_provable(sb)  # nothing proves it empty: a pool destroys it
                return
            await asyncio.sleep(1.0)
            r = await sb.exec("ls -A /work; ps -eo args | grep -c '[f]or _ in range' || true")
            assert r.stdout == "0\n", r
    run(go())


FIND_WRITABLE = r"""
import os
seen = set()
for line in open("/proc/self/mountinfo"):
    mnt = line.split()[4]
    if mnt.startswith(("/proc", "/sys")) or mnt in seen:
        continue
    seen.add(mnt)
    try:
        path = os.path.join(mnt, ".agentrl-probe")
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        os.unlink(path)
        print(mnt)
    except OSError:
        pass
"""


def test_reset_covers_every_writable_mount(backend):
    """A new writable place (a tmpfs added to a backend) must join the reset's list."""
    async def go():
        async with _tool_sandbox(backend) as sb:
            r = await sb.exec(["python3", "-c", FIND_WRITABLE])
            assert set(r.stdout.split()) <= set(WRITABLE), r.stdout
            assert {"/work", "/tmp"} <= set(r.stdout.split())
    run(go())


def test_fifo_in_place_of_a_file_is_refused_at_once(backend):
    async def go():
        async with sandbox(backend) as sb:
            await sb.exec("mkfifo /work/solution.py")
            t0 = time.monotonic()
            with pytest.raises(OSError, match="not a regular file"):
                await sb.read_file("solution.py")
            with pytest.raises(OSError):  # ENXIO: a FIFO nobody reads
                await sb.write_file("solution.py", "x")
            assert time.monotonic() - t0 < 5 and not sb.tainted
    run(go())


def test_pool_never_hands_out_a_tainted_sandbox(backend):
    async def go():
        async with SandboxPool(backend, warm=1, max_active=1, limits=SMALL) as pool:
            async with pool.acquire() as sb:
                first = sb
                sb._chan.kill()
                await sb._chan.wait()  # dead before the next request (not racing its answer)
                await sb.exec("true")  # restarts the server: tainted
            async with pool.acquire() as sb:
                assert sb is not first and first.closed
            assert pool.metrics()["tainted"] == 1
    run(go(), timeout=180)


def _sandboxes_of_this_run(backend: str) -> set[str]:
    if backend == "docker":
        from agentrl.sandboxes.docker_backend import list_containers
        return {c.name for c in list_containers(all_runs=False)}
    from agentrl.sandboxes.local_backend import list_dirs
    return {d.name for d, owner in list_dirs() if owner.get("run_id") == RUN_ID}


def test_pool_close_during_warmup_leaves_nothing(backend):
    async def go():
        before = _sandboxes_of_this_run(backend)
        pool = SandboxPool(backend, warm=3, max_active=2, limits=SMALL)
        sb = await pool.get()  # starts warming 3 more in the background
        await pool.release(sb)
        await asyncio.sleep(0.3)  # the warm-ups are mid-creation
        await pool.close()
        assert _sandboxes_of_this_run(backend) == before
    run(go(), timeout=180)


# A process of the last trajectory that tries to outlive it, and then spies on (and sabotages) the
# next trajectory's files: `kind` says how it hides from a cleanup that looks at /proc.
SURVIVOR = r"""
import ctypes, os, platform, sys, threading, time
kind = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)

def spy():
    while True:
        try:
            if os.path.exists("/work/solution.py"):
                open("/work/solution.py", "w").write("def f(): return 0  # overwritten by the last one\n")
            open("/work/spy-" + kind, "a").write(".")
        except OSError:
            pass
        time.sleep(0.05)

if kind != "plain":
    if os.fork():
        os._exit(0)  # the command returns at once; its grandchild lives on
    os.setsid()      # out of the command's session and process group
    if os.fork():
        os._exit(0)  # double fork: an orphan
if kind == "rename":
    libc.prctl(15, b"sleep", 0, 0, 0)  # PR_SET_NAME: looks like the container's main process
if kind == "zombie-thread":
    threading.Thread(target=spy).start()
    # SYS_exit ends only the main thread (ctypes let go of the GIL): /proc shows a zombie
    libc.syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
spy()
"""
SURVIVOR_KINDS = ("zombie-thread", "daemon", "rename")


def _reset_provable(sb) -> bool:
    """Whether a reset can prove the sandbox empty of processes (its cgroup, read as root)."""
    return bool(sb.cgroups) if sb.backend == "local" else os.geteuid() == 0


def test_no_process_survives_into_the_next_trajectory(backend):
    """Processes left by a command (through exec) and by a spawned server (the tool server's
    children) in every state a /proc scan may skip: after the reset none runs, none touches the
    next trajectory's solution.py, and the sandbox's cgroup (the kernel's view) holds no more."""
    async def go():
        async with SandboxPool(backend, warm=1, max_active=1, limits=SMALL) as pool:
            async with pool.acquire() as sb:
                first = sb
                await sb.write_file("survivor.py", SURVIVOR)
                for kind in SURVIVOR_KINDS:
                    r = await sb.exec(["python3", "survivor.py", kind])
                    assert r.exit_code == 0, r
                await sb.spawn(["python3", "/work/survivor.py", "plain"], cwd="/")  # like a tool server's child

                async def every_spy_ran():
                    return {f"spy-{k}" for k in SURVIVOR_KINDS} <= set((await sb.exec("ls /work")).stdout.split())

                await await_until(every_spy_ran, timeout_s=30, interval_s=0.1, what="every survivor kind running")
            async with pool.acquire() as sb:
                if _reset_provable(first):
                    assert sb is first and pool.metrics()["reused"] == 1
                else:
                    assert sb is not first  # nothing proves the old one empty: it was not reused
                await sb.write_file("solution.py", "def f(): return 42\n")
                await asyncio.sleep(1.0)
                assert await sb.read_file("solution.py") == b"def f(): return 42\n"
                r = await sb.exec("ls -A /work; ps -eo pid,stat,args | grep -c '[s]urvivor.py' || true")
                assert r.stdout == "solution.py\n0\n", r
    run(go(), timeout=180)


STDERR_FLOOD = r"""
import os, sys
chunk = b"e" * (1 << 20)
for _ in range(64):
    os.write(2, chunk)
print("flooded", flush=True)
"""


def test_stderr_of_a_spawn_is_bounded_on_the_host(backend, tmp_path):
    """64 MB written to a server's stderr (the host's end: a file the trainer owns, read back after a
    restart) in a fraction of a second: the host keeps STDERR_CAP_BYTES and a note, on both backends
    (docker: the host's docker client writes it)."""
    from agentrl.sandboxes.base import STDERR_CAP_BYTES

    async def go():
        async with sandbox(backend) as sb:
            with open(tmp_path / "stderr", "w+b") as errlog:
                proc = await sb.spawn(["python3", "-c", STDERR_FLOOD], cwd="/", stderr=errlog)
                assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"flooded\n"
                await asyncio.wait_for(proc.wait(), 30)
                # the host's drain notes what it dropped once the stream ends
                await await_until(lambda: b"dropped" in (tmp_path / "stderr").read_bytes()[-200:], timeout_s=10,
                                  interval_s=0.1, what="the host's drain noting what it dropped")
            data = (tmp_path / "stderr").read_bytes()
            assert STDERR_CAP_BYTES <= len(data) < STDERR_CAP_BYTES + 200, len(data)
            dropped = (64 << 20) - STDERR_CAP_BYTES
            assert data.endswith(b"[agentrl: %d more bytes of stderr dropped]\n" % dropped), data[-200:]
    run(go())


INOTIFY_HOLD = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 4096:
    fd = libc.inotify_init()
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), ctypes.get_errno(), flush=True)
time.sleep(120)
"""
INOTIFY_ONE = "import ctypes; print(ctypes.CDLL(None, use_errno=True).inotify_init() >= 0)"


def _quota(sb) -> dict[str, int]:
    """A local sandbox's share of the user's kernel counts (not as root), by /proc/sys/user name."""
    return dict(zip(sb.quota[:-1:2], map(int, sb.quota[1:-1:2])))


def test_a_sandbox_cannot_exhaust_anothers_inotify(backend):
    """Inotify instances (and watches) are counted per host uid: one sandbox holding all it can get,
    in every process it can start (four spawns: its tool servers, the exec server's commands), must
    leave the next sandbox its own (a host uid per sandbox: local as root, and docker, where the
    agent's uid in each container is one of its own; local not as root: the sandbox's user namespace,
    kept by its holder, whose limit is a share of the user's, and a namespace per spawn inside it;
    test_local_nonroot runs this as a non-root uid)."""
    from agentrl.sandboxes.local_backend import _host_limit

    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            held = []
            for _ in range(4):
                hog = await a.spawn(["python3", "-c", INOTIFY_HOLD], cwd="/")
                held.append(int((await asyncio.wait_for(hog.stdout.readline(), 30)).split()[0]))
            user_limit = _host_limit("/proc/sys/fs/inotify/max_user_instances", 128)
            if backend == "local" and os.geteuid() != 0 and getattr(a, "holder", None) is not None:
                # the sandbox's share (local_backend.share: cut for the sandboxes that can be live at once),
                # across all its spawns
                assert held[0] >= 1 and sum(held) == _quota(a)["max_inotify_instances"], (held, a.quota)
            else:  # a uid of its own: all the uid may have
                assert held[0] >= 100 and sum(held) <= user_limit, held
            r = await b.exec(["python3", "-c", INOTIFY_ONE])
            assert r.stdout == "True\n", r
    run(go())


FANOTIFY_HOLD = r"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
groups = 0
while groups < 4096 and libc.fanotify_init(0x200, 0) >= 0:  # FAN_REPORT_FID: what a user may, unprivileged
    groups += 1
print(groups, ctypes.get_errno(), flush=True)
time.sleep(120)
"""
FANOTIFY_ONE = "import ctypes; print(ctypes.CDLL(None, use_errno=True).fanotify_init(0x200, 0) >= 0)"


def test_a_sandbox_cannot_exhaust_anothers_fanotify(backend):
    """fanotify groups, which a user may make unprivileged since Linux 5.13, are counted per user
    like inotify instances (/proc/sys/user/max_fanotify_groups, 128): one sandbox holding all it can
    get from several spawns must leave the next sandbox its own (a uid of its own: docker, local
    as root; local not as root: the sandbox's share in its holder's user namespace)."""
    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            held = []
            for _ in range(3):
                hog = await a.spawn(["python3", "-c", FANOTIFY_HOLD], cwd="/")
                held.append(int((await asyncio.wait_for(hog.stdout.readline(), 30)).split()[0]))
            if held[0] == 0:
                pytest.skip("fanotify_init is refused in the sandbox here (kernel < 5.13 or a filter)")
            if backend == "local" and os.geteuid() != 0 and getattr(a, "holder", None) is not None:
                assert sum(held) == _quota(a)["max_fanotify_groups"], (held, a.quota)
            r = await b.exec(["python3", "-c", FANOTIFY_ONE])
            assert r.stdout == "True\n", (held, r)
    run(go())


# Forks up to the sandbox's pids limit and holds them (the kernel's RLIMIT_NPROC is per user: not as
# root every sandbox is the same user on the host, so without a namespace of its own one sandbox's
# processes would count against the next one's limit)
FORK_HOLD = r"""
import os, signal, sys, time
kids = []
try:
    while len(kids) < 4096:
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
except OSError:
    pass
print(len(kids), flush=True)
time.sleep(120)
"""
FORK_SOME = r"""
import os
kids = []
for _ in range(16):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print(len(kids))
"""


def test_a_sandbox_at_its_pids_limit_leaves_the_next_its_own(backend):
    """A sandbox holding every process its pids limit allows must not take the next sandbox's:
    docker and local as root count pids per cgroup and uid; local not as root per user namespace."""
    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            hog = await a.spawn(["python3", "-c", FORK_HOLD], cwd="/")
            held = int((await asyncio.wait_for(hog.stdout.readline(), 60)).split()[0])
            assert 16 < held < SMALL.pids, held  # stopped by its own limit
            r = await b.exec(["python3", "-c", FORK_SOME])
            assert r.stdout == "16\n", r
    run(go())


def test_a_sandbox_forking_from_several_spawns_holds_one_pids_limit(backend):
    """The pids limit holds for the sandbox as a whole, not per process tree: forking all it can from
    four spawns (tool servers, the exec server's commands), a sandbox holds fewer than `pids` together
    and the next sandbox can still fork (docker and local as root: the cgroup; local not as root: the
    RLIMIT_NPROC of its holder's user namespace, where before each spawn had `pids` of its own)."""
    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            held = []
            for _ in range(4):
                hog = await a.spawn(["python3", "-c", FORK_HOLD], cwd="/")
                line = await asyncio.wait_for(hog.stdout.readline(), 60)
                # no count: it could not start (docker's exec prints "OCI runtime exec failed" when no pid is left)
                held.append(int(line.split()[0]) if line[:1].isdigit() else 0)
            assert held[0] > 16 and sum(held) < SMALL.pids, held
            r = await b.exec(["python3", "-c", FORK_SOME])
            assert r.stdout == "16\n", r
    run(go())


# POSIX message queues: RLIMIT_MSGQUEUE is per user (800 KiB by default), so one sandbox filling it
# would leave the next none
MQ_HOLD = r"""
import ctypes, os, time
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("cur", ctypes.c_long),
                ("pad", ctypes.c_long * 4)]
made = 0
while made < 4096:
    attr = Attr(0, 8, 1024, 0)
    if rt.mq_open(b"/q%d" % made, os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(attr)) < 0:
        break
    made += 1
print(made, ctypes.get_errno(), flush=True)
time.sleep(120)
"""


def test_a_sandbox_cannot_exhaust_anothers_message_queues(backend):
    """Message-queue bytes are counted per user: a sandbox that takes all it can must leave the next
    its own (docker: its own ipc namespace and uid; local: RLIMIT_MSGQUEUE of 64 KiB per sandbox,
    counted per host uid as root, per user namespace not as root)."""
    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            hog = await a.spawn(["python3", "-c", MQ_HOLD], cwd="/")
            made = (await asyncio.wait_for(hog.stdout.readline(), 60)).split()
            assert int(made[0]) >= 1, made  # it could make some: the attack is real
            r = await b.spawn(["python3", "-c", MQ_HOLD], cwd="/")
            other = (await asyncio.wait_for(r.stdout.readline(), 60)).split()
            assert int(other[0]) >= 1, other
    run(go())

# SysV IPC: shared memory outlives its maker and is charged to the sandbox's memory, and the kernel's
# defaults per IPC namespace are nearly unbounded (shmmax 2^64, 4096 segments, 32000 queues and sets)
SYSV_HOLD = r"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
huge = libc.shmget(0, 1 << 30, 0o1600)  # one segment of 1 GiB
segments = 0
while segments < 4096 and libc.shmget(0, 1 << 20, 0o1600) >= 0:
    segments += 1
queues = 0
while queues < 40000 and libc.msgget(0, 0o1600) >= 0:
    queues += 1
sets = 0
while sets < 40000 and libc.semget(0, 1, 0o1600) >= 0:
    sets += 1
print(huge, segments, queues, sets, flush=True)
time.sleep(120)
"""
SYSV_SOME = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
ids = [libc.shmget(0, 4 << 20, 0o1600) for _ in range(4)]
addr = libc.shmat(ids[0], None, 0)
ctypes.memset(addr, 1, 4 << 20)
print(min(ids) >= 0, libc.msgget(0, 0o1600) >= 0, libc.semget(0, 4, 0o1600) >= 0)
"""


def test_sysv_ipc_is_capped_per_sandbox(backend):
    """A sandbox's SysV IPC is a namespace of its own (docker: per container; local: per spawn, made
    before bubblewrap starts in it), capped (SandboxLimits.ipc_mb, ipc_objects, as namespaced
    sysctls the agent cannot write back): a 1 GiB segment is refused, segments, queues and
    semaphore sets stop at the cap, and a sandbox beside it holding all of them makes its own."""
    from agentrl.sandboxes.base import ipc_sysctls

    caps = ipc_sysctls(SMALL)

    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            hog = await a.spawn(["python3", "-c", SYSV_HOLD], cwd="/")
            huge, segments, queues, sets = map(int, (await asyncio.wait_for(hog.stdout.readline(), 60)).split())
            n = SMALL.ipc_objects
            assert huge == -1 and segments == min(n, int(caps["kernel.shmall"]) // 256), (huge, segments)
            assert (queues, sets) == (n, n), (queues, sets)
            r = await a.exec("echo 4294967296 > /proc/sys/kernel/shmmax; cat /proc/sys/kernel/shmmax")
            assert r.stdout == caps["kernel.shmmax"] + "\n" and r.exit_code == 0, r  # not to be raised
            r = await b.exec(["python3", "-c", SYSV_SOME])
            assert r.stdout == "True True True\n", r
    run(go())


# Empty files cost no bytes of a tmpfs's size but about 1 KiB of kernel memory each (inode and
# dentry), outside the size cap and the memory limit: a tmpfs's default file count is half the
# host's RAM pages (millions), so a sandbox could pin gigabytes of the host's kernel memory
FILE_FLOOD = r"""
import os, sys, time
t0, n, err = time.monotonic(), 0, None
root = sys.argv[1] + "/flood"
os.makedirs(root)
try:
    while n < 400000 and time.monotonic() - t0 < 60:
        if n % 5000 == 0:
            os.mkdir("%s/%d" % (root, n // 5000))
        os.close(os.open("%s/%d/%d" % (root, n // 5000, n), os.O_CREAT | os.O_WRONLY, 0o600))
        n += 1
except OSError as e:
    err = e.errno
print(n, err)
"""


@pytest.mark.slow
def test_a_flood_of_empty_files_is_capped_with_the_size(backend):
    """Empty files in every writable place (/work, /tmp, /dev/shm) stop at a count bounded by that
    place's size (one file per 4 KiB: inodes_for), with ENOSPC, and the sandbox still works; a
    reset gives the room back."""
    from agentrl.sandboxes.base import inodes_for
    # local, not root: /work and /tmp are the holder's tmpfs; bubblewrap's /dev/shm has the kernel's file
    # count, and a reset cannot prove the sandbox empty (docs/security.md)
    nonroot_local = os.geteuid() != 0 and backend == "local"
    cap = max(inodes_for(SMALL.workdir_mb + SMALL.tmp_mb), inodes_for(SMALL.workdir_mb))

    async def go():
        async with sandbox(backend) as sb:
            for place in ("/work", "/tmp") if nonroot_local else ("/work", "/tmp", "/dev/shm"):
                r = await sb.exec(["python3", "-c", FILE_FLOOD, place], timeout=90)
                n, err = r.stdout.split()
                assert err == "28" and int(n) <= cap, (place, r)  # ENOSPC at the cap
                assert (await sb.exec("echo alive")).stdout == "alive\n"
                assert (await sb.exec(f"rm -rf {place}/flood", timeout=60)).ok  # (local: one tmpfs for all three)
            if nonroot_local:
                return
            assert await sb.reset()
            r = await sb.exec(["python3", "-c", FILE_FLOOD, "/work"], timeout=90)
            assert r.stdout.split()[1] == "28" and int(r.stdout.split()[0]) > 1000, r
    run(go(), timeout=600)

def _docker_overlay_root(line: str, host_tmp: str) -> bool:
    """The container's root mount on docker's overlay2 driver, whose options (lowerdir, upperdir,
    workdir) name docker's data root: the kernel shows an overlay's options on every mount of it and
    nothing in the container may unmount or hide its root (docs/security.md: inherent to docker). It
    must name no host temp dir all the same. (fuse-overlayfs, vfs, btrfs and zfs name nothing.)"""
    fields = line.split()
    return (len(fields) > 4 and fields[4] == "/" and " - overlay " in line and host_tmp + "/" not in line
            and "agentrl-" not in line)


def test_no_host_path_in_mountinfo_or_command_lines(backend):
    """/proc/self/mountinfo in a tool sandbox names no host folder of its mounts (local: the state dir
    sbx-*/etc, docker and local: the staging folders, docker: its data root's per-container
    hosts/hostname/resolv.conf and the container's cgroup path), and no process's command line does
    either (local: bubblewrap's pid 1 gets its fixed arguments through a file descriptor). Nor
    docker-init's: the container's pid 1 is the image's own reaper (docs/security.md)."""
    import tempfile
    from agentrl.sandboxes.local_backend import state_root
    if os.geteuid() != 0 and backend == "local":
        pytest.skip("local, not root: no tmpfs to mount from (docs/security.md)")
    host_tmp = str(Path(tempfile.gettempdir()).resolve())
    secrets = (str(state_root()), "agentrl-sandboxes", "agentrl-stage", host_tmp + "/", "sbx-",
               "/var/lib/docker", "/containers/", "/docker/")

    async def go():
        async with _tool_sandbox(backend) as sb:
            r = await sb.exec("cat /proc/self/mountinfo; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert r.exit_code == 0 and "/opt/agentrl-site" in r.stdout, r
            leaks = [line for line in r.stdout.splitlines() if any(s in line for s in secrets)
                     and not _docker_overlay_root(line, host_tmp)]
            assert not leaks, leaks
            if backend == "docker":  # no host file is bind-mounted from the host's disk (tini was)
                sources = {line.split()[3] for line in r.stdout.splitlines() if line.count(" - ") == 1
                           and line.split(" - ")[1].split()[1].startswith("/dev/")}
                assert not sources, sources
    run(go())


@pytest.mark.slow
def test_no_staged_host_path_where_staging_is_a_plain_folder(tmp_path, monkeypatch):
    """docker where staging is a plain host folder (the host user is not root, or the staging tmpfs
    could not be mounted): a bind mount of a staged folder showed its host temp-dir path in the
    container's /proc/self/mountinfo. The staged folders are copied into an image of their own
    instead (root-owned, read-only), so none shows; the tool servers' code still imports. Only the
    bridge folder, whose unix socket the host must share, is still bound from there (documented in
    docs/security.md); docker's own /etc/hosts files name its data root, not the temp dir."""
    from sbx_helpers import backend_or_skip
    from agentrl.sandboxes import stage
    from agentrl.tools.spec import SANDBOX_SITE, SANDBOX_SRC
    backend_or_skip("docker")
    plain = tmp_path / "agentrl-stages"
    plain.mkdir()
    monkeypatch.setattr(stage, "stage_root", lambda: plain)
    mounts, env = tool_sandbox_options()
    assert all(Path(h).is_relative_to(plain) for h in mounts), mounts
    host_tmp = str(Path(tempfile.gettempdir()).resolve())
    names = ["agentrl-stages", *(Path(h).name for h in mounts)]

    async def go():
        async with sandbox("docker", mounts=mounts, env=env) as sb:
            mountinfo = (await sb.exec("cat /proc/self/mountinfo")).stdout
            boot = await sb.exec(["python3", "-I", "-c", f"import sys; sys.path[:0] = [{SANDBOX_SRC!r}, {SANDBOX_SITE!r}]; "
                                  "import mcp, agentrl.tools.bash_server, agentrl.tools.python_server; print('ok')"])
            planted = await sb.exec(f"touch {SANDBOX_SITE}/mcp/x.py {SANDBOX_SRC}/x 2>&1; stat -c %U {SANDBOX_SITE}/mcp")
            return mountinfo, boot, planted
    mountinfo, boot, planted = run(go(), timeout=300)
    lines = mountinfo.splitlines()
    shown = [line for line in lines if any(n in line for n in names) or host_tmp + "/" in line]
    assert all(line.split()[4] == "/agentrl" for line in shown), shown  # the bridge's, nothing staged
    assert not [line for line in lines if line.split()[4] in (SANDBOX_SRC, SANDBOX_SITE)], mountinfo
    assert boot.stdout == "ok\n", boot
    assert "Read-only file system" in planted.stdout and planted.stdout.endswith("root\n"), planted


ORPHANS = r"""
import os, time
for _ in range(20):  # each child leaves a grandchild that exits at once: an orphan for pid 1 to reap
    if os.fork() == 0:
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.wait()
time.sleep(1.5)
zombies = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            stat = open("/proc/%s/stat" % pid).read()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2:].split()[:2]
        if state == "Z":
            zombies.append((pid, ppid))
print(open("/proc/1/cmdline").read().split("\0")[0], zombies)
"""


def test_orphans_are_reaped_by_the_sandboxes_own_pid_1(backend):
    """The sandbox's pid 1 reaps the orphans reparented to it (docker: the image's python3 reaper,
    not the host's docker-init; local: bubblewrap): none is left a zombie."""
    async def go():
        async with sandbox(backend) as sb:
            return await sb.exec(["python3", "-c", ORPHANS], timeout=30)
    r = run(go())
    assert r.exit_code == 0, r
    init, zombies = r.stdout.split(" ", 1)
    assert zombies.strip() == "[]", r.stdout
    assert init in ("python3", "bwrap") or init.endswith("/bwrap"), init


# Run in sandbox A while sandbox B (same backend, same host) holds a secret file, a SysV segment and an
# abstract unix socket: A reaches none of it, and B keeps working while A exhausts what it may.
REACH_NEIGHBOUR = r"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("root/work/neighbour-secret", "cwd/neighbour-secret"):
            try:
                found.append(open("/proc/%s/%s" % (pid, what)).read())
            except OSError:
                pass
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0agentrl-neighbour")
    found.append("abstract socket")
except OSError:
    pass
if libc.shmget(0x6E16, 0, 0) >= 0:
    found.append("sysv segment")
print("found", found)
"""
NEIGHBOUR = r"""
import ctypes, socket, time
libc = ctypes.CDLL(None, use_errno=True)
open("/work/neighbour-secret", "w").write("SECRET")
libc.shmget(0x6E16, 4096, 0o1666)
s = socket.socket(socket.AF_UNIX)
s.bind("\0agentrl-neighbour")
s.listen(1)
print("ready", flush=True)
time.sleep(120)
"""
EXHAUST = r"""
import os
# /tmp, /dev/shm and /work full, every fd of this process taken
for path in ("/tmp/fill", "/dev/shm/fill", "/work/fill"):
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * (1 << 20))
    except OSError as e:
        print(path, e.errno)
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print("fds", len(fds), e.errno)
"""


@pytest.mark.slow
def test_a_sandbox_reaches_nothing_of_its_neighbour(backend):
    async def go():
        async with sandbox(backend) as a, sandbox(backend) as b:
            held = await b.spawn(["python3", "-c", NEIGHBOUR], cwd="/")
            assert await asyncio.wait_for(held.stdout.readline(), 30) == b"ready\n"
            r = await a.exec(["python3", "-c", REACH_NEIGHBOUR])
            assert r.stdout == "found []\n", r
            if backend == "docker" or a.mounted:  # (local, not root: no tmpfs to fill, the host's disk)
                r = await a.exec(["python3", "-c", EXHAUST], timeout=60)
                assert r.stdout.count(" 28\n") == 3 and "fds" in r.stdout, r  # ENOSPC three times, EMFILE
            r = await a.exec(":(){ :|:& };: ; sleep 2; echo survived", timeout=20)  # a fork bomb in A ...
            r = await b.exec("head -c 1000000 /dev/zero > /tmp/x && ls /work && rm /tmp/x && echo fine", timeout=30)
            assert r.stdout == "neighbour-secret\nfine\n", r  # ... and B works on, with its room
            assert (await a.exec("echo a-alive", timeout=30)).stdout == "a-alive\n"
    run(go(), timeout=240)
