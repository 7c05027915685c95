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
    env = dict(os.environ)
    if CHILD_PYTHONPATH_VAR in env:
        child = env.pop(CHILD_PYTHONPATH_VAR)
        if child:
            env["PYTHONPATH"] = child
        else:
            env.pop("PYTHONPATH", None)
    return env


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
