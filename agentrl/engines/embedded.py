"""The embedded engine: an HF transformers model behind SGLang's native HTTP protocol.

It stands in for SGLang where there is no GPU (CPU, tests, laptops); the rollout code
cannot tell the two apart, and sglang-router can sit in front of several of them.
Concurrent /generate requests are batched continuously, as SGLang's scheduler does: a
request that arrives while others decode joins them between two decode steps (its prompt
prefilled, its KV laid beside theirs), and a finished one leaves at once, so a short request
never waits for a long one to end. Logprobs are those of the temperature-scaled
distribution, as SGLang returns them, so the trainer recomputes them with logits / T.

Prefix cache: the KV of recently finished sequences is kept (see prefix_cache.py); a
request whose input_ids extend one of them prefills only the new suffix, and its reply's
`meta_info.cached_tokens` says how many prompt tokens were reused, as SGLang's radix
cache does. A batch lays each row out as [pad | cached prefix | pad | new suffix], with
the pads masked out, so hits and misses decode together. /flush_cache and every weight
update clear the cache.

Images: a vision-language model (Qwen2-VL family: config.json has a vision_config) takes
/generate's `image_data` beside input_ids whose image placeholders its processor expanded (see
`_media`); such a request is prefilled alone, its vision features at its placeholders and its
multimodal rotary positions (agentrl/vision.py), then decodes beside the others; its KV is never
put in the prefix cache (ids alone do not name the images).

Identity: every reply carries the header `X-Agentrl-Engine: <engine id>` (sglang-router
passes response headers through) and `meta_info.engine_id`, so the rollout side can tell
which engine served each turn.

Endpoints (SGLang 0.5.15 names, request fields and reply shapes): /generate, /health,
/health_generate, /model_info, /get_model_info, /server_info, /flush_cache,
/abort_request, /pause_generation, /continue_generation, /update_weights_from_tensor,
/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /update_weight_version, /get_weights_by_name,
/release_memory_occupation, /resume_memory_occupation, /get_load; with --enable-lora,
/load_lora_adapter, /unload_lora_adapter and /generate's `lora_path` (agentrl/engines/lora.py).
One route is agentrl's own, not SGLang's: POST /agentrl/apply_weight_delta (the delta weight
sync's file work, agentrl.weight_delta), which agentrl's SGLang wrapper serves the same way.

Strict where SGLang is: what kills SGLang's scheduler kills this engine too (the reply is a
500 naming the cause, then the process exits), so a caller that would crash SGLang on a GPU
fails here on the CPU first: resuming a memory tag that is not released (SGLang: KeyError in
`offload_tags.remove`), releasing memory while a request runs (SGLang asserts the scheduler
is fully idle), generating while memory is released (SGLang's kernels read freed memory),
and a weight update that flushes the cache (SGLang's default) while requests are paused in
place (SGLang asserts the flush after an update). /health runs a one-token generation as SGLang's does, unless
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (agentrl starts engines so). A vision-language
model's weight update is refused unless SGLANG_VLM_CACHE_SIZE_MB is 0 (agentrl starts engines so):
SGLang's image-embedding cache survives updates and flushes and would serve the old vision tower.

`serialized_named_tensors` format: SGLang's own is a CUDA-IPC `MultiprocessingSerializer`
pickle, which only works between processes sharing a GPU. The embedded engine takes one
list element (for its single "TP rank") that is base64 of `torch.save` with CPU tensors, of
the structure SGLang reads for the request's `load_format`: None, a list of (name, tensor)
(`encode_named_tensors` below); "flattened_bucket", one uint8 buffer and per tensor SGLang's
FlattenedTensorMetadata fields (`encode_flattened_bucket`, what weight_sync sends). A payload
of the other format, or a bucket whose offsets do not hold its tensors, is refused;
weight_sync picks the encoding by engine kind. Distributed updates rendezvous exactly like SGLang's (tcp:// store, a
PrefixStore named after the group) and use gloo when the engine runs on CPU.

`--tp-size N` emulates what an engine of N TP ranks asks of its callers, on one device:
/server_info reports tp_size N, /update_weights_from_tensor takes exactly N payloads (SGLang's
TP rank k reads element k, and one missing is an IndexError that kills its scheduler) and
checks that every one holds the same weights (TP ranks loading different weights is the silent
corruption a per-rank sync can cause). A distributed update group of N ranks per engine is not
emulated: /init_weights_update_group refuses it.

Run: python -m agentrl.engines.embedded --model-path DIR --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import math
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from aiohttp import web

from agentrl.engines import ENGINE_HEADER
from agentrl.engines.lora import LoraAdapter, LoraServing
from agentrl.engines.prefix_cache import PrefixCache, build_cache, layer_kv
from agentrl.models import is_vision_model, load_model, load_tokenizer
from agentrl.vision import (DATA_URL_PREFIX, checkpoint_names, forward_inputs, load_processor,
                            open_data_url, pixel_inputs, placeholder_runs, tokens_per_image)
from agentrl.weight_delta import APPLY_ROUTE, serve_apply

log = logging.getLogger("agentrl.engine")

ENGINE_KIND = "agentrl-embedded"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
_SCHEDULER = web.AppKey("scheduler", asyncio.Task)


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: dict
    return_logprob: bool
    future: asyncio.Future
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    cached_tokens: int = 0
    adapter: LoraAdapter | None = None  # the LoRA adapter named by `lora_path` (None: the base model)
    cache_epoch: int = 0  # the prefix cache's epoch at its prefill (its KV is not reused across a clear)
    # its sampling limits, read from params when it joins the decoding rows
    max_new: int = 128
    stop_ids: frozenset = frozenset()
    stop_strs: list[str] = field(default_factory=list)
    sampling_seed: int | None = None  # set: its draws depend on (seed, position) only, not on the batch
    media: dict | None = None  # its images (`image_data`): pixel_values and image_grid_thw (agentrl/vision.py)


@dataclass
class _Decoding:
    """The requests decoding together: rows join between two steps and leave as they finish.
    Row i of every tensor is rows[i]; KV and mask are left-padded to a common length."""
    rows: list[_Request]
    adapter: LoraAdapter | None
    past: object  # HF cache, [B, kv_heads, T, head_dim] per layer
    mask: torch.Tensor  # [B, T]: 1 where a row has a token
    pos: torch.Tensor  # [B, 1]: the position of each row's last token fed
    logits: torch.Tensor  # [B, vocab]: each row's next-token logits
    temps: torch.Tensor  # [B]: sampling temperature (<= 0: greedy)
    top_p: torch.Tensor  # [B]
    top_k: list[int]  # -1: off


def _stop_strings(value) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else [str(x) for x in value if x]


_LOW32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values below 2**32 (products wrap;
    only their low 32 bits are kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _LOW32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _LOW32
    return h ^ (h >> 16)


def seeded_sample(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from `probs` [n, vocab] with noise that depends only on the row's
    `sampling_seed` and the token's position: SGLang's deterministic sampling (Gumbel-max with
    noise hashed from seed, position and token id), so a request's tokens do not depend on which
    others shared its batch or when it arrived."""
    row = _mix32((seeds.long() & _LOW32) ^ _mix32(positions.long() & _LOW32))
    cols = _mix32(torch.arange(probs.shape[-1], device=probs.device, dtype=torch.long))
    uniform = (_mix32(row[:, None] ^ cols[None, :]).double() + 0.5) / 2.0 ** 32
    return (probs.double().log() - (-uniform.log()).log()).argmax(-1)


