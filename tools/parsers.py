"""Named tool-call parsers: model output text -> tool calls.

    from agentrl.tools.parsers import parse_tool_calls, ToolCall, ToolCallError
    parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>', "hermes")
    # [ToolCall(name='python', arguments={'code': '1+1'}, id='call_0')]

A parser returns one item per call the model attempted, in order: a `ToolCall`, or a
`ToolCallError` whose `error` tells the model what was wrong (bad JSON, missing name...).
The caller turns errors into tool observations; parsing never raises on model output.

Built-in parsers:
  * ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number per turn. ``arguments`` may also be a JSON string.
  * ``qwen3_coder`` (Qwen3-Coder XML): ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
    </parameter>\\n</function>\\n</tool_call>``. Values are strings, converted to the type the
    tool's JSON schema declares when `tools` (name -> input schema) is given.

Register another with ``@register_parser("name")`` on a function
``(text: str, tools: Mapping[str, dict] | None) -> list[ToolCall | ToolCallError]``.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["ToolCall", "ToolCallError", "ParsedCall", "register_parser", "get_parser", "list_parsers",
           "parse_tool_calls"]


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


def register_parser(name: str):
    def deco(fn: Parser) -> Parser:
        _PARSERS[name] = fn
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
    """Tool calls in `text` by the named parser, with ids ``call_0, call_1, ...``."""
    items = get_parser(parser)(str(text), tools)
    for i, item in enumerate(items):
        item.id = item.id or f"call_{i}"
    return items


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
        raw = body.strip()
        if raw.startswith("```"):  # a fenced block inside the tags
            raw = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", raw)
        if not raw:
            if closed:
                items.append(ToolCallError(f"empty <tool_call></tool_call>. {_FORMAT_HINT}", body))
            continue  # a bare trailing "<tool_call>" with nothing after it: not a call
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            what = "it is not closed with </tool_call> and " if not closed else ""
            items.append(ToolCallError(f"could not parse the tool call: {what}its JSON is invalid ({e.msg} at "
                                       f"line {e.lineno} column {e.colno}). {_FORMAT_HINT}", body))
            continue
        items.append(_from_json_object(obj, body))
    return items


def _from_json_object(obj: Any, raw: str) -> ParsedCall:
    if not isinstance(obj, dict):
        return ToolCallError(f"the tool call must be a JSON object, got {type(obj).__name__}. {_FORMAT_HINT}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        fn = obj.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):  # OpenAI's nested form
            return _from_json_object(fn, raw)
        return ToolCallError(f'the tool call has no "name" (a non-empty string). {_FORMAT_HINT}', raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(f'the "arguments" of tool {name!r} is a string that is not valid JSON ({e.msg}); '
                                 'give "arguments" as a JSON object.', raw, name=name)
    if not isinstance(args, dict):
        return ToolCallError(f'the "arguments" of tool {name!r} must be a JSON object, got '
                             f"{type(args).__name__}.", raw, name=name)
    return ToolCall(name.strip(), args)


_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_XML_HINT = ("Write each call as <tool_call>\n<function=TOOL_NAME>\n<parameter=ARG_NAME>\nvalue\n</parameter>\n"
             "</function>\n</tool_call>.")


@register_parser("qwen3_coder")
def parse_qwen3_coder(text: str, tools: Mapping[str, dict] | None = None) -> list[ParsedCall]:
    items: list[ParsedCall] = []
    for body, closed in _blocks(text, "<tool_call>", "</tool_call>"):
        if not body.strip():
            if closed:
                items.append(ToolCallError(f"empty <tool_call></tool_call>. {_XML_HINT}", body))
            continue
        m = _FUNCTION_RE.search(body)
        if not m:
            items.append(ToolCallError(f"no <function=NAME> inside <tool_call>. {_XML_HINT}", body))
            continue
        name = m.group(1).strip()
        if not name:
            items.append(ToolCallError(f"<function=> has an empty name. {_XML_HINT}", body))
            continue
        props = ((tools or {}).get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for pm in _PARAM_RE.finditer(m.group(2)):
            key = pm.group(1).strip()
            value = pm.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            if not key:
                items.append(ToolCallError(f"a <parameter=> of {name!r} has an empty name. {_XML_HINT}", body,
                                           name=name))
                break
            args[key] = _convert(value, props.get(key))
        else:
            items.append(ToolCall(name, args))
    return items


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
        try:
            parsed = json.loads(value.strip())
        except ValueError:
            return value
        return value if isinstance(parsed, str) else parsed
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
        try:
            return json.loads(stripped)
        except (json.JSONDecodeError, ValueError):
            try:
                return ast.literal_eval(stripped)
            except (ValueError, SyntaxError):
                pass
    return value  # let schema validation tell the model what type was expected
