"""Named tool-call parsers: model output text -> tool calls.

    from agentrl.tools.parsers import parse_tool_calls, ToolCall, ToolCallError
    parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>', "hermes")
    # [ToolCall(name='python', arguments={'code': '1+1'}, id='call_0')]

A parser returns one item per call the model attempted, in order: a `ToolCall`, or a
`ToolCallError` whose `error` tells the model what was wrong (bad JSON, missing name...).
The caller turns errors into tool observations; parsing never raises on model output: the
built-in parsers run in linear time (no regex that backtracks over model text), catch what
JSON decoding raises on hostile input (nesting past the recursion limit, integers past
Python's digit limit), and `parse_tool_calls` turns whatever a registered parser still
raises into one `ToolCallError`.

Built-in parsers:
  * ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number per turn. ``arguments`` may also be a JSON string.
  * ``qwen3_coder`` (Qwen3-Coder XML): ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
    </parameter>\\n</function>\\n</tool_call>``. Values are strings, converted to the type the
    tool's JSON schema declares when `tools` (name -> input schema) is given.

Register another with ``@register_parser("name")`` on a function
``(text: str, tools: Mapping[str, dict] | None) -> list[ToolCall | ToolCallError]``. A
registered parser is code this module cannot vouch for on hostile text: it runs in a process
forked for the call (`agentrl.grading.call_in_fork`; closures work, its value comes back
pickled) that is killed past `timeout` seconds (default `PARSER_TIMEOUT_S`) or its memory
bound, and the trajectory ends as the agent's fault (`GradingTimeout`, reward 0 with the reason).
"""

from __future__ import annotations

import ast
import asyncio
import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["ToolCall", "ToolCallError", "ParsedCall", "register_parser", "get_parser", "list_parsers",
           "parse_tool_calls", "aparse_tool_calls", "valid_unicode"]

_SURROGATE_RE = re.compile("[\ud800-\udfff]")
MAX_NAME_CHARS = 200  # of a tool name quoted back to the model in an error
PARSER_TIMEOUT_S = 10.0  # a registered parser's bound on one reply


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates (which a JSON or Python escape like ``\\ud800`` decodes to)
    replaced by U+FFFD: such a string cannot be encoded to UTF-8, so a tokenizer, a JSON-RPC
    writer or a file write would raise on it."""
    return _SURROGATE_RE.sub("\ufffd", text) if _SURROGATE_RE.search(text) else text


def _quoted(name: str) -> str:
    """A name the model wrote, for an error message: repr'd (escapes shown) and cut."""
    return repr(name[:MAX_NAME_CHARS] + ("..." if len(name) > MAX_NAME_CHARS else ""))


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""


@dataclass
class ToolCallError:
    """A call the model attempted but wrote wrongly; `error` is addressed to the model."""
    error: str
    raw: str = ""
    id: str = ""
    name: str | None = None  # when it could be read


ParsedCall = ToolCall | ToolCallError
Parser = Callable[[str, "Mapping[str, dict] | None"], list[ParsedCall]]
_PARSERS: dict[str, Parser] = {}
_TIMEOUTS: dict[str, float | None] = {}  # None: a built-in, run in-process (linear time, never raises)


def register_parser(name: str, *, timeout: float = PARSER_TIMEOUT_S):
    """Decorator: register a parser under `name`, bounded by `timeout` seconds per reply."""
    if not timeout > 0:
        raise ValueError(f"register_parser({name!r}): timeout must be > 0 seconds, not {timeout!r}")

    def deco(fn: Parser) -> Parser:
        _PARSERS[name] = fn
        _TIMEOUTS[name] = None if getattr(fn, "__module__", None) == __name__ else timeout
        return fn
    return deco


def get_parser(name: str) -> Parser:
    try:
        return _PARSERS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_PARSERS), n=2)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"unknown tool parser {name!r}.{hint} Known: {', '.join(sorted(_PARSERS))}") from None


def list_parsers() -> list[str]:
    return sorted(_PARSERS)


def parse_tool_calls(text: str, parser: str = "hermes", tools: Mapping[str, dict] | None = None) -> list[ParsedCall]:
    """Tool calls in `text` by the named parser, with ids ``call_0, call_1, ...``. A parser that
    fails on the text gives one `ToolCallError` (the model's turn); a registered one past its
    time or memory bound raises `GradingTimeout` (an AgentFault: the trajectory scores 0)."""
    fn = get_parser(parser)
    limit = _TIMEOUTS.get(parser, PARSER_TIMEOUT_S)
    try:
        if limit is None:
            items = fn(str(text), tools)
        else:
            from agentrl.grading import call_in_fork
            items = call_in_fork(fn, str(text), tools, timeout=limit, what=f"the tool-call parser {parser!r}")
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        items = [ToolCallError(f"the tool calls in this reply could not be read ({type(e).__name__}); "
                               "write them in the format shown in the instructions", str(text)[:1000])]
    for i, item in enumerate(items):
        item.id = item.id or f"call_{i}"
    return items


