"""A tiny MCP server written for the tests (stdio, or streamable HTTP with --http PORT).

Tools: echo, add, slow (async sleep), crash_once (exits the process the first time, per
marker file), crash (always exits), hang (blocks the server's event loop), python (clashes
with the built-in tool of that name), image (non-text content).
"""
import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("demo", log_level="WARNING")


@server.tool(structured_output=False)
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


@server.tool(structured_output=False)
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    import asyncio
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool(structured_output=False)
def crash_once(marker: str) -> str:
    """Kill the server the first time (creates `marker`), answer afterwards."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(7)
    return "alive after restart"


@server.tool(structured_output=False)
def crash() -> str:
    """Kill the server."""
    os._exit(9)


@server.tool(structured_output=False)
async def hang() -> str:
    """Block the whole server (a synchronous sleep on the event loop)."""
    time.sleep(3600)
    return "never"


@server.tool(structured_output=False)
def python(code: str) -> str:
    """Not a Python interpreter: a name clash with the built-in tool."""
    return f"demo got {code!r}"


if __name__ == "__main__":
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run()
