"""The sandbox API for both backends: exec/files/spawn, the pool, cleanup after SIGKILL,
and the errors on bad input."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import agentrl.sandboxes as sbx
from agentrl.sandboxes import (ExecResult, ImageNotFoundError, SandboxError, SandboxLimits,
                               SandboxPool, create, create_sync, resolve_backend)
from sbx_helpers import SMALL, backend_or_skip, run, sandbox
from waiting import await_until, wait_until


def test_exec_and_files(backend):
    async def go():
        async with sandbox(backend) as sb:
            assert sb.workdir == "/work"
            r = await sb.exec("echo out; echo err >&2; exit 3")
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, "out\n", "err\n", False, False)
            r = await sb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc")
            assert r.stdout == "cba\n" and r.ok
            r = await sb.exec("pwd; echo $FOO", env={"FOO": "bar"}, cwd="/tmp")
            assert r.stdout == "/tmp\nbar\n"
            blob = bytes(range(256)) * 1000
            await sb.write_file("d/e/blob.bin", blob)
            assert await sb.read_file("/work/d/e/blob.bin") == blob
            await sb.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
            assert (await sb.exec("./run.sh")).stdout == "ran\n"
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")
            with pytest.raises(ValueError):
                await sb.read_file("d/e/blob.bin", max_bytes=10)
            r = await sb.exec(["no-such-binary"])
            assert r.exit_code == 127
            # state persists between execs; the workdir is private per sandbox
            await sb.exec("echo 1 > /work/state")
            async with sandbox(backend) as other:
                assert (await other.exec("cat /work/state")).exit_code != 0
            assert (await sb.exec("cat /work/state")).stdout == "1\n"
    run(go())


def test_reset_wipes_state(backend):
    async def go():
        async with sandbox(backend) as sb:
            await sb.exec("mkdir -p /work/a/b && touch /work/a/b/c /tmp/t /work/.hidden && chmod 000 /work/a/b")
            assert await sb.reset()
            r = await sb.exec("ls -A /work /tmp")
            assert r.stdout.split() == ["/tmp:", "/work:"], r
    run(go())


def test_spawn_long_running_process(backend):
    server = "import sys\nfor line in sys.stdin:\n    print('echo:' + line.strip(), flush=True)\n"

    async def go():
        async with sandbox(backend) as sb:
            await sb.write_file("srv.py", server)
            proc = await sb.spawn(["python3", "srv.py"], env={"X": "1"})
            proc.stdin.write(b"one\n")
            await proc.stdin.drain()
            assert await asyncio.wait_for(proc.stdout.readline(), 20) == b"echo:one\n"
            r = await sb.exec("echo between")  # an exec does not kill the spawned server
            assert r.ok
            proc.stdin.write(b"two\n")
            await proc.stdin.drain()
            assert await asyncio.wait_for(proc.stdout.readline(), 20) == b"echo:two\n"
            argv = sb.spawn_argv(["python3", "-c", "print('hi')"])
            p2 = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(p2.communicate(), 30)
            assert out == b"hi\n"
        assert await asyncio.wait_for(proc.wait(), 20) is not None  # close() killed it
    run(go())


def test_agentrl_source_mount(backend):
    mounts, env = sbx.agentrl_source_mounts()

    async def go():
        async with sandbox(backend, mounts=mounts, env=env) as sb:
            r = await sb.exec(["python3", "-c", "import agentrl.sandboxes._server as s, agentrl.errors; "
                               "print(s.__file__)"])
            assert r.ok and r.stdout.startswith("/opt/agentrl/agentrl/sandboxes/"), r
            assert (await sb.exec("touch /opt/agentrl/x")).exit_code != 0
    run(go())


def test_sync_wrapper():
    backend = backend_or_skip("local")
    with create_sync(backend, limits=SMALL) as sb:
        r = sb.exec("echo hi")
        assert isinstance(r, ExecResult) and r.stdout == "hi\n"
        sb.write_file("x", b"1")
        assert sb.read_file("x") == b"1"
    assert sb.sandbox.closed


def test_pool_groups_and_metrics(backend):
    async def go():
        pool = SandboxPool(backend, warm=2, max_active=3, limits=SMALL, acquire_timeout_s=60)
        async with pool:
            assert pool.metrics()["warm"] == 2
            seen = []
            # members of a group start identical, even though setup_cmd is random
            for _ in range(3):
                async with pool.acquire(group_id="g1", setup_files={"task.txt": "solve"},
                                        setup_cmd="head -c 16 /dev/urandom | od -An -tx1 > rnd") as sb:
                    seen.append((await sb.exec("cat task.txt rnd")).stdout)
                    await sb.exec("echo dirt > dirt; sleep 1000 &")
            assert len(set(seen)) == 1 and seen[0].startswith("solve"), seen
            async with pool.acquire() as sb:  # a reused sandbox is clean
                assert (await sb.exec("ls -A /work")).stdout == ""
            with pytest.raises(ValueError):
                async with pool.acquire(group_id="g1", setup_files={"task.txt": "other"}):
                    pass
            # the concurrency bound: a 4th concurrent acquire waits for a release
            held = [await pool.get() for _ in range(3)]
            assert pool.metrics()["active"] == 3
            await asyncio.sleep(0.2)  # no warm sandbox is made beyond max_active either
            m = pool.metrics()
            assert m["active"] + m["warm"] + m["creating"] <= 3, m
            waiter = asyncio.ensure_future(pool.get())
            await asyncio.sleep(0.5)
            assert not waiter.done()
            await pool.release(held.pop())
            held.append(await asyncio.wait_for(waiter, 60))
            for sb in held:
                await pool.release(sb)
            m = pool.metrics()
            assert m["active"] == 0 and m["acquired"] == 8 and m["acquire_s_p50"] > 0, m
        assert pool.metrics()["warm"] == 0
    run(go(), timeout=240)


def test_pool_keeps_a_burst_warm_for_the_next_one():
    """A rollout's trajectories come in bursts: the sandboxes of one burst are reset and kept for
    the next instead of being made again (at most max_creating at a time: about 6 s of every
    code-env episode's reset on a GPU machine, 2026-12-03), and never more than max_active."""
    backend = backend_or_skip("local")

    async def burst(pool, n):
        held = await asyncio.gather(*[pool.get() for _ in range(n)])
        await asyncio.gather(*[sb.exec("echo dirt > f") for sb in held])
        for sb in held:  # one by one, as trajectories end
            await pool.release(sb)

    async def go():
        async with SandboxPool(backend, warm=1, max_active=4, limits=SMALL, acquire_timeout_s=60) as pool:
            await burst(pool, 4)
            m = pool.metrics()
            assert m["created"] == 4 and m["warm"] == 4, m
            await burst(pool, 4)
            m = pool.metrics()
            assert m["created"] == 4 and m["reused"] == 8 and m["warm"] == 4, m
            async with pool.acquire() as sb:  # kept ones were reset: clean
                assert (await sb.exec("ls -A /work")).stdout == ""
    run(go(), timeout=120)


def test_pool_replaces_tainted_sandboxes_up_to_the_burst_before_it_is_needed():
    """A grader's sandbox is always tainted and destroyed (the code env: one an episode), so a burst
    kept warm by reset alone shrinks by its size every iteration and the next one waited for
    replacements (reset 6.9 s a trajectory on 1x H200, 2026-12-03). They are made in the
    background, up to the burst's size, as the tainted ones go."""
    backend = backend_or_skip("local")

    async def go():
        async with SandboxPool(backend, warm=1, max_active=4, limits=SMALL, acquire_timeout_s=60) as pool:
            held = await asyncio.gather(*[pool.get() for _ in range(4)])
            for sb in held:
                sb.taint("it ran a solution for grading")
                await pool.release(sb)
            await await_until(lambda: pool.metrics()["warm"] == 4, timeout_s=60,
                              what=lambda: f"four replacements warm ({pool.metrics()})")
            made = pool.metrics()["created"]
            held = await asyncio.gather(*[pool.get() for _ in range(4)])
            assert pool.metrics()["created"] == made == 8, pool.metrics()  # none made while they waited
            for sb in held:
                await pool.release(sb)
    run(go(), timeout=120)


@pytest.mark.slow
def test_pool_never_holds_more_than_max_active(backend):
    """Trajectories coming and going (reset and reused, or tainted and replaced) never make the
    pool hold more than max_active sandboxes, warm ones included."""
    from agentrl.sandboxes.base import _live

    async def go():
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, sum(not sb.closed for sb in _live.values()))
                await asyncio.sleep(0.005)

        async def trajectory(i):
            for _ in range(2):
                async with pool.acquire() as sb:
                    await sb.exec("echo x > f")
                    if i % 3 == 0:
                        sb.taint("graded")  # destroyed at release, a new one made
        async with SandboxPool(backend, warm=2, max_active=3, limits=SMALL, acquire_timeout_s=120) as pool:
            watcher = asyncio.ensure_future(watch())
            await asyncio.gather(*[trajectory(i) for i in range(8)])
            await await_until(lambda: pool.metrics()["creating"] == 0, timeout_s=60,
                              what=lambda: f"the pool's refills finishing ({pool.metrics()})")
            watcher.cancel()
            m = pool.metrics()
        assert peak <= 3 and m["acquired"] == 16 and m["tainted"] == 6, (peak, m)
    run(go(), timeout=240)


