"""The exec server that runs INSIDE every sandbox (docker container or bubblewrap namespace).

The host starts it once per sandbox (`python3 -I -c <boot>` with cwd "/", its source on stdin;
so nothing the agent writes to the workdir is ever on its import path), stdin/stdout piped,
and then sends one JSON request per line; it answers one JSON line per request. Running
commands through a warm server costs a fork+exec inside the sandbox instead of a fresh
`docker exec` / `bwrap` per command, which is what keeps exec latency near a bare
subprocess on the host.

Requests (`id` is echoed back):
  {"op": "exec", "argv": [...], "stdin": b64, "timeout": s, "limit": bytes, "cwd": p, "env": {}}
      -> {"exit_code", "stdout": b64, "stderr": b64, "timed_out", "truncated", "killed": n}
  {"op": "write", "path": p, "data": b64, "mode": 0o644} -> {"ok": true} | {"error": msg}
  {"op": "read", "path": p, "limit": bytes} -> {"data": b64, "truncated": bool} | {"error": msg}

After every exec, every process of the sandbox that is not protected is SIGKILLed, so
nothing an agent starts outlives its command. Protected: pid 1 (docker: the container's
reaper; local: bubblewrap's), this server, and the process trees of other `docker exec`
sessions (root has ppid 0: the host's `Sandbox.spawn`).

The server makes itself non-dumpable, so a command running as the same uid can neither
ptrace it nor open its /proc/<pid>/fd pipes to forge answers. Standard library only; it
must run on the sandbox's python3 (>= 3.6).
"""
import base64
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import time

CHUNK = 65536


def _nondumpable():
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _proc_table():
    """{pid: (ppid, state, starttime)} for every process visible in /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2:].split()
        table[int(name)] = (int(rest[1]), rest[0], int(rest[19]))
    return table


def _leftovers(me, sessions=True):
    """Pids to kill: every process but pid 1, this server and (sessions=True) the trees of other
    `docker exec` sessions."""
    table = _proc_table()
    children = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    protected = {1, me}
    # other `docker exec` sessions (host spawns) and their trees
    stack = [p for p, (pp, _, _) in table.items() if pp == 0 and p not in (1, me)] if sessions else []
    while stack:
        pid = stack.pop()
        protected.add(pid)
        stack.extend(children.get(pid, []))
    return [p for p, (_, st, _) in table.items() if p not in protected and _alive(p, st)]


def _alive(pid, state):
    """Not a plain zombie: a process whose main thread exited shows as one while its other
    threads run (a kill of its pid ends them)."""
    if state != b"Z":
        return True
    try:
        return len(os.listdir("/proc/%d/task" % pid)) > 1
    except OSError:
        return False


def kill_leftovers(me, deadline_s=2.0, sessions=True):
    killed = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = _leftovers(me, sessions)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.002)
    return len(killed)


def run(req, me):
    data = base64.b64decode(req.get("stdin") or "")
    limit = int(req.get("limit") or 1 << 20)
    timeout = float(req.get("timeout") or 60)
    env = dict(os.environ)
    env.update(req.get("env") or {})
    # a server that holds two uids (docker: real 0, effective the agent's) starts commands with
    # the effective one as all their uids, so they cannot signal or trace the servers
    ident = {}
    if os.getuid() != os.geteuid() and not req.get("as_server"):
        ident = {"user": os.geteuid(), "group": os.getegid()}
    # sweep (a reset): every other process goes, the servers of other sessions too (the host
    # killed their clients, but `docker exec` does not pass a kill on), before the command runs
    # and after it, so nothing left writes into what the command wiped and checked
    sessions = not req.get("sweep")
    killed = 0 if sessions else kill_leftovers(me, sessions=False)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            req["argv"], stdin=subprocess.PIPE if data else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=req.get("cwd") or None,
            env=env, start_new_session=True, close_fds=True, **ident)
    except OSError as e:
        return {"exit_code": 127, "stdout": "", "timed_out": False, "truncated": False,
                "stderr": base64.b64encode(("cannot run %r: %s\n" % (req["argv"][0], e)).encode()).decode()}
    sel = selectors.DefaultSelector()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    view = memoryview(data)
    truncated = timed_out = False
    exited_at = None
    swept = False
    while sel.get_map():
        now = time.monotonic()
        if not timed_out and now - t0 > timeout:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            killed += kill_leftovers(me, sessions=sessions)
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and not swept and now - exited_at > 0.05:
            # the command is gone but something still holds its pipes: a leftover process
            killed += kill_leftovers(me, sessions=sessions)
            swept = True
        if (swept and now - exited_at > 2.0) or (timed_out and now - t0 > timeout + 2.0):
            break  # pipes held by something we cannot kill: stop reading
        for key, _ in sel.select(0.02):
            fd = key.fd
            if fd in bufs:
                try:
                    chunk = os.read(fd, CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = limit - len(buf)
                if len(chunk) > room:
                    truncated = True
                    chunk = chunk[:max(room, 0)]
                buf += chunk
            else:
                try:
                    n = os.write(fd, view[:CHUNK])
                    view = view[n:]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    view = view[len(view):]
                if not len(view):
                    sel.unregister(fd)
                    proc.stdin.close()
    if data and not proc.stdin.closed:
        proc.stdin.close()
    remaining = max(0.1, timeout - (time.monotonic() - t0))
    try:
        code = proc.wait(remaining)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    killed += kill_leftovers(me, sessions=sessions)
    proc.stdout.close()
    proc.stderr.close()
    return {"exit_code": code if code >= 0 else 128 - code, "timed_out": timed_out,
            "truncated": truncated, "killed": killed,
            "stdout": base64.b64encode(bytes(bufs[out_fd])).decode(),
            "stderr": base64.b64encode(bytes(bufs[err_fd])).decode()}


def _open_regular(path, flags):
    """Open a regular file without blocking: a FIFO or device the agent put in its place
    would hang the server (and with it the host's read), so anything else is refused."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError("%s is not a regular file" % path)
    os.set_blocking(fd, True)
    return fd


def write(req):
    path = req["path"]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with os.fdopen(_open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(base64.b64decode(req["data"]))
        os.fchmod(f.fileno(), int(req.get("mode") or 0o644))
    return {"ok": True}


def read(req):
    limit = int(req.get("limit") or 1 << 26)
    with os.fdopen(_open_regular(req["path"], os.O_RDONLY), "rb") as f:
        data = f.read(limit + 1)
    return {"data": base64.b64encode(data[:limit]).decode(), "truncated": len(data) > limit}


def main():
    _nondumpable()
    me = os.getpid()
    out = sys.stdout.buffer

    def send(obj):
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    send({"ready": True, "pid": me, "uid": os.getuid(), "python": sys.version.split()[0]})
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "exec":
                resp = run(req, me)
            elif op == "write":
                resp = write(req)
            elif op == "read":
                resp = read(req)
            elif op == "ping":
                resp = {"ok": True}
            else:
                resp = {"error": "unknown op %r" % op}
        except Exception as e:  # report, never die: the host decides what it means
            req = req if isinstance(req, dict) else {}
            resp = {"error": "%s: %s" % (type(e).__name__, e)}
        resp["id"] = req.get("id")
        send(resp)


if __name__ == "__main__":
    main()
