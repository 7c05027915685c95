"""slime's rollout hooks, run as they are: `--custom-generate-function-path` and
`--rollout-function-path`.

slime (THUDM/slime, slime/rollout/sglang_rollout.py) lets a user replace generation at
two levels:

    async def generate(args, sample, sampling_params) -> Sample | list[Sample]   # one member of a group
    def generate_rollout(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]  # a batch

Both get slime's objects: `args`, the run's settings as flat attributes under slime's
names plus every field slime's rollout code reads (router address, engine counts,
concurrency, sampling defaults); slime's own `Sample` class when slime is importable (and
its HTTP client initialised), else a stand-in with the same fields; and the sampling
params slime's GenerateState builds. What the functions return is checked and turned into
agentrl's `Sample`; a wrongly shaped return stops the run with an error naming the function.

Rewards as in slime: a sample that comes back with `reward` set keeps it; otherwise
--custom-rm-path scores it, called slime's way (`rm(args, sample)` with the hook's Sample),
else the env does: reset with the group's seed and the task, then one step with the response.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import logging
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable
from urllib.parse import urlsplit

from agentrl.env import Action, Env, as_messages
from agentrl.errors import AgentFault, AgentRLError, ConfigError, SampleInvariantError
from agentrl.plugins import load_function
from agentrl.rollout.agent_loop import TRUNCATED_RESPONSE_LEN, Renderer
from agentrl.rollout.control import RolloutControl
from agentrl.rollout.manager import group_seed
from agentrl.rollout.producer import RolloutFailedError, describe_failure, failure_kind
from agentrl.types import Sample as AgentSample, SampleStatus, TurnTiming

GENERATE_FLAG = "--custom-generate-function-path"
ROLLOUT_FLAG = "--rollout-function-path"


@dataclass
class Sample:
    """agentrl's stand-in for slime's Sample (slime/utils/types.py at 624b824), used when slime
    is not importable: the same fields, `Status`, and `append_response_tokens` semantics."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict] = ""  # the prompt as text (chat template applied), as slime's Dataset gives it
    tokens: list[int] = field(default_factory=list)  # [prompt + response]; the prompt's ids to start with
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int] | None = None  # [response_length]; 1 = trained on
    weight_versions: list[str] = field(default_factory=list)  # one per engine reply
    rollout_log_probs: list[float] | None = None  # [response_length]
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list | None = None
    remove_sample: bool = False  # True: kept for the group's baseline, not trained on
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None  # the routing key: agentrl's trajectory id
    non_generation_time: float = 0.0

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable: bool = True,
                               meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Extend the response keeping tokens, loss_mask and rollout_log_probs aligned, as
        slime does: trainable tokens need their logprobs; others get mask 0, logprob 0 and
        must not pass logprobs; with `update_terminal_info`, meta_info's finish reason sets
        the status and its weight version is recorded."""
        tokens = [int(t) for t in tokens or []]
        log_probs = None if log_probs is None else [float(x) for x in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise SampleInvariantError(f"append_response_tokens: {len(tokens)} tokens but {len(log_probs)} log_probs")
        if tokens and trainable and log_probs is None:
            raise SampleInvariantError("append_response_tokens: trainable tokens need their rollout log_probs")
        if tokens and not trainable:
            if log_probs is not None:
                raise SampleInvariantError("append_response_tokens: non-trainable tokens take no log_probs")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens = self.tokens + tokens
            self.response_length += len(tokens)
            self.loss_mask = (self.loss_mask if self.loss_mask is not None else [1] * before) + \
                [int(trainable)] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise SampleInvariantError("append_response_tokens: the sample has response tokens but no "
                                               "rollout_log_probs to extend")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = self.rollout_log_probs + log_probs
        if meta_info and update_terminal_info and "finish_reason" in meta_info:
            if "weight_version" in meta_info:
                self.weight_versions.append(meta_info["weight_version"])
            kind = meta_info["finish_reason"]["type"]
            self.status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED,
                           "stop": Sample.Status.COMPLETED}.get(kind, self.status)
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise SampleInvariantError(f"loss_mask length {len(self.loss_mask)} != response_length "
                                       f"{self.response_length}")

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, args) -> float:
        return self.reward if not args.reward_key else self.reward[args.reward_key]


def slime_sample_class() -> type:
    """slime's own Sample when slime is importable (hooks get the class they check against),
    else agentrl's stand-in."""
    try:
        from slime.utils.types import Sample as SlimeSample
    except ImportError:
        return Sample
    return SlimeSample


