"""`python -m sglang.launch_server`, plus one response header: `X-Agentrl-Engine: <id>`, one
route of agentrl's own: POST /agentrl/apply_weight_delta, and, for a vision-language model, its
/generate input_ids in SGLang's form (`ImagePlaceholders`).

Usage is SGLang's own: python -m agentrl.engines.sglang_server --model-path DIR --port N ...
(every argument goes to SGLang unchanged); the engine id comes from $AGENTRL_ENGINE_ID
(agentrl sets it to the engine's URL), else host:port. With --enable-return-routed-experts
every /generate returns the routed experts unless the request says otherwise (RoutedExperts).

Why: to measure session affinity the rollout side must know which engine served each
turn. SGLang's /generate reply does not say (meta_info has no server identity, and
sglang-router adds no worker header), but the router passes a worker's response headers
through, so a pure-ASGI middleware on SGLang's FastAPI app names the engine on every
reply. It costs one header per response and touches nothing else. (With
--tokenizer-worker-num > 1 SGLang re-imports its app in worker processes, which then
answer without the header; affinity is then reported as unknown, not wrong.)

POST /agentrl/apply_weight_delta (`WeightDeltaRoute`): the delta weight sync's file work on the
engine's host (agentrl.weight_delta: the host's local checkpoint brought to a published version),
which SGLang's stock /update_weights_from_disk then loads. Served here, in the engine's own
process on its own host, because that host's disk is where the local checkpoint lives; slime
instead patches SGLang (a /pull_weights endpoint), which agentrl's upstream SGLang does not have.
It runs in a thread, so SGLang keeps serving while the files change.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from agentrl.engines import ENGINE_HEADER
from agentrl.weight_delta import APPLY_ROUTE, serve_apply


class EngineHeader:
    """ASGI middleware: add X-Agentrl-Engine to every HTTP response."""

    def __init__(self, app, engine_id: str):
        self.app = app
        self.value = engine_id.encode()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message.get("type") == "http.response.start":
                message["headers"] = list(message.get("headers") or []) + [(ENGINE_HEADER.lower().encode(), self.value)]
            await send(message)

        return await self.app(scope, receive, send_with_header)


class RoutedExperts:
    """ASGI middleware: a /generate request with no `return_routed_experts` gets `true`.

    Why: routing replay (R3) needs each reply's meta_info.routed_experts, but sglang-router
    0.3.2 re-serialises /generate requests through a typed struct that has no such field and
    drops it (rid, lora_path, logprob_start_len pass; checked 2026-11-26 with an echo worker).
    agentrl starts SGLang with --enable-return-routed-experts only for R3 runs, where every
    turn must carry them, so the server asks for them itself."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        return await _edit_generate(self.app, scope, receive, send, self.edit)

    @staticmethod
    def edit(request: dict) -> bool:
        if "return_routed_experts" in request:
            return False
        request["return_routed_experts"] = True
        return True


class ImagePlaceholders:
    """ASGI middleware: in a /generate request with `image_data`, each run of the image token in
    `input_ids` becomes one token.

    Why: agentrl's prompt ids hold each image's placeholder as the model's processor expanded it
    (the tokens the trainer scores), but SGLang 0.5.15 takes pre-tokenized input with one image
    token per image and expands it itself: its fast path (multimodal/processors/base_processor.py)
    decodes the ids and runs the HF processor on that text, which fails on an expanded run (HTTP
    500, seen on an H200 on 2026-12-03). With SGLANG_MM_AVOID_RETOKENIZE=1 (`main` sets it) SGLang
    keeps every other token as sent and expands each image's token by that image's count, so it
    serves the caller's prompt token for token, and meta_info.prompt_tokens is the expanded length
    the agent loop checks against its own."""

    def __init__(self, app, image_token_id: int):
        self.app, self.image_token_id = app, image_token_id

    async def __call__(self, scope, receive, send):
        return await _edit_generate(self.app, scope, receive, send, self.edit)

    def edit(self, request: dict) -> bool:
        ids = request.get("input_ids")
        if not request.get("image_data") or not isinstance(ids, list):
            return False
        one = one_token_per_image(ids, self.image_token_id)
        request["input_ids"] = one
        return len(one) != len(ids)


