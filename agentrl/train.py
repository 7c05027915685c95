"""The RL loop, top to bottom. Per iteration: take prompts -> multi-turn rollouts through the
engine over HTTP -> rewards -> advantages -> policy update -> weight sync -> next.

The same loop drives every configuration: the embedded CPU engine or SGLang engines behind
sglang-router, the plain-PyTorch or Megatron trainer (a Ray actor), rollout and training
taking turns or overlapping (`--async`, with `--partial-rollout` and `--max-staleness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import inspect
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from agentrl.config import Config, lora_target_modules
from agentrl.data import PromptSource, read_rows, seed_tasks
from agentrl.engines.colocate import wait_idle
from agentrl.engines.group import EngineGroup, start_engines
from agentrl.rollout.affinity import affinity_metrics
from agentrl.errors import ConfigError, EngineError
from agentrl.metrics import RunLog, eval_trajectories_path, start_wandb, write_trajectories
from agentrl.plugins import load_function
from agentrl.models import build_tiny_model, check_model_dir, load_tokenizer, tiny_model_dir
from agentrl.progress import Progress
from agentrl.registry import check_env_kwargs, get_spec, import_env_module, make
from agentrl.rollout.agent_loop import LoopSettings, Renderer
from agentrl.rollout.client import EngineClient
from agentrl.rollout.control import RolloutControl
from agentrl.rollout.manager import GroupRunner
from agentrl.rollout.producer import RolloutFailedError, RolloutProducer, nonzero_std_filter
from agentrl.rollout.slime import DataSource, GenerateHook, RolloutHook, check_hooks, slime_args
from agentrl.types import Sample, SampleStatus
from agentrl.orchestration import RemoteTrainer, reserve_placement, start_ray, stop_ray


log = logging.getLogger("agentrl.train")


def train(cfg: Config) -> Path:
    out = Path(cfg.run.output_dir or f"runs/{cfg.run.env}-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    # the trainer actor writes there too (--weight-sync-mode disk)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": str(out)})})
    cfg.dump(out / "config.yaml")
    progress = Progress(enabled=cfg.run.progress)
    seed_everything(cfg.run.seed)

    env_cls = build_env_lookup(cfg)
    source = build_prompt_source(cfg, env_cls)
    if warning := turn_budget_warning(cfg, env_cls):
        progress.note(f"warning: {warning}")
    reward_fn = build_reward_fn(cfg)
    check_hooks(cfg)  # slime's generate / rollout functions: loadable, with slime's arguments
    replay = load_debug_rollouts(cfg.run.load_debug_rollout_data) if cfg.run.debug_train_only else None
    eval_sets = load_eval_sets(cfg)
    model_path = resolve_model(cfg, progress)
    device = resolve_device(cfg)

    state = RunState()
    if cfg.run.load:
        ckpt = latest_checkpoint(Path(cfg.run.load))
        state = RunState.read(ckpt)
        source.load_state_dict(state.data)
        model_path = ckpt / "model"
        progress.note(f"resumed from {ckpt}: iteration {state.rollout_id}, data position {state.data}, "
                      f"{len(state.pending_tasks)} launched tasks to re-run")
    tokenizer = load_tokenizer(model_path)
    save_dir = Path(cfg.run.save or out / "checkpoints")

    start_ray(cfg)
    engines, runlog, placement = None, None, None
    try:
        # one placement group: trainer rank(s) and engines, each a Ray actor in its bundle
        placement = reserve_placement(cfg, device, trainer=not cfg.run.debug_rollout_only, engines=replay is None)
        trainer = None if cfg.run.debug_rollout_only else RemoteTrainer(cfg, model_path, device, placement)
        if trainer is not None and cfg.run.load:
            trainer.load(latest_checkpoint(Path(cfg.run.load)))
        if replay is None:
            engines = start_engines(cfg.rollout, model_path=str(model_path), device=device, seed=cfg.run.seed,
                                    log_dir=out / "logs", sglang_args=cfg.sglang_args, router_args=cfg.router_args,
                                    dtype=cfg.model.dtype, placement=placement, **lora_engine_args(cfg))
        runlog = RunLog(out, tokenizer=tokenizer, wandb_run=start_wandb(cfg.run, cfg.model_dump(mode="json"), out))
        asyncio.run(_loop(cfg, trainer, tokenizer, source, engines, runlog, progress, state, save_dir, reward_fn,
                          replay, eval_sets))
    finally:
        if engines is not None:
            engines.stop()
        if runlog is not None:
            runlog.close()
        progress.close()
        if placement is not None:
            placement.release()
        stop_ray()
        remove_own_containers()
    plot = runlog.plot()
    progress.note(f"run folder: {out} (metrics.jsonl, tensorboard/, trajectories/, {plot.name}); checkpoints: {save_dir}")
    return out


async def _loop(cfg: Config, trainer, tokenizer, source: PromptSource, engines: EngineGroup | None, runlog: RunLog,
                progress: Progress, state: "RunState", save_dir: Path, reward_fn, replay, eval_sets) -> None:
    r = cfg.rollout
    control = RolloutControl()
    control.partial_rollout = r.partial_rollout
    weights_lock = asyncio.Lock()  # held from a training step to the end of its weight sync
    pool = await start_sandbox_pool(cfg)
    async with contextlib.AsyncExitStack() as stack:
        # last out: what failed attempts left in reference cycles (a tool server's subprocess
        # transport held by its exception's traceback) is finalized while the loop still runs;
        # collected after asyncio.run closed it, it prints "RuntimeError: Event loop is closed"
        stack.push_async_callback(collect_garbage)
        if pool is not None:
            stack.push_async_callback(pool.close)
        producer, engine_clients, rollout_fn = None, [], None
        if engines is not None:
            client = await stack.enter_async_context(EngineClient(engines.url, request_timeout_s=r.request_timeout_s))
            engine_clients = [EngineClient(u, request_timeout_s=r.request_timeout_s) for u in engines.engine_urls]
            for c in engine_clients:
                stack.push_async_callback(c.close)
            runner = build_group_runner(cfg, tokenizer, client, pool, reward_fn, control,
                                        on_done=lambda s: progress.advance_samples())
            producer = RolloutProducer(
                source=source, run_group=runner.run_group,
                over_sampling=r.over_sampling_batch_size or r.rollout_batch_size,
                group_filter=build_group_filter(cfg), max_group_retries=r.max_group_retries,
                keep_generating=r.async_rollout, first_group_id=state.next_group_id, pending=state.pending_tasks,
                max_failed_groups=r.max_failed_groups, report=progress.note)
            stack.push_async_callback(producer.aclose)
            progress.detail = producer.status
            stack.enter_context(heartbeat(progress))
            rollout_fn = build_rollout_hook(cfg, tokenizer, client, source, runner, report=progress.note)
            evaluator = None
            if eval_sets:
                e = cfg.eval
                evaluator = build_group_runner(cfg, tokenizer, client, pool, reward_fn, control, on_done=None,
                                               n_samples=e.n_samples_per_eval_prompt, temperature=e.eval_temperature,
                                               max_response_len=e.eval_max_response_len, evaluation=True)
            if state.rollout_id > 0 and trainer is not None:  # engines loaded the checkpoint: name its version
                await update_engines(cfg, control, engines, trainer, state.policy_version)
            if trainer is not None:  # a restarted engine gets the current weights before it serves
                engines.catch_up = catch_up_fn(cfg, trainer, state, weights_lock)
                stack.callback(setattr, engines, "catch_up", None)

        async def evaluate_now(rollout_id: int, prefix: str = "eval") -> dict:
            # colocated, the engines hold their memory only inside the handover
            async with colocated(cfg, trainer, engines, engine_clients):
                return await evaluate(evaluator, eval_sets, prefix=prefix, save=lambda name, s: runlog.save_eval_trajectories(
                    name if rollout_id >= 0 else f"{name}_before_train", max(rollout_id, 0), s))

        before_train = {}
        if eval_sets and producer is not None and cfg.eval.eval_interval and state.rollout_id == 0 \
                and not cfg.eval.skip_eval_before_train:
            progress.note("evaluating the starting model (--skip-eval-before-train skips it)")
            before_train = await evaluate_now(-1, prefix="eval_before_train")
        progress.start(total=r.num_rollout, completed=state.rollout_id)
        for rollout_id in range(state.rollout_id, r.num_rollout):
            t_start = t0 = time.perf_counter()
            handover = {}
            if rollout_fn is not None:  # --rollout-function-path: slime's generate_rollout fills the batch
                try:
                    async with colocated(cfg, trainer, engines, engine_clients) as handover:
                        samples = await rollout_fn.next_batch(rollout_id, state.policy_version)
                except RolloutFailedError:  # the failure bound: keep the batch that hit it
                    runlog.log(rollout_metrics(rollout_id, rollout_fn.last_batch, time.perf_counter() - t0)
                               | {"partial": True})
                    runlog.save_trajectories(rollout_id, rollout_fn.last_batch)
                    raise
            elif producer is not None:
                try:
                    async with colocated(cfg, trainer, engines, engine_clients,
                                         drain=producer.requeue_inflight) as handover:
                        samples = await producer.next_batch(r.rollout_batch_size)
                except BaseException:  # stopped (signal, failure bound): keep what this iteration made
                    save_partial(runlog, rollout_id, producer, time.perf_counter() - t0)
                    raise
            else:
                samples = replay[rollout_id % len(replay)]
            t_rollout = time.perf_counter() - t0

            fresh, stale = split_stale(samples, state.policy_version, r.max_staleness)
            masked = 0
            if r.mask_offpolicy_in_partial_rollout:
                masked = sum(s.mask_older_than(max(s.policy_versions, default=0)) for s in fresh)
            train_metrics, t_train, sync = {}, 0.0, {}
            if trainer is not None:
                async with weights_lock:
                    t0 = time.perf_counter()
                    # The trainer actor works while the event loop keeps driving rollouts (--async).
                    train_metrics = await trainer.train_rollout(fresh)
                    t_train = time.perf_counter() - t0
                    state.policy_version += 1
                    if engines is not None:
                        sync = await update_engines(cfg, control, engines, trainer, state.policy_version)

            metrics = (rollout_metrics(rollout_id, samples, t_rollout) | before_train | train_metrics | sync | handover
                       | {"train_s": t_train, "iteration_s": time.perf_counter() - t_start,
                          "policy_version": state.policy_version, "stale_dropped": len(stale),
                          "offpolicy_tokens_masked": masked})
            before_train = {}
            if producer is not None:
                metrics |= producer.stats() | {"requests_retried": client.retried}
            last = rollout_id + 1 == r.num_rollout
            interval = cfg.eval.eval_interval
            if rollout_fn is not None:
                metrics |= rollout_fn.metrics
            if eval_sets and producer is not None and interval and (last or (rollout_id + 1) % interval == 0):
                metrics |= await evaluate_now(rollout_id)
            if pool is not None:
                metrics |= {f"sandbox/{k}": v for k, v in pool.metrics().items() if isinstance(v, (int, float))}
            runlog.log(metrics)
            # the failed attempts too (retried or dropped groups), with their tracebacks, for `agentrl inspect`
            runlog.save_trajectories(rollout_id, samples + (producer.take_failed() if producer is not None else []))
            state.rollout_id = rollout_id + 1
            if trainer is not None and (last or (cfg.run.save_interval and (rollout_id + 1) % cfg.run.save_interval == 0)):
                state.data = source.state_dict()
                if producer is not None:
                    state.pending_tasks, state.next_group_id = producer.pending_tasks(), producer.next_id
                trainer.save(save_dir / f"iter_{rollout_id + 1:06d}", state.to_dict())
            progress.iteration_done(metrics)


async def collect_garbage() -> None:
    gc.collect()
    await asyncio.sleep(0)  # the finalizers' call_soon callbacks (transport closes) run now


def remove_own_containers() -> None:
    """Docker sandboxes this process made that outlived their pool: a creation a signal cut
    short still finishes in its thread (asyncio.run waits for it) after the pool closed."""
    backend = sys.modules.get("agentrl.sandboxes.docker_backend")
    if backend is None or backend._client is None:  # never talked to docker: nothing to ask it
        return
    from agentrl.sandboxes.base import OWNER_PID
    from agentrl.sandboxes.docker_backend import list_containers

    try:
        for container in list_containers(all_runs=False):
            if container.labels.get("agentrl.owner_pid") == str(OWNER_PID):
                container.remove(force=True)
    except Exception as exc:  # cleanup goes on; `agentrl sandbox reap` removes them later
        log.warning("could not remove this run's leftover sandboxes: %r", exc)


def save_partial(runlog: RunLog, rollout_id: int, producer: RolloutProducer, seconds: float) -> None:
    """An iteration that did not finish: its finished groups and failed attempts go to its
    trajectory file, and a metrics row marked partial says how far it got."""
    finished = producer.ready_samples()
    runlog.log(rollout_metrics(rollout_id, finished, seconds) | producer.stats() | {"partial": True})
    runlog.save_trajectories(rollout_id, finished + producer.take_failed())


@contextlib.contextmanager
def heartbeat(progress: Progress, every_s: float = 5.0):
    """Ticks the progress line on a timer: a rollout in which nothing finishes still shows it is alive."""
    async def beat():
        while True:
            await asyncio.sleep(every_s)
            progress.tick()

    task = asyncio.get_running_loop().create_task(beat())
    try:
        yield
    finally:
        task.cancel()


@contextlib.asynccontextmanager
async def colocated(cfg: Config, trainer, engines: EngineGroup, clients: list[EngineClient], drain=None):
    """--colocate: during rollout the engines hold the GPU and the trainer sits in host
    memory; around training, the other way round (agentrl.engines.colocate says what SGLang
    requires of the order). `drain` stops the rollout's leftover work before the engines
    give their memory back. Yields a dict that gets each switch's seconds and the GPU's
    memory at the end of the rollout (metrics)."""
    out: dict[str, float] = {}
    if not cfg.run.colocate or trainer is None:
        yield out
        return
    t0 = time.perf_counter()
    await trainer.offload()
    t1 = time.perf_counter()
    await engines.memory.resume(clients)
    out |= {"colocate/offload_s": t1 - t0, "colocate/resume_s": time.perf_counter() - t1}
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


def lora_engine_args(cfg: Config) -> dict:
    """start_engines' LoRA arguments: with --lora-sync adapter the engines serve adapters."""
    if not (cfg.train.lora_rank and cfg.train.lora_sync == "adapter"):
        return {}
    return {"lora_max_rank": cfg.train.lora_rank, "lora_target_modules": lora_target_modules(cfg.train.target_modules)}


