"""The client side: a `ToolSet` connects to MCP servers (and plain function tools), lists
their tools, calls them and turns the results into ``{"role": "tool", ...}`` messages.

    async with ToolSet([builtin_spec("python", "bash"), "search=python -m my_server"],
                       functions=[add], sandbox=sb) as tools:
        tools.schemas                      # OpenAI-style function schemas for the chat template
        results = await tools.call_many(parse_tool_calls(action, "hermes"))
        messages = [r.message() for r in results]

What the model gets wrong becomes an error result it can read (unknown tool, arguments not
matching the schema, a call it wrote badly, a tool's own error, a timeout); nothing of that
raises. What is broken underneath does raise: a server that cannot start, or that crashes
or hangs (no answer within the call timeout), is restarted once (per server and ToolSet;
the call is retried); the next failure raises `ToolServerError`, which the agent loop turns
into a FAILED trajectory, masked out of the loss; or, for a server in a sandbox that is
still alive, `ToolServerKilledError` (an `AgentFault`: the model's code broke it), which
`ToolEnv` scores 0. A sandbox whose server was restarted is tainted (never reused).

Stdio servers run as host subprocesses, or inside an `agentrl.sandboxes` Sandbox through
`sandbox.spawn_argv(...)` (``docker exec -i`` / bubblewrap) when the spec says `in_sandbox`
and the ToolSet has a sandbox; URL servers are reached by streamable HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import inspect
import json
import logging
import re
import os
import shutil
import signal
import tempfile
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jsonschema

from agentrl.errors import AgentFault, AgentRLError
from agentrl.tools._common import clip
from agentrl.tools.functions import FunctionTool, _strip_titles, function_tool, result_text
from agentrl.tools.parsers import MAX_NAME_CHARS, ParsedCall, ToolCall, ToolCallError, valid_unicode
from agentrl.tools.spec import (MCPServerSpec, as_spec, boots_as_server, host_command, host_env,
                                sandbox_command, sandbox_server_env)

log = logging.getLogger("agentrl.tools")

__all__ = ["ToolSet", "ToolInfo", "ToolResult", "ToolServerError", "ToolServerKilledError", "MCPConnection"]


class ToolServerError(AgentRLError):
    """A tool server failed (cannot start, crashed or hung, even after one restart): an
    infrastructure failure, not the model's fault. The trajectory is marked FAILED."""


class ToolServerKilledError(ToolServerError, AgentFault):
    """A tool server inside the trajectory's sandbox crashed or hung again after its restart
    while the sandbox itself is fine: the model's own code broke it (killed it, stopped it,
    starved it). `ToolEnv` scores the trajectory 0 with this reason instead of failing it."""


@dataclass
class ToolInfo:
    name: str           # the name the model calls
    remote_name: str    # the name on its server
    server: str         # server name ("functions" for plain functions)
    description: str
    input_schema: dict

    def schema(self) -> dict:
        """OpenAI-style function schema (what chat templates take as `tools`)."""
        params = _strip_titles(dict(self.input_schema or {}))
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}


@dataclass
class ToolResult:
    name: str
    content: str
    is_error: bool = False
    call_id: str = ""
    truncated: bool = False
    duration_s: float = 0.0
    structured: Any = field(default=None, repr=False)

    def message(self) -> dict:
        """The ``tool`` chat message. Text a JSON escape made invalid (a lone surrogate) is
        replaced: a tokenizer raises on it."""
        msg = {"role": "tool", "name": valid_unicode(self.name[:MAX_NAME_CHARS]), "content": valid_unicode(self.content)}
        if self.call_id:
            msg["tool_call_id"] = self.call_id
        return msg


