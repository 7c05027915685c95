"""agentrl's own rollout against SGLang (or the embedded engine) behind sglang-router.

    python bench/sglang_rollout.py --engine sglang --model DIR --out FILE.json \
        [--num-engines 2] [--trajectories 256] [--turns 3] [--tokens-per-turn 128] [--sync tensor,disk] \
        [--sglang-attention-backend triton ...]

Two iterations of a multi-turn env, all trajectories in flight at once, through the same
code `agentrl train` uses (start_engines -> router -> generate_rollout -> agent loop ->
EngineClient), with one weight update from the trainer between them: the plain-PyTorch
trainer takes one optimizer step on the first iteration's samples and its weights go to
every engine (from tensors: CUDA IPC for SGLang, torch.save bytes for the embedded
engine; and/or through an HF checkpoint on disk). Reports per iteration: output tokens/s,
router affinity, prefix-cache hit rate; and the engines' start and weight-update times.

The env: a fixed ~200-character system-like prompt plus a task line, then every turn the
env answers with a short line and asks for more, for --turns turns. With a random-init
model nothing is learnt; throughput, affinity and caching are what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _layout() -> None:
    """Without `pip install -e .` the design-card folders are not agentrl.* subpackages yet."""
    try:
        import agentrl.trainers  # noqa: F401
    except ImportError:
        for name, folder in (("agentrl.trainers", "trainers"), ("agentrl.envs", "envs")):
            spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                          submodule_search_locations=[str(ROOT / folder)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)


_layout()

from agentrl.config import AlgoConfig, RolloutConfig, TrainConfig  # noqa: E402
from agentrl.engines.group import start_engines  # noqa: E402
from agentrl.env import Env  # noqa: E402
from agentrl.models import load_tokenizer  # noqa: E402
from agentrl.rollout.affinity import TurnLog, summarize  # noqa: E402
from agentrl.rollout.agent_loop import LoopSettings, Renderer  # noqa: E402
from agentrl.rollout.client import EngineClient  # noqa: E402
from agentrl.rollout.manager import generate_rollout  # noqa: E402
from agentrl.types import SampleStatus  # noqa: E402
from agentrl.weight_transfer import sync_weights_from_disk, sync_weights_from_tensor  # noqa: E402

SYSTEM = ("You are a careful assistant that works in several turns. Each turn, continue the list the user asks "
          "for, one item per line, and stop when the user says so. Keep the format exact and do not repeat.")


class TalkEnv(Env):
    def __init__(self, turns: int):
        self.max_turns, self.t = turns, 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": (options or {})["prompt"]}], {}

    def step(self, action):
        self.t += 1
        return [{"role": "user", "content": f"Good. That was part {self.t}. Now the next part, please."}], 0.0, \
            self.t >= self.max_turns, False, {}


async def one_iteration(url: str, tokenizer, *, iteration: int, prompts: int, n: int, turns: int,
                        tokens_per_turn: int, log: TurnLog, kill=None, kill_after_s: float = 1.0) -> tuple[dict, list]:
    settings = LoopSettings(max_response_len=turns * (tokens_per_turn + 64), max_turns=turns,
                            sampling_params={"temperature": 1.0, "top_p": 1.0}, max_tokens_per_turn=tokens_per_turn)
    tasks = [{"prompt": f"Task {iteration}-{i}: list the numbers from {i} upwards in words."} for i in range(prompts)]
    async with EngineClient(url, turn_log=log, max_connections=4096) as client:
        t0 = time.perf_counter()
        job = asyncio.create_task(generate_rollout(
            tasks, rollout_id=iteration, make_env=lambda name: (TalkEnv(turns), "talk"), n_samples=n,
            renderer=Renderer(tokenizer), client=client, settings_for=lambda env: settings, run_seed=0,
            max_concurrency=prompts * n))
        killed_at = None
        if kill is not None:  # an engine dies mid-rollout: SIGKILL to its whole process group
            await asyncio.sleep(kill_after_s)
            killed_in_flight = not job.done()
            await asyncio.to_thread(kill)
            killed_at = time.perf_counter() - t0
        samples = await job
        seconds = time.perf_counter() - t0
        retried = client.retried
    out_tokens = sum(s.num_trained_tokens for s in samples)
    figures = summarize(log.pop([s.trajectory_id for s in samples]).values())
    versions = sorted({v for s in samples for v in s.policy_versions if v >= 0})
    return {
        "iteration": iteration, "trajectories": len(samples),
        "completed": sum(s.status == SampleStatus.COMPLETED for s in samples),
        "failed": sum(s.status == SampleStatus.FAILED for s in samples),
        "errors": sorted({str(s.metadata.get("error"))[:200] for s in samples if s.metadata.get("error")})[:3],
        "turns": sum(s.num_turns for s in samples), "output_tokens": out_tokens, "rollout_s": round(seconds, 3),
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "prompt_tokens_mean": round(sum(len(s.prompt_tokens) for s in samples) / len(samples), 1),
        "client_retries": retried, "policy_versions": versions, **{k: round(v, 4) for k, v in figures.items()},
        "unique_trajectory_ids": len({s.trajectory_id for s in samples}),
        **({"engine_killed_at_s": round(killed_at, 2), "killed_while_in_flight": killed_in_flight}
           if killed_at is not None else {}),
    }, samples


class StandInTrainer:
    """Used only if the real trainer cannot be built: the HF model, nudged as a step would."""

    def __init__(self, model: str, device: str, dtype: str):
        from agentrl.models import load_model

        self.model = load_model(model, device=device, dtype=dtype)
        self.tokenizer = load_tokenizer(model)
        self.version = 0

    def train_rollout(self, samples):
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.0001)
        self.version += 1
        return {"loss": None}

    def named_tensors(self):
        for name, p in self.model.named_parameters():
            yield name, p.detach()


def build_trainer(model: str, micro_batch: int, device: str):
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    try:
        from agentrl.trainers.torch_trainer import TorchTrainer

        return TorchTrainer(model, train=TrainConfig(global_batch_size=10**6, micro_batch_size=micro_batch, lr=1e-6),
                            algo=AlgoConfig(), temperature=1.0, device=device, dtype=dtype)
    except Exception as exc:
        print(f"the torch trainer could not be built ({exc!r}); a stand-in nudges the weights", flush=True)
        return StandInTrainer(model, device, dtype)


async def weight_update(args, trainer, samples, group, log_dir: Path) -> dict:
    out: dict = {}
    t0 = time.perf_counter()
    try:
        metrics = trainer.train_rollout([s for s in samples if s.status != SampleStatus.FAILED])
        out["train_step_s"] = round(time.perf_counter() - t0, 2)
        out["train_loss"] = metrics.get("loss")
    except Exception as exc:  # memory on a shared GPU: still exercise the sync with perturbed weights
        out["train_step_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        import torch

        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.0001)
        trainer.version += 1
    version = getattr(trainer, "version", 1)
    clients = [EngineClient(u, request_timeout_s=600) for u in group.engine_urls]
    try:
        for method in args.sync.split(","):
            try:
                if method == "tensor":
                    r = await sync_weights_from_tensor(clients, trainer.named_tensors(), version=version,
                                                       bucket_bytes=512 << 20)
                else:
                    folder = Path(tempfile.mkdtemp(prefix="agentrl-ckpt-", dir=log_dir))
                    t1 = time.perf_counter()
                    trainer.model.save_pretrained(folder)
                    trainer.tokenizer.save_pretrained(folder)
                    saved = time.perf_counter() - t1
                    r = await sync_weights_from_disk(clients, str(folder), version=version)
                    r["save_s"] = saved
                out[f"sync_{method}"] = {k: round(v, 3) for k, v in r.items()}
            except Exception as exc:
                out[f"sync_{method}"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    finally:
        for c in clients:
            await c.close()
    out["version"] = version
    return out


def failover(group, trainer, tokenizer, args) -> dict:
    """After engine 0 was killed: the monitor restarts it; it rejoins the router only once it
    holds the weights the others serve, so push them (as the next weight update would)."""
    victim, out = group.engines[0], {}
    t_kill = time.time()
    events = lambda: [(round(t - t_kill, 1), what.split(";")[0]) for t, url, what in group.monitor.events  # noqa
                      if url == victim.url]
    t0 = time.perf_counter()
    while victim.state not in ("catching_up", "serving") and time.perf_counter() - t0 < 150:
        time.sleep(0.5)
    out["restart_healthy_s"] = round(time.perf_counter() - t0, 1)
    out["state_after_restart"] = victim.state
    if trainer is not None and victim.state == "catching_up":
        async def push():
            clients = [EngineClient(u, request_timeout_s=600) for u in group.engine_urls]
            try:
                return await sync_weights_from_tensor(clients, trainer.named_tensors(), version=trainer.version,
                                                      bucket_bytes=512 << 20)
            finally:
                for c in clients:
                    await c.close()
        out["weight_push"] = {k: round(v, 3) for k, v in asyncio.run(push()).items()}
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < 60 and (victim.state != "serving" or
                                              group.router.healthy_urls() != set(group.engine_urls)):
        time.sleep(0.5)
    out["rejoined"] = victim.state == "serving" and group.router.healthy_urls() == set(group.engine_urls)
    out["rejoin_after_push_s"] = round(time.perf_counter() - t1, 1)
    out["monitor_events"] = events()
    log = TurnLog()
    figures, _ = asyncio.run(one_iteration(group.url, tokenizer, iteration=99, prompts=args.prompts, n=args.n_samples,
                                           turns=args.turns, tokens_per_turn=args.tokens_per_turn, log=log))
    out["iteration_after_rejoin"] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sglang", "embedded"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-engines", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--sync", default="tensor,disk", help="weight-update paths to run, in order")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--kill-one", action="store_true",
                        help="SIGKILL engine 0 during the last iteration, then time its restart and rejoin (after a "
                             "weight push) and run one more iteration")
    parser.add_argument("--kill-after-s", type=float, default=1.0)
    args, rest = parser.parse_known_args()
    sglang_args: dict[str, str | None] = {}
    i = 0
    while i < len(rest):  # --sglang-NAME [VALUE]
        assert rest[i].startswith("--sglang-"), f"unknown argument {rest[i]}"
        name = rest[i][len("--sglang-"):]
        value = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else None
        sglang_args[name] = value
        i += 2 if value is not None else 1

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="agentrl-bench-"))
    result: dict = {"engine": args.engine, "num_engines": args.num_engines, "model": args.model,
                    "trajectories_per_iteration": args.prompts * args.n_samples, "turns": args.turns,
                    "tokens_per_turn": args.tokens_per_turn, "sglang_args": sglang_args, "iterations": []}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        pass
    cfg = RolloutConfig(rollout_engine=args.engine, num_engines=args.num_engines, rollout_num_gpus=1,
                        engine_startup_timeout_s=400, max_concurrency=args.prompts * args.n_samples)
    t0 = time.perf_counter()
    group = start_engines(cfg, model_path=args.model, device=args.device, seed=0, log_dir=log_dir,
                          sglang_args=sglang_args if args.engine == "sglang" else None,
                          dtype="bfloat16" if args.device.startswith("cuda") else "float32")
    result["engines_and_router_start_s"] = round(time.perf_counter() - t0, 1)
    result["router"] = group.router is not None
    print(json.dumps({"started": result}), flush=True)
    tokenizer = load_tokenizer(args.model)
    trainer = None
    try:
        for it in range(args.iterations):
            log = TurnLog()
            kill = group.engines[0].server.kill if args.kill_one and it == args.iterations - 1 else None
            figures, samples = asyncio.run(one_iteration(group.url, tokenizer, iteration=it, prompts=args.prompts,
                                                         n=args.n_samples, turns=args.turns,
                                                         tokens_per_turn=args.tokens_per_turn, log=log, kill=kill,
                                                         kill_after_s=args.kill_after_s))
            result["iterations"].append(figures)
            print(json.dumps(figures), flush=True)
            if kill is not None:
                Path(args.out).write_text(json.dumps(result, indent=1))
                result["failover"] = failover(group, trainer, tokenizer, args)
                print(json.dumps(result["failover"]), flush=True)
            if it + 1 < args.iterations:
                if trainer is None:
                    t1 = time.perf_counter()
                    trainer = build_trainer(args.model, args.micro_batch, args.device)
                    result["trainer_load_s"] = round(time.perf_counter() - t1, 1)
                update = asyncio.run(weight_update(args, trainer, samples, group, log_dir))
                if args.device.startswith("cuda"):
                    import torch

                    torch.cuda.empty_cache()  # the engines share this GPU
                result.setdefault("weight_updates", []).append(update)
                print(json.dumps(update), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        group.stop()
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
