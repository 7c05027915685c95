"""The run's OpenAI-compatible endpoint: one aiohttp server, many sessions.

    POST {base}/chat/completions   (stream or not)
    GET  {base}/models

A session's `base` is ``http://HOST:PORT/s/KEY/v1`` and its api key is KEY, so a framework
that takes only a base URL, or only an api key (with the server's plain ``/v1``), reaches
the same session. An unknown key is refused with OpenAI's 401. A session may also be served
on unix sockets (`bind`: a sandbox's bridge): there the socket, not a key, names the
session. Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

A streamed reply is sent once the engine has produced the turn (the engine gives a turn
whole): the tokens are recorded before the first byte goes out, so a client that
disconnects mid-stream loses nothing already recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import traceback

from aiohttp import web

from agentrl.errors import EngineError
from agentrl.gateway.protocol import RequestError, completion, parse_request, stream_chunks
from agentrl.gateway.session import Session

SESSION_PREFIX = "/s/{key}/v1"
MAX_SOCKET_CONNECTIONS = 16  # open connections per bound unix socket: a sandbox cannot take the host's fds


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport):
        transport.close()


class _BoundedUnixSite(web.UnixSite):
    """A UnixSite that holds at most MAX_SOCKET_CONNECTIONS connections open; more are closed at once."""

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server, path = self._runner.server, str(self._path)

        def protocol():
            live = sum(1 for h in server.connections
                       if h.transport is not None and h.transport.get_extra_info("sockname") == path)
            return server() if live < MAX_SOCKET_CONNECTIONS else _Refuse()

        self._server = await asyncio.get_running_loop().create_unix_server(protocol, path, backlog=self._backlog)


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


class Gateway:
    """Serves the sessions registered with `open`; `close(key)` ends one and returns its samples."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "agentrl-policy",
                 max_request_bytes: int = 64 << 20):
        self.host, self.port, self.model_name = host, port, model_name
        self.max_request_bytes = max_request_bytes
        self.sessions: dict[str, Session] = {}
        self.url: str | None = None  # http://host:port once started
        self._runner: web.AppRunner | None = None
        self._by_socket: dict[str, str] = {}  # unix socket path -> the key of the session it serves
        self._sites: dict[str, web.UnixSite] = {}

    # -- lifetime ------------------------------------------------------------------------------
    async def start(self) -> "Gateway":
        if self._runner is not None:
            return self
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def aclose(self) -> None:
        for session in self.sessions.values():
            session.closed = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for path in list(self._sites):
            await self.unbind(path)

    async def __aenter__(self) -> "Gateway":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- sessions ------------------------------------------------------------------------------
    def open(self, session: Session) -> tuple[str, str]:
        """Register `session`: (its base URL, its api key)."""
        if self.url is None:
            raise RuntimeError("Gateway.open before start()")
        key = f"agentrl-{secrets.token_urlsafe(12)}"
        self.sessions[key] = session
        return f"{self.url}{SESSION_PREFIX.format(key=key)}", key

    def close(self, key: str):
        """End the session: its samples; later requests with its key, or on its sockets, get 401."""
        for path in [p for p, k in self._by_socket.items() if k == key]:
            del self._by_socket[path]
        return self.sessions.pop(key).close()

    async def bind(self, key: str, path: str | os.PathLike, uid: int | None = None) -> None:
        """Serve session `key` on a unix socket at `path` too (a sandbox's bridge, see
        agentrl.sandboxes.bridge): a request that comes in on it is that session's, whatever key
        or path it names. The socket is made `uid`'s alone (mode 0600; chown when we are root)."""
        if self._runner is None or key not in self.sessions:
            raise RuntimeError("Gateway.bind: start() the gateway and open() the session first")
        path = str(path)
        site = _BoundedUnixSite(self._runner, path)
        await site.start()
        self._sites[path] = site
        os.chmod(path, 0o600)
        if uid is not None and os.geteuid() == 0:
            os.chown(path, uid, uid)
        self._by_socket[path] = key

    async def unbind(self, path: str | os.PathLike) -> None:
        """Stop listening on a socket of `bind` and remove it."""
        path = str(path)
        self._by_socket.pop(path, None)
        site = self._sites.pop(path, None)
        if site is not None and self._runner is not None:
            await site.stop()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _session(self, request: web.Request) -> Session:
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if isinstance(sockname, str) and sockname:  # a unix socket: it names the session (bind)
            session = self.sessions.get(self._by_socket.get(sockname, ""))
            if session is None:
                raise RequestError("this socket's session has ended", code="invalid_api_key", status=401,
                                   type="authentication_error")
            return session
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        session = self.sessions.get(key or "")
        if session is None:
            raise RequestError("unknown or ended session: use the base_url and api_key the agent was given",
                               code="invalid_api_key", status=401, type="authentication_error")
        return session

    # -- routes --------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._errors])
        for base in ("/v1", SESSION_PREFIX):
            app.router.add_post(f"{base}/chat/completions", self.chat_completions)
            app.router.add_get(f"{base}/models", self.models)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every failure answered in OpenAI's error shape."""
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(exc)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
            return _error(RequestError(f"{request.method} {request.path}: {exc.reason}", status=exc.status,
                                       code=exc.reason.lower().replace(" ", "_")))
        except EngineError as exc:
            return _error(RequestError(f"the engine failed: {exc}", status=502, type="server_error",
                                       code="engine_error"))
        except Exception as exc:  # a bug of ours: the agent sees a 500, the log has the traceback
            traceback.print_exc()
            return _error(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                       type="server_error", code="internal_error"))

    async def models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        try:
            body = await request.json(loads=json.loads)
        except ValueError as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None
        chat = parse_request(body)
        reply = await session.complete(chat)
        reply_id = f"chatcmpl-{secrets.token_hex(12)}"
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}
        if not chat.stream:
            return web.json_response(completion(reply_id, chat.model, reply.message, reply.finish_reason, usage))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            for chunk in stream_chunks(reply_id, chat.model, reply.message, reply.finish_reason,
                                       usage if chat.include_usage else None):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client went away: the reply was recorded before streaming
            session.disconnects += 1
        return response
