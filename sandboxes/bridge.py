"""The bridge: how a process in a sandbox with no network reaches one host service (the
gateway of its trajectory), and nothing else.

Every sandbox gets a host directory of its own (`Sandbox.bridge_dir`; in a tmpfs as root, so
no host path shows inside), mounted read-only at `INSIDE` (/agentrl) when it is made:
root-owned, mode 0711 (the sandbox's uid can pass through it, not list it), so only that
sandbox sees what the host puts there. The host serves a session on a unix socket in it
(`socket_path`: a fresh name per session; agentrl.gateway's `Gateway.bind` makes it the
sandbox uid's, mode 0600: another uid cannot connect, and another sandbox does not even see
the path). The socket, not a key, tells the server whose session a request is.

Inside, `FORWARDER` (python3, standard library only) listens on 127.0.0.1 (every sandbox has
its own loopback: docker's `--network none` and bubblewrap's `--unshare-net` both keep `lo`),
starts the command with OPENAI_BASE_URL=http://127.0.0.1:PORT/v1, and copies each TCP
connection to the unix socket, so any client (the `openai` package, curl, any language)
works unchanged. It also bounds the command's output (stdout and stderr together): past
the bound it kills the command's process group and exits FLOOD_EXIT, so a flood ends at
once instead of at the time bound; the exec server's own per-stream bound holds anyway.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

INSIDE = "/agentrl"  # where a sandbox sees its bridge dir (a top-level dir of its own: no host /run shows)
# the forwarder's exit codes (written as numbers in its source)
FLOOD_EXIT = 121  # it stopped a command that printed past its bound
NO_LOOPBACK_EXIT = 120  # the sandbox had no loopback to listen on (infrastructure, not the agent)
FLOOD_NOTE = "agentrl-bridge: output past"
MARGIN = 4096  # room in the exec server's per-stream bound for the forwarder's own note

# The relay runs on an asyncio loop in a thread; the command is a plain Popen the main thread
# waits on (an asyncio subprocess's wait() was seen to hang in the docker image's python 3.11
# after the command was killed).
FORWARDER = r'''
import asyncio, os, selectors, signal, socket, subprocess, sys, threading, time
SOCK, CAP, CMD = sys.argv[1], int(sys.argv[2]), sys.argv[3]

async def copy(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass

async def relay(cr, cw):
    try:
        ur, uw = await asyncio.open_unix_connection(SOCK)
    except OSError as e:
        sys.stderr.write("agentrl-bridge: cannot reach the gateway at %s: %s\n" % (SOCK, e))
        cw.close()
        return
    await asyncio.gather(copy(cr, uw), copy(ur, cw))
    for w in (uw, cw):
        w.close()

async def serve(listener):
    server = await asyncio.start_server(relay, sock=listener)
    await server.serve_forever()

try:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
except OSError as e:
    sys.stderr.write("agentrl-bridge: no loopback in the sandbox: %s\n" % e)
    sys.exit(120)
port = listener.getsockname()[1]
threading.Thread(target=asyncio.run, args=(serve(listener),), daemon=True).start()
env = dict(os.environ, OPENAI_BASE_URL="http://127.0.0.1:%d/v1" % port, OPENAI_API_BASE="http://127.0.0.1:%d/v1" % port)
child = subprocess.Popen(["/bin/sh", "-c", CMD], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
outs = {child.stdout.fileno(): sys.stdout.buffer, child.stderr.fileno(): sys.stderr.buffer}
sel = selectors.DefaultSelector()
for fd in outs:
    sel.register(fd, selectors.EVENT_READ)
total, flood, exited = 0, False, None
while sel.get_map() and not flood:
    for key, _ in sel.select(0.1):
        data = os.read(key.fd, 65536)
        if not data:
            sel.unregister(key.fd)
            continue
        room = CAP - total
        total += len(data)
        outs[key.fd].write(data[:max(room, 0)])
        outs[key.fd].flush()
        if len(data) > room:
            flood = True
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
            sys.stderr.write("\nagentrl-bridge: output past %d bytes: the command was stopped\n" % CAP)
            sys.stderr.flush()
            break
    if exited is None and child.poll() is not None:
        exited = time.monotonic()
    if exited is not None and time.monotonic() - exited > 1.0:
        break  # what it printed last is in; a process it left holding the pipes is not waited for
code = child.wait()
os._exit(121 if flood else code if code >= 0 else 128 - code)
'''


def forwarder_argv(socket_inside: str, command: str, output_bytes: int) -> list[str]:
    """The argv, run in the sandbox, that starts `command` behind the forwarder."""
    return ["python3", "-I", "-c", FORWARDER, socket_inside, str(int(output_bytes)), command]


def make_dir(path: Path) -> Path:
    """Create a sandbox's bridge dir: root's, 0711 when we are root (the sandbox's uid only passes
    through); else ours, 0700 (unprivileged sandboxes run as us)."""
    path.mkdir(parents=True, mode=0o711 if os.geteuid() == 0 else 0o700)
    path.chmod(0o711 if os.geteuid() == 0 else 0o700)
    return path


def docker_root() -> Path:
    """Where docker sandboxes' bridge dirs live on the host: in the staging tmpfs (as root), so a
    container's mountinfo shows "/bridges/<hash>", no host path (see stage.stage_root)."""
    from .stage import stage_root

    root = stage_root() / "bridges"
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    return root


def docker_dir(sandbox_id: str) -> Path:
    """A docker sandbox's bridge dir (named by a hash: "sbx-" names nothing inside)."""
    return docker_root() / hashlib.sha256(sandbox_id.encode()).hexdigest()[:16]


def remove_dir(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def reap_docker_dirs(live_ids: set[str]) -> None:
    """Remove the bridge dirs of docker sandboxes that no longer exist (and are a minute old: another
    process's container may be starting with its dir)."""
    import time

    live = {docker_dir(i).name for i in live_ids}
    for d in docker_root().iterdir():
        try:
            old = time.time() - d.stat().st_mtime > 60
        except OSError:
            continue
        if d.name not in live and old:
            remove_dir(d)


def socket_path(sandbox) -> tuple[Path, str]:
    """A fresh socket name in `sandbox`'s bridge dir: (host path, path inside)."""
    if getattr(sandbox, "bridge_dir", None) is None:
        raise RuntimeError(f"sandbox {sandbox.id} ({sandbox.backend}) has no bridge dir")
    name = f"s-{secrets.token_hex(8)}.sock"
    return sandbox.bridge_dir / name, f"{INSIDE}/{name}"
