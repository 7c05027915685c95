"""The setup steps of a run, each building one piece from the config: the model and device,
the trainer, the env lookup and the prompt source, eval sets and saved rollouts, the sandbox
pool, the reward function, and the rollout's group runner, filter and slime hooks.
`agentrl train`, `agentrl eval`, `agentrl sft` and the trainer actor all build through here."""

from __future__ import annotations

import asyncio
import inspect
import json
import random
from pathlib import Path

import numpy as np
import torch

from agentrl.config import AlgoConfig, Config, lora_target_modules
from agentrl.data import PromptSource, read_rows, seed_tasks
from agentrl.errors import ConfigError
from agentrl.models import build_tiny_model, check_model_dir, tiny_model_dir
from agentrl.plugins import load_function
from agentrl.progress import Progress
from agentrl.registry import check_env_kwargs, get_spec, import_env_module, make
from agentrl.rollout.agent_loop import LoopSettings, Renderer
from agentrl.rollout.client import EngineClient
from agentrl.rollout.control import RolloutControl
from agentrl.rollout.manager import GroupRunner
from agentrl.rollout.producer import nonzero_std_filter
from agentrl.rollout.slime import DataSource, GenerateHook, RolloutHook, slime_args
from agentrl.slime_args import read_eval_config
from agentrl.types import Sample


def engine_sglang_args(cfg: Config) -> dict:
    """The --sglang-* arguments the launched SGLang servers get: the user's, plus what a trainer
    feature needs from the engine (routing replay: the experts each token was routed to)."""
    from agentrl.trainers.megatron.flags import wants_routing_replay

    needed = {}
    if cfg.rollout.rollout_engine == "sglang" and wants_routing_replay(cfg.megatron_args):
        needed["enable-return-routed-experts"] = None
    return {**needed, **cfg.sglang_args}


def lora_engine_args(cfg: Config) -> dict:
    """start_engines' LoRA arguments: with --lora-sync adapter the engines serve adapters."""
    if not (cfg.train.lora_rank and cfg.train.lora_sync == "adapter"):
        return {}
    return {"lora_max_rank": cfg.train.lora_rank, "lora_target_modules": lora_target_modules(cfg.train.target_modules)}


def build_trainer(cfg: Config, model_path: Path, device: str, *, sft: bool = False):
    """The configured trainer. `sft`: no RL algorithm and temperature 1 (the NLL of the model's
    own distribution; no reference model or critic), whatever the config's RL sections say."""
    algo = AlgoConfig() if sft else cfg.algo
    temperature = 1.0 if sft else cfg.rollout.rollout_temperature
    if cfg.train.trainer == "megatron":
        from agentrl.trainers.megatron import MegatronTrainer

        return MegatronTrainer(str(model_path), train=cfg.train, algo=algo, temperature=temperature, device=device,
                               dtype=cfg.model.dtype, megatron_args=cfg.megatron_args, seed=cfg.run.seed,
                               ref_load=None if sft else cfg.run.ref_load)
    from agentrl.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(str(model_path), train=cfg.train, algo=algo, temperature=temperature, device=device,
                        dtype=cfg.model.dtype, ref_load=None if sft else cfg.run.ref_load)


def build_renderer(cfg: Config, tokenizer) -> Renderer:
    """The conversation renderer; a vision-language model's processor makes the prompt ids of prompts
    with images (--multimodal-keys), and names the media tokens its replies must not hold (text-only
    prompts too)."""
    from agentrl.models import VISION_FAMILIES, is_vision_model
    from agentrl.vision import load_processor

    d, model = cfg.data, cfg.model.model
    vision = bool(model) and is_vision_model(model)
    if d.multimodal_keys and not vision:
        raise ConfigError(f"--multimodal-keys: --model {model or '(the tiny default)'} is not a vision-language "
                          f"model agentrl trains (a config.json with a vision_config, of the families "
                          f"{', '.join(VISION_FAMILIES)})")
    return Renderer(tokenizer, d.apply_chat_template, d.apply_chat_template_kwargs,
                    processor=load_processor(model) if vision else None)


