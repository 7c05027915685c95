"""MCP tool server with several built-in tools in one process (one MCP server start per
trajectory instead of one per tool: each start costs about a second of CPU).

    python -m agentrl.tools.builtin_server --tools python,bash,files [--workdir DIR]

Same tools and options as `python_server`, `bash_server` and `files_server`.
"""

from __future__ import annotations

from pathlib import Path

from mcp.server.mcpserver import MCPServer

from agentrl.tools._common import new_server, serve

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
    def build(args, workdir, **limits):
        return build_server([t.strip() for t in args.tools.split(",") if t.strip()], workdir, **limits)

    serve("agentrl.tools.builtin_server", __doc__, build, argv,
          lambda p: p.add_argument("--tools", default=",".join(BUILTINS), help="comma-separated: python,bash,files"))


if __name__ == "__main__":
    main()
