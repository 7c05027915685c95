"""What happens to the engines around a training step: the GPU handover (`--colocate`:
engines and trainer take turns on the GPUs) and the weight update (new weights into every
live engine, a restarted engine caught up before it serves again)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from agentrl.build import lora_engine_args
from agentrl.config import Config
from agentrl.engines.colocate import wait_idle
from agentrl.engines.group import EngineGroup
from agentrl.errors import EngineError
from agentrl.rollout.client import EngineClient, decode_routed_experts
from agentrl.trainers.megatron.flags import wants_routing_replay
from agentrl.rollout.control import RolloutControl

log = logging.getLogger("agentrl.weight_update")


@contextlib.asynccontextmanager
async def colocated(cfg: Config, trainer, engines: EngineGroup, clients: list[EngineClient], drain=None):
    """--colocate: during rollout the engines hold the GPU and the trainer sits in host
    memory; around training, the other way round (agentrl.engines.colocate says what SGLang
    requires of the order). `drain` stops the rollout's leftover work before the engines
    give their memory back. Yields a dict that gets each switch's seconds and the GPU's
    memory at the end of the rollout (metrics)."""
    out: dict[str, float] = {}
    if not cfg.run.colocate or trainer is None:
        await probe_engines(cfg, engines, clients)
        yield out
        return
    t0 = time.perf_counter()
    out |= await trainer.offload(engines_released=bool(engines.memory.released)) or {}
    t1 = time.perf_counter()
    await engines.memory.resume(clients)
    out |= {"colocate/offload_s": t1 - t0, "colocate/resume_s": time.perf_counter() - t1}
    await probe_engines(cfg, engines, clients)  # the engines can generate again (their KV cache is back)
    try:
        yield out
    finally:
        used = (await trainer.gpu_memory()).get("used_gib")
        t0 = time.perf_counter()
        if drain is not None:
            await drain()
        await _each(clients, "/abort_request", {"abort_all": True})
        await wait_idle(clients)
        await engines.memory.release(clients)
        t1 = time.perf_counter()
        await trainer.onload()
        out |= {"colocate/release_s": t1 - t0, "colocate/onload_s": time.perf_counter() - t1}
        if used is not None:
            out["gpu/used_rollout_gib"] = used


async def update_engines(cfg: Config, control: RolloutControl, engines: EngineGroup, trainer, version: int,
                         probe_prompts: list[list[int]] | None = None,
                         probe_images: list[list[str]] | None = None) -> dict:
    """New weights into every live engine. The gate keeps agent loops from sending requests
    and the engines pause, so no generation sees half-updated weights. With --partial-rollout
    in-flight generations are aborted first and resume under the new weights; without it the
    update waits for them to finish under the old ones. Either way no request is in an engine
    when its weights change, which SGLang requires: it flushes its prefix cache after the
    update and asserts that nothing runs (its scheduler dies otherwise), and a generation
    paused in place would keep KV of the old weights. An engine that misses the update leaves
    the pool until it catches up."""
    clients = [EngineClient(u, request_timeout_s=cfg.rollout.request_timeout_s) for u in engines.live()]
    control.pause()
    try:
        if cfg.rollout.partial_rollout:
            await _each(clients, "/abort_request", {"abort_all": True})
        t0 = time.perf_counter()
        await _drain(clients, cfg.rollout.request_timeout_s)
        drained = time.perf_counter() - t0
        # SGLang's pause without a mode aborts; "in_place" leaves requests be (there should be none)
        await _each(clients, "/pause_generation", {"mode": "in_place"})
        try:
            out = await trainer.sync_weights([c.base_url for c in clients], version)
            out["weight_update_drain_s"] = drained  # waiting for the generations in flight
            control.policy_version = version
            if lora_engine_args(cfg):  # from now on every request names this version's adapter
                from agentrl.weight_transfer import lora_adapter_name

                control.lora_adapter = lora_adapter_name(version)
        finally:
            await _each(clients, "/continue_generation", {})
        failed = out.pop("failed_engines", [])
        restarting = engines.monitor is not None and engines.monitor.restart
        if failed and len(failed) == len(clients) and not restarting:
            raise EngineError(f"every engine missed the weight update to version {version} ({', '.join(failed)}) "
                              "and none is restarted (--no-engine-restart?): resume with --load")
        for url in failed:  # restarted, an engine gets the current weights before it serves again
            engines.quarantine(url)
        if probe_prompts and weight_check_due(cfg, version):
            images = probe_images or [[]] * len(probe_prompts)  # a prompt with images whole: a cut one loses them
            probes = [(p if im else p[-PROBE_CONTEXT:], im) for p, im in zip(probe_prompts[:PROBE_PROMPTS], images) if p]
            engines.probe_prompts, engines.probe_images = [p for p, _ in probes], [im for _, im in probes]
            engines.probe_lora = control.lora_adapter  # --lora-sync adapter: the probe names the new adapter
        return out | ({"weight_sync_failed": len(failed)} if failed else {})
    finally:
        control.resume()
        await asyncio.gather(*[c.close() for c in clients])


PROBE_PROMPTS, PROBE_TOKENS, PROBE_CONTEXT = 2, 8, 256  # per engine: 16 sampled tokens, cheap


def weight_check_due(cfg: Config, version: int) -> bool:
    n = cfg.train.weight_check_interval
    # temperature 0 (greedy) has no logprobs to compare: the trainer's are of logits / T
    return bool(n) and cfg.rollout.rollout_temperature > 0 and (version == 1 or version % n == 0)


async def probe_engines(cfg: Config, engines: EngineGroup | None, clients: list[EngineClient]) -> None:
    """The weight check's engine half, where the engines can generate after a sync (with
    --colocate not before their KV cache is back): each engine samples a few tokens after each
    probe prompt, with their logprobs, under the sampling the trainer's logprobs assume."""
    from agentrl.types import Sample

    if engines is None or not engines.probe_prompts:
        return
    prompts, engines.probe_prompts = engines.probe_prompts, None
    images, engines.probe_images = getattr(engines, "probe_images", None) or [[]] * len(prompts), None
    params = {"max_new_tokens": PROBE_TOKENS, "temperature": cfg.rollout.rollout_temperature, "top_p": 1.0,
              "top_k": -1, "min_p": 0.0}

    request = {"sampling_params": params, "return_logprob": True}
    if engines.probe_lora:
        request["lora_path"] = engines.probe_lora
    replay = wants_routing_replay(cfg.megatron_args)
    if replay:  # R3: the trainer replays the engine's routing on the probe too (it refuses a sample without)
        request["return_routed_experts"] = True

    async def one(client: EngineClient, prompt: list[int], images: list[str]):
        media = {"image_data": images} if images else {}
        reply = await client.post("/generate", {"input_ids": prompt, **request, **media})
        meta = reply["meta_info"]
        pairs = [(int(t), float(lp)) for lp, t, *_ in meta["output_token_logprobs"]]
        sample = Sample(prompt_tokens=list(prompt), response_tokens=[t for t, _ in pairs], loss_mask=[1] * len(pairs),
                        rollout_logprobs=[lp for _, lp in pairs], policy_versions=[0] * len(pairs), images=images)
        if replay:
            sample.routed_experts = decode_routed_experts(meta.get("routed_experts"), len(prompt) + len(pairs) - 1)
        return client.base_url, str(meta.get("weight_version")), sample

    if any(e.worker_type != "regular" for e in engines.engines):
        # --prefill-num-servers: a prefill or a decode engine cannot generate alone; the router pairs them
        async with EngineClient(engines.url, request_timeout_s=cfg.rollout.request_timeout_s) as router:
            replies = await asyncio.gather(*[one(router, p, im) for p, im in zip(prompts, images)],
                                           return_exceptions=True)
    else:
        serving = set(engines.serving())  # one down or catching up is the monitor's, and holds older weights
        replies = await asyncio.gather(*[one(c, p, im) for c in clients if c.base_url in serving
                                         for p, im in zip(prompts, images)],
                                       return_exceptions=True)
    for r in replies:
        if isinstance(r, BaseException):  # it went down meanwhile: the monitor takes it out of the pool
            log.warning("weight check: a probe request failed: %r", r)
    engines.probe_results = [r for r in replies if not isinstance(r, BaseException) and r[2].response_tokens]


