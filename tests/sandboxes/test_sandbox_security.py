"""Escape and abuse attempts, for both backends: each is contained, reported, and leaves
the host unchanged; the sandbox stays usable afterwards (or fails as a SandboxError)."""
from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path

import pytest

from agentrl.sandboxes import SandboxLimits
from sbx_helpers import SMALL, run, sandbox


async def _still_usable(sb):
    r = await sb.exec("echo alive", timeout=20)
    assert r.exit_code == 0 and r.stdout == "alive\n", r


def test_identity_no_root_no_caps(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec("id -u; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status")
            lines = r.stdout.split()
            assert lines[0] == str(sb.uid) and sb.uid >= 1000, r  # local: 1000; docker: a uid per container
            status = dict(zip(lines[1::2], lines[2::2]))
            assert status["CapEff:"] == status["CapPrm:"] == "0000000000000000", r.stdout
            assert status["CapBnd:"] == "0000000000000000", r.stdout
            assert status["NoNewPrivs:"] == "1", r.stdout
            r = await sb.exec("su -c true root </dev/null; sudo true </dev/null", timeout=10)
            assert r.exit_code != 0
    run(go())


def test_network_egress_blocked(backend):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(1.0)
    port = listener.getsockname()[1]
    probe = ("import socket, sys\n"
             "for host, port in (('1.1.1.1', 80), ('127.0.0.1', %d)):\n"
             "    s = socket.socket(); s.settimeout(3)\n"
             "    try:\n"
             "        s.connect((host, port)); print('CONNECTED', host)\n"
             "    except OSError as e:\n"
             "        print('blocked', host, type(e).__name__)\n" % port)

    async def go():
        async with sandbox(backend) as sb:
            t0 = time.monotonic()
            r = await sb.exec(["python3", "-c", probe], timeout=15)
            assert time.monotonic() - t0 < 5, "egress attempts must fail at once, not time out"
            assert "CONNECTED" not in r.stdout, r
            assert r.stdout.count("blocked") == 2, r
            r = await sb.exec("getent hosts deb.debian.org || echo no-dns", timeout=10)
            assert "no-dns" in r.stdout
    try:
        run(go())
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


def test_writes_outside_workdir_fail(backend):
    # host paths outside /tmp (the sandbox's /tmp is its own): none may appear or change
    victim = Path(f"/var/tmp/agentrl-victim-{os.getpid()}.txt")
    this_file = Path(__file__).resolve()
    before = this_file.read_bytes()
    targets = ["/etc/passwd", "/etc/agentrl-pwned", "/usr/bin/agentrl-pwned", "/agentrl-pwned",
               "/root/agentrl-pwned", "/var/agentrl-pwned", str(victim),
               "/proc/sys/kernel/hostname", "/sys/kernel/agentrl-pwned"]
    if not str(this_file).startswith(("/work/", "/tmp/")):  # those are the sandbox's own
        targets.append(str(this_file))

    async def go():
        async with sandbox(backend) as sb:
            for path in targets:
                r = await sb.exec(f"echo pwned > {path}", timeout=10)
                assert r.exit_code != 0, (path, r)
                with pytest.raises(OSError):
                    await sb.write_file(path, "pwned")
            r = await sb.exec("echo ok > /work/f && echo ok > /tmp/f && cat /work/f /tmp/f")
            assert r.stdout == "ok\nok\n", r
            r = await sb.exec("mount -t tmpfs none /mnt || mount -o remount,rw / ", timeout=10)
            assert r.exit_code != 0
    run(go())
    assert not victim.exists() and this_file.read_bytes() == before
    assert not os.path.exists("/etc/agentrl-pwned") and not os.path.exists("/agentrl-pwned")
    assert "pwned" not in open("/etc/passwd").read()


def test_host_files_and_env_hidden(backend, tmp_path, monkeypatch):
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("AGENTRL_TEST_SECRET", secret)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o644)

    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec(f"env; cat /proc/[0-9]*/environ; cat {secret_file}; ls /root /home; "
                              "cat /proc/[0-9]*/cmdline", timeout=20)
            assert secret not in r.stdout + r.stderr, r
            assert "AGENTRL_TEST_SECRET" not in r.stdout
            r = await sb.exec(["cat", str(secret_file)])
            assert r.exit_code != 0
    run(go())


def test_fork_bomb_contained(backend):
    async def go():
        async with sandbox(backend) as sb:
            t0 = time.monotonic()
            r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 3; echo survived", timeout=8)
            assert time.monotonic() - t0 < 30
            # contained: the pids limit stops it; exec returns; every bomb process is gone
            r = await sb.exec("ps -e --no-headers | wc -l")
            assert int(r.stdout) < 10, r
            await _still_usable(sb)
    run(go(), timeout=120)


def test_memory_bomb_contained(backend):
    async def go():
        async with sandbox(backend, limits=SandboxLimits(memory_mb=200, timeout_s=30)) as sb:
            r = await sb.exec(["python3", "-c", "x = bytearray(1_500_000_000); x[::4096] = b'1' * len(x[::4096]); print('ALLOCATED')"])
            assert "ALLOCATED" not in r.stdout, r
            assert r.exit_code != 0, r
            await _still_usable(sb)
    run(go())


def test_cpu_spin_past_timeout(backend):
    async def go():
        async with sandbox(backend) as sb:
            t0 = time.monotonic()
            r = await sb.exec(["python3", "-c", "while True: pass"], timeout=1.5)
            took = time.monotonic() - t0
            assert r.timed_out and r.exit_code == 137, r
            assert took < 6, took
            r = await sb.exec("ps -e -o pid=,comm= | awk '$1 != 1 && $2 == \"python3\"' | wc -l")
            assert r.stdout.strip() == "1", r  # only the exec server itself (docker's pid 1 is a python3 too)
            await _still_usable(sb)
    run(go())


