"""`agentrl tools`: look at and try MCP tool servers.

    agentrl tools list --mcp-server python --mcp-server "fs=npx some-server ."
    agentrl tools call --mcp-server bash bash '{"command": "ls -la"}'
    agentrl tools call --mcp-server python --sandbox docker python '{"code": "1+1"}'
    agentrl tools parse --parser qwen3_coder < model_output.txt

--mcp-server takes NAME=COMMAND ARGS..., NAME=http(s)://URL, or a built-in name (python,
bash, files); repeat it for several. Without any, the built-ins (python, bash, files) run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import textwrap

from agentrl.tools.spec import builtin_spec, parse_mcp_server_flag


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl tools", description="List, call and parse MCP tools.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--mcp-server", action="append", default=[], metavar="SPEC",
                        help="NAME=COMMAND ARGS..., NAME=http(s)://URL, or python|bash|files (repeatable)")
        sp.add_argument("--sandbox", default=None, choices=["local", "docker", "auto"],
                        help="run the built-in servers inside a sandbox of this backend (default: on the host)")
        sp.add_argument("--workdir", default=None, help="working directory of host servers (default: a temp dir)")
        sp.add_argument("--timeout", type=float, default=60.0, help="seconds per call (default 60)")
        sp.add_argument("--max-output", type=int, default=16000, help="characters of a result shown (default 16000)")

    ls = sub.add_parser("list", help="print the tools with descriptions and JSON schemas")
    common(ls)
    ls.add_argument("--json", action="store_true", help="print the OpenAI-style schemas as JSON")
    call = sub.add_parser("call", help="call one tool and print its result")
    common(call)
    call.add_argument("tool")
    call.add_argument("arguments", nargs="?", default="{}", help="JSON object (default {})")
    parse = sub.add_parser("parse", help="parse tool calls in model output (stdin or --text)")
    parse.add_argument("--parser", default="hermes")
    parse.add_argument("--text", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "parse":
        from agentrl.tools.parsers import parse_tool_calls
        text = args.text if args.text is not None else sys.stdin.read()
        for item in parse_tool_calls(text, args.parser):
            print(json.dumps(item.__dict__, ensure_ascii=False))
        return 0
    try:
        specs = [parse_mcp_server_flag(s) for s in args.mcp_server] or [builtin_spec()]
    except ValueError as e:
        print(f"agentrl tools: {e}", file=sys.stderr)
        return 2
    arguments = None
    if args.cmd == "call":
        try:
            arguments = json.loads(args.arguments)
        except json.JSONDecodeError as e:
            print(f"agentrl tools call: ARGUMENTS is not valid JSON ({e}): {args.arguments!r}", file=sys.stderr)
            return 2
    return asyncio.run(_run(args, specs, arguments))


async def _run(args, specs, arguments) -> int:
    from agentrl.tools.client import ToolServerError, ToolSet
    sandbox = None
    try:
        if args.sandbox and any(s.in_sandbox for s in specs):
            from agentrl.sandboxes import create
            from agentrl.tools.spec import tool_sandbox_options
            mounts, env = tool_sandbox_options()
            sandbox = await create(args.sandbox, mounts=mounts, env=env)
        async with ToolSet(specs, sandbox=sandbox, workdir=args.workdir, call_timeout=args.timeout,
                           max_output_chars=args.max_output) as tools:
            if args.cmd == "list":
                if args.json:
                    print(json.dumps(tools.schemas, indent=2, ensure_ascii=False))
                    return 0
                for info in tools.tools.values():
                    where = f"server {info.server}" + (f", remote name {info.remote_name}"
                                                       if info.remote_name != info.name else "")
                    print(f"{info.name}  ({where})")
                    print(textwrap.indent(info.description.strip() or "(no description)", "    "))
                    print(textwrap.indent("parameters: " + json.dumps(info.schema()["function"]["parameters"],
                                                                      ensure_ascii=False), "    "))
                    print()
                return 0
            result = await tools.call(args.tool, arguments)
            print(result.content)
            return 1 if result.is_error else 0
    except ToolServerError as e:
        print(f"agentrl tools: {e}", file=sys.stderr)
        return 3
    finally:
        if sandbox is not None:
            await sandbox.close()


if __name__ == "__main__":
    sys.exit(main())