async def update_engines(cfg: Config, control: RolloutControl, engines: EngineGroup, trainer, version: int) -> dict:
    """New weights into every live engine. The gate keeps agent loops from sending requests
    and the engines pause in place, so no generation sees half-updated weights. With
    --partial-rollout in-flight generations are aborted first and resume under the new
    weights, so every token's policy version is exact; without it a generation paused in
    place finishes under the new weights and carries the version it finished under (as
    SGLang reports it). An engine that misses the update leaves the pool until it catches up."""
    clients = [EngineClient(u, request_timeout_s=cfg.rollout.request_timeout_s) for u in engines.live()]
    control.pause()
    try:
        if cfg.rollout.partial_rollout:
            await _each(clients, "/abort_request", {"abort_all": True})
        # SGLang's pause without a mode aborts; "in_place" keeps the requests to finish later.
        await _each(clients, "/pause_generation", {"mode": "in_place"})
        try:
            out = await trainer.sync_weights([c.base_url for c in clients], version)
            control.policy_version = version
            if lora_engine_args(cfg):  # from now on every request names this version's adapter
                from agentrl.weight_sync import lora_adapter_name

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
        return out | ({"weight_sync_failed": len(failed)} if failed else {})
    finally:
        control.resume()
        await asyncio.gather(*[c.close() for c in clients])