MARKER_VAR = "AGENTRL_MCP_SERVER"
_KILL_MARKED = """import os, signal, sys
m = sys.argv[1].encode()
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != os.getpid():
        for what in ("cmdline", "environ"):  # a server's environ is closed (not dumpable), its cmdline is not
            try:
                if m in open("/proc/%s/%s" % (p, what), "rb").read().split(b"\\0"):
                    os.kill(int(p), signal.SIGKILL)
                    break
            except OSError:
                pass
"""


class _ServerFailure(Exception):
    def __init__(self, what: str, generation: int):
        super().__init__(what)
        self.what, self.generation = what, generation


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class MCPConnection:
    """One MCP server and the client session to it. The transport and session live in a
    task of their own (anyio scopes must be exited by the task that entered them), so calls
    can come from any task and a restart can happen in the middle of a turn."""

    def __init__(self, spec: MCPServerSpec, *, sandbox=None, workdir: str | None = None,
                 start_timeout: float = 60.0, max_restarts: int = 1):
        self.spec, self.sandbox, self.workdir = spec, sandbox, workdir
        self.start_timeout, self.max_restarts = start_timeout, max_restarts
        self.session = None
        self.generation = 0
        self.restarts = 0
        self.server_name = ""
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._errlog = None
        self._lock = asyncio.Lock()
        self._marker = ""

    @property
    def in_sandbox(self) -> bool:
        return self.spec.url is None and self.spec.in_sandbox and self.sandbox is not None

    def where(self) -> str:
        if self.spec.url:
            return self.spec.url
        return f"sandbox {self.sandbox.id}" if self.in_sandbox else "host"

    def _stdio_argv(self) -> tuple[list[str], dict[str, str] | None, str | None]:
        """(host argv, env, cwd) of a stdio server."""
        if self.in_sandbox:
            sb = self.sandbox
            env = {**sandbox_server_env(self.spec, sb.workdir), MARKER_VAR: self._marker}
            # cwd "/": the workdir is the agent's, nothing there may shadow a module the server imports
            cmd = sandbox_command(self.spec, f"{MARKER_VAR}={self._marker}")
            return sb.spawn_argv(cmd, env=env, cwd=self.spec.cwd or "/", server=boots_as_server(cmd)), None, None
        return host_command(self.spec), host_env(self.spec, self.workdir or "."), self.spec.cwd or self.workdir

    def stderr_tail(self, n: int = 2000) -> str:
        if self._errlog is None:
            return ""
        try:
            self._errlog.flush()
            self._errlog.seek(0)
            text = self._errlog.read()[-n:].strip()
        except (OSError, ValueError):
            return ""
        return f"\n--- server stderr (last {n} chars) ---\n{text}" if text else ""

    async def _run(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        from mcp import ClientSession
        try:
            async with AsyncExitStack() as stack:
                if self.spec.url:
                    from mcp.client.streamable_http import streamable_http_client
                    from mcp.shared._httpx_utils import create_mcp_http_client
                    http = await stack.enter_async_context(create_mcp_http_client(headers=self.spec.headers or None))
                    read, write = await stack.enter_async_context(streamable_http_client(self.spec.url, http_client=http))
                else:
                    argv, env, cwd = self._stdio_argv()
                    read, write = await stack.enter_async_context(bounded_stdio_client(argv, env, cwd, self._errlog))
                session = await stack.enter_async_context(ClientSession(read, write))
                init = await session.initialize()
                self.server_name = getattr(init.server_info, "name", "") or ""
                self.session = session
                ready.set_result(None)
                await stop.wait()
        except BaseException as e:
            if not ready.done():
                leaf = _leaf(e)
                ready.set_exception(leaf if isinstance(leaf, Exception) else RuntimeError(repr(leaf)))
                ready.exception()  # retrieved: a start() cancelled with the run never reads it (no "never retrieved" noise)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.session = None

    async def start(self) -> None:
        if self._errlog is None and not self.spec.url:
            self._errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self._marker = f"{self.spec.name}-{uuid.uuid4().hex[:12]}"
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(ready, self._stop), name=f"mcp-{self.spec.name}")
        what = f"MCP server {self.spec.name!r} ({self.spec.describe()}, on {self.where()})"
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.start_timeout)
        except asyncio.TimeoutError:
            await self.stop()
            raise ToolServerError(f"{what} did not start within {self.start_timeout:g} s{self.stderr_tail()}") from None
        except Exception as e:
            await self.stop()
            raise ToolServerError(f"{what} could not start: {type(e).__name__}: {e}{self.stderr_tail()}") from e
        self.generation += 1

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stop.set()
        if self.session is None and not task.done():
            task.cancel()  # still starting: nothing to shut down gracefully
        try:
            await asyncio.wait_for(asyncio.shield(task), 15)
        except asyncio.TimeoutError:
            task.cancel()
            try:
                await asyncio.wait_for(task, 10)
            except BaseException:
                pass
        except BaseException:
            pass
        self.session = None
        if self.in_sandbox:
            await self._kill_in_sandbox()

    async def _kill_in_sandbox(self) -> None:
        """Kill what is left of this server inside the sandbox: `docker exec` does not pass
        the kill on, so a hung server (and its children) would live on until the sandbox
        goes. Its processes carry a marker in their environment."""
        sb = self.sandbox
        if getattr(sb, "closed", False) or not getattr(sb, "started", True):
            return
        try:
            await sb.exec(["python3", "-I", "-c", _KILL_MARKED, f"{MARKER_VAR}={self._marker}"], timeout=20,
                          as_server=True)
        except Exception as e:  # the sandbox is going away anyway
            log.warning("MCP server %r: cleaning up inside sandbox %s failed: %s", self.spec.name, sb.id, e)

    async def close(self) -> None:
        await self.stop()
        if self._errlog is not None:
            self._errlog.close()
            self._errlog = None

    async def list_tools(self) -> list:
        tools, cursor = [], None
        while True:
            from mcp.types import PaginatedRequestParams
            res = await asyncio.wait_for(
                self.session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None),
                self.start_timeout)
            tools += res.tools
            cursor = res.next_cursor
            if not cursor:
                return tools

    async def call(self, name: str, arguments: dict, timeout: float):
        """The CallToolResult; _ServerFailure when the server is gone or does not answer."""
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT
        gen, session = self.generation, self.session
        if session is None or self._task is None or self._task.done():
            raise _ServerFailure("is not running (it crashed)", gen)
        try:
            return await asyncio.wait_for(session.call_tool(name, arguments, read_timeout_seconds=timeout),
                                          timeout + 5)
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                raise _ServerFailure("crashed (connection closed)", gen) from None
            if e.code == REQUEST_TIMEOUT:
                raise _ServerFailure(f"did not answer within {timeout:g} s", gen) from None
            raise
        except asyncio.TimeoutError:
            raise _ServerFailure(f"did not answer within {timeout:g} s", gen) from None
        except (OSError, EOFError) as e:
            raise _ServerFailure(f"crashed ({type(e).__name__}: {e})", gen) from None
        except Exception as e:
            import anyio
            if isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)):
                raise _ServerFailure(f"crashed ({type(e).__name__})", gen) from None
            raise

    async def sandbox_alive(self) -> bool:
        """This server runs in a sandbox that still answers (so what broke the server ran there)."""
        if not self.in_sandbox:
            return False
        try:
            await self.sandbox.ping()
        except Exception:
            return False
        return True

    async def restart(self, failed_generation: int, what: str) -> bool:
        """Restart after a failure seen at `failed_generation`; False when out of restarts."""
        async with self._lock:
            if self.generation != failed_generation:
                return True  # another call restarted it already
            if self.restarts >= self.max_restarts:
                return False
            self.restarts += 1
            log.warning("MCP server %r %s; restarting it (%d/%d)%s", self.spec.name, what, self.restarts,
                        self.max_restarts, self.stderr_tail(800))
            if self.in_sandbox:  # what the model's code did to it may have left traces there
                self.sandbox.taint(f"MCP server {self.spec.name!r} {what}")
            await self.stop()
            await self.start()
            return True