async def aparse_tool_calls(text: str, parser: str = "hermes",
                            tools: Mapping[str, dict] | None = None) -> list[ParsedCall]:
    """`parse_tool_calls` from the event loop: a registered parser's process is waited on from a
    thread, so the loop goes on while it runs."""
    if _TIMEOUTS.get(parser, PARSER_TIMEOUT_S) is None:
        return parse_tool_calls(text, parser, tools)
    return await asyncio.to_thread(parse_tool_calls, text, parser, tools)


def _blocks(text: str, open_tag: str, close_tag: str) -> list[tuple[str, bool]]:
    """Contents of open_tag...close_tag blocks; a last block left open (the model stopped
    before closing it) is returned with closed=False."""
    out, pos = [], 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return out
        start += len(open_tag)
        end = text.find(close_tag, start)
        if end < 0:
            out.append((text[start:], False))
            return out
        out.append((text[start:end], True))
        pos = end + len(close_tag)


_FORMAT_HINT = 'Write each call as <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>.'


@register_parser("hermes")
def parse_hermes(text: str, tools: Mapping[str, dict] | None = None) -> list[ParsedCall]:
    items: list[ParsedCall] = []
    for body, closed in _blocks(text, "<tool_call>", "</tool_call>"):
        raw = _unfence(body.strip())
        if not raw:
            if closed:
                items.append(ToolCallError(f"empty <tool_call></tool_call>. {_FORMAT_HINT}", body))
            continue  # a bare trailing "<tool_call>" with nothing after it: not a call
        obj, problem = _json(raw)
        if problem:
            what = "it is not closed with </tool_call> and " if not closed else ""
            items.append(ToolCallError(f"could not parse the tool call: {what}its JSON is invalid ({problem}). "
                                       f"{_FORMAT_HINT}", body))
            continue
        items.append(_from_json_object(obj, body))
    return items


def _unfence(raw: str) -> str:
    """A ```json ... ``` fence around the call's JSON, taken off (string operations: a regex with
    `\\s*` next to a long run of whitespace backtracks quadratically)."""
    if not raw.startswith("```"):
        return raw
    i = 3
    while i < len(raw) and raw[i].isascii() and raw[i].isalpha():  # the language tag
        i += 1
    raw = raw[i:].lstrip()
    return raw[:-3].rstrip() if raw.endswith("```") else raw