def one_token_per_image(ids: list, image_token_id: int) -> list:
    """`ids` with each run of `image_token_id` as one token (SGLang's form of a pre-tokenized
    multimodal prompt)."""
    return [t for k, t in enumerate(ids) if t != image_token_id or k == 0 or ids[k - 1] != image_token_id]


def image_token_id(argv: list[str]) -> int | None:
    """The image token of the --model-path checkpoint's config.json when it is a vision-language
    model (a `vision_config` beside it), else None."""
    path = next((v for f, v in zip(argv, argv[1:]) if f == "--model-path"), None)
    try:
        config = json.loads((Path(path) / "config.json").read_text()) if path else {}
    except (OSError, ValueError):
        return None
    token = config.get("image_token_id")
    return token if "vision_config" in config and isinstance(token, int) else None


async def _edit_generate(app, scope, receive, send, edit):
    """Run `app` on the request, a POST /generate's JSON body first given to `edit(request)`,
    which changes it in place and says whether it did."""
    if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") != "/generate":
        return await app(scope, receive, send)
    body, gone = await _read_body(receive)
    if gone is not None:  # the client went away: let SGLang see it
        return await app(scope, _replay([gone], receive), send)
    try:
        request = json.loads(body)
    except ValueError:
        request = None  # SGLang answers a malformed body with its own error
    if isinstance(request, dict) and edit(request):
        body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
    return await app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


class WeightDeltaRoute:
    """ASGI middleware: serve POST /agentrl/apply_weight_delta (agentrl.weight_delta.serve_apply,
    the embedded engine's handler too); every other request goes to SGLang."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("path") != APPLY_ROUTE:
            return await self.app(scope, receive, send)
        if scope.get("method") != "POST":
            return await _json_reply(send, 405, {"success": False, "message": f"{APPLY_ROUTE} takes POST"})
        raw, gone = await _read_body(receive)
        if gone is not None:  # the client went away
            return
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        status, reply = await serve_apply(body if isinstance(body, dict) else {})
        return await _json_reply(send, status, reply)


async def _read_body(receive) -> tuple[bytes, dict | None]:
    """A request's whole body, and None; or what was read and the message that ended it early
    (the client went away)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks), None


async def _json_reply(send, status: int, reply: dict) -> None:
    data = json.dumps(reply).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _replay(messages: list[dict], receive):
    """An ASGI receive() that hands out `messages` first, then the real ones."""
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay


def _engine_id(argv: list[str]) -> str:
    if os.environ.get("AGENTRL_ENGINE_ID"):
        return os.environ["AGENTRL_ENGINE_ID"]
    host, port = "127.0.0.1", "30000"
    for flag, value in zip(argv, argv[1:]):
        if flag == "--host":
            host = value
        elif flag == "--port":
            port = value
    return f"http://{host}:{port}"


def main() -> None:
    engine_id = _engine_id(sys.argv[1:])
    try:
        from sglang.srt.entrypoints import http_server

        http_server.app.add_middleware(EngineHeader, engine_id=engine_id)
    except Exception as exc:  # serve anyway: only the affinity metric needs the header
        print(f"agentrl: could not add the X-Agentrl-Engine header ({exc!r}); serving without it", file=sys.stderr)
    from sglang.srt.entrypoints import http_server

    http_server.app.add_middleware(WeightDeltaRoute)  # not optional: --weight-sync-mode delta fails without it
    if "--enable-return-routed-experts" in sys.argv[1:]:  # not optional: R3 fails without it
        http_server.app.add_middleware(RoutedExperts)
    image_token = image_token_id(sys.argv[1:])
    if image_token is not None:  # not optional: SGLang answers an expanded image placeholder with HTTP 500
        os.environ.setdefault("SGLANG_MM_AVOID_RETOKENIZE", "1")
        http_server.app.add_middleware(ImagePlaceholders, image_token_id=image_token)
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