def build_group_runner(cfg: Config, tokenizer, client: EngineClient, pool, reward_fn, control: RolloutControl,
                       on_done, *, n_samples: int | None = None, temperature: float | None = None,
                       max_response_len: int | None = None, evaluation: bool = False, top_p: float | None = None,
                       top_k: int | None = None) -> GroupRunner:
    """Trajectories of groups; the keyword overrides serve evaluation. With
    --custom-generate-function-path, slime's generate plays each trajectory."""
    r = cfg.rollout
    sampling = {"temperature": r.rollout_temperature if temperature is None else temperature,
                "top_p": r.rollout_top_p if top_p is None else top_p,
                "top_k": r.rollout_top_k if top_k is None else top_k} | ({"ignore_eos": True} if r.rollout_ignore_eos else {})
    if r.rollout_stop_token_ids:
        sampling["stop_token_ids"] = list(r.rollout_stop_token_ids)

    def settings_for(env) -> LoopSettings:
        params = {**sampling, "stop": list(env.stop)} if getattr(env, "stop", None) else sampling
        return LoopSettings(max_response_len=max_response_len or r.rollout_max_response_len,
                            max_turns=r.max_turns or env.max_turns,
                            sampling_params=params, apply_chat_template=cfg.data.apply_chat_template,
                            max_tokens_per_turn=r.rollout_max_tokens_per_turn,
                            max_context_len=r.rollout_max_context_len,
                            skip_special_tokens=r.rollout_skip_special_tokens)

    def make_env(name: str | None):
        name = name or cfg.run.env
        kwargs = dict(cfg.run.env_kwargs) if name == cfg.run.env else {}
        extra = tool_kwargs(cfg, get_spec(name).load(), pool)
        if "sandbox" in extra:  # the pool was made of the backend --env-kwargs named
            kwargs.pop("sandbox", None)
        return make(name, **kwargs, **extra), name

    renderer = build_renderer(cfg, tokenizer)
    generate_fn = None
    if r.custom_generate_function_path:
        generate_fn = GenerateHook(r.custom_generate_function_path, renderer=renderer, sampling_params=sampling,
                                   args=slime_args(cfg, engine_url=client.base_url, model_path=tokenizer.name_or_path),
                                   max_new_tokens=max_response_len or r.rollout_max_response_len,
                                   reward_fn=reward_fn, control=control, evaluation=evaluation)
    elif _is_agent_env(cfg.run.env):  # an agent program plays each trajectory through the OpenAI-compatible gateway
        from agentrl.gateway import AgentRunner

        generate_fn = AgentRunner(renderer=renderer, client=client, settings_for=settings_for, control=control,
                                  model_name=str(tokenizer.name_or_path), request_timeout_s=r.request_timeout_s)
    return GroupRunner(make_env=make_env, n_samples=n_samples or r.n_samples_per_prompt, renderer=renderer,
                       client=client, settings_for=settings_for, run_seed=cfg.run.seed,
                       max_concurrency=r.max_concurrency, reward_fn=reward_fn, control=control, on_done=on_done,
                       generate_fn=generate_fn, cancel_siblings_on_failure=not evaluation)


def _is_agent_env(name: str) -> bool:
    from agentrl.gateway import AgentEnv

    env_cls = get_spec(name).load()
    return isinstance(env_cls, type) and issubclass(env_cls, AgentEnv)


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


def check_data_files(cfg: Config) -> None:
    """--prompt-data and the eval sets' files exist: a cheap check among the start-up checks, so a
    mistyped path fails before Ray starts (their rows are read beside Ray's start, build_prompt_source
    and load_eval_sets; those name a missing file the same way)."""
    from agentrl.data import existing_data_file

    if cfg.data.prompt_data:
        existing_data_file(cfg.data.prompt_data, "--prompt-data")
    for spec, flag in eval_set_specs(cfg):
        existing_data_file(str(spec["path"]), flag)


def eval_set_specs(cfg: Config) -> list[tuple[dict, str]]:
    """(spec, the flag that named it) of each eval set: --eval-config's datasets, or the NAME PATH
    pairs of --eval-prompt-data as {"name", "path"}."""
    if cfg.eval.eval_config:
        return [(spec, f"--eval-config {cfg.eval.eval_config}: dataset {spec['name']!r}:")
                for spec in read_eval_config(cfg.eval.eval_config)]
    pairs = cfg.eval.eval_prompt_data
    return [({"name": name, "path": path}, f"--eval-prompt-data {name}") for name, path in zip(pairs[::2], pairs[1::2])]


