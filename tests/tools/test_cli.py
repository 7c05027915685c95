import json

from agentrl.tools.cli import main
from tools_fixtures import demo_command  # noqa: F401 (fixtures)


def test_list_prints_tools_with_descriptions_and_schemas(capsys):
    assert main(["list", "--mcp-server", "files"]) == 0
    out = capsys.readouterr().out
    for name in ("read_file", "write_file", "list_files", "edit_file"):
        assert f"{name}  (server files)" in out
    assert "replacing an exact string" in out and '"old_string": {"type": "string"}' in out


def test_list_json_and_call(capsys, demo_command):
    assert main(["list", "--json", "--mcp-server", f"demo={demo_command}"]) == 0
    schemas = json.loads(capsys.readouterr().out)
    assert {"echo", "add"} <= {s["function"]["name"] for s in schemas}
    assert main(["call", "--mcp-server", "python", "python", '{"code": "sum(range(10))"}']) == 0
    assert capsys.readouterr().out.strip() == "45"


def test_call_errors(capsys, demo_command):
    assert main(["call", "--mcp-server", f"demo={demo_command}", "add", '{"a": "x"}']) == 1
    assert "invalid arguments for add" in capsys.readouterr().out
    assert main(["call", "--mcp-server", "python", "python", "{not json"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["list", "--mcp-server", "nonsense"]) == 2


def test_parse(capsys):
    assert main(["parse", "--text", '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>']) == 0
    assert json.loads(capsys.readouterr().out) == {"name": "a", "arguments": {"x": 1}, "id": "call_0"}
