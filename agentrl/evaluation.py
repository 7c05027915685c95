"""Evaluation: the eval sets' groups through the same group runner as training (reward means,
response lengths, pass@k), during a run or as `agentrl eval` on a model or checkpoint."""

from __future__ import annotations

import asyncio
import copy
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from agentrl.build import (build_env_lookup, build_group_runner, build_prompt_source, build_reward_fn,
                           latest_checkpoint, load_eval_sets, resolve_device, resolve_model, start_sandbox_pool)
from agentrl.config import Config
from agentrl.engines.group import start_engines
from agentrl.judge import close_judges
from agentrl.metrics import eval_trajectories_path, write_trajectories
from agentrl.models import load_tokenizer
from agentrl.progress import Progress
from agentrl.rollout.client import EngineClient
from agentrl.rollout.control import RolloutControl
from agentrl.rollout.manager import GroupRunner
from agentrl.teacher import start_served_models
from agentrl.types import SampleStatus


def evaluate_checkpoint(cfg: Config, *, limit: int | None = None) -> dict[str, float]:
    """`agentrl eval`: the model of --model (or --load) on the eval sets, with the same engines
    as training (and the judge's engine group of --judge-load, as train starts it) and no
    trainer; prints a summary table and writes eval.json in the run folder.
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
    served = start_served_models(cfg, device=device, log_dir=out / "logs", teacher=False)  # --judge-load
    try:
        engines = start_engines(cfg.rollout, model_path=str(model_path), device=device, seed=cfg.run.seed,
                                log_dir=out / "logs", sglang_args=cfg.sglang_args, router_args=cfg.router_args,
                                dtype=cfg.model.dtype)
    except BaseException:
        served.stop()
        raise

    async def run() -> dict[str, float]:
        pool = await start_sandbox_pool(cfg)
        try:
            async with EngineClient(engines.url, request_timeout_s=cfg.rollout.request_timeout_s) as client:
                e = cfg.eval
                runner = build_group_runner(cfg, tokenizer, client, pool, build_reward_fn(cfg), RolloutControl(),
                                            on_done=None, n_samples=e.n_samples_per_eval_prompt,
                                            temperature=e.eval_temperature, max_response_len=e.eval_max_response_len,
                                            evaluation=True, top_p=e.eval_top_p, top_k=e.eval_top_k)
                try:
                    return await evaluate(runner, eval_sets, save=lambda name, s: write_trajectories(
                        eval_trajectories_path(out, name, 0), s, tokenizer))
                finally:
                    if hasattr(runner.generate_fn, "aclose"):  # an agent env's gateway server
                        await runner.generate_fn.aclose()
        finally:
            await close_judges()  # the LLM judge's HTTP sessions on this loop (--rm-type llm-judge)
            if pool is not None:
                await pool.close()

    try:
        results = asyncio.run(run())
    finally:
        engines.stop()
        served.stop()
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
    for name, tasks, *per_set in eval_sets:
        set_runner = runner
        if per_set and per_set[0] and per_set[0] != runner.n_samples:  # --eval-config's n_samples_per_eval_prompt
            set_runner = copy.copy(runner)
            set_runner.n_samples = int(per_set[0])
        groups = await asyncio.gather(*[set_runner.run_group(t, EVAL_GROUP_BASE + i) for i, t in enumerate(tasks)])
        if save is not None:
            save(name, [s for g in groups for s in g])
        done = [s for g in groups for s in g if s.status != SampleStatus.FAILED]
        out[f"{prefix}/{name}/reward_mean"] = float(np.mean([s.reward_value for s in done])) if done else 0.0
        out[f"{prefix}/{name}/response_len_mean"] = float(np.mean([s.response_length for s in done])) if done else 0.0
        out[f"{prefix}/{name}/failed"] = sum(len(g) for g in groups) - len(done)
        k = set_runner.n_samples
        if k > 1:
            out[f"{prefix}/{name}/pass@{k}"] = float(np.mean([any(s.reward_value >= 1.0 for s in g) for g in groups]))
    return out