def catch_up_fn(cfg: Config, trainer, state: "RunState", weights_lock: asyncio.Lock):
    """For the engine monitor (another thread): url -> Future of pushing the current weights
    to that engine and resuming it, done on this event loop between two weight updates."""
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


async def _each(clients: list[EngineClient], path: str, payload: dict) -> None:
    """A control call to every engine; one that is down is the monitor's business, not the loop's."""
    results = await asyncio.gather(*[c.post(path, payload) for c in clients], return_exceptions=True)
    for c, r in zip(clients, results):
        if isinstance(r, Exception):
            log.warning("%s %s failed: %r", c.base_url, path, r)


def evaluate_checkpoint(cfg: Config, *, limit: int | None = None) -> dict[str, float]:
    """`agentrl eval`: the model of --model (or --load) on the eval sets, with the same engines
    as training and no trainer; prints a summary table and writes eval.json in the run folder.
    Without --eval-prompt-data it evaluates --prompt-data (as "data") or the env's own tasks."""
    out = Path(cfg.run.output_dir or f"runs/eval-{cfg.run.env}-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(enabled=cfg.run.progress)
    env_cls = build_env_lookup(cfg)
    eval_sets = load_eval_sets(cfg)
    if not eval_sets:
        source = build_prompt_source(cfg, env_cls)
        n = limit or (len(source.tasks) if source.tasks is not None else 32)
        eval_sets = [("data" if cfg.data.prompt_data else cfg.run.env, source.next_batch(n))]
    model_path = latest_checkpoint(Path(cfg.run.load)) / "model" if cfg.run.load else resolve_model(cfg, progress)
    device = resolve_device(cfg)
    tokenizer = load_tokenizer(model_path)
    engines = start_engines(cfg.rollout, model_path=str(model_path), device=device, seed=cfg.run.seed,
                            log_dir=out / "logs", sglang_args=cfg.sglang_args, router_args=cfg.router_args,
                            dtype=cfg.model.dtype)

    async def run() -> dict[str, float]:
        pool = await start_sandbox_pool(cfg)
        try:
            async with EngineClient(engines.url, request_timeout_s=cfg.rollout.request_timeout_s) as client:
                e = cfg.eval
                runner = build_group_runner(cfg, tokenizer, client, pool, build_reward_fn(cfg), RolloutControl(),
                                            on_done=None, n_samples=e.n_samples_per_eval_prompt,
                                            temperature=e.eval_temperature, max_response_len=e.eval_max_response_len,
                                            evaluation=True)
                return await evaluate(runner, eval_sets, save=lambda name, s: write_trajectories(
                    eval_trajectories_path(out, name, 0), s, tokenizer))
        finally:
            if pool is not None:
                await pool.close()

    try:
        results = asyncio.run(run())
    finally:
        engines.stop()
        progress.close()
    (out / "eval.json").write_text(json.dumps({"model": str(model_path), **results}, indent=1) + "\n")
    width = max(len(k) for k in results)
    print(f"{'metric':<{width}}  value\n" + "\n".join(f"{k:<{width}}  {v:.4f}" for k, v in results.items()))
    progress.note(f"model {model_path}; results in {out / 'eval.json'}")
    return results


EVAL_GROUP_BASE = 10**9  # eval groups get their own ids (and env seeds), the same at every evaluation


async def evaluate(runner: GroupRunner, eval_sets: list[tuple[str, list[dict]]], save=None,
                   prefix: str = "eval") -> dict[str, float]:
    """<prefix>/<name>/reward_mean, response_len_mean and, with several samples per prompt,
    pass@k (a sample passes when its reward is at least 1, as the envs' binary rewards).
    `save(name, samples)` keeps each set's trajectories."""
    out: dict[str, float] = {}
    for name, tasks in eval_sets:
        groups = await asyncio.gather(*[runner.run_group(t, EVAL_GROUP_BASE + i) for i, t in enumerate(tasks)])
        if save is not None:
            save(name, [s for g in groups for s in g])
        done = [s for g in groups for s in g if s.status != SampleStatus.FAILED]
        out[f"{prefix}/{name}/reward_mean"] = float(np.mean([s.reward_value for s in done])) if done else 0.0
        out[f"{prefix}/{name}/response_len_mean"] = float(np.mean([s.response_length for s in done])) if done else 0.0
        out[f"{prefix}/{name}/failed"] = sum(len(g) for g in groups) - len(done)
        k = runner.n_samples
        if k > 1:
            out[f"{prefix}/{name}/pass@{k}"] = float(np.mean([any(s.reward_value >= 1.0 for s in g) for g in groups]))
    return out


def split_stale(samples: list[Sample], policy_version: int, max_staleness: int | None):
    """(fresh, stale): a sample whose oldest policy token is more than K versions behind is not trained on."""
    if max_staleness is None:
        return samples, []
    fresh, stale = [], []
    for s in samples:
        old = s.oldest_policy_version
        (stale if old >= 0 and policy_version - old > max_staleness else fresh).append(s)
    return fresh, stale


@dataclass
class RunState:
    """What a checkpoint restores besides weights and optimizer: where the run was."""

    rollout_id: int = 0  # the next iteration
    policy_version: int = 0  # weight syncs so far; tokens record the version that sampled them
    data: dict = field(default_factory=dict)  # PromptSource position
    pending_tasks: list = field(default_factory=list)  # launched, not yet trained: re-run on resume
    next_group_id: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, ckpt: Path) -> "RunState":
        raw = json.loads((ckpt / "trainer_state.json").read_text())
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def rollout_metrics(rollout_id: int, samples: list[Sample], seconds: float) -> dict:
    ok = [s for s in samples if s.status != SampleStatus.FAILED]
    generated = sum(s.num_trained_tokens for s in samples)
    rewards = [s.reward_value for s in ok] or [0.0]
    status = {f"status_{st.value}": sum(s.status == st for s in samples) for st in SampleStatus}
    truncations = Counter(s.metadata.get("truncation") for s in samples if s.status == SampleStatus.TRUNCATED)
    status |= {f"truncated/{reason}": n for reason, n in sorted(truncations.items(), key=str)}
    gen_s = [t.generate_s for s in samples for t in s.turn_timings]
    env_s = [t.env_s for s in samples for t in s.turn_timings]
    return {
        "rollout_id": rollout_id,
        "reward_mean": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        "response_len_mean": float(np.mean([s.response_length for s in ok])) if ok else 0.0,
        "turns_mean": float(np.mean([s.num_turns for s in ok])) if ok else 0.0,
        "tool_calls_mean": float(np.mean([s.metadata.get("tool_calls", 0) for s in ok])) if ok else 0.0,
        "num_samples": len(samples),
        **status,
        "rollout_s": seconds,
        "generate_s_mean": float(np.mean(gen_s)) if gen_s else 0.0,
        "env_s_mean": float(np.mean(env_s)) if env_s else 0.0,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        **affinity_metrics(samples),  # router_affinity, prefix_cache_hit_rate (from the engines' replies)
    }