async def check_probe(cfg: Config, trainer, engines: EngineGroup | None, version: int) -> dict[str, float]:
    """The weight check's trainer half, before the next training step changes its weights: the
    trainer's logprobs of the tokens each engine sampled on the probe. Metrics weight_check/*
    (the worst engine's); an engine past --weight-check-max-diff, or one that does not report
    the version it was sent, ends the run naming it."""
    if engines is None or not engines.probe_results:
        return {}
    results, engines.probe_results = engines.probe_results, None
    t0 = time.perf_counter()
    mine = await trainer.probe_logprobs([s for _, _, s in results])
    diffs: dict[str, list[float]] = {}
    for (url, engine_version, sample), lps in zip(results, mine):
        if engine_version != str(version):
            raise EngineError(f"weight check: engine {url} reports weight version {engine_version}, the trainer "
                              f"synced version {version}")
        diffs.setdefault(url, []).extend(abs(a - b) for a, b in zip(sample.rollout_logprobs, lps))
    worst = max(diffs, key=lambda u: sum(diffs[u]) / len(diffs[u]))
    mean = sum(diffs[worst]) / len(diffs[worst])
    out = {"weight_check/mean_abs_diff": mean, "weight_check/max_abs_diff": max(max(d) for d in diffs.values()),
           "weight_check/tokens": float(sum(len(d) for d in diffs.values())),
           "weight_check/s": time.perf_counter() - t0}
    if mean > cfg.train.weight_check_max_diff:
        raise EngineError(f"weight check after the sync to version {version}: engine {worst} disagrees with the "
                          f"trainer by {mean:.3f} nats a token on average (max {max(diffs[worst]):.3f}, "
                          f"{len(diffs[worst])} tokens) > --weight-check-max-diff {cfg.train.weight_check_max_diff}: "
                          "it does not hold the trainer's weights (a weight-sync layout or name mismatch?)")
    return out


