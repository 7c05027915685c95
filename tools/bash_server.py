"""MCP tool server `bash`: run a shell command in the workdir.

    python -m agentrl.tools.bash_server [--workdir DIR] [--timeout 30]

Tool ``bash(command, timeout=None)``: runs ``bash -c command`` (``sh`` without bash) in the
workdir with stdin from /dev/null; returns stdout and stderr interleaved, then the exit
code. On a timeout the command's process group is killed and the output so far is
returned with a note. Processes a command leaves in the background are killed when it
returns, also those that left its process group (`setsid cmd &`: the server is their
subreaper). Each call is a fresh shell (cd / export do not carry over); the files persist.
Confinement is the sandbox's job, not this server's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

from mcp.server.mcpserver import MCPServer

from agentrl.tools._common import (KEEP_PIDS, become_subreaper, child_env, child_identity, clip, kill_leftovers,
                                   new_server, resolve_workdir, serve)


async def run_command(command: str, cwd: Path, timeout: float, max_output: int) -> tuple[int | None, str, bool]:
    """(exit code or None on timeout, output, timed_out)."""
    bash = shutil.which("bash")
    # --norc --noprofile: no startup file, whatever the agent writes to its HOME (the workdir)
    shell = [bash, "--norc", "--noprofile"] if bash else ["/bin/sh"]
    proc = await asyncio.create_subprocess_exec(
        *shell, "-c", command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=str(cwd), env=child_env(), start_new_session=True,
        **child_identity())
    KEEP_PIDS.add(proc.pid)
    chunks, size = [], 0

    async def reader():
        nonlocal size
        while True:
            data = await proc.stdout.read(65536)
            if not data:
                return
            size += len(data)
            if sum(len(c) for c in chunks) < 4 * max_output:  # keep a bounded amount
                chunks.append(data)

    read_task = asyncio.create_task(reader())
    # Wait for the exit, not `proc.wait()`: that also waits for the pipe to close, which a
    # background process (`cmd &`) holding it would turn into a timeout of a finished call.
    timed_out = not await _exited(proc, timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the command on timeout; its leftovers otherwise
    except (ProcessLookupError, PermissionError):
        pass
    KEEP_PIDS.discard(proc.pid)
    kill_leftovers(KEEP_PIDS)  # what left the process group (setsid, double forks), orphaned to us
    try:
        await asyncio.wait_for(proc.wait(), 10)
        await asyncio.wait_for(read_task, 5)
    except asyncio.TimeoutError:  # something we could not kill still holds the pipe
        read_task.cancel()
    out = b"".join(chunks).decode("utf-8", errors="replace")
    if size > len(b"".join(chunks)):
        out += f"\n[... {size - len(b''.join(chunks))} more bytes of output dropped ...]"
    return (None if timed_out else proc.returncode), out, timed_out


async def _exited(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """Whether `proc` exits within `timeout` s (its pipes may stay open): a pidfd, readable at
    the exit; polling where there is none (or the process is already gone)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        exited = loop.create_future()
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    while proc.returncode is None and loop.time() < deadline:  # the child watcher's reap lags the exit
        await asyncio.sleep(0.005)
    return proc.returncode is not None


def add_bash_tool(server: MCPServer, workdir: Path | str | None = None, timeout: float = 30.0,
                  max_timeout: float = 600.0, max_output: int = 64 * 1024) -> None:
    root = resolve_workdir(workdir)
    become_subreaper()

    @server.tool(name="bash", structured_output=False)
    async def bash(command: str, timeout: float | None = None) -> str:
        """Run a shell command (bash -c) in the task's working directory and return its output
        (stdout and stderr together) and exit code. Each call starts a fresh shell; files persist.

        Args:
            command: the command line to run.
            timeout: seconds before the command is killed.
        """
        limit = min(float(timeout or default_timeout), max_timeout)
        code, out, timed_out = await run_command(command, root, limit, max_output)
        out = clip(out.rstrip("\n"), max_output)
        status = (f"[timed out after {limit:g} s: the command was killed]" if timed_out
                  else f"[exit code: {code}]")
        return f"{out}\n{status}" if out else status

    default_timeout = timeout


def build_server(workdir: Path | str | None = None, **kw) -> MCPServer:
    server = new_server("bash", "Run shell commands in the task's working directory with `bash`.")
    add_bash_tool(server, workdir, **kw)
    return server


def main(argv: list[str] | None = None) -> None:
    serve("agentrl.tools.bash_server", __doc__, lambda args, workdir, **limits: build_server(workdir, **limits), argv)


if __name__ == "__main__":
    main()