def slime_sampling_params(args, sampling_params: dict, max_new_tokens: int) -> dict:
    """The sampling params slime's GenerateState builds (slime/rollout/sglang_rollout.py):
    the stop tag stays in the text (no_stop_trim) and special tokens are kept."""
    return {**sampling_params, "max_new_tokens": max_new_tokens, "stop": args.rollout_stop,
            "stop_token_ids": args.rollout_stop_token_ids, "skip_special_tokens": args.rollout_skip_special_tokens,
            "no_stop_trim": True, "spaces_between_special_tokens": False}


def init_slime_http(args) -> bool:
    """slime's HTTP client (slime.utils.http_utils.init_http_client), which its `post`/`get`
    use; returns whether slime is importable."""
    try:
        from slime.utils.http_utils import init_http_client
    except ImportError:
        return False
    init_http_client(args)
    return True


class SlimeArgs(SimpleNamespace):
    """slime's `args`: the run's settings as flat attributes under slime's names. A slime
    argument agentrl has no counterpart for raises AttributeError saying so
    (`getattr(args, name, default)` works as usual)."""

    def __getattr__(self, name: str):  # only reached when the attribute is missing
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"args.{name}: slime's argument {name!r} has no agentrl counterpart "
                             "(docs/slime.md maps them)")