# -- setup steps -------------------------------------------------------------------------------
def build_trainer(cfg: Config, model_path: Path, device: str):
    if cfg.train.trainer == "megatron":
        from agentrl.trainers.megatron import MegatronTrainer

        return MegatronTrainer(str(model_path), train=cfg.train, algo=cfg.algo,
                               temperature=cfg.rollout.rollout_temperature, device=device, dtype=cfg.model.dtype,
                               megatron_args=cfg.megatron_args, seed=cfg.run.seed)
    from agentrl.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(str(model_path), train=cfg.train, algo=cfg.algo, temperature=cfg.rollout.rollout_temperature,
                        device=device, dtype=cfg.model.dtype)


def build_group_runner(cfg: Config, tokenizer, client: EngineClient, pool, reward_fn, control: RolloutControl,
                       on_done, *, n_samples: int | None = None, temperature: float | None = None,
                       max_response_len: int | None = None, evaluation: bool = False) -> GroupRunner:
    """Trajectories of groups; the keyword overrides serve evaluation. With
    --custom-generate-function-path, slime's generate plays each trajectory."""
    r = cfg.rollout
    sampling = {"temperature": r.rollout_temperature if temperature is None else temperature,
                "top_p": r.rollout_top_p, "top_k": r.rollout_top_k} | ({"ignore_eos": True} if r.rollout_ignore_eos else {})

    def settings_for(env) -> LoopSettings:
        params = {**sampling, "stop": list(env.stop)} if getattr(env, "stop", None) else sampling
        return LoopSettings(max_response_len=max_response_len or r.rollout_max_response_len,
                            max_turns=r.max_turns or env.max_turns,
                            sampling_params=params, apply_chat_template=cfg.data.apply_chat_template,
                            max_tokens_per_turn=r.rollout_max_tokens_per_turn)

    def make_env(name: str | None):
        name = name or cfg.run.env
        kwargs = dict(cfg.run.env_kwargs) if name == cfg.run.env else {}
        extra = tool_kwargs(cfg, get_spec(name).load(), pool)
        if "sandbox" in extra:  # the pool was made of the backend --env-kwargs named
            kwargs.pop("sandbox", None)
        return make(name, **kwargs, **extra), name

    renderer = Renderer(tokenizer, cfg.data.apply_chat_template)
    generate_fn = None
    if r.custom_generate_function_path:
        generate_fn = GenerateHook(r.custom_generate_function_path, renderer=renderer, sampling_params=sampling,
                                   args=slime_args(cfg, engine_url=client.base_url, model_path=tokenizer.name_or_path),
                                   max_new_tokens=max_response_len or r.rollout_max_response_len,
                                   reward_fn=reward_fn, control=control, evaluation=evaluation)
    return GroupRunner(make_env=make_env, n_samples=n_samples or r.n_samples_per_prompt, renderer=renderer,
                       client=client, settings_for=settings_for, run_seed=cfg.run.seed,
                       max_concurrency=r.max_concurrency, reward_fn=reward_fn, control=control, on_done=on_done,
                       generate_fn=generate_fn)