class ToolSet:
    """The tools of one trajectory: MCP servers (specs or ``--mcp-server`` strings) and plain
    functions. Start it once (`await start()` or ``async with``), then call tools; `close()`
    stops the servers.

    call_timeout: seconds a call may take (a spec's timeout_s overrides it per server).
    max_output_chars: longer results are cut (head and tail kept) with a note saying so.
    sandbox: a started `agentrl.sandboxes.Sandbox` where `in_sandbox` specs run.
    workdir: cwd of host servers (default: a fresh temp dir, removed at close).
    Name clashes: the first tool keeps its name; later ones become ``SERVER_TOOL``.
    """

    def __init__(self, servers: Sequence[MCPServerSpec | str] = (), functions: Sequence[Callable | FunctionTool] = (),
                 *, sandbox=None, workdir: str | None = None, call_timeout: float = 60.0,
                 max_output_chars: int = 16000, start_timeout: float = 60.0, max_restarts: int = 1):
        self.specs = [as_spec(s) for s in servers]
        names = [s.name for s in self.specs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"two MCP servers are named {', '.join(sorted(dup))}: give them different names")
        self.functions = [function_tool(f) for f in functions]
        self.sandbox = sandbox
        self.workdir = workdir
        self.call_timeout = call_timeout
        self.max_output_chars = max_output_chars
        self.start_timeout = start_timeout
        self.max_restarts = max_restarts
        self.connections: dict[str, MCPConnection] = {}
        self.tools: dict[str, ToolInfo] = {}
        self._functions: dict[str, FunctionTool] = {}
        self._validators: dict[str, Any] = {}
        self._own_workdir = False
        self.started = False

    # ---- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> "ToolSet":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> list[dict]:
        """Start every server and list the tools; returns `schemas`."""
        if self.started:
            return self.schemas
        needs_workdir = any(s.command and not (s.in_sandbox and self.sandbox) for s in self.specs)
        if self.workdir is None and needs_workdir:
            self.workdir = tempfile.mkdtemp(prefix="agentrl-tools-")
            self._own_workdir = True
        self.connections = {s.name: MCPConnection(s, sandbox=self.sandbox, workdir=self.workdir,
                                                  start_timeout=self.start_timeout, max_restarts=self.max_restarts)
                            for s in self.specs}
        try:
            await _gather_or_cancel([c.start() for c in self.connections.values()])
            listings = await _gather_or_cancel([c.list_tools() for c in self.connections.values()])
        except BaseException as e:
            await self.close()
            if isinstance(e, asyncio.TimeoutError):
                raise ToolServerError(f"listing the tools of the MCP servers timed out after {self.start_timeout} s")
            raise
        self.tools, self._functions = {}, {}
        for conn, tools in zip(self.connections.values(), listings):
            for t in tools:
                desc = inspect.cleandoc(t.description or "")
                self._add(ToolInfo(t.name, t.name, conn.spec.name, desc, dict(t.input_schema or {})))
        for f in self.functions:
            if self._add(ToolInfo(f.name, f.name, "functions", f.description, f.input_schema)):
                self._functions[self._last_added] = f
        self.started = True
        return self.schemas

    def _add(self, info: ToolInfo) -> bool:
        if info.name in self.tools:
            prefixed = f"{info.server}_{info.remote_name}"
            if prefixed in self.tools:
                log.warning("tool %r of %r is shadowed by another tool of that name; skipped", info.remote_name,
                            info.server)
                return False
            info.name = prefixed
        self.tools[info.name] = info
        self._last_added = info.name
        return True

    async def close(self) -> None:
        conns, self.connections = list(self.connections.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if self._own_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir, self._own_workdir = None, False
        self.started = False

    # ---- tools ----------------------------------------------------------------------------
    @property
    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    @property
    def input_schemas(self) -> dict[str, dict]:
        """{tool name: input JSON schema}: what a parser needs to convert XML argument text."""
        return {n: t.input_schema for n, t in self.tools.items()}

    def _error(self, name: str, text: str, call_id: str = "") -> ToolResult:
        # an error may quote what the model wrote (a schema error quotes the value): cut like any result
        return ToolResult(name, clip(f"Error: {text}", self.max_output_chars), is_error=True, call_id=call_id)

    def validate(self, name: str, arguments: Any) -> str | None:
        """None when `arguments` fit the tool's schema, else what is wrong (for the model)."""
        info = self.tools[name]
        if not isinstance(arguments, dict):
            return f"the arguments of {name} must be a JSON object, got {type(arguments).__name__}"
        validator = self._validators.get(name)
        if validator is None:
            schema = info.input_schema or {"type": "object"}
            try:
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
                validator = cls(schema)
            except jsonschema.SchemaError:
                validator = False  # the server's schema is broken: let the server judge
            self._validators[name] = validator
        if not validator:
            return None
        errors = list(validator.iter_errors(arguments))
        if not errors:
            return None
        err = jsonschema.exceptions.best_match(errors)
        where = f" at '{'.'.join(str(p) for p in err.absolute_path)}'" if err.absolute_path else ""
        props = info.input_schema.get("properties") or {}
        required = set(info.input_schema.get("required") or [])
        sig = ", ".join(f"{k}: {_type_name(v)}{'' if k in required else ' (optional)'}" for k, v in props.items())
        return f"invalid arguments for {name}{where}: {err.message}. Expected: {name}({sig})"

    async def call(self, name: str, arguments: Any = None, *, call_id: str = "") -> ToolResult:
        """Call one tool. Model mistakes come back as error results; ToolServerError when the
        server is broken beyond one restart."""
        if not self.started:
            raise RuntimeError("ToolSet.call before start(): start the servers first (await toolset.start())")
        t0 = time.perf_counter()
        arguments = {} if arguments is None else arguments
        if name not in self.tools:
            known = sorted(self.tools)
            close = difflib.get_close_matches(name, known, n=2) if len(name) <= MAX_NAME_CHARS else []
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            shown = repr(name) if len(name) <= MAX_NAME_CHARS else f"{name[:MAX_NAME_CHARS]!r}..."
            return self._error(name, f"unknown tool {shown}.{hint} Available tools: {', '.join(known) or '(none)'}.",
                               call_id)
        arguments, problem = wire_arguments(arguments)
        problem = problem or self.validate(name, arguments)
        if problem:
            return self._error(name, problem, call_id)
        info = self.tools[name]
        if name in self._functions:
            result = await self._call_function(self._functions[name], arguments, name)
        else:
            result = await self._call_mcp(info, arguments)
        result.call_id, result.duration_s = call_id, time.perf_counter() - t0
        if len(result.content) > self.max_output_chars:
            result.content = clip(result.content, self.max_output_chars, f"; the limit is {self.max_output_chars}")
            result.truncated = True
        return result

    async def call_many(self, calls: Sequence[ParsedCall | tuple[str, dict]]) -> list[ToolResult]:
        """Run one turn's calls concurrently; results in the order of `calls`. Parse errors
        (ToolCallError) become error results."""
        async def one(c) -> ToolResult:
            if isinstance(c, ToolCallError):
                return self._error(c.name or "tool_call", c.error, c.id)
            if isinstance(c, ToolCall):
                return await self.call(c.name, c.arguments, call_id=c.id)
            return await self.call(c[0], c[1])
        return await _gather_or_cancel([one(c) for c in calls])

    async def _call_function(self, fn: FunctionTool, arguments: dict, name: str) -> ToolResult:
        timeout = fn.timeout_s or self.call_timeout
        try:
            value = await asyncio.wait_for(fn(arguments), timeout)
        except asyncio.TimeoutError:
            return self._error(name, f"the tool did not finish within {timeout:g} s")
        except Exception as e:
            return self._error(name, f"{type(e).__name__}: {e}")
        return ToolResult(name, result_text(value), structured=value)

    async def _call_mcp(self, info: ToolInfo, arguments: dict) -> ToolResult:
        from mcp import MCPError
        conn = self.connections[info.server]
        timeout = conn.spec.timeout_s or self.call_timeout
        note = ""
        for attempt in (0, 1):
            try:
                res = await conn.call(info.remote_name, arguments, timeout)
            except _ServerFailure as f:
                restarted = attempt == 0 and await conn.restart(f.generation, f.what)
                if not restarted:
                    again = "again after a restart" if attempt else "and its restart budget is spent"
                    what = (f"MCP server {conn.spec.name!r} ({conn.where()}) {f.what} during "
                            f"{info.name}({json.dumps(arguments)[:200]}) {again}")
                    if await conn.sandbox_alive():
                        raise ToolServerKilledError(f"{what}, while its sandbox is alive: the model's code "
                                                    "broke it") from None
                    raise ToolServerError(f"{what}{conn.stderr_tail()}") from None
                note = (f"\n[note: the {conn.spec.name} tool server {f.what} and was restarted; "
                        "state kept by its tools (variables, sessions) is lost]")
                continue
            except MCPError as e:  # a protocol-level error answer (e.g. invalid params)
                return self._error(info.name, e.message)
            out = _result_to_text(res)
            return ToolResult(info.name, out + note if not res.is_error else _as_error(out) + note,
                              is_error=bool(res.is_error), structured=res.structured_content)
        raise AssertionError("unreachable")


MAX_ARGUMENT_DEPTH = 32  # nesting of a call's arguments (the MCP SDK's JSON writer stops at a few hundred)


def wire_arguments(arguments: Any) -> tuple[Any, str]:
    """(arguments as they can be sent, "") or (arguments, what is wrong, for the model). What a
    parser decoded from model text may not go on the wire as is: a lone surrogate (from a
    ``\\ud800`` escape) cannot be encoded to UTF-8, nesting past the SDK's serialization depth
    raises in its writer task, and either would close the connection to the server (a
    restart, then a failed trajectory). Surrogates are replaced; tuples become lists."""
    def clean(value: Any, depth: int) -> Any:
        if depth > MAX_ARGUMENT_DEPTH:
            raise _Unsendable(f"the arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels")
        if isinstance(value, str):
            return valid_unicode(value)
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, dict):
            return {valid_unicode(k) if isinstance(k, str) else _unsendable(k): clean(v, depth + 1)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, depth + 1) for v in value]
        return _unsendable(value)

    if not isinstance(arguments, dict):
        return arguments, ""  # validate() says what it should be
    try:
        cleaned = clean(arguments, 0)
        json.dumps(cleaned)  # what else would fail in the writer (integers past Python's digit limit)
    except _Unsendable as e:
        return arguments, str(e)
    except (ValueError, TypeError, RecursionError) as e:
        return arguments, f"the arguments cannot be sent as JSON ({type(e).__name__})"
    return cleaned, ""