def slime_args(cfg, *, engine_url: str, model_path: str) -> SlimeArgs:
    """Every config field under its own name (agentrl keeps slime's), the --sglang-*/--router-*
    pass-through flags as `sglang_X`/`router_X`, and slime's names for the rest."""
    from agentrl.config import SECTIONS

    values: dict[str, Any] = {}
    for section in SECTIONS:
        values.update(getattr(cfg, section).model_dump())
    for prefix, extra in (("sglang_", cfg.sglang_args), ("router_", cfg.router_args)):
        for k, v in extra.items():
            values[prefix + k.replace("-", "_")] = v
    url = urlsplit(engine_url)
    r = cfg.rollout
    gpus = r.rollout_num_gpus or r.rollout_num_gpus_per_engine
    engines = max(1, gpus // r.rollout_num_gpus_per_engine)
    values.update(
        hf_checkpoint=str(model_path), rollout_seed=cfg.run.seed,
        sglang_router_ip=url.hostname, sglang_router_port=url.port,
        # slime's semaphore is this x the engines: --max-concurrency is the run's total
        sglang_server_concurrency=max(1, r.max_concurrency // engines),
        over_sampling_batch_size=r.over_sampling_batch_size or r.rollout_batch_size,
        rollout_stop=env_stop(cfg.run.env), rollout_stop_token_ids=r.rollout_stop_token_ids or None, rollout_skip_special_tokens=r.rollout_skip_special_tokens,
        rollout_global_dataset=True, group_rm=False, eval_reward_key=None,
        use_rollout_routing_replay=False, sglang_dp_size=values.get("sglang_dp_size"), ci_test=False,
        # one engine group behind the router: slime's request limit is concurrency x engines
        rollout_num_gpus=gpus, use_distributed_post=False,
        num_gpus_per_node=r.rollout_num_gpus_per_engine, dynamic_sampling_filter_path=None,
        rollout_sample_filter_path=None, rollout_all_samples_process_path=None, rollout_sample_hook_path=None,
        rm_type=values.get("rm_type"), rm_url=values.get("rm_url"), multimodal_keys=None,
        apply_chat_template_kwargs=values.get("apply_chat_template_kwargs") or {},
        sglang_enable_deterministic_inference="sglang_enable_deterministic_inference" in values,
        router_policy=values.get("router_policy"),
        **megatron_sizes(cfg.megatron_args),
        # slime's model name -> its router (get_model_url): the one model agentrl serves, at engine_url
        sglang_model_routers={r.engine_model_name: (url.hostname, url.port)}, eval_datasets=[],
    )
    if cfg.algo.custom_config_path:  # slime sets every key on args; the keys agentrl took are in values already
        from agentrl.slime_args import read_custom_config

        values = {**read_custom_config(cfg.algo.custom_config_path), **values}
    args = SlimeArgs(**values)
    init_slime_http(args)
    return args


def megatron_sizes(megatron_args: dict) -> dict[str, int]:
    """Megatron's parallel sizes as slime's args carry them (ints, default 1): slime's examples
    size budgets by them (retool: context_parallel_size * max_tokens_per_gpu)."""
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "expert_model_parallel_size")
    return {n: int(megatron_args.get(n) or 1) for n in names}


def env_stop(name: str) -> list[str] | None:
    """The run's env's stop strings (its `stop`), which agentrl's loop stops generation on: slime's --rollout-stop."""
    from agentrl.registry import get_spec

    return list(getattr(get_spec(name).load(), "stop", None) or []) or None


def _check_signature(fn: Callable, spec: str, flag: str, names: tuple[str, ...]) -> bool:
    """The function must take slime's positional arguments; returns whether it takes `evaluation`."""
    try:
        sig = inspect.signature(fn)
        sig.bind(*names)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {spec}: {getattr(fn, '__name__', fn)}{_sig(fn)} does not take slime's arguments "
                          f"({', '.join(names)})") from None
    params = sig.parameters
    return "evaluation" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _sig(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def _prompt_sample(task: dict, renderer: Renderer, *, group_index: int, index: int) -> Sample:
    """A slime Sample of one data row, as slime's Dataset makes it: the prompt rendered by
    the chat template (or concatenated), its token ids, label and metadata."""
    if task.get("prompt") is None:
        raise ConfigError("slime's hooks need each task's prompt: give --prompt-data, or an env with a dataset "
                          f"(got the task {task!r})")
    text = renderer.render(as_messages(task["prompt"]), None)
    sample = slime_sample_class()(group_index=group_index, index=index, prompt=text, tokens=renderer.encode(text),
                                  label=task.get("label"), metadata=dict(task.get("metadata") or {}))
    sample.task = task  # agentrl's data row (prompt, label, metadata, env): scoring and the env need it
    return sample


_STATUS = {"PENDING": SampleStatus.COMPLETED, "COMPLETED": SampleStatus.COMPLETED,
           "TRUNCATED": SampleStatus.TRUNCATED, "ABORTED": SampleStatus.ABORTED, "FAILED": SampleStatus.FAILED}


def to_agentrl(s: Any, *, where: str, trajectory_id: str, group_id: int, env_name: str, version: int,
               renderer: Renderer) -> AgentSample:
    """slime Sample -> agentrl Sample, checking the arrays; ConfigError (naming `where`) if it
    is not shaped like one. Tokens are the policy's (appended with their logprobs) where
    loss_mask is 1, context elsewhere; each carries the last weight version the engine
    reported to the function, else `version`."""
    if not all(hasattr(s, a) for a in ("tokens", "response_length", "loss_mask", "rollout_log_probs", "status")):
        raise ConfigError(f"{where} returned {type(s).__name__}, not a slime Sample (tokens, response_length, "
                          "loss_mask, rollout_log_probs, status, reward)")
    tokens, n = [int(t) for t in s.tokens], int(s.response_length)
    if not 0 <= n < len(tokens):
        raise ConfigError(f"{where}: sample {trajectory_id} has {len(tokens)} tokens and response_length {n}; "
                          "tokens must be the prompt's ids followed by the response's")
    mask = [int(m) for m in s.loss_mask] if s.loss_mask is not None else [1] * n
    if len(mask) != n or any(m not in (0, 1) for m in mask):
        raise ConfigError(f"{where}: sample {trajectory_id}: loss_mask has {len(mask)} entries (0/1), "
                          f"response_length is {n}")
    if s.rollout_log_probs is None and any(mask):
        raise ConfigError(f"{where}: sample {trajectory_id} has no rollout_log_probs for its trained tokens: "
                          "send return_logprob=True and keep meta_info['output_token_logprobs']")
    logprobs = [0.0] * n if s.rollout_log_probs is None else [float(x) for x in s.rollout_log_probs]
    if len(logprobs) != n:
        raise ConfigError(f"{where}: sample {trajectory_id}: rollout_log_probs has {len(logprobs)} entries, "
                          f"response_length is {n}")
    status = _STATUS.get(str(getattr(s.status, "name", s.status)).upper())
    if status is None:
        raise ConfigError(f"{where}: sample {trajectory_id} has status {s.status!r}")
    versions = [int(v) for v in (getattr(s, "weight_versions", None) or []) if str(v).lstrip("-").isdigit()]
    version = versions[-1] if versions else version
    metadata = {**(getattr(s, "metadata", None) or {}), "label": getattr(s, "label", None)}
    if getattr(s, "remove_sample", False):
        mask, metadata["remove_sample"] = [0] * n, True
    if status == SampleStatus.TRUNCATED:  # slime's TRUNCATED: the engine stopped at max_new_tokens
        metadata.setdefault("truncation", TRUNCATED_RESPONSE_LEN)
    task = getattr(s, "task", None) or {}
    prompt, response = tokens[:len(tokens) - n], tokens[len(tokens) - n:]
    text = getattr(s, "response", "") or renderer.decode(response)
    out = AgentSample(prompt_tokens=prompt, trajectory_id=trajectory_id, group_id=group_id, env_name=env_name,
                      status=status, num_turns=1, metadata=metadata,
                      messages=(as_messages(task["prompt"]) if task.get("prompt") else [])
                      + [{"role": "assistant", "content": text}])
    start = 0
    for end in range(1, n + 1):  # runs of equal mask: the policy's tokens, or context
        if end == n or mask[end] != mask[start]:
            if mask[start]:
                out.append_generated(response[start:end], logprobs[start:end], version)
            else:
                out.append_observation(response[start:end])
            start = end
    reward = getattr(s, "reward", None)
    if reward is not None:
        out.reward = numeric_reward(reward)
    out.validate()
    return out


async def score(sample: AgentSample, task: dict, *, env: Env, seed: int, reward_fn, renderer: Renderer) -> None:
    """A sample without a reward: --custom-rm-path, else the env (reset with the group's seed,
    one step with the response). A failure fails the sample (masked), as in the agent loop."""
    try:
        if reward_fn is not None:
            try:
                sample.reward = await reward_fn(sample)
            except AgentFault as exc:  # past --custom-rm-timeout on this output: scored 0, not failed
                sample.reward = 0.0
                sample.metadata["agent_fault"] = f"{type(exc).__name__}: {exc}"
            return
        await env.areset(seed=seed, options=task or None)  # {}: a seed-only task
        ids = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if m]
        if ids and ids[-1] == renderer.tokenizer.eos_token_id:
            ids = ids[:-1]
        text = sample.response or renderer.decode(ids)
        _, reward, *_ = await env.astep(Action.build(text, ids, renderer.decode))
        sample.reward = numeric_reward(reward)
    except Exception as exc:
        sample.status, sample.reward = SampleStatus.FAILED, 0.0
        sample.metadata["error"] = f"scoring the sample: {type(exc).__name__}: {exc}"
        sample.metadata["traceback"] = traceback.format_exc()


