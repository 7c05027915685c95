"""Client of SGLang's native HTTP protocol (served by SGLang, the embedded engine, or
sglang-router in front of either). Token ids in, token ids + logprobs out.

Session affinity: `generate(..., session_id=trajectory_id)` sends the id as the routing
key (`X-SMG-Routing-Key`, read by sglang-router's `manual` policy), so every turn of a
trajectory lands on one engine and finds its prefix in that engine's cache.

Failures: a /generate that fails on the way (connection refused or reset, timeout, HTTP
5xx, e.g. the router's answer when the engine behind it died) is sent again, with
exponential backoff, up to `retries` more times (a timeout only once more); the router meanwhile drops the dead
engine and maps the trajectory to a surviving one. 4xx answers are not retried. A retried
request is the same request: its trajectory is continued once, never duplicated.

Each completed /generate is recorded in a TurnLog (which engine served it, prompt and
cached tokens) for the router_affinity and prefix_cache_hit_rate metrics.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import numpy as np
import orjson

from agentrl.engines import ENGINE_HEADER
from agentrl.errors import EngineError
from agentrl.rollout.affinity import Turn, TurnLog

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


# JSON both ways through orjson: the standard library's codec was ~10% of a turn's client CPU with a
# 100-token context (bench/rollout_overhead.py), and grows with the context. What orjson refuses to
# write (integers past 64 bits) or read (NaN) goes through json as before. Unlike json, orjson writes
# NaN and infinities as null and reads integers past 64 bits as floats: no engine reply holds those.
def _dumps(value) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value)


def _loads(data: bytes):
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


@dataclass
class GenerateResult:
    output_ids: list[int]  # [num_new_tokens]
    logprobs: list[float]  # [num_new_tokens]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    engine_id: str | None = None  # which engine served it (None: the engine did not say)
    # R3: the experts the engine routed each token of input + output (but the last) to,
    # [prompt_tokens + num_new_tokens - 1][layers * top-k]; only when the client asked
    routed_experts: list[list[int]] | None = None


def decode_routed_experts(value, num_tokens: int) -> list[list[int]]:
    """SGLang's meta_info.routed_experts -> [num_tokens][layers * top-k] expert ids. SGLang
    sends base64 of an int32 array [tokens, layers, top-k], as a string or (newer) as
    {"topk_ids": ..., "topk_weights": ...}."""
    if isinstance(value, dict):
        value = value.get("topk_ids")
    if not isinstance(value, str):
        raise EngineError("engine reply has no meta_info.routed_experts: start SGLang with "
                          "--enable-return-routed-experts (routing replay asked for them)")
    ids = np.frombuffer(base64.b64decode(value), dtype=np.int32)
    if num_tokens <= 0 or ids.size % num_tokens:
        raise ValueError(f"routed_experts holds {ids.size} ids, not a whole number per token for {num_tokens} tokens")
    return ids.reshape(num_tokens, -1).tolist()


class GenerateClient(Protocol):
    """What the agent loop and the group runner ask of an engine client: EngineClient over HTTP,
    or anything else that samples tokens with their logprobs (a test's scripted engine, an
    in-process model). `session_id` is the routing key (the trajectory id: one engine per
    trajectory behind sglang-router); `rid` lets the request be aborted; `lora_path` names a
    loaded adapter (None: the base model)."""

    async def generate(self, input_ids: list[int], sampling_params: dict, *, session_id: str | None = None,
                       rid: str | None = None, lora_path: str | None = None) -> GenerateResult: ...


class EngineClient:
    """One aiohttp session to one base URL (an engine or a router).

    `max_connections`: None (the default) sets no limit of its own: the rollout's
    --max-concurrency already bounds the requests in flight, and a pool smaller than it
    would hold turns back until other trajectories' generations end (at 2,000 trajectories
    in flight and a 1,024 pool, p99 turn latency rose by 5 s: bench/driver_scale.py)."""

    def __init__(self, base_url: str, *, request_timeout_s: float = 600.0, max_connections: int | None = None,
                 retries: int = 6, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 turn_log: TurnLog | None = None, return_routed_experts: bool = False):
        self.base_url = base_url.rstrip("/")
        self.return_routed_experts = return_routed_experts  # R3 (SGLang --enable-return-routed-experts)
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.turn_log = TurnLog() if turn_log is None else turn_log  # which engine served each turn
        self.retried = 0  # requests sent again after a failure (all calls of this client)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._kind: str | None = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections or 0),  # 0: aiohttp's "no limit"
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s), json_serialize=_dumps,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt)

    async def _post(self, path: str, payload: dict, headers: dict | None = None,
                    retries: int | None = None) -> tuple[dict | str | None, str | None]:
        """(body, the engine that served it: the X-Agentrl-Engine header or None)."""
        retries = self.retries if retries is None else retries
        last: Exception | None = None
        timeouts = 0
        for attempt in range(retries + 1):
            if attempt:
                self.retried += 1
            try:
                async with self.session.post(self.base_url + path, json=payload, headers=headers) as resp:
                    if resp.status >= 500 and attempt < retries:
                        last = EngineError(f"POST {self.base_url}{path}: HTTP {resp.status} {(await resp.text())[:300]}")
                        await asyncio.sleep(self._delay(attempt))
                        continue
                    if resp.status != 200:
                        raise EngineError(f"POST {self.base_url}{path}: HTTP {resp.status}: {(await resp.text())[:500]}")
                    # a case-insensitive lookup: sglang-router (hyper) sends headers lower-cased
                    engine = resp.headers.get(ENGINE_HEADER)
                    if resp.content_type == "application/json":  # as resp.json(), without its checks redone
                        data = (await resp.read()).strip()
                        return (_loads(data) if data else None), engine
                    return await resp.text(), engine
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                last = exc
                if isinstance(exc, asyncio.TimeoutError):
                    timeouts += 1
                    if timeouts > 1:  # a request that timed out twice is not tried a third time
                        break
                if attempt < retries:
                    await asyncio.sleep(self._delay(attempt))
        raise EngineError(f"POST {self.base_url}{path} failed after {attempt + 1} tries: {last!r}")

    async def generate(self, input_ids: list[int], sampling_params: dict, *, session_id: str | None = None,
                       rid: str | None = None, lora_path: str | None = None) -> GenerateResult:
        """`lora_path`: the name of a loaded LoRA adapter to generate with (SGLang's field); None: the base model."""
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        if rid:
            payload["rid"] = rid
        if lora_path:
            payload["lora_path"] = lora_path
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
        headers = {ROUTING_KEY_HEADER: session_id} if session_id else None
        body, engine = await self._post("/generate", payload, headers)
        try:
            meta = body["meta_info"]
            pairs = meta["output_token_logprobs"]
            output_ids = [int(p[1]) for p in pairs]
            sent_ids = body.get("output_ids")
            if sent_ids is not None and (sent_ids if type(sent_ids) is list else list(sent_ids)) != output_ids:
                raise EngineError("engine reply: output_ids and output_token_logprobs disagree")
            finish = meta["finish_reason"]
            result = GenerateResult(
                output_ids=output_ids,
                logprobs=[float(p[0]) for p in pairs],
                finish_reason=finish["type"] if isinstance(finish, dict) else str(finish),
                prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                weight_version=str(meta.get("weight_version", "0")),
                engine_id=engine or meta.get("engine_id"),
            )
            if self.return_routed_experts:
                result.routed_experts = decode_routed_experts(meta.get("routed_experts"),
                                                              len(input_ids) + len(output_ids) - 1)
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineError(f"malformed /generate reply from {self.base_url}: {exc!r}: {str(body)[:300]}") from exc
        if session_id:
            self.turn_log.record(session_id, Turn(result.engine_id, result.prompt_tokens, result.cached_tokens))
        return result

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            async with self.session.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def get(self, path: str) -> dict | str | None:
        async with self.session.get(self.base_url + path) as r:
            if r.status != 200:
                raise EngineError(f"GET {self.base_url}{path}: HTTP {r.status}: {(await r.text())[:300]}")
            return await r.json() if r.content_type == "application/json" else await r.text()

    async def kind(self) -> str:
        """"embedded" (agentrl's engine) or "sglang", from /model_info (cached)."""
        if self._kind is None:
            info = await self.get("/model_info")
            self._kind = "embedded" if isinstance(info, dict) and info.get("engine") == "agentrl-embedded" \
                else "sglang"
        return self._kind

    async def post(self, path: str, payload: dict, *, retries: int | None = None) -> dict | str | None:
        """Any other protocol call: /flush_cache, /abort_request, /update_weights_from_*, ...
        (control calls retry less by default: 2 more tries)."""
        body, _ = await self._post(path, payload, retries=2 if retries is None else retries)
        return body
