"""agentrl.tools — tools are MCP servers, usually running inside the trajectory's sandbox.

Built-in servers (real MCP servers over stdio, also usable from any MCP client):
    python -m agentrl.tools.python_server   # `python`: stateful interpreter, timeout, restart
    python -m agentrl.tools.bash_server     # `bash`: a command in the workdir, exit code, timeout
    python -m agentrl.tools.files_server    # read_file, write_file, list_files, edit_file
    python -m agentrl.tools.builtin_server --tools python,bash,files   # several in one process

Client side (imported lazily from here):
    ToolEnv            agentrl.tools.env       base class of envs with tools
    ToolSet            agentrl.tools.client    connect, list, call, results -> tool messages
    ToolServerError    agentrl.tools.client    a server failed beyond one restart (infra failure)
    MCPServerSpec, builtin_spec, parse_mcp_server_flag, tool_sandbox_options   agentrl.tools.spec
    parse_tool_calls, register_parser, ToolCall, ToolCallError                 agentrl.tools.parsers
    function_tool      agentrl.tools.functions plain Python functions as tools
CLI: `agentrl tools list|call --mcp-server ...` (agentrl.tools.cli).

This package's __init__ stays import-free: the servers import it inside sandboxes, where
only the standard library and `mcp` are available.
"""

_EXPORTS = {
    "ToolEnv": "agentrl.tools.env",
    "ToolSet": "agentrl.tools.client", "ToolResult": "agentrl.tools.client", "ToolInfo": "agentrl.tools.client",
    "ToolServerError": "agentrl.tools.client",
    "MCPServerSpec": "agentrl.tools.spec", "builtin_spec": "agentrl.tools.spec",
    "parse_mcp_server_flag": "agentrl.tools.spec", "tool_sandbox_options": "agentrl.tools.spec",
    "parse_tool_calls": "agentrl.tools.parsers", "register_parser": "agentrl.tools.parsers",
    "get_parser": "agentrl.tools.parsers", "ToolCall": "agentrl.tools.parsers",
    "ToolCallError": "agentrl.tools.parsers",
    "function_tool": "agentrl.tools.functions", "FunctionTool": "agentrl.tools.functions",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agentrl.tools' has no attribute {name!r}")
