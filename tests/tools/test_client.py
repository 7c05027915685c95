"""ToolSet against a server written for the tests (demo_server.py): restarts, hangs,
external servers by command line and URL, name clashes, function tools."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.tools import MCPServerSpec, ToolEnv, ToolServerError, ToolSet, parse_mcp_server_flag
from agentrl.tools.spec import builtin_spec
from tools_fixtures import arun, demo_command  # noqa: F401 (fixtures)
from waiting import accepts_connections, wait_until

DEMO_SERVER = Path(__file__).with_name("demo_server.py")


def test_a_crashed_server_is_restarted_once_then_fails(arun, demo_command, tmp_path):
    async def go():
        async with ToolSet([f"demo={demo_command}"], call_timeout=20) as tools:
            r = await tools.call("crash_once", {"marker": str(tmp_path / "marker")})
            assert not r.is_error and r.content.startswith("alive after restart")
            assert "was restarted" in r.content  # the model is told its state is gone
            assert tools.connections["demo"].restarts == 1
            assert (await tools.call("echo", {"text": "still here"})).content == "still here"
            with pytest.raises(ToolServerError, match="demo.*crashed") as err:
                await tools.call("crash", {})
            assert "restart budget is spent" in str(err.value)
    arun(go())


@pytest.mark.slow
def test_a_hung_server_is_restarted_then_fails(arun, demo_command):
    async def go():
        spec = parse_mcp_server_flag(f"demo={demo_command}")
        spec.timeout_s = 1.0
        async with ToolSet([spec]) as tools:
            t0 = time.monotonic()
            with pytest.raises(ToolServerError, match="did not answer within 1 s.*again after a restart"):
                await tools.call("hang", {})
            assert time.monotonic() - t0 < 30
    arun(go())


def test_a_server_that_cannot_start_raises(arun, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; print('boom: no such thing', file=sys.stderr); sys.exit(1)")
    with pytest.raises(ToolServerError, match="could not start(.|\n)*boom: no such thing"):
        arun(ToolSet([f"bad={sys.executable} {bad}"], start_timeout=30).start())


def test_concurrent_calls_on_one_server(arun, demo_command):
    async def go():
        async with ToolSet([f"demo={demo_command}"]) as tools:
            t0 = time.monotonic()
            results = await tools.call_many([("slow", {"seconds": 1}), ("slow", {"seconds": 1}),
                                             ("add", {"a": 1, "b": 2})])
            assert [r.content for r in results] == ["slept 1.0", "slept 1.0", "3"]
            assert time.monotonic() - t0 < 1.8
    arun(go())


class MixedEnv(ToolEnv):
    builtin_tools = ("python",)

    def lookup(word: str) -> str:  # noqa: N805 - a plain function, used as a tool
        """Look a word up.

        Args:
            word: the word.
        """
        return {"mcp": "model context protocol"}.get(word, "unknown")

    function_tools = (lookup,)


def test_external_server_by_command_line_joins_the_env(arun, demo_command):
    env = MixedEnv(mcp_servers=[f"demo={demo_command}"])
    try:
        _, info = arun(env.areset(options={"prompt": "hi"}))
        names = [t["function"]["name"] for t in info["tools"]]
        # the built-in python keeps its name; the demo server's clashing one is prefixed
        assert names[:2] == ["python", "echo"] and "demo_python" in names and names[-1] == "lookup"
        lookup = info["tools"][-1]["function"]
        assert lookup["description"] == "Look a word up." and \
            lookup["parameters"]["properties"]["word"] == {"type": "string", "description": "the word."}
        action = ('<tool_call>{"name": "demo_python", "arguments": {"code": "1"}}</tool_call>'
                  '<tool_call>{"name": "python", "arguments": {"code": "6*7"}}</tool_call>'
                  '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                  '<tool_call>{"name": "lookup", "arguments": {"word": "mcp"}}</tool_call>')
        obs, *_ = arun(env.astep(action))
        assert [m["content"] for m in obs] == ["demo got '1'", "42", "5", "model context protocol"]
        # structured content without text is shown as JSON; the demo's add returns both
        assert obs[2]["name"] == "add"
    finally:
        arun(env.aclose())


def test_qwen3_coder_parser_in_an_env(arun, demo_command):
    env = ToolEnv(mcp_servers=[f"demo={demo_command}"], tool_parser="qwen3_coder")
    try:
        arun(env.areset(options={"prompt": "hi"}))
        action = "<tool_call>\n<function=add>\n<parameter=a>\n40\n</parameter>\n<parameter=b>\n2\n</parameter>\n" \
                 "</function>\n</tool_call>"
        obs, *_ = arun(env.astep(action))
        assert obs[0]["content"] == "42"
        obs, *_ = arun(env.astep("<tool_call>\n<function=add>\n<parameter=a>\nforty\n</parameter>\n</function>\n</tool_call>"))
        assert obs[0]["content"].startswith("Error: invalid arguments for add at 'a'")
    finally:
        arun(env.aclose())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_external_server_by_url(arun):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(DEMO_SERVER), "--http", str(port)], stderr=subprocess.PIPE)
    try:
        wait_until(lambda: accepts_connections(port), timeout_s=30, while_=lambda: proc.poll() is None,
                   what=lambda: f"the HTTP demo server starting ({proc.stderr.read().decode() if proc.poll() is not None else 'no connection'})")
        spec = parse_mcp_server_flag(f"web=http://127.0.0.1:{port}/mcp")
        assert spec.url and spec.command is None

        async def go():
            async with ToolSet([spec]) as tools:
                assert "echo" in tools.tools
                r = await tools.call("echo", {"text": "over http"})
                assert r.content == "over http"
        arun(go())
    finally:
        proc.terminate()
        proc.wait(10)


def test_function_tools_without_mcp(arun):
    async def fetch(url: str, retries: int = 1) -> dict:
        """Fetch a page."""
        return {"url": url, "retries": retries}

    def broken(x: int) -> int:
        raise ValueError("x must be positive")

    def slow() -> str:
        import time
        time.sleep(2)
        return "late"

    async def go():
        from agentrl.tools import function_tool
        async with ToolSet(functions=[fetch, broken, function_tool(slow, timeout_s=0.3)]) as tools:
            assert tools.workdir is None and tools.connections == {}
            assert (await tools.call("fetch", {"url": "u"})).content == '{"url": "u", "retries": 1}'
            r = await tools.call("broken", {"x": 1})
            assert r.is_error and r.content == "Error: ValueError: x must be positive"
            r = await tools.call("fetch", {"url": 3})
            assert r.is_error and "is not of type 'string'" in r.content
            r = await tools.call("slow", {})
            assert r.is_error and "did not finish within 0.3 s" in r.content
    arun(go())


def test_server_flag_parsing():
    assert parse_mcp_server_flag("python").command[-1] == "agentrl.tools.python_server"
    spec = parse_mcp_server_flag("fs = npx -y some-server --root '/a b'")
    assert spec == MCPServerSpec("fs", command=["npx", "-y", "some-server", "--root", "/a b"])
    assert parse_mcp_server_flag("s=https://x.org/mcp").url == "https://x.org/mcp"
    alias = parse_mcp_server_flag("py=python")
    assert alias.name == "py" and alias.in_sandbox
    for bad in ["nonsense", "=cmd", "x=", "bad name=cmd"]:
        with pytest.raises(ValueError):
            parse_mcp_server_flag(bad)
    with pytest.raises(ValueError, match="two MCP servers"):
        ToolSet(["a=x", "a=y"])
    assert builtin_spec("python", "bash").command[-2:] == ["--tools", "python,bash"]
