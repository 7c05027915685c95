"""MCP tool server `python`: a stateful Python interpreter (one per trajectory).

    python -m agentrl.tools.python_server [--workdir DIR] [--timeout 30]

Tool ``python(code, timeout=None)``: runs `code` in a persistent namespace (variables,
imports and functions survive between calls) and returns its stdout, stderr and the repr
of the last expression, like a notebook cell. The namespace lives in a worker process
(`_python_worker.py`, standard library only); on a timeout the worker's process group is
killed and a fresh one starts at the next call (variables are lost, and the model is told).
Confinement is the sandbox's job, not this server's.

Importable: ``build_server(workdir=...)`` returns the MCPServer; ``add_python_tool(server, ...)``
adds the tool to another server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from agentrl.tools._common import KEEP_PIDS, child_env, child_identity, clip, new_server, resolve_workdir, serve

WORKER = str(Path(__file__).with_name("_python_worker.py"))


class Interpreter:
    """The worker process holding the namespace; restarted after a timeout or a crash."""

    def __init__(self, workdir: Path, python: str = sys.executable):
        self.workdir, self.python = workdir, python
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    async def _start(self) -> None:
        if self.proc is not None:
            KEEP_PIDS.discard(self.proc.pid)
        self.proc = await asyncio.create_subprocess_exec(
            # -I: no user site (HOME is the workdir: a planted usercustomize.py or .pth would run at
            # every start), no PYTHON* variables, no cwd on the path while it starts; the worker adds
            # the workdir and PYTHONPATH once it runs. stderr: the worker's own (the code's goes to a
            # file it reads back); never the server's, which the host reads
            self.python, "-I", "-u", WORKER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, cwd=str(self.workdir), env=child_env(), start_new_session=True, limit=256 << 20,
            **child_identity())
        KEEP_PIDS.add(self.proc.pid)  # the bash tool's cleanup spares the interpreter

    async def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        KEEP_PIDS.discard(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the model's subprocesses too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            pass

    async def run(self, code: str, timeout: float, max_output: int) -> dict:
        async with self.lock:
            if self.proc is None or self.proc.returncode is not None:
                await self._start()
            proc = self.proc
            try:
                proc.stdin.write(json.dumps({"code": code, "max_output": max_output}).encode() + b"\n")
                await proc.stdin.drain()
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            except asyncio.TimeoutError:
                await self.kill()
                raise ToolError(f"TimeoutError: the code ran longer than {timeout:g} s and was stopped. The "
                                "interpreter was restarted: all variables, imports and functions are lost.") from None
            except (BrokenPipeError, ConnectionResetError):
                line = b""
            if not line:
                await asyncio.sleep(0.05)
                code_ = proc.returncode
                await self.kill()
                how = f"exit code {code_}" if code_ is not None and code_ >= 0 else \
                    f"killed by signal {-code_}" if code_ is not None else "unknown cause"
                raise ToolError(f"the Python process died ({how}; out of memory, os._exit or a crash). It was "
                                "restarted: all variables, imports and functions are lost.")
            return json.loads(line)


def add_python_tool(server: MCPServer, workdir: Path | str | None = None, timeout: float = 30.0,
                    max_timeout: float = 600.0, max_output: int = 64 * 1024) -> Interpreter:
    interp = Interpreter(resolve_workdir(workdir))

    @server.tool(name="python", structured_output=False)
    async def python(code: str, timeout: float | None = None) -> str:
        """Run Python code in a persistent interpreter: variables, imports and functions stay defined
        between calls. Returns what the code printed (stdout, stderr with tracebacks) and the value
        of the last expression, like a notebook cell. The working directory is the task's workdir.

        Args:
            code: Python source to run.
            timeout: seconds before the run is stopped (the interpreter is then restarted and its state lost).
        """
        limit = min(float(timeout or default_timeout), max_timeout)
        res = await interp.run(code, limit, max_output)
        parts = []
        if res["stdout"]:
            parts.append(res["stdout"].rstrip("\n"))
        if res["stderr"]:
            parts.append(("[stderr]\n" if res["stdout"] else "") + res["stderr"].rstrip("\n"))
        if res.get("value") is not None:
            parts.append(res["value"])
        if not parts:
            parts.append("(no output)" if not res.get("error") else res["error"])
        return clip("\n".join(parts), max_output)

    default_timeout = timeout
    return interp


def build_server(workdir: Path | str | None = None, **kw) -> MCPServer:
    server = new_server("python", "A stateful Python interpreter: call `python` with code to run.")
    add_python_tool(server, workdir, **kw)
    return server


def main(argv: list[str] | None = None) -> None:
    serve("agentrl.tools.python_server", __doc__, lambda args, workdir, **limits: build_server(workdir, **limits), argv)


if __name__ == "__main__":
    main()