def encode_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """The embedded engine's `serialized_named_tensors` element: base64 of torch.save."""
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu()) for n, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode()


def decode_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    return torch.load(io.BytesIO(base64.b64decode(data)), weights_only=True)


FLAT_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")  # SGLang's FlattenedTensorMetadata


def encode_flattened_bucket(flat: torch.Tensor, meta: list[tuple]) -> str:
    """The embedded engine's `load_format="flattened_bucket"` element: SGLang's structure
    ({"flattened_tensor": uint8 buffer, "metadata": per tensor FlattenedTensorMetadata's fields,
    here as dicts}) as base64 of torch.save, the buffer on the CPU. `meta`: (name, shape, dtype,
    start, end) per tensor, byte offsets into `flat`."""
    buf = io.BytesIO()
    metadata = [dict(zip(FLAT_FIELDS, (n, list(s), str(d).removeprefix("torch."), a, b, b - a)))
                for n, s, d, a, b in meta]
    torch.save({"flattened_tensor": flat.detach().cpu(), "metadata": metadata}, buf)
    return base64.b64encode(buf.getvalue()).decode()


def decode_flattened_bucket(data: str) -> list[tuple[str, torch.Tensor]]:
    """A flattened-bucket element -> (name, tensor) views of its buffer, as SGLang's
    FlattenedTensorBucket.reconstruct_tensors rebuilds them. Stricter than SGLang: every entry's
    fields, sizes and offsets are checked (SGLang fails on a misaligned or short slice, and loads
    overlapping or out-of-order entries silently)."""
    bucket = torch.load(io.BytesIO(base64.b64decode(data)), weights_only=True)
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        got = sorted(bucket) if isinstance(bucket, dict) else type(bucket).__name__
        raise ValueError(f"a flattened bucket is a dict of flattened_tensor and metadata (SGLang reads both), "
                         f"got {got}")
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor (SGLang views its byte slices by dtype)")
    out, end = [], 0
    for i, m in enumerate(metadata):
        if not isinstance(m, dict) or set(m) != set(FLAT_FIELDS):
            raise ValueError(f"metadata[{i}]: the fields of SGLang's FlattenedTensorMetadata {FLAT_FIELDS}, "
                             f"got {m!r:.200}")
        dtype = getattr(torch, str(m["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"metadata[{i}] ({m['name']}): unknown dtype {m['dtype']!r}")
        size = math.prod(m["shape"]) * dtype.itemsize
        start, stop = int(m["start_idx"]), int(m["end_idx"])
        if start < end or stop - start != size or m["numel"] != size or stop > flat.numel() or start % dtype.itemsize:
            raise ValueError(f"metadata[{i}] ({m['name']}): bytes [{start}, {stop}) numel {m['numel']} do not hold "
                             f"{m['shape']} {m['dtype']} ({size} bytes) after byte {end} of a "
                             f"{flat.numel()}-byte buffer, "
                             f"aligned to its element size")
        out.append((m["name"], flat[start:stop].view(dtype).reshape(m["shape"])))
        end = stop
    return out


def _data_urls(image_data) -> list[str] | None:
    """SGLang's `image_data` (one image or a list) as a list of base64 data URLs; [] for none, None
    when one is anything else (a URL or a path: the embedded engine reads no files or URLs)."""
    images = image_data if isinstance(image_data, list) else [] if image_data is None else [image_data]
    return images if all(isinstance(u, str) and u.startswith(DATA_URL_PREFIX) for u in images) else None

def _abort(message: str = "aborted") -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


class EmbeddedEngine:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 256,
                 seed: int = 0, engine_id: str = "embedded", prefix_cache_tokens: int = 65536,
                 enable_lora: bool = False, tp_size: int = 1):
        self.model_path = model_path
        self.tp_size = tp_size  # emulated (see the module docstring)
        self.device = device
        self.dtype = dtype
        self.engine_id = engine_id
        self.model = load_model(model_path, device=device, dtype=dtype).eval()
        self.tokenizer = load_tokenizer(model_path)
        # a vision-language model's processor: /generate's image_data into pixel values (agentrl/vision.py)
        self.processor = load_processor(model_path) if is_vision_model(model_path) else None
        # a weight update names a VLM's weights as its checkpoint does (SGLang loads those): checkpoint -> memory
        self._memory_names = {v: k for k, v in checkpoint_names(self.model).items()} if self.processor else {}
        self.eos_ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_ids.discard(None)
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.weight_version = "0"
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.lora = LoraServing(self.model) if enable_lora else None  # --enable-lora, as SGLang's
        self._prefix_caches = {None: self.prefix_cache}  # by adapter name: KV under one adapter is not another's
        self.waiting: deque[_Request] = deque()  # received, not yet decoding (FIFO)
        self._arrived = asyncio.Event()
        self.aborted: set[str] = set()
        self.abort_all = False
        self.paused = asyncio.Event()
        self.paused.set()  # set = running: the scheduler takes new batches
        self.lock = asyncio.Lock()  # held while requests decode or weights change
        self._weights_waiting = 0  # weight changes waiting for the lock: no request joins meanwhile
        # in-place pause: the decode loop parks between two steps until resumed
        self._run = asyncio.Event()
        self._run.set()
        self._parked = asyncio.Event()
        self._groups: dict[str, object] = {}  # weight-update process groups by name
        self._cache_epoch = 0
        self._rid = itertools.count()
        self.stats = {"batches": 0, "requests": 0, "max_batch": 0}  # prefills, requests, most decoding at once
        self.released: set[str] = set()  # memory tags released (/release_memory_occupation)
        self.inflight = 0  # /generate requests received and not yet answered
        self.decoding: list[_Request] = []  # the requests decoding now (/get_load's num_tokens)
        self.dead: str | None = None  # why the engine died (see _fatal)
        self.exit_on_fatal = False  # the server process exits (main); in-process it answers 500 from then on

    def _fatal(self, what: str) -> web.Response:
        """Die as SGLang's scheduler would, after saying why."""
        log.critical("fatal (SGLang's scheduler dies here too): %s", what)
        self.dead = what
        if self.exit_on_fatal:
            asyncio.get_running_loop().call_later(0.2, os._exit, 70)
        return _error(f"fatal: {what}; the engine is dead (SGLang's scheduler dies here too)", status=500)

    # -- scheduling --------------------------------------------------------------------------
    def _enqueue(self, req: _Request) -> None:
        self.waiting.append(req)
        self._arrived.set()

    async def scheduler(self) -> None:
        while True:
            while not self.waiting:
                self._arrived.clear()
                await self._arrived.wait()
            await self.paused.wait()
            async with self.lock:
                served = await self._decode_while_requests()
            if not served:  # none could join (all being aborted): let the abort end, without spinning
                await asyncio.sleep(0.01)

    def _admit(self, decoding: _Decoding | None) -> list[_Request]:
        """Waiting requests that join now, in arrival order: the running rows' adapter only (the
        first of another waits for them to finish), none while aborting, paused or a weight
        change waits (the rows drain, then it runs, as SGLang's update lock lets it)."""
        if self.abort_all or not self.paused.is_set() or self._weights_waiting or not self.waiting:
            return []
        adapter = decoding.adapter if decoding is not None else self.waiting[0].adapter
        room = self.max_batch_size - (len(decoding.rows) if decoding is not None else 0)
        joining = []
        while self.waiting and len(joining) < room and self.waiting[0].adapter is adapter:
            r = self.waiting.popleft()
            if not r.future.done():
                joining.append(r)
        return joining

    async def _decode_while_requests(self) -> bool:
        """Decode steps until no request is left, admitting waiting ones between steps. False:
        none was admitted."""
        decoding, joining = None, []
        try:
            while True:
                joining = self._admit(decoding)
                if joining:
                    if decoding is None:
                        self._use_adapter(joining[0].adapter)
                    decoding = await asyncio.to_thread(self._join, decoding, joining)
                    joining = []
                if decoding is None or not decoding.rows:
                    return decoding is not None
                self.decoding = decoding.rows  # _join and _step make new lists: never changed in place
                if not self._run.is_set():  # paused in place: park at this safe point
                    self._parked.set()
                    await self._run.wait()
                    self._parked.clear()
                for r in await asyncio.to_thread(self._step, decoding):
                    if not r.future.done():
                        r.future.set_result(r)
        except Exception as exc:  # a failed step fails its requests, not the server
            log.exception("decode step failed")
            for r in joining + (decoding.rows if decoding is not None else []):
                if not r.future.done():
                    r.future.set_exception(exc)
        finally:
            self.decoding = []
            self._use_adapter(None)  # stats and weight updates see the base model's cache

    def _use_adapter(self, adapter: LoraAdapter | None) -> None:
        """The adapter (and its own prefix cache) the next decode runs with."""
        if self.lora is not None:
            self.lora.active = adapter
        key = adapter.name if adapter is not None else None
        if key not in self._prefix_caches:
            base = self._prefix_caches[None]
            self._prefix_caches[key] = PrefixCache(base.max_tokens) if base is not None else None
        self.prefix_cache = self._prefix_caches[key]

    def _prefill_inputs(self, batch: list[_Request]):
        """Input ids, attention mask, positions and past KV for a batch whose rows may reuse
        cached prefixes. Row i: [pad | cached c_i | pad | suffix s_i]; P = max c_i, S = max s_i."""
        hits = []
        for r in batch:
            n, kv = self.prefix_cache.lookup(r.input_ids) if self.prefix_cache is not None else (0, None)
            r.cached_tokens = n
            hits.append(kv)
        pad = self.tokenizer.pad_token_id or 0
        P = max(r.cached_tokens for r in batch)
        S = max(len(r.input_ids) - r.cached_tokens for r in batch)
        ids = torch.full((len(batch), S), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), P + S), dtype=torch.long)
        for i, r in enumerate(batch):
            c, s = r.cached_tokens, len(r.input_ids) - r.cached_tokens
            ids[i, S - s:] = torch.tensor(r.input_ids[c:])
            mask[i, P - c:P] = 1
            mask[i, P + S - s:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]
        past = None
        if P > 0:
            ref = next(kv for kv in hits if kv is not None)
            layers = []
            for layer in range(len(ref)):
                heads, _, dim = ref[layer][0].shape
                ks = torch.zeros((len(batch), heads, P, dim), dtype=ref[layer][0].dtype, device=ref[layer][0].device)
                vs = torch.zeros_like(ks)
                for i, kv in enumerate(hits):
                    if kv is not None:
                        c = kv[layer][0].shape[1]
                        ks[i, :, P - c:] = kv[layer][0]
                        vs[i, :, P - c:] = kv[layer][1]
                layers.append((ks, vs))
            past = build_cache(layers)
        return ids, mask, positions, past

    def _decode_batch(self, batch: list[_Request]) -> None:
        """Decode `batch` to its end with nothing joining (the server admits rows as they come)."""
        decoding = self._join(None, batch)
        while decoding.rows:
            self._step(decoding)

    @torch.no_grad()
    def _join(self, decoding: _Decoding | None, joining: list[_Request]) -> _Decoding:
        """Prefill `joining` and lay its rows beside the decoding ones (left-padded to one length)."""
        self.stats["batches"] += 1
        self.stats["requests"] += len(joining)
        for r in joining:
            r.cache_epoch = self._cache_epoch
            p = r.params
            r.max_new = int(p["max_new_tokens"]) if p.get("max_new_tokens") is not None else 128
            r.stop_ids = frozenset(p.get("stop_token_ids") or []) | frozenset(() if p.get("ignore_eos") else self.eos_ids)
            r.stop_strs = _stop_strings(p.get("stop"))
            r.sampling_seed = p.get("sampling_seed")
        merged = decoding if decoding is not None and decoding.rows else None
        text = [r for r in joining if r.media is None]
        for rows in ([text] if text else []) + [[r] for r in joining if r.media is not None]:
            fresh = self._prefill(rows)
            merged = fresh if merged is None else _merge(merged, fresh)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(merged.rows))
        return merged

    def _prefill(self, rows: list[_Request]) -> _Decoding:
        """The rows' prompts through the model: text rows together (reusing cached prefixes), a row
        with images alone, its features at its placeholders and its rotary positions the model's
        multimodal ones (its decode steps then go on from the last of them)."""
        if rows[0].media is None:
            ids, mask, positions, past = self._prefill_inputs(rows)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                             use_cache=True)
            last = positions[:, -1:]
        else:
            (r,) = rows
            ids = torch.tensor([r.input_ids], device=self.device)
            mask = torch.ones_like(ids)
            kwargs, _ = forward_inputs(self.model, ids, mask, r.media["pixel_values"].to(self.device),
                                       r.media["image_grid_thw"].to(self.device), ids == self.processor.image_token_id)
            out = self.model(**kwargs, use_cache=True)
            last = kwargs["position_ids"][0, :, -1:]  # [1, 1]: the prompt ends in text, its 3 axes equal
        return _Decoding(
            rows, rows[0].adapter, out.past_key_values, mask, last, out.logits[:, -1].float(),
            temps=torch.tensor([float(r.params.get("temperature", 1.0)) for r in rows], device=self.device),
            top_p=torch.tensor([float(r.params.get("top_p", 1.0)) for r in rows], device=self.device),
            top_k=[int(r.params["top_k"]) if r.params.get("top_k") is not None else -1 for r in rows])

    @torch.no_grad()
    def _step(self, decoding: _Decoding) -> list[_Request]:
        """Sample one token for every row; the finished rows leave (returned), the others are
        fed their token for the next step's logits."""
        rows, temps = decoding.rows, decoding.temps
        greedy = temps <= 0
        scaled = decoding.logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = self._filter(logprobs.exp(), decoding.top_p, decoding.top_k)
        # each row drawn once: by its sampling_seed where it has one, else from the engine's generator
        sampled = torch.empty(len(rows), dtype=torch.long, device=self.device)
        seeded = [i for i, r in enumerate(rows) if r.sampling_seed is not None]
        free = [i for i, r in enumerate(rows) if r.sampling_seed is None]
        if free:
            at = torch.tensor(free, device=self.device)
            sampled[at] = torch.multinomial(probs[at], 1, generator=self.generator).squeeze(-1)
        if seeded:
            at = torch.tensor(seeded, device=self.device)
            sampled[at] = seeded_sample(
                probs[at], torch.tensor([rows[i].sampling_seed for i in seeded], device=self.device),
                torch.tensor([len(rows[i].input_ids) + len(rows[i].output_ids) for i in seeded], device=self.device))
        tokens = torch.where(greedy, logprobs.argmax(-1), sampled)
        token_lp = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        finished, keep = [], []
        for i, (r, tok, lp) in enumerate(zip(rows, tokens.tolist(), token_lp.tolist())):
            r.finish = self._finish(r, tok, lp)
            (finished if r.finish is not None else keep).append(i)
        if finished:
            for i in finished:
                self.aborted.discard(rows[i].rid)
            self._remember([rows[i] for i in finished], decoding.mask[finished], decoding.past, finished)
            if not keep:
                decoding.rows = []
                return [rows[i] for i in finished]
            idx = torch.tensor(keep, device=self.device)
            mask = decoding.mask.index_select(0, idx)
            first = int(mask.any(0).nonzero()[0])  # columns every remaining row pads: dropped
            decoding.mask = mask[:, first:]
            decoding.past = build_cache([(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:])
                                         for k, v in layer_kv(decoding.past)])
            decoding.pos, tokens = decoding.pos.index_select(0, idx), tokens.index_select(0, idx)
            decoding.temps, decoding.top_p = temps.index_select(0, idx), decoding.top_p.index_select(0, idx)
            decoding.top_k = [decoding.top_k[i] for i in keep]
            decoding.rows = [rows[i] for i in keep]
        decoding.mask = torch.cat([decoding.mask, decoding.mask.new_ones((len(decoding.rows), 1))], dim=1)
        decoding.pos = decoding.pos + 1
        out = self.model(input_ids=tokens[:, None], attention_mask=decoding.mask, position_ids=decoding.pos,
                         past_key_values=decoding.past, use_cache=True)
        decoding.past, decoding.logits = out.past_key_values, out.logits[:, -1].float()
        return [rows[i] for i in finished]

    def _finish(self, r: _Request, tok: int, lp: float) -> dict | None:
        """Append the sampled token unless `r` is aborted; why `r` ends now (None: it goes on)."""
        if self.abort_all or r.rid in self.aborted:
            return _abort()
        if r.max_new <= 0:  # the prompt's prefill only
            return {"type": "length", "length": r.max_new}
        r.output_ids.append(tok)
        r.logprobs.append(lp)
        if tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.stop_strs and (hit := self._ends_with_stop(r.output_ids, r.stop_strs)) is not None:
            return {"type": "stop", "matched": hit}  # SGLang's `stop` strings
        if len(r.output_ids) >= r.max_new:
            return {"type": "length", "length": r.max_new}
        return None

    def _remember(self, rows: list[_Request], mask: torch.Tensor, past, at: list[int]) -> None:
        """Put each finished row's KV in the prefix cache: its prompt and all but the last
        output token (the last one was never fed back, so it has no KV of its own). `at`: the
        rows' places in `past`; `mask`: theirs."""
        if self.prefix_cache is None:
            return
        kv = layer_kv(past)
        for r, m, i in zip(rows, mask, at):
            if r.cache_epoch != self._cache_epoch or r.media is not None:  # stale KV; KV of images the ids do not name
                continue
            n = len(r.input_ids) + max(len(r.output_ids) - 1, 0)
            cols = m.nonzero().squeeze(-1)[:n]
            self.prefix_cache.insert((r.input_ids + r.output_ids)[:n],
                                     [(k[i].index_select(1, cols), v[i].index_select(1, cols)) for k, v in kv])

    def _ends_with_stop(self, output_ids: list[int], stop: list[str]) -> str | None:
        # A stop string spans at most as many tokens as it has characters (plus the token it
        # ends inside): decode only that tail. Checked every step, so a hit is the first one.
        tail = self.tokenizer.decode(output_ids[-(max(len(x) for x in stop) + 1):], skip_special_tokens=False)
        return next((x for x in stop if x in tail), None)

    @staticmethod
    def _filter(probs: torch.Tensor, top_p: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        if all(k <= 0 for k in top_k) and bool((top_p >= 1).all()):
            return probs
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_k], device=probs.device)[:, None]
        keep = (ranks < k) & ((sorted_p.cumsum(-1) - sorted_p) < top_p[:, None])
        sorted_p = sorted_p * keep
        return torch.zeros_like(probs).scatter(-1, idx, sorted_p)

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        input_ids = body.get("input_ids")
        if input_ids is None and isinstance(body.get("text"), str):  # as SGLang: text is tokenized here
            input_ids = await asyncio.to_thread(self._encode_text, body["text"], body.get("image_data"))
        if not input_ids or not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
            return _error("input_ids must be a non-empty list of ints")
        vocab = self.model.config.get_text_config().vocab_size  # a VLM's: its text model's
        if any(t < 0 or t >= vocab for t in input_ids):
            return _error(f"input_ids out of range [0, {vocab})")
        if body.get("stream"):
            return _error("streaming is not supported by the embedded engine")
        seed = (body.get("sampling_params") or {}).get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            return _error(f"sampling_params.sampling_seed must be an integer, got {seed!r}")
        if self.released:
            return self._fatal(f"/generate while memory is released ({sorted(self.released)})")
        try:
            media = await asyncio.to_thread(self._media, input_ids, body.get("image_data"))
        except ValueError as exc:
            return _error(str(exc))
        if media is not None and body.get("logprob_start_len") not in (None, -1):
            return _error("logprob_start_len with image_data: the embedded engine scores input tokens of text "
                          "prompts only")
        adapter = None
        if body.get("lora_path"):
            try:
                adapter = await self._resolve_adapter(body["lora_path"])
            except ValueError as exc:
                return _error(str(exc))
        start = body.get("logprob_start_len")
        start = -1 if start is None else start
        if not isinstance(start, int) or isinstance(start, bool) or start < -1 or start >= len(input_ids):
            # SGLang aborts a request whose logprob_start_len is not below its input length
            return _error(f"logprob_start_len must be -1 or in [0, {len(input_ids)}) (the input's length), "
                          f"got {start!r}")
        input_lps = None
        if body.get("return_logprob") and start >= 0:  # the input tokens' logprobs (a teacher scoring tokens)
            async with self.lock:
                self._use_adapter(adapter)
                try:
                    input_lps = await asyncio.to_thread(self._input_logprobs, input_ids, start)
                finally:
                    self._use_adapter(None)
        rid = str(body.get("rid") or f"req-{next(self._rid)}")
        req = _Request(rid=rid, input_ids=input_ids, params=body.get("sampling_params") or {},
                       return_logprob=bool(body.get("return_logprob")),
                       future=asyncio.get_running_loop().create_future(), adapter=adapter, media=media)
        started = time.perf_counter()
        self.inflight += 1
        try:
            self._enqueue(req)
            await req.future
        except asyncio.CancelledError:  # the client went away: as SGLang, its request stops generating
            self._abort_queued(lambda r: r is req)
            if not req.future.done():
                self.aborted.add(rid)
            raise
        finally:
            self.inflight -= 1
        meta = {
            "id": rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(input_ids),
            "weight_version": self.weight_version,  # as SGLang: the version when the reply is made
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "e2e_latency": time.perf_counter() - started,
            "engine_id": self.engine_id,  # not SGLang's: which engine served this
        }
        if req.return_logprob:
            meta["input_token_logprobs"] = input_lps or []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
            meta["output_token_logprobs_length"] = len(req.output_ids)
        skip = req.params.get("skip_special_tokens", True)
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=skip)
        return web.json_response({"text": text, "output_ids": req.output_ids, "meta_info": meta})

    def _encode_text(self, text: str, image_data) -> list[int]:
        """/generate's `text` as ids; with images, each placeholder expanded by the processor, as
        SGLang expands them (slime sends a first multimodal turn so)."""
        images = _data_urls(image_data)
        if self.processor is None or not images:
            return self.tokenizer.encode(text)  # _media says what is wrong with the images, if anything
        try:
            return self.processor(text=[text], images=[open_data_url(u) for u in images])["input_ids"][0]
        except Exception:  # the placeholders and images disagree, or an image is unreadable: _media names it
            return self.tokenizer.encode(text)

    def _media(self, input_ids: list[int], image_data) -> dict | None:
        """`image_data` (SGLang's field: one image or a list, here base64 data URLs) as pixel inputs,
        checked against `input_ids`: one run of image tokens per image, each as long as the processor
        expands that image (agentrl's form). SGLang 0.5.15 takes one image token per image and
        expands it by its image; agentrl's SGLang wrapper (engines/sglang_server.py, ImagePlaceholders)
        turns these runs into that form, so a run of another length would be served as a prompt
        other than the caller's tokens. A placeholder without an image, an image left over, or a run
        of another length: errors here. None: no images."""
        if image_data in (None, []):
            if self.processor is not None and self.processor.image_token_id in input_ids:
                raise ValueError("input_ids hold image tokens and the request has no image_data")
            return None
        if self.processor is None:
            raise ValueError(f"image_data: {self.model_path} is not a vision-language model (no vision_config)")
        images = _data_urls(image_data)
        if images is None:
            raise ValueError("image_data: the embedded engine takes images as base64 data URLs "
                             "(data:image/png;base64,...); not fetched from URLs or files")
        try:
            media = pixel_inputs(self.processor, images)
        except Exception as exc:
            raise ValueError(f"image_data: cannot read an image: {exc}") from None
        runs = placeholder_runs(input_ids, self.processor.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"input_ids hold {len(runs)} image placeholders and image_data {len(images)} images "
                             "(one each)")
        want = tokens_per_image(self.processor, media["image_grid_thw"])
        for k, ((start, n), m) in enumerate(zip(runs, want)):
            if n != m:
                raise ValueError(f"image {k}: its placeholder at token {start} has {n} image tokens, the image makes "
                                 f"{m} (expand the prompt with the model's processor)")
        return media

    @torch.no_grad()
    def _input_logprobs(self, input_ids: list[int], start: int) -> list[list]:
        """SGLang's input_token_logprobs from `start` on: [logprob, token id, None] per input token,
        the logprob of the token given the ones before it, at temperature 1 (SGLang's input
        logprobs are not temperature-scaled). The first entry's logprob is always None, as
        SGLang's scheduler pads it (it computes logits from `start` on, so the token at `start`
        is never scored): to score token k, ask from k - 1."""
        ids = torch.tensor([input_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0].float()  # [T, V]: row t predicts token t + 1
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        values = [None, *lp]
        return [[None if t == start else values[t], input_ids[t], None] for t in range(start, len(input_ids))]

    async def chat_completions(self, request: web.Request) -> web.Response:
        """OpenAI's /v1/chat/completions, as SGLang serves it, for an LLM judge served by an
        embedded engine (agentrl.judge): the messages through the model's chat template, sampled
        like /generate (temperature, top_p, max_tokens), answered as one choice."""
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in
                ("system", "user", "assistant") for m in messages):
            return _error("messages must be a non-empty list of {role: system|user|assistant, content: str}")
        if body.get("stream") or (body.get("n") or 1) != 1:
            return _error("the embedded engine answers one choice, unstreamed")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        input_ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = {"temperature": float(body.get("temperature", 1.0)), "top_p": float(body.get("top_p", 1.0)),
                  "max_new_tokens": int(body.get("max_tokens") or 128)}
        req = _Request(rid=f"chat-{next(self._rid)}", input_ids=list(input_ids), params=params, return_logprob=False,
                       future=asyncio.get_running_loop().create_future())
        self.inflight += 1
        try:
            self._enqueue(req)
            await req.future
        finally:
            self.inflight -= 1
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        finish = "stop" if (req.finish or {}).get("type") == "stop" else "length"
        return web.json_response({
            "id": req.rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_path,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(req.output_ids),
                      "total_tokens": len(input_ids) + len(req.output_ids)}})

    async def health(self, request: web.Request) -> web.Response:
        if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("false", "0", "no", "off"):
            return web.Response(text="")
        return await self.health_generate(request)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.released:
            return self._fatal(f"a health-check generation while memory is released ({sorted(self.released)})")
        req = _Request(rid=f"health-{next(self._rid)}", input_ids=[self.tokenizer.eos_token_id],
                       params={"max_new_tokens": 1, "temperature": 0.0}, return_logprob=False,
                       future=asyncio.get_running_loop().create_future())
        self._enqueue(req)
        try:
            await asyncio.wait_for(req.future, timeout=60)
        except asyncio.TimeoutError:
            return web.Response(status=503, text="generation did not answer within 60 s")
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": self.processor is not None, "has_audio_understanding": False,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
            # not SGLang's: what the rollout side uses to pick the weight encoding
            "engine": ENGINE_KIND, "engine_id": self.engine_id, "batching": self.stats,
            "prefix_cache": self.prefix_cache_stats(),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tp_size": self.tp_size, "dtype": self.dtype,
                                  "version": ENGINE_KIND, "weight_version": self.weight_version})

    def prefix_cache_stats(self) -> dict:
        if self.prefix_cache is None:
            return {"enabled": False}
        return {"enabled": True, "entries": len(self.prefix_cache), "tokens": self.prefix_cache.num_tokens,
                **self.prefix_cache.stats}

    async def flush_cache(self, request: web.Request) -> web.Response:
        async with self._weights_guard():
            self._clear_prefix_cache()
        return web.Response(text="Cache flushed.\n")

    # -- control -------------------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("abort_all"):
            await self._abort_everything()
        elif body.get("rid"):
            rid = str(body["rid"])
            self.aborted.add(rid)
            self._abort_queued(lambda r: r.rid == rid)
        return web.Response(status=200)

    def _abort_queued(self, which) -> None:
        """Waiting requests matching `which` answer at once with an empty abort."""
        keep = deque()
        for r in self.waiting:
            if which(r) and not r.future.done():
                r.finish = _abort()
                r.future.set_result(r)
            else:
                keep.append(r)
        self.waiting = keep

    async def _abort_everything(self) -> None:
        self.abort_all = True
        self._abort_queued(lambda r: True)
        self._run.set()  # rows parked by an in-place pause must see the flag
        while self.lock.locked():  # the decoding rows see the flag and stop
            await asyncio.sleep(0.01)
        self.abort_all = False
        if not self.paused.is_set():
            self._run.clear()

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's modes: "abort" (default) aborts what runs and waits; "in_place" and
        "retract" keep running requests and park the decode loop between two steps (the
        embedded engine treats retract as in_place). Weight updates are allowed while paused."""
        body = await _json(request)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _error(f"unknown pause mode {mode!r}")
        self.paused.clear()
        if mode == "abort":
            await self._abort_everything()
            self._run.clear()
        else:
            self._run.clear()
            while self.lock.locked() and not self._parked.is_set():
                await asyncio.sleep(0.01)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._run.set()
        self.paused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _weights_guard(self):
        """Exclusive access to the weights: the decode lock (taken once the decoding requests
        finish), unless they are parked by an in-place pause (a safe point; they hold the lock)."""
        engine = self

        class Guard:
            async def __aenter__(self):
                self.held = not engine._parked.is_set()
                if self.held:
                    engine._weights_waiting += 1  # no request joins the decoding ones meanwhile
                    try:
                        await engine.lock.acquire()
                    finally:
                        engine._weights_waiting -= 1

            async def __aexit__(self, *exc):
                if self.held:
                    engine.lock.release()

        return Guard()

    # -- weights -------------------------------------------------------------------------------
    def _clear_prefix_cache(self) -> None:
        self._cache_epoch += 1  # a batch parked across the clear must not put old KV back
        for cache in self._prefix_caches.values():
            if cache is not None:
                cache.clear()

    # -- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter, /generate's lora_path) --------
    async def _resolve_adapter(self, lora_path) -> LoraAdapter:
        if not isinstance(lora_path, str):
            raise ValueError("lora_path: one adapter name per request (the embedded engine takes no batch lists)")
        if self.lora is None:
            raise ValueError(f"LoRA adapter '{lora_path}' was requested, but LoRA is not enabled. Please launch the "
                             "server with --enable-lora flag and preload adapters using --lora-paths or "
                             "/load_lora_adapter endpoint.")
        if lora_path in self.lora.adapters:
            return self.lora.adapters[lora_path]
        async with self._weights_guard():  # reloading an unloaded name reads its folder again
            return await asyncio.to_thread(self.lora.resolve, lora_path)

    def _lora_reply(self, error: str | None = None) -> web.Response:
        loaded = {n: a.path for n, a in self.lora.adapters.items()} if self.lora is not None else {}
        return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                                 status=400 if error else 200)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if self.lora is None:
            return self._lora_reply("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not isinstance(body.get("lora_name"), str) or not isinstance(body.get("lora_path"), str):
            return self._lora_reply("lora_name and lora_path (strings) are required")
        try:
            async with self._weights_guard():
                await asyncio.to_thread(self.lora.load, body["lora_name"], body["lora_path"])
        except (ValueError, OSError, KeyError) as exc:
            return self._lora_reply(f"{type(exc).__name__}: {exc}")
        log.info("LoRA adapter %s loaded from %s", body["lora_name"], body["lora_path"])
        return self._lora_reply()

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if self.lora is None:
            return self._lora_reply("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        try:
            async with self._weights_guard():  # requests already holding the adapter still finish with it
                self.lora.unload(str(body.get("lora_name")))
                self._prefix_caches.pop(body.get("lora_name"), None)
        except ValueError as exc:
            return self._lora_reply(str(exc))
        return self._lora_reply()

    def _loaded(self, body: dict, what: str) -> web.Response | None:
        """After new weights: None, or the fatal reply where SGLang's scheduler dies. It flushes
        its cache after an update unless told not to, and asserts the flush worked, which it
        does not while requests paused in place hold KV of the old weights."""
        # KV computed under the old weights is never reused, whatever `flush_cache` says
        self._clear_prefix_cache()
        image_cache_mb = os.environ.get("SGLANG_VLM_CACHE_SIZE_MB", "100 (the default)")
        if self.processor is not None and image_cache_mb.strip() != "0":
            # SGLang would go on serving the old vision tower's image embeddings from its cache (not
            # cleared by updates or flushes) and drift silently: refused here, on the CPU, instead
            return web.json_response({"success": False, "message": (
                f"weights updated ({what}) with SGLANG_VLM_CACHE_SIZE_MB={image_cache_mb}: SGLang keeps serving image "
                "embeddings of the old vision tower from that cache; start the engine with SGLANG_VLM_CACHE_SIZE_MB=0 "
                "(agentrl's launcher does)")}, status=400)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        log.info("weights updated (%s), version %s", what, self.weight_version)
        if body.get("flush_cache", True) and self._parked.is_set():
            return self._fatal(f"Cache flush failed after updating weights ({what}): {len(self.decoding)} requests "
                               "paused in place (drain the engine before a flushing update)")
        return None

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            if body.get("abort_all_requests"):
                await self._abort_everything()
            named = self._decode_ranks(body["serialized_named_tensors"], body.get("load_format"))
            async with self._weights_guard():
                await asyncio.to_thread(self._load_named, named)
                if fatal := self._loaded(body, "tensor"):
                    return fatal
        except Exception as exc:
            return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=400)
        return web.json_response({"success": True, "message": f"Succeeded to update {len(named)} tensors."})

    def _decode_ranks(self, payloads: list, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """One payload per (emulated) TP rank, in `load_format` (SGLang's None: a list of (name,
        tensor); "flattened_bucket": one buffer and its metadata); every rank must get the same weights."""
        if not isinstance(payloads, list) or len(payloads) != self.tp_size:
            got = len(payloads) if isinstance(payloads, list) else type(payloads).__name__
            raise ValueError(f"serialized_named_tensors holds {got} payloads for {self.tp_size} TP ranks "
                             "(SGLang's TP rank k reads element k)")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r}: the embedded engine reads None and 'flattened_bucket'")
        ranks = [decode_flattened_bucket(p) if load_format else decode_named_tensors(p) for p in payloads]
        if load_format is None and not all(isinstance(r, list) and all(isinstance(x, (tuple, list)) and len(x) == 2
                                                                       for x in r) for r in ranks):
            raise ValueError("load_format None reads a list of (name, tensor) pairs (SGLang unpacks each); a flattened "
                             "bucket needs load_format 'flattened_bucket'")
        for k, other in enumerate(ranks[1:], start=1):
            same = len(other) == len(ranks[0]) and all(
                n == n0 and t.shape == t0.shape and torch.equal(t, t0) for (n, t), (n0, t0) in zip(other, ranks[0]))
            if not same:
                raise ValueError(f"TP rank {k} got other weights than TP rank 0 "
                                 f"({[n for n, _ in other][:3]}... vs {[n for n, _ in ranks[0]][:3]}...)")
        return ranks[0]

    def _load_named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under both names
        named = [(self._memory_names.get(n, n), t) for n, t in named]
        unknown = [n for n, _ in named if n not in params]
        if unknown:
            raise KeyError(f"unknown weight names: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in named:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
                params[name].copy_(tensor.to(params[name].dtype))

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            if body.get("abort_all_requests"):
                await self._abort_everything()
            async with self._weights_guard():
                fresh = await asyncio.to_thread(load_model, body["model_path"], device=self.device, dtype=self.dtype)
                await asyncio.to_thread(self._load_named, list(fresh.state_dict().items()))
                self.model_path = body["model_path"]
                if fatal := self._loaded(body, "disk"):
                    return fatal
        except Exception as exc:
            return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}",
                                      "num_paused_requests": 0}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def apply_weight_delta(self, request: web.Request) -> web.Response:
        """agentrl's route, not SGLang's (agentrl.engines.sglang_server serves it beside SGLang): the
        host's local checkpoint brought to a delta version, which /update_weights_from_disk then loads.
        Only files change here: the served weights stay as they are until that load."""
        status, reply = await serve_apply(await _json(request))
        return web.json_response(reply, status=status)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from agentrl.engines.distributed import init_custom_process_group

        body = await request.json()
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if self.tp_size > 1:
            return web.json_response({"success": False, "message": f"the embedded engine emulates --tp-size "
                                      f"{self.tp_size} for tensor updates only; a distributed update group needs "
                                      "SGLang (or --tp-size 1)"}, status=400)
        if self.device == "cpu" or not torch.cuda.is_available():
            backend = "gloo"  # CPU tensors: nccl cannot carry them
        try:
            self._groups[name] = await asyncio.to_thread(
                init_custom_process_group, backend=backend,
                init_method=f"tcp://{body['master_address']}:{int(body['master_port'])}",
                world_size=int(body["world_size"]), rank=int(body["rank_offset"]), group_name=name)
        except Exception as exc:
            return web.json_response({"success": False, "message": f"Failed to initialize custom process group: "
                                                                   f"{type(exc).__name__}: {exc}."}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("group_name", "weight_update_group")
        if name not in self._groups:
            return web.json_response({"success": False, "message": f"Group {name} not in {list(self._groups)}. "
                                      "Please call `init_weights_update_group` first."}, status=400)
        try:
            if body.get("abort_all_requests"):
                await self._abort_everything()
            async with self._weights_guard():
                named = await asyncio.to_thread(self._receive, body["names"], body["dtypes"], body["shapes"],
                                                self._groups[name])
                await asyncio.to_thread(self._load_named, named)
                if fatal := self._loaded(body, "distributed"):
                    return fatal
        except Exception as exc:
            return web.json_response({"success": False, "message": f"Failed to update parameter online: "
                                                                   f"{type(exc).__name__}: {exc}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    def _receive(self, names, dtypes, shapes, group) -> list[tuple[str, torch.Tensor]]:
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(group) == "gloo" else self.device
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=getattr(torch, str(dtype).removeprefix("torch.")), device=device)
            dist.broadcast(t, src=0, group=group)
            out.append((name, t))
        return out

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        body = await _json(request)
        name = body.get("group_name", "weight_update_group")
        group = self._groups.pop(name, None)
        if group is None:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # the group is dropped either way
            log.warning("destroying group %s: %r", name, exc)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("abort_all_requests", True):
            await self._abort_everything()
        self.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {self.weight_version}",
                                  "new_version": self.weight_version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await _json(request)
        params = self.model.state_dict()
        if body.get("name") not in params:
            return _error(f"Get parameter by name failed: no parameter {body.get('name')!r}")
        t = params[body["name"]]
        return web.json_response(t[: int(body.get("truncate_size", 100))].float().cpu().tolist())

    async def release_memory(self, request: web.Request) -> web.Response:
        body = await _json(request)
        tags = body.get("tags") or list(MEMORY_TAGS)
        if self.inflight:
            return self._fatal(f"/release_memory_occupation while {self.inflight} requests run "
                               "(SGLang: \"release_memory_occupation should be called only when server is idle\")")
        async with self._weights_guard():
            if "kv_cache" in tags:
                self._clear_prefix_cache()
            if "weights" in tags and self.device != "cpu":  # on CPU there is nothing to give back
                self.model.to("cpu")
            if self.device != "cpu":
                torch.cuda.empty_cache()
        self.released |= set(tags)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        body = await _json(request)
        tags = body.get("tags") or list(MEMORY_TAGS)
        if not set(tags) <= self.released:
            return self._fatal(f"/resume_memory_occupation of {sorted(set(tags) - self.released)}, which "
                               f"{'is' if len(set(tags) - self.released) == 1 else 'are'} not released "
                               f"(released: {sorted(self.released) or 'nothing'}; SGLang: KeyError)")
        if "weights" in tags and self.device != "cpu":
            async with self._weights_guard():
                self.model.to(self.device)
        self.released -= set(tags)
        return web.json_response(None)

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's /get_load shape: one entry per data-parallel rank; num_tokens, the tokens the
        running batch holds in its KV cache (prompts and what was generated so far)."""
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in list(self.decoding))
        return web.json_response([{"dp_rank": 0, "num_reqs": self.inflight, "num_waiting_reqs": len(self.waiting),
                                   "num_tokens": tokens, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}])

    async def workers(self, request: web.Request) -> web.Response:
        """sglang-router's /workers shape, this engine the one worker: slime's abort asks the
        router for its workers, then aborts each (slime/rollout/sglang_rollout.py, abort)."""
        return web.json_response({"workers": [{"url": f"{request.scheme}://{request.host}"}]})

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's /v1/loads, the count slime's abort waits to see at zero (server_control.py)."""
        return web.json_response({"loads": [{"dp_rank": 0, "num_reqs": self.inflight + len(self.waiting)}]})

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        @web.middleware
        async def identify(request, handler):
            if self.dead is not None:
                resp = _error(f"the engine is dead: {self.dead}", status=500)
            else:
                resp = await handler(request)
            resp.headers[ENGINE_HEADER] = self.engine_id
            return resp

        app = web.Application(client_max_size=1 << 31, middlewares=[identify])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_load", self.get_load)
        r.add_get("/workers", self.workers)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/get_server_info", self.server_info)
        for method in (r.add_get, r.add_post):
            method("/flush_cache", self.flush_cache)
            method("/release_memory_occupation", self.release_memory)
            method("/resume_memory_occupation", self.resume_memory)
            method("/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post(APPLY_ROUTE, self.apply_weight_delta)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)

        async def start_scheduler(app):
            app[_SCHEDULER] = asyncio.create_task(self.scheduler())

        async def stop_scheduler(app):
            self._run.set()
            app[_SCHEDULER].cancel()

        app.on_startup.append(start_scheduler)
        app.on_cleanup.append(stop_scheduler)
        return app


def _merge(a: _Decoding, b: _Decoding) -> _Decoding:
    """Rows of `b` laid beside those of `a` (KV and masks left-padded to one length)."""
    T = max(a.mask.shape[1], b.mask.shape[1])
    layers = [(torch.cat([_left_pad(k0, T, 2), _left_pad(k1, T, 2)]), torch.cat([_left_pad(v0, T, 2), _left_pad(v1, T, 2)]))
              for (k0, v0), (k1, v1) in zip(layer_kv(a.past), layer_kv(b.past))]
    return _Decoding(a.rows + b.rows, a.adapter, build_cache(layers),
                     torch.cat([_left_pad(a.mask, T, 1), _left_pad(b.mask, T, 1)]), torch.cat([a.pos, b.pos]),
                     torch.cat([a.logits, b.logits]), torch.cat([a.temps, b.temps]), torch.cat([a.top_p, b.top_p]),
                     a.top_k + b.top_k)


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`t` with zeros before its entries along `dim`, to `length`."""
    short = length - t.shape[dim]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _drop_http2_probes(record: logging.LogRecord) -> bool:
    """sglang-router probes each worker for gRPC (HTTP/2) too; aiohttp logs that as an error."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and "PRI/Upgrade" in str(exc))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="agentrl embedded engine (SGLang-compatible HTTP)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--engine-id", default=None, help="identity sent in X-Agentrl-Engine (default: host:port)")
    parser.add_argument("--prefix-cache-tokens", type=int, default=None,
                        help="tokens of finished sequences whose KV is kept for reuse (0 disables the prefix cache; "
                             "default 65536 on CPU, 1048576 on a GPU)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (/load_lora_adapter; /generate's lora_path names one), as SGLang's")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="emulate an engine of this many TP ranks (one device; see the module docstring)")
    parser.add_argument("--start-paused", action="store_true",
                        help="hold /generate requests until /continue_generation (a restarted engine waits for "
                             "the current weights before it serves)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_drop_http2_probes)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = EmbeddedEngine(args.model_path, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                            seed=args.seed, engine_id=args.engine_id or f"http://{args.host}:{args.port}",
                            prefix_cache_tokens=args.prefix_cache_tokens if args.prefix_cache_tokens is not None
                            else 65536 if args.device == "cpu" else 1 << 20, enable_lora=args.enable_lora,
                            tp_size=args.tp_size)
    engine.exit_on_fatal = True  # as SGLang's server: what kills its scheduler ends the process
    if args.start_paused:
        engine.paused.clear()
        engine._run.clear()
    log.info("embedded engine %s serving %s on %s:%d (%s)", engine.engine_id, args.model_path, args.host, args.port,
             args.device)
    # handler_cancellation: a client's disconnect cancels its handler (generate aborts the request)
    web.run_app(engine.app(), host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