CHILD = textwrap.dedent("""
    import asyncio, sys
    from agentrl.sandboxes import create, SandboxLimits
    async def main():
        boxes = [await create(sys.argv[1], limits=SandboxLimits(memory_mb=128)) for _ in range(2)]
        for sb in boxes:
            await sb.exec("true")
        await boxes[0].spawn(["sleep", sys.argv[2]])
        print("READY", flush=True)
        await asyncio.sleep(600)
    asyncio.run(main())
""")


def test_no_sandbox_survives_sigkill(backend, tmp_path):
    run_id = f"sigkill-test-{os.getpid()}-{time.time_ns()}"
    # A duration no other test uses, so `ps` finds this sandbox's process and nothing else's.
    marker = f"1000.{time.time_ns() % 10**6:06d}"
    env = {**os.environ, "AGENTRL_RUN_ID": run_id}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, backend, marker], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read() if proc.poll() is not None else line
        names = _sandboxes_of(backend, run_id)
        assert len(names) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    sbx.reap()  # what every start-up does
    wait_until(lambda: _sandboxes_of(backend, run_id) == [], timeout_s=20,
               what=lambda: f"the killed run's sandboxes going ({_sandboxes_of(backend, run_id)} left)")
    # nothing of it runs any more (container processes show in the host's ps too)
    wait_until(lambda: _processes_with(f"sleep {marker}") == [], timeout_s=10,
               what=lambda: f"the killed run's processes ending ({_processes_with(f'sleep {marker}')} left)")
    if backend == "local":  # nothing of them stays mounted (other sandboxes may live: xdist's other worker)
        mountinfo = Path("/proc/self/mountinfo").read_text()
        assert not [name for name in names if name in mountinfo], mountinfo