class _Unsendable(Exception):
    pass


def _unsendable(value: Any):
    raise _Unsendable(f"an argument of type {type(value).__name__} cannot be sent as JSON")


def _type_name(schema: dict) -> str:
    t = schema.get("type")
    if isinstance(t, list):
        return " | ".join(t)
    if t:
        return t
    alts = [s.get("type", "?") for s in schema.get("anyOf", []) if isinstance(s, dict)]
    return " | ".join(alts) if alts else "any"


def _as_error(text: str) -> str:
    text = re.sub(r"^Error executing tool [\w.-]+: ", "Error: ", text)  # the SDK's prefix
    return text if text.lower().startswith("error") else f"Error: {text}"


def _result_to_text(res) -> str:
    """A CallToolResult's content blocks as one text for the model."""
    parts = []
    for block in res.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif kind == "resource":
            r = block.resource
            parts.append(getattr(r, "text", None) or f"[resource {r.uri}: {getattr(r, 'mime_type', '') or 'binary'}]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}]")
        else:
            parts.append(str(block))
    if not parts and res.structured_content is not None:
        parts.append(json.dumps(res.structured_content, ensure_ascii=False, default=str))
    text = "\n".join(parts)
    return text if text else "(no output)"


MAX_LINE_BYTES = 32 << 20      # longest message line read from a stdio server
MAX_LINES_PER_S = 2000         # messages a stdio server may send per second, on average over 5 s


