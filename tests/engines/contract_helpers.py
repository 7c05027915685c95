"""Checks of requests and replies against the pinned SGLang's structures
(sglang_contract.json, made by make_sglang_contract.py), and a client that records what
agentrl sends. A uniquely named module: tests/ has several conftest.py files."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from agentrl.rollout.client import EngineClient

CONTRACT = json.loads((Path(__file__).parent / "sglang_contract.json").read_text())
EXTENSIONS = {"meta_info": {"engine_id"}}  # agentrl's own additions, documented in embedded.py


def conforms(value, annotation: str) -> bool:
    """Does a JSON value fit a Python annotation as SGLang's HTTP layer reads it?"""
    return _fits(value, ast.parse(annotation, mode="eval").body)


def _name(node) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _args(node) -> list:
    s = node.slice
    return list(s.elts) if isinstance(s, ast.Tuple) else [s]


def _fits(value, node) -> bool:
    if isinstance(node, ast.Constant):
        return value is None if node.value is None else value == node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = _name(node)
        simple = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
                  "bytes": lambda v: isinstance(v, str),  # base64 over HTTP (Base64Bytes)
                  "dict": lambda v: isinstance(v, dict), "list": lambda v: isinstance(v, list)}
        return simple[name](value) if name in simple else True  # Any and SGLang's own aliases
    if isinstance(node, ast.Subscript):
        head, args = _name(node.value), _args(node)
        if head == "Optional":
            return value is None or _fits(value, args[0])
        if head == "Union":
            return any(_fits(value, a) for a in args)
        if head in ("List", "Set", "list", "set"):
            return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
        if head == "Literal":
            return any(_fits(value, a) for a in args)
        if head == "Annotated":
            return _fits(value, args[0])
        return True
    return True


def check_request(endpoint: str, payload: dict) -> None:
    fields = CONTRACT["requests"][endpoint]["fields"]
    unknown = set(payload) - set(fields)
    assert not unknown, f"{endpoint}: fields SGLang 0.5.15 does not have: {unknown}"
    for key, value in payload.items():
        assert conforms(value, fields[key]), f"{endpoint}.{key} = {value!r:.80} does not fit {fields[key]}"
    if endpoint == "/generate" and payload.get("sampling_params"):
        sp = CONTRACT["sampling_params"]
        for key, value in payload["sampling_params"].items():
            assert key in sp, f"sampling_params.{key}: not one of SGLang's"
            assert conforms(value, sp[key]), f"sampling_params.{key} = {value!r} does not fit {sp[key]}"


def check_reply(endpoint: str, status: int, content_type: str, body) -> None:
    spec = CONTRACT["responses"][endpoint]
    assert status == 200, (endpoint, status, body)
    if spec["kind"] == "json":
        assert content_type == "application/json", (endpoint, content_type)
        for key, ann in spec["keys"].items():
            assert key in body, f"{endpoint}: reply lacks {key!r} ({sorted(body)})"
            assert conforms(body[key], ann), f"{endpoint}: reply {key} = {body[key]!r:.80} does not fit {ann}"
    elif spec["kind"] == "json_null":
        assert body is None, (endpoint, body)
    elif spec["kind"] == "empty":
        assert body in ("", None), (endpoint, body)
    else:
        assert isinstance(body, str), (endpoint, body)
    if endpoint == "/generate":
        check_meta_info(body["meta_info"], logprobs="output_token_logprobs" in body["meta_info"])


def check_meta_info(meta: dict, logprobs: bool) -> None:
    want = dict(CONTRACT["meta_info"], **(CONTRACT["meta_info_logprob"] if logprobs else {}))
    for key, ann in want.items():
        assert key in meta, f"meta_info lacks {key!r}"
        assert conforms(meta[key], ann), f"meta_info.{key} = {meta[key]!r:.80} does not fit {ann}"
    extra = set(meta) - set(want) - EXTENSIONS["meta_info"]
    assert not extra, f"meta_info fields SGLang does not send: {extra}"
    finish = meta["finish_reason"]
    spec = CONTRACT["finish_reasons"][finish["type"]]
    assert set(finish) <= set(spec), (finish, spec)
    for key, ann in spec.items():
        assert key in finish and conforms(finish[key], ann), (finish, spec)


class RecordingClient(EngineClient):
    """An EngineClient that keeps every (path, payload, status, content type, reply) it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, dict, int, str, object]] = []

    async def _post(self, path, payload, headers=None, retry=None):
        async with self.session.post(self.base_url + path, json=payload, headers=headers) as resp:
            text = await resp.text()
            ctype = resp.content_type
            status = resp.status
            resp_headers = dict(resp.headers)
        body = json.loads(text) if ctype == "application/json" else text
        self.calls.append((path, payload, status, ctype, body))
        if status != 200:
            from agentrl.errors import EngineError

            raise EngineError(f"POST {path}: HTTP {status}: {text[:300]}")
        return body, resp_headers


def serve(engine, go):
    """Run `await go(client)` against `engine` (an EmbeddedEngine) served in-process over HTTP."""
    import asyncio

    from aiohttp.test_utils import TestServer

    async def main():
        server = TestServer(engine.app())
        await server.start_server()
        try:
            async with EngineClient(str(server.make_url("")).rstrip("/"), request_timeout_s=60) as client:
                return await go(client)
        finally:
            await server.close()

    return asyncio.run(main())
