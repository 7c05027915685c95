"""OpenAI's chat-completions wire format: requests checked field by field, replies and
stream chunks built, errors in OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``), and the conversions between OpenAI messages and what a chat template renders.

Only what the gateway honours is accepted: ``n`` must be 1, ``tool_choice`` "auto" or
"none", ``response_format`` "text". Other OpenAI fields a framework sends by habit
(``user``, ``metadata``, ``store``, ``parallel_tool_calls``, ``stream_options``, ``seed``,
``logprobs``...) are ignored: they change nothing the policy samples.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4  # OpenAI's limit


class RequestError(Exception):
    """A request OpenAI would refuse: answered with HTTP `status` and OpenAI's error object."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    model: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    tool_choice: str = "auto"


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name} must be a number from {low} to {high}, got {value!r}", param=name,
                           code="invalid_value")
    return float(value)


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or None (empty)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{i}]: only text parts are supported ({{'type': 'text', "
                                   f"'text': ...}}), got {str(part)[:80]}", param=f"{where}.content",
                                   code="invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, a list of text parts or null, got "
                       f"{type(content).__name__}", param=f"{where}.content", code="invalid_type")


def _check_tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls", code="invalid_type")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str):
            raise RequestError(f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                               "{'name': str, 'arguments': str}}", param=f"{where}.tool_calls", code="invalid_value")
    return calls


def parse_request(body: Any) -> ChatRequest:
    """The request's fields, checked; RequestError (HTTP 400) names the first bad one."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages",
                           code="missing_required_parameter" if messages is None else "invalid_value")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got "
                               f"{m.get('role') if isinstance(m, dict) else m!r}", param=f"{where}.role",
                               code="invalid_value")
        _text_of(m.get("content"), where)
        if m["role"] == "assistant" and m.get("tool_calls"):
            _check_tool_calls(m["tool_calls"], where)
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise RequestError(f"{where}: a tool message needs tool_call_id (a string)", param=f"{where}.tool_call_id",
                               code="missing_required_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string", param="model", code="missing_required_parameter")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(f"n must be 1 (one trajectory samples one reply per turn), got {n!r}", param="n",
                           code="unsupported_value")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise RequestError("tools must be a list of {'type': 'function', 'function': {'name': ..., "
                               "'parameters': {...}}}", param="tools", code="invalid_value")
        tools = tools or None
    tool_choice = body.get("tool_choice") or "auto"
    if tool_choice not in ("auto", "none"):
        raise RequestError(f"tool_choice {tool_choice!r} is not supported: the policy decides itself whether to "
                           "call a tool ('auto'), or 'none' when no tools are offered", param="tool_choice",
                           code="unsupported_value")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format other than {'type': 'text'} is not supported: the policy's own output "
                           "is what is trained", param="response_format", code="unsupported_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens",
                           code="invalid_value")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings",
                           param="stop", code="invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options") or {}
    return ChatRequest(messages=messages, tools=tools if tool_choice != "none" else None, model=model,
                       max_tokens=max_tokens, temperature=_number(body, "temperature", 0, 2),
                       top_p=_number(body, "top_p", 0, 1), stop=stop, stream=stream, tool_choice=tool_choice,
                       include_usage=isinstance(options, dict) and bool(options.get("include_usage")))


# -- messages: what is compared, what is rendered -----------------------------------------------

def _arguments_key(arguments: str) -> Any:
    """Tool-call arguments compared by value: a framework may re-serialize the JSON it was given."""
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True)
    except ValueError:
        return arguments


def message_key(m: dict) -> tuple:
    """What must be equal for a message the agent sends back to be the one it was given (or sent
    before): the role, the text, the calls by name and arguments, the answered call's id. Ids
    the gateway made up, `name`, `refusal` and other extras are not compared."""
    role = "system" if m["role"] == "developer" else m["role"]
    calls = tuple((c["function"]["name"], _arguments_key(c["function"].get("arguments", "")))
                  for c in (m.get("tool_calls") or []))
    return role, _text_of(m.get("content"), "message").strip(), calls, m.get("tool_call_id") or ""


def template_message(m: dict) -> dict:
    """An OpenAI message as chat templates take it (the transformers convention): text content,
    `developer` as `system`, tool-call arguments as objects."""
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text_of(m.get("content"), "message")}
    if m["role"] == "tool":
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            try:
                args = json.loads(c["function"].get("arguments") or "{}")
            except ValueError:
                args = c["function"].get("arguments")
            calls.append({"id": c.get("id", ""), "type": "function",
                          "function": {"name": c["function"]["name"], "arguments": args}})
        out["tool_calls"] = calls
    return out


_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


async def assistant_message(text: str, parser: str | None, tools: list[dict] | None, call_prefix: str) -> dict:
    """The reply as OpenAI gives it: tool calls the model family's parser reads from `text`
    (when tools were offered), and the text outside them as content. A call the model wrote
    wrongly stays in the content as written, for the agent to see. A user-registered parser runs
    in a process of its own (off the event loop); one past its bound raises its AgentFault."""
    from agentrl.tools.parsers import ToolCall, aparse_tool_calls

    calls = []
    if tools and parser:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        parsed = await aparse_tool_calls(text, parser, schemas)
        if parsed and all(isinstance(c, ToolCall) for c in parsed):
            calls = [{"id": f"{call_prefix}_{i}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(parsed)]
            text = _TOOL_CALL_BLOCK.sub("", text).strip()
    message = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


# -- replies ------------------------------------------------------------------------------------

def completion(reply_id: str, model: str, message: dict, finish_reason: str, usage: dict) -> dict:
    return {"id": reply_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage, "system_fingerprint": None}


def stream_chunks(reply_id: str, model: str, message: dict, finish_reason: str, usage: dict | None) -> list[dict]:
    """The reply as stream chunks: the role, the content, each tool call whole, then the finish
    reason (the engine gives a turn whole, so each part comes in one piece)."""
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, finish_reason))
    if usage is not None:  # asked for with stream_options.include_usage
        chunks.append({**chunk({}), "choices": [], "usage": usage})
    return chunks