def build_rollout_hook(cfg: Config, tokenizer, client: EngineClient, source: PromptSource,
                       runner: GroupRunner, report=None) -> RolloutHook | None:
    """--rollout-function-path: slime's generate_rollout, fed by a slime-shaped data source."""
    r = cfg.rollout
    if not r.rollout_function_path:
        return None
    args = slime_args(cfg, engine_url=client.base_url, model_path=tokenizer.name_or_path)
    return RolloutHook(r.rollout_function_path, args=args, renderer=runner.renderer, make_env=runner.make_env,
                       data_source=DataSource(source, runner.renderer, r.n_samples_per_prompt),
                       reward_fn=runner.reward_fn, run_seed=cfg.run.seed,
                       max_failed_groups=r.max_failed_groups, report=report)


def build_group_filter(cfg: Config):
    """--dynamic-sampling-filter-path: "nonzero_std" or a user fn(args, samples) -> bool | (bool, reason)."""
    path = cfg.rollout.dynamic_sampling_filter_path
    if path is None:
        return None
    if path == "nonzero_std":
        return nonzero_std_filter
    fn = load_function(path, flag="--dynamic-sampling-filter-path")

    def group_filter(samples):
        out = fn(cfg, samples)
        if isinstance(out, tuple):
            return bool(out[0]), str(out[1])
        if hasattr(out, "keep"):
            return bool(out.keep), str(getattr(out, "reason", None) or "filtered")
        return bool(out), "filtered"

    return group_filter