class GenerateHook:
    """--custom-generate-function-path: slime's generate, called for each member of a group
    in place of the agent loop (GroupRunner's `generate_fn`)."""

    def __init__(self, spec: str, *, args: SlimeArgs, renderer: Renderer, sampling_params: dict,
                 max_new_tokens: int, reward_fn, control: RolloutControl | None, evaluation: bool = False):
        self.spec, self.fn = spec, load_function(spec, flag=GENERATE_FLAG)
        self.takes_evaluation = _check_signature(self.fn, spec, GENERATE_FLAG, ("args", "sample", "sampling_params"))
        self.args, self.renderer, self.reward_fn, self.control = args, renderer, reward_fn, control
        self.sampling_params = slime_sampling_params(args, sampling_params, max_new_tokens)
        self.slime_rm = load_slime_rm(args)
        self.evaluation = evaluation

    async def __call__(self, env: Env, task: dict, *, trajectory_id: str, group_id: int, index: int, seed: int,
                       env_name: str) -> list[AgentSample]:
        where = f"{GENERATE_FLAG} {self.spec}"
        try:
            row = task
            if task.get("prompt") is None:  # a seed-only task: the env makes the prompt, as in the agent loop
                obs, _ = await env.areset(seed=seed, options=task or None)
                row = {**task, "prompt": obs}
            sample = _prompt_sample(row, self.renderer, group_index=group_id, index=index)
            sample.session_id = trajectory_id
            prompt_ids = list(sample.tokens)
            if self.control is not None:
                await self.control.wait()  # no trajectory starts while the weights change
            version = self.control.policy_version if self.control is not None else 0
            kwargs = {"evaluation": self.evaluation} if self.takes_evaluation else {}
            t0, started_at = time.perf_counter(), time.time()
            try:
                out = self.fn(self.args, sample, dict(self.sampling_params), **kwargs)
                out = await out if inspect.isawaitable(out) else out
            except SampleInvariantError as exc:  # it misused Sample's methods: a bug, stop the run
                raise ConfigError(f"{where}: {exc}") from exc
            except Exception as exc:  # the function failed (engine, tools): this trajectory fails, visibly
                failed = AgentSample(prompt_tokens=prompt_ids, trajectory_id=trajectory_id,
                                     group_id=group_id, env_name=env_name, status=SampleStatus.FAILED,
                                     metadata={"error": f"{where}: {type(exc).__name__}: {exc}",
                                               "traceback": traceback.format_exc()})
                return [failed]
            elapsed = time.perf_counter() - t0
            outs = out if isinstance(out, list) else [out]
            if not outs:
                raise ConfigError(f"{where} returned an empty list; expected a Sample or a list of Samples")
            results = []
            for s in outs:
                await slime_reward(self.slime_rm, self.args, s)
            for j, s in enumerate(outs):
                tid = trajectory_id if len(outs) == 1 else f"{trajectory_id}-{j}"
                converted = to_agentrl(s, where=where, trajectory_id=tid, group_id=group_id, env_name=env_name,
                                       version=version, renderer=self.renderer)
                converted.turn_timings = [TurnTiming(generate_s=elapsed)]
                # its requests' span, as the agent loop records it (rollout tok/s: agentrl.batches)
                converted.metadata.setdefault("stages", {}).update(first_request_at=started_at,
                                                                   last_reply_at=started_at + elapsed)
                if getattr(s, "reward", None) is None and converted.status != SampleStatus.FAILED:
                    await score(converted, task, env=env, seed=seed, reward_fn=self.reward_fn,
                                renderer=self.renderer)
                results.append(converted)
            return results
        finally:
            try:
                await env.aclose()
            except Exception:
                pass