def catch_up_fn(cfg: Config, trainer, state, weights_lock: asyncio.Lock):
    """For the engine monitor (another thread): url -> Future of pushing the current weights
    (`state.policy_version`) to that engine and resuming it, done on this event loop between
    two weight updates."""
    loop = asyncio.get_running_loop()

    async def push(url: str) -> None:
        async with weights_lock:
            out = await trainer.sync_weights([url], state.policy_version, fresh=True)
            if out.get("failed_engines"):
                raise EngineError(f"{url}: catch-up weight push failed")
            async with EngineClient(url, request_timeout_s=cfg.rollout.request_timeout_s) as c:
                await c.post("/continue_generation", {})

    return lambda url: asyncio.run_coroutine_threadsafe(asyncio.wait_for(push(url), cfg.rollout.request_timeout_s),
                                                        loop)


async def _drain(clients: list[EngineClient], timeout_s: float) -> None:
    """Until the engines hold no request (the gate is closed: the ones in flight finish or,
    aborted, end). One that does not answer is the sync's to find: it misses the update."""
    try:
        await wait_idle(clients, timeout_s)
        await asyncio.sleep(0.05)  # a turn let through just before the gate closed may still be on its way
        await wait_idle(clients, timeout_s)
    except Exception as exc:
        log.warning("engines not idle before a weight update: %r", exc)


async def _each(clients: list[EngineClient], path: str, payload: dict) -> None:
    """A control call to every engine; one that is down is the monitor's business, not the loop's."""
    results = await asyncio.gather(*[c.post(path, payload) for c in clients], return_exceptions=True)
    for c, r in zip(clients, results):
        if isinstance(r, Exception):
            log.warning("%s %s failed: %r", c.base_url, path, r)