def _processes_with(text: str) -> list[str]:
    """pid, state and cgroups of each live process whose command line contains `text`."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or text not in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                continue
            state = (d / "stat").read_text().split(")")[-1].split()[0]
            if state != "Z":
                found.append(f"{d.name} {state} {(d / 'cgroup').read_text().split()}")
        except OSError:
            pass
    return found


def _sandboxes_of(backend: str, run_id: str) -> list[str]:
    if backend == "docker":
        from agentrl.sandboxes.docker_backend import docker_client
        return [c.name for c in docker_client().containers.list(
            all=True, filters={"label": f"agentrl.run_id={run_id}"})]
    from agentrl.sandboxes.local_backend import list_dirs
    return [d.name for d, owner in list_dirs() if owner.get("run_id") == run_id]


def test_missing_image_says_how_to_build():
    backend_or_skip("docker")
    with pytest.raises(ImageNotFoundError, match="agentrl sandbox build"):
        run(create("docker", image="agentrl-no-such-image:v0").start())


def test_no_engine_errors_and_auto_falls_back(monkeypatch, caplog):
    backend_or_skip("local")
    from agentrl.sandboxes import docker_backend
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setattr(docker_backend, "_client", None)
    monkeypatch.setattr(sbx.backends, "_auto_choice", None)
    with pytest.raises(SandboxError, match="no Docker engine answers"):
        resolve_backend("docker")
    with pytest.raises(SandboxError, match="no Docker engine answers"):
        docker_backend.docker_client()
    with caplog.at_level(logging.INFO, logger="agentrl.sandboxes"):
        assert resolve_backend("auto") == "local"
    assert "auto -> local" in caplog.text
    with pytest.raises(SandboxError, match="unknown sandbox backend"):
        resolve_backend("vm")


def test_cli(capsys):
    backend_or_skip("local")
    from agentrl.sandboxes.cli import main
    assert main(["check", "--sandbox", "local"]) == 0
    assert "exit 0" in capsys.readouterr().out
    assert main(["ls"]) == 0
    assert main(["reap"]) == 0


def test_cli_build_is_cached():
    backend_or_skip("docker")  # builds the image on demand if missing
    from agentrl.sandboxes.cli import main
    t0 = time.monotonic()
    assert main(["build"]) == 0
    assert time.monotonic() - t0 < 10, "an up-to-date image must not be rebuilt"


def test_dead_container_is_a_sandbox_error():
    backend_or_skip("docker")

    async def go():
        async with sandbox("docker") as sb:
            await asyncio.to_thread(sb.container.kill)
            with pytest.raises(SandboxError):
                await sb.exec("echo hi")
    run(go())


def test_pool_replaces_a_dead_warm_sandbox():
    backend_or_skip("docker")

    async def go():
        async with SandboxPool("docker", warm=1, max_active=1, limits=SMALL) as pool:
            idle = pool._idle[0]
            await asyncio.to_thread(idle.container.kill)
            async with pool.acquire() as sb:
                assert sb is not idle and (await sb.exec("echo 1")).stdout == "1\n"
    run(go())


def test_local_nonroot_says_loudly_when_no_user_namespace_of_its_own(caplog):
    """Where the kernel refuses the per-spawn user namespace (or its /proc/sys/user is read-only),
    the local backend, not as root, warns once that sandboxes share the user's kernel objects."""
    import logging
    from agentrl.sandboxes import local_backend
    with caplog.at_level(logging.WARNING):
        assert local_backend._userns_quota_works(("false",)) is False
    assert "share the user's inotify instances" in caplog.text and "docs/security.md" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        argv = local_backend.userns_quota_argv()
    if argv:  # the kernel allows it (test_local_nonroot then runs the attacks through it)
        assert argv[:3] == ["unshare", "--user", "--map-root-user"] and int(argv[-2]) >= 1, argv
    else:
        assert "share the user's inotify instances" in caplog.text


