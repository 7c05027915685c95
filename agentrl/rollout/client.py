"""Client of SGLang's native HTTP protocol (served by SGLang, the embedded engine, or
sglang-router in front of either). Token ids in, token ids + logprobs out.

Session affinity: `generate(..., session_id=trajectory_id)` sends the id as the routing
key (`X-SMG-Routing-Key`, read by sglang-router's `manual` policy), so every turn of a
trajectory lands on one engine and finds its prefix in that engine's cache.

Failures: a /generate that fails on the way (connection refused or reset, timeout, HTTP
5xx, e.g. the router's answer when the engine behind it died) is sent again under
`GENERATE_RETRY` (agentrl.http.RetryPolicy: back-off with jitter, 7 tries, none started
later than a minute past the request timeout, a timeout only once more); the router
meanwhile drops the dead engine and maps the trajectory to a surviving one. 4xx answers are
not retried. A retried request is the same request: its
trajectory is continued once, never duplicated. Other protocol calls retry less
(`CONTROL_RETRY`: 3 tries).

Each completed /generate is recorded in a TurnLog (which engine served it, prompt and
cached tokens) for the router_affinity and prefix_cache_hit_rate metrics.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, replace
from typing import Protocol

import aiohttp
import numpy as np

from agentrl.engines import ENGINE_HEADER
from agentrl.errors import EngineError
from agentrl.http import RetryPolicy, get_json, get_ok, json_session, post_json
from agentrl.rollout.affinity import Turn, TurnLog

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
GENERATE_RETRY = RetryPolicy(attempts=7, backoff_s=0.5, max_backoff_s=8.0)
CONTROL_RETRY = replace(GENERATE_RETRY, attempts=3)
# each client's deadline: no try starts later than this past its request timeout, counted from the
# first try (a reply that failed late still gets retries; the router drops a dead engine in seconds)
RETRY_GRACE_S = 60.0


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
                       rid: str | None = None, lora_path: str | None = None,
                       image_data: list[str] | None = None) -> GenerateResult: ...


class EngineClient:
    """One aiohttp session to one base URL (an engine or a router).

    `max_connections`: None (the default) sets no limit of its own: the rollout's
    --max-concurrency already bounds the requests in flight, and a pool smaller than it
    would hold turns back until other trajectories' generations end (at 2,000 trajectories
    in flight and a 1,024 pool, p99 turn latency rose by 5 s: bench/driver_scale.py)."""

    def __init__(self, base_url: str, *, request_timeout_s: float = 600.0, max_connections: int | None = None,
                 retry: RetryPolicy | None = None, turn_log: TurnLog | None = None,
                 return_routed_experts: bool = False):
        self.base_url = base_url.rstrip("/")
        self.return_routed_experts = return_routed_experts  # R3 (SGLang --enable-return-routed-experts)
        self.request_timeout_s = request_timeout_s
        # of /generate (other calls: CONTROL_RETRY)
        self.retry = retry or replace(GENERATE_RETRY, deadline_s=request_timeout_s + RETRY_GRACE_S)
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
            self._session = json_session(timeout_s=self.request_timeout_s, max_connections=self._max_connections)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _count_retry(self, exc: BaseException) -> None:
        self.retried += 1

    async def _post(self, path: str, payload: dict, headers: dict | None = None,
                    retry: RetryPolicy | None = None) -> tuple[dict | str | None, str | None]:
        """(body, the engine that served it: the X-Agentrl-Engine header or None)."""
        body, resp_headers = await post_json(self.session, self.base_url + path, payload, headers=headers,
                                             retry=self.retry if retry is None else retry, on_retry=self._count_retry)
        # a case-insensitive lookup: sglang-router (hyper) sends headers lower-cased
        return body, resp_headers.get(ENGINE_HEADER)

    async def generate(self, input_ids: list[int], sampling_params: dict, *, session_id: str | None = None,
                       rid: str | None = None, lora_path: str | None = None,
                       image_data: list[str] | None = None) -> GenerateResult:
        """`lora_path`: the name of a loaded LoRA adapter to generate with (SGLang's field); None: the base model.
        `image_data`: the prompt's images (data URLs, SGLang's field), one per image placeholder run of
        `input_ids`, which hold each image's tokens as the processor expanded them (agentrl/vision.py)."""
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        if image_data:
            payload["image_data"] = list(image_data)
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
        return await get_ok(self.session, self.base_url + "/health", timeout_s=timeout_s)

    async def get(self, path: str) -> dict | str | None:
        return await get_json(self.session, self.base_url + path)

    async def kind(self) -> str:
        """"embedded" (agentrl's engine) or "sglang", from /model_info (cached)."""
        if self._kind is None:
            info = await self.get("/model_info")
            self._kind = "embedded" if isinstance(info, dict) and info.get("engine") == "agentrl-embedded" \
                else "sglang"
        return self._kind

    async def post(self, path: str, payload: dict, *, retry: RetryPolicy = CONTROL_RETRY,
                   retries: int | None = None) -> dict | str | None:
        """Any other protocol call: /flush_cache, /abort_request, /update_weights_from_*, ...
        (retried less than /generate: CONTROL_RETRY). `retries`: the older spelling of
        `retry`, as that many more tries (kept for callers written against it)."""
        if retries is not None:
            retry = replace(retry, attempts=retries + 1)
        body, _ = await self._post(path, payload, retry=retry)
        return body
