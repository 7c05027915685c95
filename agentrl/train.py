"""The RL loop, top to bottom. Per iteration: take prompts -> multi-turn rollouts through the
engine over HTTP -> rewards -> advantages -> policy update -> weight sync -> next.

The same loop drives every configuration: the embedded CPU engine or SGLang engines behind
sglang-router, the plain-PyTorch or Megatron trainer (a Ray actor), rollout and training
taking turns or overlapping (`--async`, with `--partial-rollout` and `--max-staleness`).
`train` builds the pieces (agentrl.build), `start_rollout` the rollout side, `_loop` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from agentrl.batches import BatchSource, HookBatches, ProducerBatches, ReplayBatches, rollout_metrics
from agentrl.build import (build_env_lookup, build_group_filter, build_group_runner, build_prompt_source,
                           build_reward_fn, build_rollout_hook, check_data_files, latest_checkpoint,
                           load_debug_rollouts, engine_sglang_args, load_eval_sets, lora_engine_args, resolve_device,
                           resolve_model, seed_everything, start_sandbox_pool, turn_budget_warning)
from agentrl.cluster.engine_actor import stop_engines
from agentrl.cluster.node_watch import NodeWatch
from agentrl.cluster.placement import reserve_placement
from agentrl.cluster.ray_session import start_ray, stop_ray
from agentrl.cluster.trainer_actor import RemoteTrainer
from agentrl.config import Config
from agentrl.data import PromptSource
from agentrl.engines.group import EngineGroup, start_engines
from agentrl.evaluation import evaluate
from agentrl.fp8 import engine_model_path
from agentrl.judge import close_judges
from agentrl.metrics import (RunContext, RunLog, Timeline, engine_log_steps, rollout_stage_metrics, start_wandb,
                             triton_cache_kernels)
from agentrl.models import load_tokenizer
from agentrl.progress import Progress
from agentrl.rollout.client import EngineClient
from agentrl.rollout.control import RolloutControl
from agentrl.rollout.gc_tuning import tune_gc_for_rollouts
from agentrl.rollout.producer import RolloutProducer
from agentrl.rollout.slime import check_hooks
from agentrl.teacher import score_with_teacher, start_served_models
from agentrl.trainers.megatron.flags import wants_routing_replay
from agentrl.types import Sample
from agentrl.weight_update import catch_up_fn, check_probe, colocated, update_engines


log = logging.getLogger("agentrl.train")


def train(cfg: Config) -> Path:
    out = Path(cfg.run.output_dir or f"runs/{cfg.run.env}-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    # the trainer actor writes there too (--weight-sync-mode disk)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": str(out)})})
    if cfg.train.use_pytorch_profiler and not cfg.train.profile_dir:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"profile_dir": str(out / "profile")})})
    cfg.dump(out / "config.yaml")  # as given; what it met here goes to run.json
    context = RunContext(out)
    progress = Progress(enabled=cfg.run.progress)
    timeline = Timeline(context, progress.note)  # start-up and stop steps: run.json and the console
    timeline.add("startup", "python", 0.0, timeline.now())  # the interpreter, imports, the config
    seed_everything(cfg.run.seed)

    with timeline.step("startup", "checks"):  # what fails fast on a bad flag: before anything starts
        env_cls = build_env_lookup(cfg)
        check_data_files(cfg)  # a missing data file: before Ray, not in the set-up thread beside it
        if warning := turn_budget_warning(cfg, env_cls):
            progress.note(f"warning: {warning}")
        if (chance := getattr(env_cls, "chance_reward", None)) and (chance := chance(**cfg.run.env_kwargs)) is not None:
            progress.chance_reward = chance
            context.record(chance_reward=chance)
        reward_fn = build_reward_fn(cfg)
        check_hooks(cfg)  # slime's generate / rollout functions: loadable, with slime's arguments
        if cfg.rollout.rollout_engine == "sglang" and not cfg.rollout.rollout_engine_urls and not cfg.run.debug_train_only:
            # SGLang imported here, on the only thread: imported beside the driver's set-up thread
            # (transformers) it met accelerate half-initialized once (1x H200, 2026-12-03)
            from agentrl.engines.sglang import validate_sglang_args

            validate_sglang_args(engine_sglang_args(cfg))
        model_path = resolve_model(cfg, progress)
        device = resolve_device(cfg)
    state = RunState()
    if cfg.run.load:
        ckpt = latest_checkpoint(Path(cfg.run.load))
        state = RunState.read(ckpt)
        model_path = ckpt / "model"
        progress.note(f"resumed from {ckpt}: iteration {state.rollout_id}, data position {state.data}, "
                      f"{len(state.pending_tasks)} launched tasks to re-run")
    if cfg.run.start_rollout_id is not None:  # slime's: the loop starts there, whatever --load restored
        state.rollout_id = cfg.run.start_rollout_id
    save_dir = Path(cfg.run.save or out / "checkpoints")
    context.record(device=device, model_path=str(model_path), resumed_from=state.rollout_id if cfg.run.load else None)
    # The driver's own set-up (prompts, tokenizer, eval sets, the metrics writers) needs neither Ray
    # nor the actors: it runs in a thread while Ray starts and the trainer and engines launch.
    setup = Background(lambda: _driver_setup(cfg, env_cls, model_path, state, out, timeline))

    with timeline.step("startup", "ray"):
        start_ray(cfg)
    engines, runlog, placement, watch, trainer, served = None, None, None, None, None, None
    debug_train_only = bool(cfg.run.debug_train_only)  # replays saved rollouts: no engines
    try:
        # one placement group: trainer rank(s) and engines, each a Ray actor in its bundle
        with timeline.step("startup", "placement"):
            placement = reserve_placement(cfg, device, trainer=not cfg.run.debug_rollout_only,
                                          engines=not debug_train_only)
        # the trainer's actors build it (Megatron / torch init, the HF weights) while the engines start
        trainer = None if cfg.run.debug_rollout_only else RemoteTrainer(cfg, model_path, device, placement)
        setup.raise_if_failed()  # a bad data file stops the run before the engines' long start
        with timeline.step("startup", "served_models"):  # --judge-load, a served OPD teacher: their own engines
            served = start_served_models(cfg, device=device, log_dir=out / "logs")
        if not debug_train_only:
            kernels = triton_cache_kernels()  # a cold cache: the engines compile theirs while starting
            with timeline.step("startup", "engines"):
                engine_model = engine_model_path(cfg, model_path, out)  # --sglang-quantization fp8: a block-fp8 copy
                engines = start_engines(cfg.rollout, model_path=str(engine_model), device=device, seed=cfg.run.seed,
                                        log_dir=out / "logs", sglang_args=engine_sglang_args(cfg),
                                        router_args=cfg.router_args, dtype=cfg.model.dtype, placement=placement,
                                        **lora_engine_args(cfg))
            # SGLang's own steps, from its log: weights, KV pool, CUDA graphs, warm-up
            for name, (begin, end) in engine_log_steps(out / "logs", since=timeline.started_at).items():
                timeline.add("startup", name, begin - timeline.started_at, end - timeline.started_at)
            if trainer is not None:  # which trainer rank sits on each engine TP rank's GPU (weight sync)
                trainer.engines_placed(engines.engine_urls)
            context.record(engines={"kind": engines.kind, "urls": engines.engine_urls, "generate_url": engines.url,
                                    "router": engines.router is not None},
                           triton_cache_kernels={"before_engines": kernels, "engines_ready": triton_cache_kernels()})
        if trainer is not None and cfg.run.load:  # queued behind the trainer's build, waited for here
            with timeline.step("startup", "trainer_load"):
                trainer.load(latest_checkpoint(Path(cfg.run.load)))
        context.record(placement=placement.describe(), trainer_ranks=len(placement.trainer_bundles))
        watch = NodeWatch(placement).start()  # a lost Ray node ends the run, naming the node
        with timeline.step("startup", "wait_setup"):
            source, tokenizer, replay, eval_sets, runlog = setup.result()
        tune_gc_for_rollouts()  # what start-up built lives for the run: no collection walks it again
        asyncio.run(_loop(Run(cfg=cfg, trainer=trainer, engines=engines, tokenizer=tokenizer, source=source,
                              runlog=runlog, progress=progress, state=state, save_dir=save_dir, reward_fn=reward_fn,
                              replay=replay, eval_sets=eval_sets, context=context, timeline=timeline)))
        context.end("completed")
        plotting = Background(runlog.plot)  # matplotlib's import and the plot, while the engines and Ray stop
    except BaseException as exc:
        context.end("interrupted" if isinstance(exc, KeyboardInterrupt) else f"failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        stop = functools.partial(timeline.step, "stop")
        if runlog is None:  # failed before the set-up was taken: its writers still need closing
            runlog = setup.result_or_none()[-1]
        if watch is not None:
            with stop("node_watch"):
                watch.stop()
        if engines is not None:
            with stop("engines"):
                stop_engines(engines)
        if served is not None:
            with stop("served_models"):
                served.stop()
        if trainer is not None:
            with stop("trainer"):
                trainer.stop()
        if runlog is not None:
            with stop("metrics_close"):
                runlog.close()
        progress.close()
        with stop("ray"):
            if placement is not None:
                placement.release()
            stop_ray()
        remove_own_containers()
    with stop("plot"):
        plot = plotting.result(timeout_s=120.0)
    timeline.report("stop")
    if summary := progress.summary():
        progress.note(summary)
    progress.note(f"run folder: {out} (metrics.jsonl, tensorboard/, trajectories/, {plot.name}); checkpoints: {save_dir}")
    return out


def _driver_setup(cfg: Config, env_cls, model_path: Path, state: "RunState", out: Path, timeline: Timeline):
    """(prompt source, tokenizer, saved rollouts or None, eval sets, RunLog): the driver's part
    of the start-up, which no actor waits for (run in a thread beside them)."""
    with timeline.step("startup", "data_env"):
        source = build_prompt_source(cfg, env_cls)
        if cfg.run.load:
            source.load_state_dict(state.data)
        replay = load_debug_rollouts(cfg.run.load_debug_rollout_data) if cfg.run.debug_train_only else None
        eval_sets = load_eval_sets(cfg)
        tokenizer = load_tokenizer(model_path)
        runlog = RunLog(out, tokenizer=tokenizer, wandb_run=start_wandb(cfg.run, cfg.model_dump(mode="json"), out))
    return source, tokenizer, replay, eval_sets, runlog


class Background:
    """fn() in a daemon thread (Ctrl-C never waits for it); its result or its exception, once."""

    def __init__(self, fn: Callable):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="agentrl-setup", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            self._error = exc

    def raise_if_failed(self) -> None:
        """Raise its exception now if it already failed; never waits."""
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def result(self, timeout_s: float = 3600.0):
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the driver's set-up (data, tokenizer, eval sets) took over {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result

    def result_or_none(self, timeout_s: float = 10.0) -> tuple:
        """For cleanup: the result if it came (5 Nones otherwise), never raising."""
        self._thread.join(timeout_s)
        return self._result if self._result is not None else (None,) * 5


@dataclass
class Run:
    """What `train` built for the loop."""

    cfg: Config
    trainer: RemoteTrainer | None  # None: --debug-rollout-only
    engines: EngineGroup | None  # None: --debug-train-only, which replays saved rollouts
    tokenizer: Any
    source: PromptSource
    runlog: RunLog
    progress: Progress
    state: RunState
    save_dir: Path
    reward_fn: Callable | None  # --custom-rm-path
    replay: list[list[Sample]] | None  # --debug-train-only's saved rollouts
    eval_sets: list[tuple[str, list[dict]]]
    context: RunContext  # run.json
    control: RolloutControl = field(default_factory=RolloutControl)  # the weight-update gate of the agent loops
    timeline: Timeline | None = None  # start-up and stop steps (run.json); None: not recorded


async def _loop(run: Run) -> None:
    """Each iteration: a batch -> stale samples dropped -> one training step and its weight
    update -> metrics, trajectories, evaluation and a checkpoint when due.

    Left to others: building the pieces (`train`, agentrl.build, `start_rollout`); where a
    batch comes from and what a stopped iteration saves (agentrl.batches); over-sampling,
    filters, group retries and generating ahead (agentrl.rollout.producer); the --colocate
    GPU handover, the weight update and a restarted engine's catch-up (agentrl.weight_update);
    scoring the eval sets (agentrl.evaluation)."""
    cfg, state, r = run.cfg, run.state, run.cfg.rollout
    run.control.partial_rollout = r.partial_rollout
    weights_lock = asyncio.Lock()  # held from a training step to the end of its weight sync
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(close_judges)  # the LLM judge's HTTP sessions on this loop (--rm-type llm-judge)
        batches, evaluate_now, pool = await start_rollout(run, stack, weights_lock)
        before_train = {}
        if evaluate_now is not None and state.rollout_id == 0 and not cfg.eval.skip_eval_before_train:
            run.progress.note("evaluating the starting model (--skip-eval-before-train skips it)")
            before_train = await evaluate_now(-1, prefix="eval_before_train")
        run.progress.start(total=r.num_rollout, completed=state.rollout_id)
        first_iteration = state.rollout_id
        for rollout_id in range(state.rollout_id, r.num_rollout):
            t_start, at_start = time.perf_counter(), time.time()
            run.progress.phase("rollout")
            samples = await batches.next_batch(rollout_id, state.policy_version)
            t_rollout = time.perf_counter() - t_start
            stages = rollout_stage_metrics(samples, at_start, time.time())  # the rollout phase, stage by stage

            fresh, stale = split_stale(samples, state.policy_version, r.max_staleness)
            masked = 0
            if r.mask_offpolicy_in_partial_rollout:
                masked = sum(s.mask_older_than(max(s.policy_versions, default=0)) for s in fresh)
            trained = await train_step(run, fresh, weights_lock) if run.trainer is not None else {"train_s": 0.0}

            metrics = (rollout_metrics(rollout_id, samples, t_rollout) | stages | before_train | trained
                       | {"iteration_s": time.perf_counter() - t_start, "policy_version": state.policy_version,
                          "stale_dropped": len(stale), "trained_samples": len(fresh) if run.trainer is not None else 0,
                          # prompt and response: every token the trainer's passes run through (an MFU's count)
                          "trained_tokens": sum(len(s.prompt_tokens) + len(s.response_tokens) for s in fresh)
                          if run.trainer is not None else 0,
                          "offpolicy_tokens_masked": masked} | batches.metrics() | run.source.metrics())
            before_train = {}
            last = rollout_id + 1 == r.num_rollout
            if evaluate_now is not None and is_due(cfg.eval.eval_interval, rollout_id, last):
                metrics |= await evaluate_now(rollout_id)
            if pool is not None:
                metrics |= {f"sandbox/{k}": v for k, v in pool.metrics().items() if isinstance(v, (int, float))}
            run.runlog.log(metrics)
            # the failed attempts too (retried or dropped groups), with their tracebacks, for `agentrl inspect`
            run.runlog.save_trajectories(rollout_id, samples + batches.take_failed())
            state.rollout_id = rollout_id + 1
            if run.trainer is not None and is_due(cfg.run.save_interval, rollout_id, last):
                state.data = run.source.state_dict()
                for key, value in batches.checkpoint().items():
                    setattr(state, key, value)
                with _step(run, "stop", "final_checkpoint") if last else contextlib.nullcontext():
                    run.trainer.save(run.save_dir / f"iter_{rollout_id + 1:06d}", state.to_dict())
            run.progress.iteration_done(metrics)
            if rollout_id == first_iteration and run.timeline is not None:
                await startup_done(run, at_start, metrics)
        closing = time.time()  # the rollout side closes: producer, clients, sandboxes, tool servers
    if run.timeline is not None:
        run.timeline.add("stop", "rollout_close", closing - run.timeline.started_at, run.timeline.now())


def _step(run: Run, part: str, name: str):
    return run.timeline.step(part, name) if run.timeline is not None else contextlib.nullcontext()


async def startup_done(run: Run, rollout_at: float, metrics: dict) -> None:
    """After the run's first iteration: its start-up steps completed from what only now is known
    (the trainer actors' own build, the first request, train step and weight sync), then printed."""
    t = run.timeline
    for key, name in (("train_s", "first_train_step_s"), ("weight_sync_s", "first_weight_sync_s")):
        if key in metrics:  # durations, inside the first iteration (not moments: no pair)
            t.context.record(**{name: round(metrics[key], 2)})
    if "stage/first_request_after_s" in metrics:
        t.mark("startup", "first_rollout_request", rollout_at + metrics["stage/first_request_after_s"])
    t.mark("startup", "first_iteration_done")
    if run.trainer is not None:
        for name, span in (await run.trainer.startup_steps()).items():
            t.add("startup", name, span[0] - t.started_at, span[1] - t.started_at)
    t.report("startup")


def eval_fn(run: Run, client: EngineClient, pool, handover, stack: contextlib.AsyncExitStack):
    """evaluate_now(rollout_id, prefix) -> the eval sets' figures, their trajectories saved;
    generated inside the handover (colocated, the engines hold the GPU only there)."""
    e = run.cfg.eval
    evaluator = build_group_runner(run.cfg, run.tokenizer, client, pool, run.reward_fn, run.control,
                                   on_done=lambda s: run.progress.advance_eval_samples(),
                                   n_samples=e.n_samples_per_eval_prompt, temperature=e.eval_temperature,
                                   max_response_len=e.eval_max_response_len, evaluation=True, top_p=e.eval_top_p,
                                   top_k=e.eval_top_k)
    if hasattr(evaluator.generate_fn, "aclose"):  # an agent env's gateway server
        stack.push_async_callback(evaluator.generate_fn.aclose)

    async def evaluate_now(rollout_id: int, prefix: str = "eval") -> dict:
        def save(name: str, samples: list[Sample]) -> None:
            run.runlog.save_eval_trajectories(name if rollout_id >= 0 else f"{name}_before_train",
                                              max(rollout_id, 0), samples)

        run.progress.phase("eval", f"{len(run.eval_sets)} eval sets")
        async with handover():
            return await evaluate(evaluator, run.eval_sets, prefix=prefix, save=save)

    return evaluate_now


def is_due(interval: int | None, rollout_id: int, last: bool) -> bool:
    """Every `interval` iterations and after the last one."""
    return last or bool(interval and (rollout_id + 1) % interval == 0)


async def train_step(run: Run, samples: list[Sample], weights_lock: asyncio.Lock) -> dict:
    """One training step, then its weights into the engines, under the weights lock (a restarted
    engine's catch-up waits for both). The trainer actor works while the event loop keeps
    driving rollouts (--async)."""
    async with weights_lock:
        checked = await check_probe(run.cfg, run.trainer, run.engines, run.state.policy_version)
        t0 = time.perf_counter()
        run.progress.phase("train", f"{len(samples)} samples")
        await score_with_teacher(run.cfg, samples)  # --opd-type sglang: the served teacher's logprobs
        out = await run.trainer.train_rollout(samples)
        t_train = time.perf_counter() - t0
        for line in out.pop("profile_summaries", []):  # --use-pytorch-profiler, from whichever node trained
            run.progress.note(line)
        run.state.policy_version += 1
        if run.engines is not None:
            run.progress.phase("sync", f"weights version {run.state.policy_version}")
            out |= await update_engines(run.cfg, run.control, run.engines, run.trainer, run.state.policy_version,
                                        probe_prompts=[s.prompt_tokens for s in samples[:2]],
                                        probe_images=[s.images for s in samples[:2]])
        out |= checked
    return out | {"train_s": t_train}


async def start_rollout(run: Run, stack: contextlib.AsyncExitStack, weights_lock: asyncio.Lock):
    """The rollout side of the loop, closed by `stack`: the sandbox pool, the engine clients, the
    batch source, the evaluator and the restarted engines' catch-up. Returns (batch source,
    evaluate_now(rollout_id, prefix) or None when no evaluation is due, sandbox pool or None)."""
    cfg, r, state = run.cfg, run.cfg.rollout, run.state
    pool = await start_sandbox_pool(cfg)
    if pool is not None:
        run.context.record(sandbox={"backend": pool.backend, "max_active": pool.max_active})
    # last out: what failed attempts left in reference cycles (a tool server's subprocess
    # transport held by its exception's traceback) is finalized while the loop still runs;
    # collected after asyncio.run closed it, it prints "RuntimeError: Event loop is closed"
    stack.push_async_callback(collect_garbage)
    if pool is not None:
        stack.push_async_callback(pool.close)
    if run.engines is None:
        return ReplayBatches(run.replay), None, pool

    client = await stack.enter_async_context(EngineClient(run.engines.url, request_timeout_s=r.request_timeout_s,
                                                         return_routed_experts=wants_routing_replay(cfg.megatron_args)))
    engine_clients = [EngineClient(u, request_timeout_s=r.request_timeout_s) for u in run.engines.engine_urls]
    for c in engine_clients:
        stack.push_async_callback(c.close)
    # colocated, the engines hold their memory only inside the handover
    handover = functools.partial(colocated, cfg, run.trainer, run.engines, engine_clients)
    runner = build_group_runner(cfg, run.tokenizer, client, pool, run.reward_fn, run.control,
                                on_done=lambda s: run.progress.advance_samples())
    if hasattr(runner.generate_fn, "aclose"):  # an agent env's gateway server
        stack.push_async_callback(runner.generate_fn.aclose)
    producer = RolloutProducer(
        source=run.source, run_group=runner.run_group,
        over_sampling=r.over_sampling_batch_size or r.rollout_batch_size,
        group_filter=build_group_filter(cfg), max_group_retries=r.max_group_retries,
        keep_generating=r.async_rollout, first_group_id=state.next_group_id, pending=state.pending_tasks,
        max_failed_groups=r.max_failed_groups, report=run.progress.note)
    stack.push_async_callback(producer.aclose)
    run.progress.detail = producer.status
    stack.enter_context(heartbeat(run.progress))
    hook = build_rollout_hook(cfg, run.tokenizer, client, run.source, runner, report=run.progress.note)
    parts = dict(batch_size=r.rollout_batch_size, client=client, handover=handover, runlog=run.runlog)
    batches: BatchSource = HookBatches(hook, producer, **parts) if hook else ProducerBatches(producer, **parts)

    evaluate_now = eval_fn(run, client, pool, handover, stack) if run.eval_sets and cfg.eval.eval_interval else None
    if run.trainer is not None:
        if state.rollout_id > 0:  # engines loaded the checkpoint: name its version
            await update_engines(cfg, run.control, run.engines, run.trainer, state.policy_version)
        # a restarted engine gets the current weights before it serves
        run.engines.catch_up = catch_up_fn(cfg, run.trainer, state, weights_lock)
        stack.callback(setattr, run.engines, "catch_up", None)
    return batches, evaluate_now, pool


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