@pytest.mark.slow
def test_gigabytes_of_output_truncated(backend):
    async def go():
        async with sandbox(backend, limits=SandboxLimits(timeout_s=60, output_bytes=1 << 20)) as sb:
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            r = await sb.exec("head -c 2000000000 /dev/zero | tr '\\0' x; echo done >&2", timeout=60)
            rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            assert r.truncated and not r.timed_out, r.exit_code
            assert len(r.stdout) == 1 << 20 and set(r.stdout) == {"x"}
            assert r.stderr == "done\n" and r.exit_code == 0
            assert (rss1 - rss0) * 1024 < 200 << 20, "host memory grew with the sandbox's output"
    run(go(), timeout=180)


def test_background_process_killed_after_exec(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec("sleep 1000 & (setsid sleep 1001 &) ; nohup sleep 1002 >/dev/null 2>&1 & "
                              "python3 -c 'import os\nif os.fork() == 0:\n os.setsid()\n if os.fork() == 0:\n  import time; time.sleep(1003)' ; echo started")
            assert r.stdout.strip() == "started", r
            r = await sb.exec("ps -e -o args= | grep -c '[s]leep 100' || true; ps -e -o args= | grep -c '[t]ime.sleep' || true")
            assert r.stdout.split() == ["0", "0"], r
    run(go())


def test_readonly_grader_file(backend, tmp_path):
    grader = tmp_path / "grader"
    grader.mkdir()
    (grader / "grade.py").write_text("print('score', 0)\n")
    before = sorted((p.name, p.read_bytes()) for p in grader.iterdir())

    async def go():
        async with sandbox(backend, mounts={str(grader): "/grader"}) as sb:
            r = await sb.exec("python3 /grader/grade.py")
            assert r.stdout == "score 0\n"
            attacks = ["echo \"print('score', 1)\" > /grader/grade.py", "rm -f /grader/grade.py",
                       "mv /grader/grade.py /grader/x.py", "chmod 777 /grader/grade.py",
                       "touch /grader/new.py", "ln -s /work /grader/link"]
            for cmd in attacks:
                r = await sb.exec(cmd)
                assert r.exit_code != 0, (cmd, r)
            with pytest.raises(OSError):
                await sb.write_file("/grader/grade.py", "print('score', 1)")
            r = await sb.exec("python3 /grader/grade.py")
            assert r.stdout == "score 0\n"
    run(go())
    assert sorted((p.name, p.read_bytes()) for p in grader.iterdir()) == before
    assert oct(os.stat(grader / "grade.py").st_mode & 0o777) == "0o644"


def test_killing_the_exec_server_is_survivable(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec("kill -9 -1; sleep 1", timeout=10)
            if backend == "docker":  # the server's uid pair is out of the agent's reach
                assert r.exit_code == 0 and not sb.tainted, r
            else:  # one uid per user namespace: it dies, is restarted, and the sandbox is never reused
                assert r.exit_code == 137 and sb.tainted, r
            await _still_usable(sb)
            await sb.write_file("f", "x")
            assert await sb.read_file("f") == b"x"
    run(go())


def test_workdir_size_capped(backend):
    async def go():
        async with sandbox(backend, limits=SMALL) as sb:  # 64 MiB /work
            r = await sb.exec("head -c 200000000 /dev/zero > /work/big; echo rc=$?; ls -l /work/big", timeout=30)
            assert "rc=0" not in r.stdout, r
            await _still_usable(sb)
    run(go())


SYSCALL_PROBE = r"""
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    r = getattr(libc, name)(*args)
    return "ok" if r != -1 else os.strerror(ctypes.get_errno())
print("unshare", call("unshare", 0x10000000))                  # CLONE_NEWUSER
print("mount", call("mount", b"none", b"/work", b"tmpfs", 0, None))
print("keyctl", call("syscall", 250 if os.uname().machine == "x86_64" else 219, 0, 0))
print("ptrace", call("ptrace", 0, 0, None, None))               # PTRACE_TRACEME
out = []
t = threading.Thread(target=lambda: out.append(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout))
t.start(); t.join()
print("threads+fork", out[0].strip())
"""


def test_dangerous_syscalls_refused(backend):
    """The seccomp filter (local: sandboxes/seccomp.py; docker: its default profile): namespaces,
    mounts and keyrings are refused while threads and child processes work as usual."""
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec(["python3", "-c", SYSCALL_PROBE], timeout=30)
            got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
            assert got["unshare"] == got["mount"] == got["keyctl"] == "Operation not permitted", r
            assert got["threads+fork"] == "child", r
            if backend == "local":  # Docker's default profile allows ptrace on current kernels
                assert got["ptrace"] == "Operation not permitted", r
            r = await sb.exec("unshare -Ur true && echo ESCAPED", timeout=10)
            assert "ESCAPED" not in r.stdout and r.exit_code != 0, r
            await _still_usable(sb)
    run(go())


def test_seccomp_table_matches_kernel_headers():
    from agentrl.sandboxes import seccomp
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip("kernel headers not installed (linux-libc-dev)")
    numbers = {}
    for line in header.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("__NR_"):
            numbers[parts[1][5:]] = int(parts[2])
    table = seccomp.SYSCALLS["x86_64"]
    assert {k: numbers.get(k) for k in table} == table
    assert set(seccomp.DENIED) <= set(table)