@asynccontextmanager
async def bounded_stdio_client(argv: list[str], env: dict[str, str] | None, cwd: str | None, errlog,
                               max_line: int = MAX_LINE_BYTES, max_rate: float = MAX_LINES_PER_S):
    """An MCP stdio transport (the SDK's `stdio_client` streams) that bounds what it reads: a
    line is joined once, at its newline (the SDK re-joins its buffer per chunk: a 48 MB line
    cost seconds of CPU), and a line longer than `max_line` or a flood of lines closes the
    connection (the session then sees the server gone). The server runs in its own session;
    leaving kills its process group.

    Why not the SDK's `stdio_client` (mcp 2.3): its reader keeps a line of any length and takes
    no bound (a server that model code controls can print one without end), and its reading
    cannot be replaced on its own. Everything above the line (JSON-RPC, the session, the
    message types) is the SDK's: `ClientSession`, `SessionMessage`, `jsonrpc_message_adapter`."""
    import anyio
    from mcp.client.stdio import get_default_environment
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    process = await anyio.open_process(argv, env={**get_default_environment(), **(env or {})}, cwd=cwd,
                                       stderr=errlog, start_new_session=True)
    read_writer, read_stream = anyio.create_memory_object_stream(0)
    write_stream, write_reader = anyio.create_memory_object_stream(0)

    def parse(line: bytes):
        try:
            return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
        except ValueError as e:
            return e

    async def reader() -> None:
        pending: list[bytes] = []  # pieces of the line being read
        size, window, count = 0, time.monotonic(), 0
        async with read_writer:
            try:
                async for chunk in process.stdout:
                    while chunk:
                        nl = chunk.find(b"\n")
                        if nl < 0:
                            pending.append(chunk)
                            size += len(chunk)
                            chunk = b""
                        else:
                            pending.append(chunk[:nl])
                            size += nl
                            chunk = chunk[nl + 1:]
                        if size > max_line:
                            log.warning("MCP server %s: a line longer than %d bytes; closing it", argv[:3], max_line)
                            return
                        if nl < 0:
                            break
                        line, pending, size = b"".join(pending), [], 0
                        count += 1
                        now = time.monotonic()
                        if now - window > 5:
                            window, count = now, 1
                        elif count > max_rate * 5:
                            log.warning("MCP server %s: more than %d lines/s; closing it", argv[:3], max_rate)
                            return
                        if line.strip():
                            await read_writer.send(parse(line))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                pass

    async def writer() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        tg.start_soon(writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await process.stdin.aclose()
                with anyio.move_on_after(2):
                    await process.wait()
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(process.pid, signal.SIGKILL)
                    with anyio.move_on_after(5):
                        await process.wait()
                await _aclose_quietly(process, read_stream, write_stream)
            tg.cancel_scope.cancel()


async def _aclose_quietly(*resources) -> None:
    for r in resources:
        with contextlib.suppress(Exception):
            await r.aclose()


async def _gather_or_cancel(coros: list) -> list:
    """gather, but the first exception cancels the rest and is raised as itself (callers catch
    ToolServerError and friends, not a group)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]
