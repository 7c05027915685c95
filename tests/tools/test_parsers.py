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


# ---- hostile model output (issue 31): every attack class ends as a ToolCallError, fast ----------------
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

from agentrl.tools.parsers import valid_unicode  # noqa: E402

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("body, words", [
    (DEEP, ["nested too deeply"]),                                               # RecursionError in json
    ('{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}", ["4300 digits"]),  # ValueError past the digit limit
    ('{"name": "f", "arguments": "' + "[" * 100_000 + '"}', ["nested too deeply"]),  # the same, in a string
    ('{"function": ' * 500 + '{"name": " "}' + "}" * 500, ['no "name"']),        # OpenAI's nesting, deep
])
def test_hermes_hostile_json_is_the_models_error(body, words):
    [item] = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert isinstance(item, ToolCallError)
    for w in words:
        assert w in item.error


def test_qwen3_coder_nested_and_huge_values_stay_text():
    deep = "[" * 100_000
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n{deep}\n</parameter>\n<parameter=n>\n{'9' * 5000}\n</parameter>\n</function>\n</tool_call>"
    for schema in (None, {"f": {"properties": {"x": {"type": "array"}, "n": {"type": "integer"}}}}):
        [call] = parse_tool_calls(text, "qwen3_coder", schema)
        assert call == ToolCall("f", {"x": deep, "n": "9" * 5000}, "call_0")  # text: schema validation tells the model


@pytest.mark.parametrize("parser, text", [
    ("qwen3_coder", "<tool_call>" + "<function=" * 200_000),                  # unclosed openings, one line
    ("qwen3_coder", "<tool_call>" + "<function=\n" * 100_000 + ">"),         # a ">" only after every newline
    ("qwen3_coder", "<tool_call><function=f>" + "<parameter=" * 200_000),     # unclosed parameters
    ("qwen3_coder", "<tool_call><function=f>" + "<parameter=a>x" * 100_000),  # values with no terminator
    ("hermes", "<tool_call>```" + " " * 500_000 + "x</tool_call>"),           # a fence next to long whitespace
    ("hermes", "<tool_call>" * 200_000),                                      # tag soup
])
def test_parsers_are_linear_on_tag_soup(parser, text):
    t0 = time.perf_counter()
    parse_tool_calls(text, parser)
    assert time.perf_counter() - t0 < 5.0  # the regexes they replaced took minutes on these


def test_a_parser_that_raises_gives_one_error_item():
    from agentrl.tools.parsers import _PARSERS, register_parser

    @register_parser("test-raises")
    def broken(text, tools):
        raise ValueError("boom")

    try:
        [item] = parse_tool_calls("<tool_call>x</tool_call>", "test-raises")
    finally:
        _PARSERS.pop("test-raises")
    assert isinstance(item, ToolCallError) and "could not be read" in item.error and item.id == "call_0"


def test_lone_surrogates_are_replaced_in_names():
    [call] = parse_tool_calls('<tool_call>{"name": "f\\ud800", "arguments": {"s": "\\udfff"}}</tool_call>')
    assert call.name == "f\ufffd"
    assert valid_unicode(call.arguments["s"]) == "\ufffd" and valid_unicode("ok \U0001F600") == "ok \U0001F600"


# The regexes qwen3_coder used before (quadratic on unclosed tags): the linear scan must read every
# well-formed and malformed call the same way. Small random tag soup, compared exactly.
_OLD_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_OLD_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)


def test_qwen3_coder_scan_matches_the_regexes_it_replaced():
    from hypothesis import given, settings, strategies as st

    from agentrl.tools.parsers import _qwen3_function, _qwen3_parameters

    pieces = st.sampled_from(["<function=", "</function>", "<parameter=", "</parameter>", ">", "\n", "a", "b c",
                              "<", "=", "<tool_call>"])

    @settings(max_examples=800, derandomize=True, deadline=None)
    @given(st.lists(pieces, max_size=24).map("".join))
    def check(body):
        m = _OLD_FUNCTION.search(body)
        assert _qwen3_function(body) == (None if m is None else (m.group(1), m.group(2)))
        assert _qwen3_parameters(body) == [(p.group(1), p.group(2)) for p in _OLD_PARAM.finditer(body)]

    check()


@pytest.mark.parametrize("attack", ["spins", "sleeps"])
def test_a_registered_parser_that_hangs_is_killed_at_its_bound(tmp_path, attack):
    """A registered parser (a closure: it runs in a process forked for the reply) that never returns
    on some text: GradingTimeout (the agent's fault) within its bound, its process gone, the event
    loop free meanwhile; the same parser on other text works."""
    import asyncio
    import os

    from agentrl.grading import GradingTimeout
    from agentrl.tools.parsers import _PARSERS, aparse_tool_calls, register_parser

    pids = tmp_path / "pids"

    @register_parser("test-hangs", timeout=1.5)
    def hangs(text, tools):
        pids.write_text(str(os.getpid()))
        if "hang" in text:
            while attack == "spins":
                pass
            time.sleep(3600)
        return [ToolCall("f", {"text": text})]

    async def go():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1
        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        with pytest.raises(GradingTimeout, match="tool-call parser 'test-hangs' ran past its 1.5 s limit"):
            await aparse_tool_calls("please hang", "test-hangs")
        elapsed = time.monotonic() - t0
        ticker.cancel()
        return elapsed, ticks

    try:
        elapsed, ticks = asyncio.run(go())
        [call] = parse_tool_calls("fine", "test-hangs")
    finally:
        _PARSERS.pop("test-hangs")
    assert elapsed < 5 and ticks >= 10, (elapsed, ticks)
    assert call == ToolCall("f", {"text": "fine"}, "call_0")
    pid = int(pids.read_text())
    assert pid != os.getpid() and not os.path.exists(f"/proc/{pid}")


def test_builtin_parsers_run_in_process():
    from agentrl.tools.parsers import _TIMEOUTS
    assert _TIMEOUTS["hermes"] is None and _TIMEOUTS["qwen3_coder"] is None