def _json(text: str) -> tuple[Any, str]:
    """(value, "") or (None, what is wrong) for JSON the model wrote: besides invalid JSON,
    nesting past the recursion limit (RecursionError) and integers past Python's digit limit
    (ValueError) are the model's mistakes too."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return None, str(e)[:200]


def _from_json_object(obj: Any, raw: str) -> ParsedCall:
    for _ in range(8):  # OpenAI's nested form {"function": {"name": ...}}, a few levels at most
        if not isinstance(obj, dict):
            return ToolCallError(f"the tool call must be a JSON object, got {type(obj).__name__}. {_FORMAT_HINT}", raw)
        name = obj.get("name")
        if isinstance(name, str) and name.strip():
            break
        fn = obj.get("function")
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            return ToolCallError(f'the tool call has no "name" (a non-empty string). {_FORMAT_HINT}', raw)
        obj = fn
    else:
        return ToolCallError(f'the tool call has no "name" (a non-empty string). {_FORMAT_HINT}', raw)
    name = valid_unicode(name.strip())
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        args, problem = _json(args) if args.strip() else ({}, "")
        if problem:
            return ToolCallError(f'the "arguments" of tool {_quoted(name)} is a string that is not valid JSON '
                                 f'({problem}); give "arguments" as a JSON object.', raw, name=name)
    if not isinstance(args, dict):
        return ToolCallError(f'the "arguments" of tool {_quoted(name)} must be a JSON object, got '
                             f"{type(args).__name__}.", raw, name=name)
    return ToolCall(name, args)


_XML_HINT = ("Write each call as <tool_call>\n<function=TOOL_NAME>\n<parameter=ARG_NAME>\nvalue\n</parameter>\n"
             "</function>\n</tool_call>.")


class _Finder:
    """`text.find(tag, pos)` for positions that only move forward, each tag searched once per
    occurrence: the scans below stay linear however many unclosed tags the model writes."""

    def __init__(self, text: str):
        self.text, self.next = text, {}

    def find(self, tag: str, pos: int) -> int:
        at = self.next.get(tag)
        if at is None or (0 <= at < pos):
            at = self.text.find(tag, pos)
            self.next[tag] = at
        return at


def _opening(text: str, finder: _Finder, tag: str, pos: int) -> tuple[int, str, int]:
    """The next ``<tag=NAME>`` at or after `pos` with NAME on one line (no ``>`` nor newline in it):
    (its start, NAME, where its content starts), or (-1, "", -1). What `<tag=([^>\\n]*)>` matches,
    in linear time: an opening that fails fails for every other one on its line too."""
    while True:
        start = finder.find(tag, pos)
        if start < 0:
            return -1, "", -1
        name_at = start + len(tag)
        line_end = finder.find("\n", name_at)
        line_end = len(text) if line_end < 0 else line_end
        gt = text.find(">", name_at, line_end)
        if gt >= 0:
            return start, text[name_at:gt], gt + 1
        pos = line_end  # no ">" before this line ends: no opening on the rest of the line closes either


def _qwen3_function(body: str) -> tuple[str, str] | None:
    """(NAME, content) of the first ``<function=NAME>content</function>`` (content to the end if unclosed)."""
    finder = _Finder(body)
    start, name, content_at = _opening(body, finder, "<function=", 0)
    if start < 0:
        return None
    end = body.find("</function>", content_at)
    if end < 0:  # to the end, before a last newline (as a regex's "$")
        end = max(len(body) - 1 if body.endswith("\n") else len(body), content_at)
    return name, body[content_at:end]


def _qwen3_parameters(text: str) -> list[tuple[str, str]]:
    """(NAME, raw value) of each ``<parameter=NAME>value`` in order; a value ends at
    ``</parameter>`` (consumed), before the next ``<parameter=`` or ``</function>``, or at the
    end of the text (before a last newline, as a regex's ``$``)."""
    finder, out, pos = _Finder(text), [], 0
    text_end = len(text) - 1 if text.endswith("\n") else len(text)
    while True:
        start, name, value_at = _opening(text, finder, "<parameter=", pos)
        if start < 0:
            return out
        close = finder.find("</parameter>", value_at)
        ends = [at for at in (close, finder.find("<parameter=", value_at), finder.find("</function>", value_at))
                if at >= 0]
        end = min(ends + [max(text_end, value_at)])
        out.append((name, text[value_at:end]))
        pos = end + len("</parameter>") if end == close else end


@register_parser("qwen3_coder")
def parse_qwen3_coder(text: str, tools: Mapping[str, dict] | None = None) -> list[ParsedCall]:
    items: list[ParsedCall] = []
    for body, closed in _blocks(text, "<tool_call>", "</tool_call>"):
        if not body.strip():
            if closed:
                items.append(ToolCallError(f"empty <tool_call></tool_call>. {_XML_HINT}", body))
            continue
        function = _qwen3_function(body)
        if function is None:
            items.append(ToolCallError(f"no <function=NAME> inside <tool_call>. {_XML_HINT}", body))
            continue
        name = valid_unicode(function[0].strip())
        if not name:
            items.append(ToolCallError(f"<function=> has an empty name. {_XML_HINT}", body))
            continue
        schema = tools.get(name) if isinstance(tools, Mapping) else None
        props = (schema.get("properties") if isinstance(schema, dict) else None) or {}
        args: dict[str, Any] = {}
        for key, value in _qwen3_parameters(function[1]):
            key = valid_unicode(key.strip())
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            if not key:
                items.append(ToolCallError(f"a <parameter=> of {_quoted(name)} has an empty name. {_XML_HINT}", body,
                                           name=name))
                break
            args[key] = _convert(value, props.get(key) if isinstance(props, dict) else None)
        else:
            items.append(ToolCall(name, args))
    return items


_JSON_STARTS = frozenset('[{"-0123456789tfnNI')
MAX_LITERAL_CHARS = 100_000  # ast.literal_eval compiles its input: longer text stays text


def _convert(value: str, schema: dict | None) -> Any:
    """A parameter's text -> the type its schema asks for (text stays text when unsure)."""
    types = (schema or {}).get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if not types:
        for sub in (schema or {}).get("anyOf") or (schema or {}).get("oneOf") or []:
            t = sub.get("type") if isinstance(sub, dict) else None
            if isinstance(t, str):
                types.append(t)
    if not types:  # no schema: text, unless it is a JSON literal of another kind (42, true, [..], {..})
        stripped = value.strip()
        if not stripped or stripped[0] not in _JSON_STARTS:  # plain text: no JSON error raised and caught
            return value
        parsed, problem = _json(stripped)
        return value if problem or isinstance(parsed, str) else parsed
    if "string" in types and not {"integer", "number", "boolean", "object", "array"} & set(types):
        return value
    stripped = value.strip()
    if "null" in types and stripped.lower() in ("null", "none"):
        return None
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "integer" in types:
        try:
            return int(stripped)
        except ValueError:
            pass
    if "number" in types:
        try:
            f = float(stripped)
            return int(f) if f.is_integer() and "." not in stripped and "e" not in stripped.lower() else f
        except ValueError:
            pass
    if "object" in types or "array" in types:
        parsed, problem = _json(stripped)
        if not problem:
            return parsed
        if len(stripped) <= MAX_LITERAL_CHARS:  # Python's literal syntax ('a', (1, 2), True)
            try:
                return ast.literal_eval(stripped)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    return value  # let schema validation tell the model what type was expected