def test_local_shares_are_a_ledger_of_the_live_pools(tmp_path, monkeypatch):
    """Not as root, local sandboxes' shares of the user's kernel counts (processes, inotify, fanotify,
    message-queue bytes) come from a ledger in the state dir (every process's): a pool reserves its
    max_active shares when it is made, from what the earlier ones left (1/max(all reserved,
    default_max_active) each at most), so the live shares together keep the host's quarter; where
    nothing is left a new pool (or a sandbox outside a pool) is refused, naming the live pools; a
    reservation ends with its pool (closed or dropped) or its process."""
    import gc
    import resource
    from fractions import Fraction
    from agentrl.sandboxes import SandboxError, SandboxPool, local_backend as lb
    from agentrl.sandboxes.pool import default_max_active
    monkeypatch.setenv("AGENTRL_SANDBOX_DIR", str(tmp_path / "sandboxes"))
    monkeypatch.setattr(lb, "needs_shares", lambda: True)  # the suite runs as root
    floor = default_max_active("local")
    ledger = tmp_path / "sandboxes" / ".slots"
    a = SandboxPool("local", warm=0, max_active=2)
    assert a._reservation.part == Fraction(1, floor)
    # another process's reservation, still alive (our parent), and a dead one's
    (ledger / "live").write_text(json.dumps({"pid": os.getppid(), "start": None, "n": 1, "part": f"1/{4 * floor}",
                                             "what": "a pool of max_active 1"}))
    (ledger / "dead").write_text(json.dumps({"pid": 2 ** 22 + 7, "start": 1, "n": 99, "part": "1/99"}))
    left = 1 - Fraction(2, floor) - Fraction(1, 4 * floor)
    b = SandboxPool("local", warm=0, max_active=floor)  # what is left, cut for all of them
    assert b._reservation.part == min(Fraction(1, floor + 3), left / floor) > 0, b._reservation
    assert not (ledger / "dead").exists() and len(lb.reserved()) == 3
    held = [(2, a._reservation.part), (1, Fraction(1, 4 * floor)), (floor, b._reservation.part)]
    assert sum(n * part for n, part in held) <= 1
    for name, limit in [*lb._user_counts().items(), ("processes", lb._user_processes())]:
        usable = limit - limit // lb.HOST_PART
        assert sum(n * int(usable * part) for n, part in held) <= usable, name  # the host keeps its quarter
    procs = lb._user_processes()
    assert lb.nproc_share(b._reservation.part) == max(1, int((procs - procs // 4) * b._reservation.part))
    pairs, limit = lb.share(b._reservation.part), lb._user_counts()["max_inotify_instances"]
    assert int(pairs[pairs.index("max_inotify_instances") + 1]) == max(1, int((limit - limit // 4) * b._reservation.part))
    soft = resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0]
    if soft != resource.RLIM_INFINITY:
        assert 2 * lb.msgqueue_share(a._reservation.part) + floor * lb.msgqueue_share(b._reservation.part) \
            <= soft - soft // lb.HOST_PART
    rest = 1 - sum(n * part for n, part in held)  # whatever b left (none where the default is small)
    (ledger / "rest").write_text(json.dumps({"pid": os.getppid(), "start": None, "n": 1, "part": str(rest),
                                             "what": "a pool of max_active 1"}))
    with pytest.raises(SandboxError) as e:
        SandboxPool("local", warm=0, max_active=3)
    msg = str(e.value)
    assert "left for a pool of max_active 3" in msg and "a pool of max_active 2" in msg \
        and f"a pool of max_active {floor}" in msg and "docs/security.md" in msg, msg
    with pytest.raises(SandboxError, match="left for a sandbox outside a pool"):
        lb.reserve_slots(1, "a sandbox outside a pool")
    run(a.close())
    lb.release_slots(ledger / "rest")
    c = SandboxPool("local", warm=0, max_active=2)  # a's shares are free again
    assert c._reservation.part > 0
    del b, c
    gc.collect()
    assert [e["what"] for e in lb.reserved()] == ["a pool of max_active 1"]  # only the other process's