class DataSource:
    """slime's `data_source` for --rollout-function-path: `get_samples(n)` gives the next n
    prompts as n groups of n_samples_per_prompt Samples; `add_samples(groups)` puts groups
    back (they come out first next time)."""

    def __init__(self, source, renderer: Renderer, n_samples_per_prompt: int):
        self.source, self.renderer, self.n = source, renderer, n_samples_per_prompt
        self.buffer: list[list[Sample]] = []
        self.next_group = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups, self.buffer = self.buffer[:num_samples], self.buffer[num_samples:]
        for task in self.source.next_batch(num_samples - len(groups)):
            g, self.next_group = self.next_group, self.next_group + 1
            groups.append([_prompt_sample(task, self.renderer, group_index=g, index=g * self.n + k)
                           for k in range(self.n)])
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        self.buffer += samples


class RolloutHook:
    """--rollout-function-path: slime's generate_rollout fills each training batch in place
    of agentrl's producer. A plain function runs in a worker thread (slime's run their own
    event loop), an `async def` on the loop.

    Failures are bounded as the producer bounds them (the function does its own retries):
    the function raising stops the run naming it, with its traceback; groups with a failed
    member, `max_failed_groups` in a row across batches, stop it with the first failure's
    traceback; the first failure of each kind is reported as it comes."""

    GROUP_BASE = 10**6  # group ids of iteration i: i * GROUP_BASE + position

    def __init__(self, spec: str, *, args: SlimeArgs, data_source: DataSource, renderer: Renderer,
                 make_env: Callable[[str | None], tuple[Env, str]], reward_fn, run_seed: int,
                 max_failed_groups: int | None = 8, report: Callable[[str], None] | None = None):
        self.spec, self.fn = spec, load_function(spec, flag=ROLLOUT_FLAG)
        self.takes_evaluation = _check_signature(self.fn, spec, ROLLOUT_FLAG, ("args", "rollout_id", "data_source"))
        self.args, self.data_source, self.renderer = args, data_source, renderer
        self.make_env, self.reward_fn, self.run_seed = make_env, reward_fn, run_seed
        self.slime_rm = load_slime_rm(args)
        self.metrics: dict[str, float] = {}  # the last batch's metrics from the function, as rollout_fn/<key>
        self.max_failed_groups = max_failed_groups
        self.report = report or logging.getLogger("agentrl.rollout").warning
        self.failures: dict[str, int] = {}  # failed samples by kind
        self.failed_in_row, self.first_failure = 0, None
        self.last_batch: list[AgentSample] = []  # a stopped run writes it
        self.ahead: tuple[int, asyncio.Future] | None = None  # --async: the next batch's call, started early

    async def next_batch(self, rollout_id: int, version: int) -> list[AgentSample]:
        """The function's groups as agentrl Samples, scored (the unscored ones). With --async
        (slime's train_async.py) the call for the next batch starts as soon as this one is
        returned, so it generates while this one trains: one step off policy, as in slime; the
        weight update in between waits for the requests in flight (update_engines drains)."""
        if self.ahead is not None and self.ahead[0] == rollout_id:
            task, self.ahead = self.ahead[1], None
        else:
            task = asyncio.ensure_future(self._generate(rollout_id, version))
        self.last_batch = []
        samples, self.metrics = await task
        self.last_batch = samples
        if getattr(self.args, "async_rollout", False) and rollout_id + 1 < self.args.num_rollout:
            self.ahead = (rollout_id + 1, asyncio.ensure_future(self._generate(rollout_id + 1, version)))
        return samples

    async def _generate(self, rollout_id: int, version: int) -> tuple[list[AgentSample], dict]:
        where = f"{ROLLOUT_FLAG} {self.spec}"
        kwargs = {"evaluation": False} if self.takes_evaluation else {}
        call = functools.partial(self.fn, self.args, rollout_id, self.data_source, **kwargs)
        started_at = time.time()
        try:
            out = await call() if inspect.iscoroutinefunction(self.fn) else await asyncio.to_thread(call)
            if inspect.isawaitable(out):
                out = await out
            # the call's span stands for its requests' where a sample has none (rollout tok/s: agentrl.batches)
            span = {"first_request_at": started_at, "last_reply_at": time.time()}
        except (AgentRLError, SampleInvariantError):
            raise
        except Exception as exc:  # no retry of a whole batch: slime stops here too
            raise RolloutFailedError(f"{where} raised {type(exc).__name__}: {exc}\n"
                                     f"{traceback.format_exc().rstrip()}") from exc
        metrics = {}
        if hasattr(out, "samples"):  # slime's RolloutFnTrainOutput(samples, metrics)
            metrics = {f"rollout_fn/{k}": v for k, v in (getattr(out, "metrics", None) or {}).items()
                       if isinstance(v, (int, float))}
            out = out.samples
        if not isinstance(out, list) or not out:
            raise ConfigError(f"{where} returned {type(out).__name__}; expected slime's list[list[Sample]] "
                              "(groups of samples), non-empty")
        groups = out if all(isinstance(g, list) for g in out) else _chunk(out, self.args.n_samples_per_prompt, where)
        await asyncio.gather(*(slime_reward(self.slime_rm, self.args, s) for group in groups for s in group
                               if not isinstance(s, list)))
        samples, unscored = [], []
        for g, group in enumerate(groups):
            group_id = rollout_id * self.GROUP_BASE + g
            for k, s in enumerate(group):
                if isinstance(s, list):
                    raise ConfigError(f"{where}: group {g} holds a list, not a Sample; expected list[list[Sample]]")
                task = getattr(s, "task", None) or {"prompt": getattr(s, "prompt", ""),  # a Sample it made itself
                                                    "label": getattr(s, "label", None),
                                                    "metadata": getattr(s, "metadata", None) or {}}
                converted = to_agentrl(s, where=where, trajectory_id=f"g{group_id}-s{k}", group_id=group_id,
                                       env_name=task.get("env") or self.args.env, version=version,
                                       renderer=self.renderer)
                stages = converted.metadata.setdefault("stages", {})
                if "first_request_at" not in stages:
                    stages.update(span)
                samples.append(converted)
                if getattr(s, "reward", None) is None and converted.status != SampleStatus.FAILED:
                    unscored.append(self._score(converted, task))
        await asyncio.gather(*unscored)
        self.last_batch = samples
        self._bound(samples, where)
        return samples, metrics

    def _bound(self, samples: list[AgentSample], where: str) -> None:
        by_group: dict[int, list[AgentSample]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        for group in by_group.values():
            failed = [s for s in group if s.status == SampleStatus.FAILED]
            self.failed_in_row = self.failed_in_row + 1 if failed else 0
            for s in failed:
                kind = failure_kind(s)
                if kind not in self.failures:
                    self.first_failure = self.first_failure or describe_failure(s)
                    self.report(f"first failure of its kind: {describe_failure(s)}")
                self.failures[kind] = self.failures.get(kind, 0) + 1
        if self.max_failed_groups is not None and self.failed_in_row >= self.max_failed_groups:
            summary = ", ".join(f"{n} x {k}" for k, n in sorted(self.failures.items(), key=lambda kv: -kv[1])[:3])
            raise RolloutFailedError(f"{self.failed_in_row} groups in a row from {where} had failed samples "
                                     f"({summary}); stopping (--max-failed-groups {self.max_failed_groups}). "
                                     f"The first failure: {self.first_failure}")

    async def _score(self, sample: AgentSample, task: dict) -> None:
        env, _ = self.make_env(task.get("env"))
        try:
            await score(sample, task, env=env, seed=group_seed(self.run_seed, sample.group_id),
                        reward_fn=self.reward_fn, renderer=self.renderer)
        finally:
            await env.aclose()


def numeric_reward(reward) -> float | dict[str, float]:
    """A reward as agentrl keeps it: a number, or a dict of numbers. slime's reward dicts also
    carry text (math_dapo's "pred", the parsed answer): it is dropped, not a crash."""
    if isinstance(reward, dict):
        return {k: float(v) for k, v in reward.items() if isinstance(v, (int, float)) and not isinstance(v, str)}
    return float(reward)


def load_slime_rm(args):
    """--custom-rm-path for samples a slime hook returns: called as slime calls it,
    `rm(args, sample)` with slime's args and the hook's own Sample (slime/rollout/rm_hub)."""
    path = getattr(args, "custom_rm_path", None)
    return load_function(path, flag="--custom-rm-path") if path else None


async def slime_reward(rm, args, sample) -> None:
    """Score a hook's sample that came back without a reward with slime's rm, if one is set;
    an aborted or failed sample is left unscored (slime skips aborted ones)."""
    if rm is None or getattr(sample, "reward", None) is not None:
        return
    if str(getattr(sample.status, "name", sample.status)).upper() in ("ABORTED", "FAILED"):
        return
    from agentrl.grading import call_reward_fn

    try:
        sample.reward = await call_reward_fn(rm, args, sample, timeout=getattr(args, "custom_rm_timeout", 60.0))
    except AgentFault as exc:  # past its time limit on this output: scored 0, not failed
        sample.reward = 0.0
        sample.metadata["agent_fault"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # as a failed env scoring: this sample fails (masked), the run goes on
        sample.status, sample.reward = type(sample).Status.FAILED, 0.0
        sample.metadata["error"] = f"--custom-rm-path: {type(exc).__name__}: {exc}"
        sample.metadata["traceback"] = traceback.format_exc()


def check_hooks(cfg) -> None:
    """Import every configured hook and check it takes slime's arguments, before anything
    starts (and in --dry-run): a wrong path or a module that fails to import is an error
    naming the flag and the path."""
    r = cfg.rollout
    hooks = [(GENERATE_FLAG, r.custom_generate_function_path, ("args", "sample", "sampling_params")),
             (ROLLOUT_FLAG, r.rollout_function_path, ("args", "rollout_id", "data_source")),
             ("--custom-rm-path", cfg.algo.custom_rm_path, ("args", "sample")),
             ("--dynamic-sampling-filter-path", None if r.dynamic_sampling_filter_path == "nonzero_std"
              else r.dynamic_sampling_filter_path, ("args", "samples"))]
    for flag, spec, names in hooks:
        if spec:
            _check_signature(import_hook(spec, flag), spec, flag, names)


def import_hook(spec: str, flag: str) -> Callable:
    """load_function, with an import failure (a typo, a missing dependency) as a ConfigError naming the hook."""
    try:
        return load_function(spec, flag=flag)
    except ConfigError:
        raise
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        raise ConfigError(f"{flag} {spec}: cannot import it: {type(exc).__name__}: {exc}") from exc


def _chunk(flat: list, n: int, where: str) -> list[list]:
    """A flat list of samples, in groups of n consecutive ones (as slime normalises rewards)."""
    if len(flat) % n:
        raise ConfigError(f"{where} returned a flat list of {len(flat)} samples, not a multiple of "
                          f"--n-samples-per-prompt ({n}); return list[list[Sample]], one list per group")
    return [flat[i:i + n] for i in range(0, len(flat), n)]
