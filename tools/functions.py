"""Plain Python functions as tools (no MCP, no process): for simple envs.

    def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: the first number.
            b: the second number.
        '''
        return a + b

    tool = function_tool(add)        # or @function_tool / @function_tool(name=..., timeout_s=...)
    tool.input_schema                # JSON schema from the signature; descriptions from "Args:"

Sync functions run in a worker thread, async ones on the loop. The result is shown to the
model as text (str as is, anything else as JSON); an exception becomes an error result.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

import pydantic
from transformers.utils.chat_template_utils import parse_google_format_docstring


@dataclass
class FunctionTool:
    fn: Callable[..., Any]
    name: str
    description: str
    input_schema: dict
    model: type[pydantic.BaseModel]
    timeout_s: float | None = None

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        args = self.model.model_validate(arguments)
        kwargs = {k: getattr(args, k) for k in self.model.model_fields}
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**kwargs)
        result = await asyncio.to_thread(self.fn, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def function_tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
                  timeout_s: float | None = None):
    """A FunctionTool from `fn` (also usable as a decorator, with or without arguments)."""
    if fn is None:
        return lambda f: function_tool(f, name=name, description=description, timeout_s=timeout_s)
    if isinstance(fn, FunctionTool):
        return fn
    # transformers' Google-style parser: the one chat templates' tool schemas are built with
    desc, arg_docs, _ = parse_google_format_docstring(inspect.cleandoc(fn.__doc__ or ""))
    fields: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("self", "cls"):
            continue
        ann = Any if p.annotation is inspect.Parameter.empty else p.annotation
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (ann, pydantic.Field(default, description=arg_docs.get(p.name)))
    tool_name = name or fn.__name__
    model = pydantic.create_model(f"{tool_name}_arguments", **fields)
    schema = _strip_titles(model.model_json_schema())
    schema.setdefault("properties", {})
    return FunctionTool(fn, tool_name, description or desc or tool_name, schema, model, timeout_s)


def result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "(no output)"
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)