def label_needed_by(name: str) -> str | None:
    """The env's name if it grades against a label (its class sets `needs_label`): data without one fails at start."""
    return name if getattr(get_spec(name).load(), "needs_label", False) else None


def load_eval_sets(cfg: Config) -> list[tuple[str, list[dict]]]:
    """--eval-prompt-data NAME PATH ...: read (and so check) every eval set before any work."""
    d, pairs = cfg.data, cfg.eval.eval_prompt_data
    sets = []
    for name, path in zip(pairs[::2], pairs[1::2]):
        tasks = read_rows(path, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key,
                          label_needed_by=label_needed_by(cfg.run.env))
        for task in tasks:
            if task.get("env"):
                get_spec(task["env"])
        sets.append((name, tasks))
    return sets


def load_debug_rollouts(path: str) -> list[list[Sample]]:
    """Saved rollouts of a run (its trajectories/rollout_*.jsonl), one list per iteration."""
    folder = Path(path)
    folder = folder / "trajectories" if (folder / "trajectories").is_dir() else folder
    files = sorted(folder.glob("rollout_*.jsonl"))
    if not files:
        raise ConfigError(f"--load-debug-rollout-data {path}: no trajectories/rollout_*.jsonl in it")
    out = []
    for f in files:
        rows = []
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            try:
                rows.append(Sample.from_dict(json.loads(line)))
            except Exception as exc:
                raise ConfigError(f"{f}:{lineno}: not a saved Sample: {exc}") from exc
        out.append(rows)
    return out