def load_eval_sets(cfg: Config) -> list[tuple]:
    """--eval-prompt-data NAME PATH ... (or --eval-config's datasets): read (and so check) every
    eval set before any work. Each is (name, tasks) or, from --eval-config, (name, tasks,
    n_samples_per_eval_prompt or None); a set's rm_type goes into its rows' metadata (a row's own wins)."""
    d = cfg.data
    sets = []
    for spec, flag in eval_set_specs(cfg):
        tasks = read_rows(str(spec["path"]), input_key=spec.get("input_key", d.input_key),
                          label_key=spec.get("label_key", d.label_key),
                          metadata_key=spec.get("metadata_key", d.metadata_key),
                          label_needed_by=label_needed_by(cfg.run.env), multimodal_keys=d.multimodal_keys, flag=flag)
        for task in tasks:
            if task.get("env"):
                get_spec(task["env"])
            if spec.get("rm_type"):
                task["metadata"] = {"rm_type": spec["rm_type"], **(task.get("metadata") or {})}
        name = str(spec["name"])
        sets.append((name, tasks, spec.get("n_samples_per_eval_prompt")) if cfg.eval.eval_config else (name, tasks))
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


def drop_long_prompts(tasks: list[dict], cfg: Config) -> list[dict]:
    """--rollout-max-prompt-len (slime's, at load): the tasks whose prompt, rendered as slime's
    dataset renders it (the row's messages, the chat template with its kwargs, the generation
    prompt), has at most that many tokens; none left is an error."""
    from agentrl.env import as_messages
    from agentrl.models import load_tokenizer

    limit, d = cfg.rollout.rollout_max_prompt_len, cfg.data
    renderer = build_renderer(cfg, load_tokenizer(cfg.model.model or build_tiny_model()))
    kept = [t for t in tasks if len(renderer.prompt(as_messages(t["prompt"]), None)[1]) <= limit]
    if not kept:
        raise ConfigError(f"--rollout-max-prompt-len {limit}: every one of the {len(tasks)} prompts of {d.prompt_data} "
                          "is longer")
    return kept


def build_prompt_source(cfg: Config, env_cls) -> PromptSource:
    d = cfg.data
    if d.prompt_data:
        tasks = read_rows(d.prompt_data, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key,
                          label_needed_by=label_needed_by(cfg.run.env), multimodal_keys=d.multimodal_keys)
        for task in tasks:  # rows naming their env must name a known one, before any work starts
            if task.get("env"):
                get_spec(task["env"])
        if cfg.rollout.rollout_max_prompt_len is not None:
            tasks = drop_long_prompts(tasks, cfg)
        return PromptSource(tasks, shuffle=d.rollout_shuffle, seed=cfg.run.seed, difficulty_window=d.difficulty_window,
                            revisit_prob=d.difficulty_revisit_prob)
    if d.difficulty_window is not None:
        PromptSource(generator=seed_tasks, difficulty_window=d.difficulty_window)  # refused: names the flag
    dataset = getattr(env_cls, "dataset", None)
    if dataset is None or dataset(**cfg.run.env_kwargs) is None:  # episodes from each group's seed
        return PromptSource(generator=seed_tasks, seed=cfg.run.seed)
    return PromptSource(generator=lambda: dataset(seed=cfg.run.seed, **cfg.run.env_kwargs), seed=cfg.run.seed)


def turn_budget_warning(cfg: Config, env_cls) -> str | None:
    """Why --rollout-max-response-len (all turns, policy and env tokens) cannot fit the env's
    turns, or None: trajectories would end "truncated (no room for another turn)"."""
    r = cfg.rollout
    turns = r.max_turns or cfg.run.env_kwargs.get("max_turns") or getattr(env_cls, "max_turns", None)
    if turns is not None and int(turns) <= 1:
        return None
    which = f"all {int(turns)} turns" if turns else "all the turns (it sets no max_turns: until it terminates)"
    budget = (f"--rollout-max-response-len {r.rollout_max_response_len} is the budget of {which} of env "
              f"{cfg.run.env!r} together (policy and env tokens)")
    if r.rollout_max_tokens_per_turn is None:
        return (f"{budget}, and with no --rollout-max-tokens-per-turn the first turn may use all of it: later "
                f"turns end truncated (no room for another turn). Set --rollout-max-tokens-per-turn "
                f"{max(1, r.rollout_max_response_len // int(turns or 2))} or lower, or raise the budget.")
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
    from agentrl.grading import call_reward_fn

    rm = load_function(cfg.algo.custom_rm_path, flag="--custom-rm-path")

    async def reward_fn(sample):  # bounded: GradingTimeout (the agent's fault) past --custom-rm-timeout
        from agentrl.rollout.slime import numeric_reward

        out = await call_reward_fn(rm, cfg, sample, timeout=cfg.algo.custom_rm_timeout)
        return numeric_reward(out)  # slime's dict rewards carry text too

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
