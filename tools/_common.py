"""Shared bits of the built-in tool servers (stdlib + the mcp SDK only: they run inside
sandboxes, where nothing else of agentrl's dependencies may be importable)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

#: Environment variable naming the workdir of the built-in servers (default: their cwd).
WORKDIR_VAR = "AGENTRL_TOOLS_WORKDIR"
#: When set, the PYTHONPATH the servers give to the model's code (python, bash): the
#: sandbox launcher sets it so the mounts that make the server run don't leak to the model.
CHILD_PYTHONPATH_VAR = "AGENTRL_CHILD_PYTHONPATH"
DEFAULT_MAX_OUTPUT = 64 * 1024  # characters a server returns per call (the client truncates again)


def new_server(name: str, instructions: str):
    from mcp.server.mcpserver import MCPServer

    logging.getLogger("mcp").setLevel(logging.WARNING)
    return MCPServer(name, instructions=instructions, log_level="WARNING")


def resolve_workdir(path: str | os.PathLike | None = None) -> Path:
    return Path(path or os.environ.get(WORKDIR_VAR) or os.getcwd()).resolve()


def child_env() -> dict[str, str]:
    """Environment for processes the model starts (python worker, bash commands)."""
    # no shell startup file: bash -c reads $BASH_ENV, sh $ENV (the workdir is the agent's)
    env = {k: v for k, v in os.environ.items() if k not in ("BASH_ENV", "ENV")}
    if CHILD_PYTHONPATH_VAR in env:
        child = env.pop(CHILD_PYTHONPATH_VAR)
        if child:
            env["PYTHONPATH"] = child
        else:
            env.pop("PYTHONPATH", None)
    return env


def child_identity() -> dict[str, int]:
    """subprocess keywords for processes the model starts: a server holding two uids (in a docker
    sandbox: real 0, effective the agent's; see agentrl.sandboxes.base.SERVER_IDENTITY) gives
    them the effective one as all their uids, so they cannot signal or trace the server."""
    if os.getuid() != os.geteuid():
        return {"user": os.geteuid(), "group": os.getegid()}
    return {}


#: pids whose process trees outlive a tool call (the python tool's interpreter) or belong to a
#: call still running: `kill_leftovers` spares them
KEEP_PIDS: set[int] = set()


def become_subreaper() -> None:
    """Processes the model's commands orphan (``setsid cmd &``, double forks) are re-parented to
    this server instead of init, so `kill_leftovers` finds them (Linux; a no-op elsewhere)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def kill_leftovers(keep: set[int], deadline_s: float = 2.0) -> int:
    """SIGKILL every descendant of this process outside the trees rooted at `keep`; returns
    how many were killed. Repeats (bounded) while killing makes new orphans appear."""
    import signal
    import time
    me, killed = os.getpid(), set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                except OSError:
                    continue
                rest = stat[stat.rfind(b")") + 2:].split()
                if rest[0] != b"Z" or _has_threads(name):  # a zombie leader whose threads still run counts
                    children.setdefault(int(rest[1]), []).append(int(name))
        doomed, stack = [], [p for p in children.get(me, []) if p not in keep]
        while stack:
            pid = stack.pop()
            doomed.append(pid)
            stack += [c for c in children.get(pid, []) if c not in keep]
        if not doomed:
            break
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.005)
    return len(killed)


def _has_threads(pid: str) -> bool:
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def clip(text: str, limit: int, hint: str = "") -> str:
    """Keep the head and the tail of `text` within `limit` characters, saying what was cut."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    note = f"\n\n[... {len(text) - head - tail} characters truncated (output was {len(text)} characters){hint} ...]\n\n"
    return text[:head] + note + text[len(text) - tail:]


def base_argparser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--workdir", default=None, help=f"working directory (default ${WORKDIR_VAR} or the cwd)")
    p.add_argument("--timeout", type=float, default=30.0, help="default time limit of one call, seconds")
    p.add_argument("--max-timeout", type=float, default=600.0, help="largest timeout a call may ask for")
    p.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT, help="characters returned per call")
    return p


def serve(module: str, doc: str, build, argv: list[str] | None = None, add_flags=None) -> None:
    """A tool server's `main`: the shared flags (plus `add_flags(parser)`'s), work in --workdir,
    then `build(args, workdir, timeout=, max_timeout=, max_output=)` serves on stdio."""
    parser = base_argparser(f"python -m {module}", doc)
    if add_flags is not None:
        add_flags(parser)
    args = parser.parse_args(argv)
    workdir = resolve_workdir(args.workdir)
    os.chdir(workdir)
    build(args, workdir, timeout=args.timeout, max_timeout=args.max_timeout, max_output=args.max_output).run()