def resolve_device(cfg: Config) -> str:
    """--device: auto is cuda when a GPU is there, else cpu."""
    return "cuda" if cfg.model.device == "auto" and torch.cuda.is_available() else cfg.model.device.replace("auto", "cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_env_lookup(cfg: Config):
    for module in cfg.run.env_module:
        import_env_module(module)
    spec = get_spec(cfg.run.env)  # unknown name: the error lists the known ones
    env_cls = spec.load()
    # an argument the env does not take fails now, not inside every trajectory
    given = {**cfg.run.env_kwargs, **tool_kwargs(cfg, env_cls, pool=cfg.run.sandbox)}
    check_env_kwargs(cfg.run.env, env_cls, given)
    return env_cls


def build_prompt_source(cfg: Config, env_cls) -> PromptSource:
    d = cfg.data
    if d.prompt_data:
        tasks = read_rows(d.prompt_data, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key,
                          label_needed_by=label_needed_by(cfg.run.env))
        for task in tasks:  # rows naming their env must name a known one, before any work starts
            if task.get("env"):
                get_spec(task["env"])
        return PromptSource(tasks, shuffle=d.rollout_shuffle, seed=cfg.run.seed)
    dataset = getattr(env_cls, "dataset", None)
    if dataset is None or dataset(**cfg.run.env_kwargs) is None:  # episodes from each group's seed
        return PromptSource(generator=seed_tasks, seed=cfg.run.seed)
    return PromptSource(generator=lambda: dataset(seed=cfg.run.seed, **cfg.run.env_kwargs), seed=cfg.run.seed)


def turn_budget_warning(cfg: Config, env_cls) -> str | None:
    """Why --rollout-max-response-len (all turns, policy and env tokens) cannot fit the env's
    turns, or None: trajectories would end "truncated (no room for another turn)"."""
    r = cfg.rollout
    turns = int(r.max_turns or cfg.run.env_kwargs.get("max_turns") or getattr(env_cls, "max_turns", 1))
    if turns <= 1:
        return None
    budget = (f"--rollout-max-response-len {r.rollout_max_response_len} is the budget of all {turns} turns of env "
              f"{cfg.run.env!r} together (policy and env tokens)")
    if r.rollout_max_tokens_per_turn is None:
        return (f"{budget}, and with no --rollout-max-tokens-per-turn the first turn may use all of it: later "
                f"turns end truncated (no room for another turn). Set --rollout-max-tokens-per-turn "
                f"{max(1, r.rollout_max_response_len // turns)} or lower, or raise the budget.")
    if 2 * r.rollout_max_tokens_per_turn > r.rollout_max_response_len:
        return (f"{budget}: a first turn of --rollout-max-tokens-per-turn {r.rollout_max_tokens_per_turn} leaves "
                "no room for a second one; later turns end truncated (no room for another turn).")
    return None


def tool_kwargs(cfg: Config, env_factory, pool) -> dict:
    """--mcp-server and the run's sandbox pool, for envs whose constructor takes them."""
    params = inspect.signature(env_factory).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    out = {}
    if cfg.run.mcp_server:
        if "mcp_servers" not in params and not takes_any:
            raise ConfigError(f"--mcp-server: env {cfg.run.env!r} takes no MCP servers (subclass agentrl.tools.ToolEnv)")
        out["mcp_servers"] = list(cfg.run.mcp_server)
    if pool is not None and ("sandbox" in params or takes_any):
        out["sandbox"] = pool
    return out


def run_sandbox_backend(cfg: Config, env_cls) -> str | None:
    """--sandbox, else the backend the run's env picks for itself (`sandbox` in --env-kwargs, its
    constructor's default, or its class attribute) when that is a backend name: one bounded pool
    then serves every trajectory instead of a sandbox each (a 2-core machine cannot hold 100)."""
    if cfg.run.sandbox is not None:
        return cfg.run.sandbox
    if "sandbox" in cfg.run.env_kwargs:
        chosen = cfg.run.env_kwargs["sandbox"]
    else:
        param = inspect.signature(env_cls).parameters.get("sandbox")
        chosen = getattr(env_cls, "sandbox", None) if param is None or param.default is param.empty else param.default
    return chosen if isinstance(chosen, str) and chosen in ("docker", "local", "auto") else None


async def start_sandbox_pool(cfg: Config):
    """One warm, bounded pool of sandboxes for the run's tool servers (see run_sandbox_backend), or None.
    A trajectory waits for a free sandbox (each holds one for a bounded time), so the wait is long."""
    env_cls = get_spec(cfg.run.env).load()
    backend = run_sandbox_backend(cfg, env_cls)
    if backend is None:
        return None
    from agentrl.sandboxes import SandboxLimits, SandboxPool
    from agentrl.tools.spec import tool_sandbox_options

    mounts, env = await asyncio.to_thread(tool_sandbox_options)
    pool = SandboxPool(backend, warm=4, max_active=cfg.run.sandbox_max_active, mounts=mounts, env=env,
                       limits=SandboxLimits(**getattr(env_cls, "sandbox_limits", {})), acquire_timeout_s=3600)
    return await pool.start()


def build_reward_fn(cfg: Config):
    """--custom-rm-path: slime's `async def rm(args, sample)` (a sync function works too)."""
    if not cfg.algo.custom_rm_path:
        return None
    rm = load_function(cfg.algo.custom_rm_path, flag="--custom-rm-path")

    async def reward_fn(sample):
        out = rm(cfg, sample)
        return await out if inspect.isawaitable(out) else out

    return reward_fn


def resolve_model(cfg: Config, progress: Progress) -> Path:
    if cfg.model.model:
        return check_model_dir(cfg.model.model)
    fresh = not (tiny_model_dir() / "config.json").exists()
    path = build_tiny_model()
    progress.note(f"no --model given: using the built-in tiny model (Qwen2 architecture, random init from a fixed "
                  f"seed, tokenizer trained offline; nothing downloaded) {'built at' if fresh else 'from'} {path}")
    return path


def latest_checkpoint(folder: Path) -> Path:
    if (folder / "trainer_state.json").exists():
        return folder
    found = sorted(folder.glob("iter_*/trainer_state.json"))
    if not found:
        raise ConfigError(f"--load {folder}: no checkpoint (iter_*/trainer_state.json) in it")
    return found[-1].parent
