"""MCP tool server with several built-in tools in one process (one MCP server start per
trajectory instead of one per tool: each start costs about a second of CPU).

    python -m agentrl.tools.builtin_server --tools python,bash,files [--workdir DIR]

Same tools and options as `python_server`, `bash_server` and `files_server`.
"""

from __future__ import annotations

import os
from pathlib import Path

from mcp.server.mcpserver import MCPServer

from agentrl.tools._common import base_argparser, new_server, resolve_workdir

BUILTINS = ("python", "bash", "files")


def build_server(tools: tuple[str, ...] | list[str] = BUILTINS, workdir: Path | str | None = None,
                 timeout: float = 30.0, max_timeout: float = 600.0, max_output: int = 64 * 1024,
                 name: str = "builtin") -> MCPServer:
    unknown = [t for t in tools if t not in BUILTINS]
    if unknown:
        raise ValueError(f"unknown built-in tool(s) {unknown}: choose from {', '.join(BUILTINS)}")
    server = new_server(name, f"Built-in tools: {', '.join(tools)}, working in the task's directory.")
    kw = dict(timeout=timeout, max_timeout=max_timeout, max_output=max_output)
    if "python" in tools:
        from agentrl.tools.python_server import add_python_tool
        add_python_tool(server, workdir, **kw)
    if "bash" in tools:
        from agentrl.tools.bash_server import add_bash_tool
        add_bash_tool(server, workdir, **kw)
    if "files" in tools:
        from agentrl.tools.files_server import add_file_tools
        add_file_tools(server, workdir, max_output=max_output)
    return server


def main(argv: list[str] | None = None) -> None:
    p = base_argparser("python -m agentrl.tools.builtin_server", __doc__)
    p.add_argument("--tools", default=",".join(BUILTINS), help="comma-separated: python,bash,files")
    args = p.parse_args(argv)
    workdir = resolve_workdir(args.workdir)
    os.chdir(workdir)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    build_server(tools, workdir, timeout=args.timeout, max_timeout=args.max_timeout, max_output=args.max_output).run()


if __name__ == "__main__":
    main()
