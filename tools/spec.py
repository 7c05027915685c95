"""How to reach an MCP tool server: `MCPServerSpec`, the built-in servers, `--mcp-server` flags,
and what a sandbox needs to run tool servers inside it.

    MCPServerSpec("search", command=["python", "-m", "my_search_server"])   # stdio, host process
    MCPServerSpec("web", url="http://127.0.0.1:8000/mcp")                   # streamable HTTP
    builtin_spec("python", "bash", "files")          # one server process with the three built-ins
    parse_mcp_server_flag("fs=npx some-mcp-server --root .")                # the CLI's --mcp-server

Built-in specs run inside the trajectory's sandbox when there is one (`in_sandbox=True`):
the command's ``{python}`` is the sandbox's ``python3`` there and this interpreter on the host.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from agentrl.sandboxes.base import SERVER_IDENTITY
from agentrl.tools._common import CHILD_PYTHONPATH_VAR, WORKDIR_VAR

PYTHON = "{python}"  # placeholder in a command: the host's interpreter, or python3 in a sandbox
BUILTIN_NAMES = ("python", "bash", "files")
BUILTIN_TOOL_NAMES = {"python": ("python",), "bash": ("bash",),
                      "files": ("read_file", "write_file", "list_files", "edit_file")}
SANDBOX_SRC = "/opt/agentrl"        # where the agentrl sources are mounted inside a sandbox
SANDBOX_SITE = "/opt/agentrl-site"  # where the host's site-packages (mcp and its deps) are mounted


@dataclass
class MCPServerSpec:
    """One MCP server. Exactly one of `command` (stdio: argv) and `url` (streamable HTTP).

    env: extra environment variables for the server process. cwd: its working directory
    (default: the ToolSet's workdir on the host, the sandbox's workdir inside one).
    in_sandbox: run it inside the ToolSet's sandbox when there is one (else on the host).
    timeout_s: per-call timeout for this server's tools (default: the ToolSet's).
    headers: HTTP headers for `url` servers.
    """
    name: str
    command: list[str] | None = None
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    in_sandbox: bool = False
    timeout_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"MCP server name {self.name!r}: use letters, digits, '_' and '-'")
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of command (stdio) and url (HTTP)")
        if self.command is not None:
            if isinstance(self.command, str):
                self.command = shlex.split(self.command)
            if not self.command:
                raise ValueError(f"MCP server {self.name!r}: empty command")

    def describe(self) -> str:
        where = self.url or shlex.join(self.command or [])
        return f"{self.name}={where}" + (" (in sandbox)" if self.in_sandbox else "")


def builtin_spec(*tools: str, name: str | None = None, timeout: float | None = None,
                 max_output: int | None = None, in_sandbox: bool = True,
                 max_timeout: float | None = None) -> MCPServerSpec:
    """A server with the named built-in tools (python, bash, files), in one process.
    max_timeout: the longest timeout a call may ask for (the server's default: 600 s); the client
    then waits that long plus 30 s, so a call within it is never taken for a hung server."""
    tools = tools or BUILTIN_NAMES
    bad = [t for t in tools if t not in BUILTIN_NAMES]
    if bad:
        raise ValueError(f"unknown built-in tool server(s) {bad}: choose from {', '.join(BUILTIN_NAMES)}")
    if len(tools) == 1:
        cmd = [PYTHON, "-m", f"agentrl.tools.{tools[0]}_server"]
    else:
        cmd = [PYTHON, "-m", "agentrl.tools.builtin_server", "--tools", ",".join(tools)]
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    if max_timeout is not None:
        cmd += ["--max-timeout", str(max_timeout)]
    if max_output is not None:
        cmd += ["--max-output", str(max_output)]
    longest = max(t for t in (timeout, max_timeout, -1.0) if t is not None)
    return MCPServerSpec(name or (tools[0] if len(tools) == 1 else "builtin"), command=cmd, in_sandbox=in_sandbox,
                         timeout_s=None if longest < 0 else longest + 30)


def parse_mcp_server_flag(value: str) -> MCPServerSpec:
    """``--mcp-server`` value -> spec: ``NAME=COMMAND ARGS...`` (stdio), ``NAME=http(s)://...``
    (streamable HTTP), or a built-in name (``python``, ``bash``, ``files``)."""
    value = value.strip()
    if value in BUILTIN_NAMES:
        return builtin_spec(value)
    name, sep, rest = value.partition("=")
    name, rest = name.strip(), rest.strip()
    if not sep or not name or not rest:
        raise ValueError(f"--mcp-server {value!r}: expected NAME=COMMAND ARGS..., NAME=http(s)://URL, "
                         f"or one of {', '.join(BUILTIN_NAMES)}")
    if rest.startswith(("http://", "https://")):
        return MCPServerSpec(name, url=rest)
    if rest in BUILTIN_NAMES:  # NAME=python: the built-in under another name
        return replace(builtin_spec(rest), name=name)
    return MCPServerSpec(name, command=shlex.split(rest))


def as_spec(server: "MCPServerSpec | str") -> MCPServerSpec:
    return server if isinstance(server, MCPServerSpec) else parse_mcp_server_flag(server)


def host_command(spec: MCPServerSpec) -> list[str]:
    return [sys.executable if a == PYTHON else a for a in spec.command or []]


# ---- sandboxes ------------------------------------------------------------------------------
#: what a built-in server needs of agentrl inside a sandbox: the tools package's servers, under
#: an `agentrl` package of its own (its real __init__ would import the core and its dependencies)
TOOL_SERVER_MODULES = ("__init__", "_common", "_python_worker", "python_server", "bash_server",
                       "files_server", "builtin_server")
_STUB_INIT = b'"""agentrl, as staged into sandboxes: only the built-in tool servers (agentrl.tools)."""\n'
# How a `{python} -m MODULE` server starts inside a sandbox: isolated (-I: no cwd, PYTHONPATH or user
# site on sys.path, so a module the agent planted in the workdir is never imported, even at a restart),
# with the staged code first on sys.path, under the servers' identity (sandboxes.base.SERVER_IDENTITY:
# not dumpable, and on docker a uid pair the agent's code cannot signal): no forged answers through
# its pipes, no rewrite of its memory.
SERVER_BOOT = SERVER_IDENTITY + (
    f"import sys, runpy; sys.path[:0] = [{SANDBOX_SRC!r}, {SANDBOX_SITE!r}]; del sys.argv[1]; "
    "mod = sys.argv.pop(1); runpy.run_module(mod, run_name='__main__', alter_sys=True)")


def site_packages_dir() -> Path:
    """The site-packages folder holding `mcp` (and its dependencies) in this interpreter."""
    import mcp
    return Path(mcp.__file__).resolve().parent.parent


def tool_sandbox_options() -> tuple[dict[str, str], dict[str, str]]:
    """(mounts, env) for `agentrl.sandboxes.create(...)` so that the built-in tool servers can
    run inside: their sources (only `TOOL_SERVER_MODULES`, no data files) at /opt/agentrl, and
    the `mcp` SDK with its dependencies (those distributions only, not this interpreter's
    whole site-packages) at /opt/agentrl-site, both staged copies mounted read-only. The
    sandbox's python3 must be the same minor version as this one (3.11: the base image's
    Debian bookworm python3, or the host's /usr/bin/python3 in the local backend)."""
    from agentrl.sandboxes.stage import distribution_files, stage_files
    tools_dir = Path(__file__).resolve().parent
    src = {"agentrl/__init__.py": _STUB_INIT,
           **{f"agentrl/tools/{m}.py": tools_dir / f"{m}.py" for m in TOOL_SERVER_MODULES}}
    return {str(stage_files(src)): SANDBOX_SRC, str(stage_files(distribution_files("mcp"))): SANDBOX_SITE}, {}


def sandbox_server_env(spec: MCPServerSpec, workdir: str) -> dict[str, str]:
    """Environment of a server started inside a sandbox (the staged code is on its sys.path
    through `SERVER_BOOT`, so the model's code, python/bash children, does not see it)."""
    return {CHILD_PYTHONPATH_VAR: "", WORKDIR_VAR: workdir, "PYTHONDONTWRITEBYTECODE": "1", **spec.env}


def boots_as_server(argv: list[str]) -> bool:
    """argv (from `sandbox_command`) starts through SERVER_BOOT, which takes the servers' identity."""
    return argv[:4] == ["python3", "-I", "-c", SERVER_BOOT]


def sandbox_command(spec: MCPServerSpec, tag: str = "-") -> list[str]:
    """argv inside the sandbox: ``{python} -m MODULE ARGS`` starts through `SERVER_BOOT`
    (isolated, the servers' identity), with `tag` in its command line (what finds it again:
    its /proc environ is closed); other commands run as given."""
    cmd = list(spec.command or [])
    if len(cmd) >= 3 and cmd[0] == PYTHON and cmd[1] == "-m":
        return ["python3", "-I", "-c", SERVER_BOOT, tag, *cmd[2:]]
    return ["python3" if a == PYTHON else a for a in cmd]


def host_env(spec: MCPServerSpec, workdir: str) -> dict[str, str]:
    """Environment of a host server, on top of the SDK's safe defaults (HOME, PATH, ...)."""
    passthrough = {k: os.environ[k] for k in ("PYTHONPATH", "VIRTUAL_ENV", "LANG", "TMPDIR") if k in os.environ}
    return {**passthrough, WORKDIR_VAR: workdir, **spec.env}
