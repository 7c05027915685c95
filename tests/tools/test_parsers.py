import pytest

from agentrl.tools.parsers import ToolCall, ToolCallError, get_parser, list_parsers, parse_tool_calls


def test_hermes_several_calls_and_argument_forms():
    text = ('Let me check.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
            '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
            '<tool_call>{"name": "noargs"}</tool_call>')
    calls = parse_tool_calls(text, "hermes")
    assert calls == [ToolCall("python", {"code": "print(1)"}, "call_0"), ToolCall("bash", {"command": "ls"}, "call_1"),
                     ToolCall("noargs", {}, "call_2")]


def test_hermes_no_call_and_unclosed_call():
    assert parse_tool_calls("The answer is 42.", "hermes") == []
    assert parse_tool_calls("text <tool_call>", "hermes") == []  # a bare opening tag, nothing to run
    [call] = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}', "hermes")  # stopped before </tool_call>
    assert call == ToolCall("f", {"x": 1}, "call_0")


@pytest.mark.parametrize("body, words", [
    ('{"name": "f", "arguments": {"x": 1}', ["JSON is invalid"]),
    ('{"arguments": {"x": 1}}', ['no "name"']),
    ('{"name": "", "arguments": {}}', ['no "name"']),
    ('["f", 1]', ["must be a JSON object"]),
    ('{"name": "f", "arguments": [1, 2]}', ['"arguments" of tool', "must be a JSON object"]),
    ('{"name": "f", "arguments": "{x"}', ["not valid JSON"]),
    ("", ["empty"]),
])
def test_hermes_malformed_calls_say_what_is_wrong(body, words):
    [item] = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert isinstance(item, ToolCallError)
    for w in words:
        assert w in item.error
    assert "<tool_call>" in item.error or '"arguments"' in item.error  # says how to write it


def test_hermes_keeps_good_calls_next_to_a_bad_one():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    good, bad = parse_tool_calls(text, "hermes")
    assert isinstance(good, ToolCall) and isinstance(bad, ToolCallError) and bad.id == "call_1"


def test_qwen3_coder_xml_with_schema_types():
    text = ("I'll run it.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\necho 'a < b'\n</parameter>\n"
            "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=write>\n<parameter=items>\n[1, 2]\n</parameter>\n<parameter=flag>\ntrue\n"
            "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>")
    schemas = {"bash": {"properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}},
               "write": {"properties": {"items": {"type": "array"}, "flag": {"type": "boolean"},
                                        "ratio": {"type": "number"}}}}
    calls = parse_tool_calls(text, "qwen3_coder", schemas)
    assert calls == [ToolCall("bash", {"command": "ls -la\necho 'a < b'", "timeout": 5}, "call_0"),
                     ToolCall("write", {"items": [1, 2], "flag": True, "ratio": 0.5}, "call_1")]


def test_qwen3_coder_without_schema_and_string_types():
    text = "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\nhello\n</parameter>\n</function>\n</tool_call>"
    assert parse_tool_calls(text, "qwen3_coder") == [ToolCall("f", {"n": 42, "s": "hello"}, "call_0")]
    # a string-typed parameter stays a string even when it looks like a number
    [call] = parse_tool_calls(text, "qwen3_coder", {"f": {"properties": {"n": {"type": "string"}}}})
    assert call.arguments["n"] == "42"


def test_qwen3_coder_malformed():
    [item] = parse_tool_calls("<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "qwen3_coder")
    assert isinstance(item, ToolCallError) and "<function=NAME>" in item.error
    [item] = parse_tool_calls("<tool_call>\n<function=>\n</function>\n</tool_call>", "qwen3_coder")
    assert isinstance(item, ToolCallError) and "empty name" in item.error


def test_parser_registry():
    assert {"hermes", "qwen3_coder"} <= set(list_parsers())
    with pytest.raises(KeyError, match="hermes"):
        get_parser("hermez")
