"""Models a run serves beside the policy, each from an engine group of its own: the LLM judge
(`--judge-load PATH`, agentrl.judge) and the on-policy-distillation teacher (`--use-opd
--opd-type sglang --opd-teacher-load PATH`).

Each group is one engine of the run's engine kind (`--rollout-engine`: embedded on the CPU or
one GPU, SGLang on GPUs, with the run's `--sglang-*` arguments), started by
`agentrl.engines.group.start_engines` with no router and no weight updates (these models never
change). `--opd-teacher-url URL` attaches to a teacher already serving SGLang's /generate instead.

The judge is asked over the OpenAI-compatible path (/v1/chat/completions) that both SGLang and
the embedded engine serve. The teacher scores the student's sampled tokens by prefill, as
slime's OPD reward function asks SGLang: /generate with the whole trajectory as input_ids,
max_new_tokens 0, return_logprob and logprob_start_len = the prompt's length - 1, so
meta_info.input_token_logprobs holds [logprob, token id, None] of each response token given
what precedes it (at temperature 1: SGLang's input logprobs are not temperature-scaled), after
an entry for the prompt's last token whose logprob SGLang always leaves None. The
logprobs go on the sample (metadata["teacher_logprobs"], one per response token) and the
trainer's OPD term reads them there instead of running a teacher itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from agentrl.algorithms import teacher_is_served
from agentrl.errors import EngineError
from agentrl.served import served_url, set_served


@dataclass
class ServedModels:
    groups: dict = field(default_factory=dict)  # role -> EngineGroup (started by this run)
    attached: list = field(default_factory=list)  # roles served by a server this run did not start

    def stop(self) -> None:
        for role in [*self.groups, *self.attached]:
            set_served(role, None)
        for group in self.groups.values():
            group.stop()
        self.groups.clear()
        self.attached.clear()


def start_served_models(cfg, *, device: str, log_dir: Path, teacher: bool = True) -> ServedModels:
    """The judge's and (unless teacher=False: `agentrl eval` trains nothing) the teacher's
    engine groups this run's flags ask for (none: nothing starts). Every group is stopped
    again if one fails to start."""
    from agentrl.engines.group import start_engines

    out, roles = ServedModels(), {}
    if cfg.algo.judge_load:
        roles["judge"] = cfg.algo.judge_load
    if teacher and teacher_is_served(cfg.algo):
        if cfg.algo.opd_teacher_url:
            set_served("teacher", cfg.algo.opd_teacher_url)
            out.attached.append("teacher")
        else:
            roles["teacher"] = cfg.algo.opd_teacher_load
    one = {"num_engines": 1, "use_router": "never", "rollout_engine_urls": [], "engine_restart": False,
           "rollout_num_gpus": cfg.rollout.rollout_num_gpus_per_engine}
    try:
        for role, path in roles.items():
            group = start_engines(cfg.rollout.model_copy(update=one), model_path=str(path), device=device,
                                  seed=cfg.run.seed, log_dir=Path(log_dir) / role,
                                  sglang_args=cfg.sglang_args if cfg.rollout.rollout_engine == "sglang" else None,
                                  dtype=cfg.model.dtype)
            out.groups[role] = group
            set_served(role, group.url + ("/v1" if role == "judge" else ""))
    except BaseException:
        out.stop()
        raise
    return out


async def teacher_logprobs(url: str, samples, *, timeout_s: float = 600.0, max_concurrency: int = 32
                           ) -> list[list[float] | None]:
    """The teacher's logprob of every response token of each trainable sample (None for the
    others), scored by the engine at `url` by prefill. A reply that does not score exactly the
    sample's response tokens is an EngineError (a teacher engine that ignores logprob_start_len
    or another tokenizer's ids would otherwise train on misaligned logprobs)."""
    limit = asyncio.Semaphore(max_concurrency)

    async def one(session, s) -> list[float] | None:
        if not s.trainable:
            return None
        start = len(s.prompt_tokens)
        if start < 1:
            raise EngineError(f"trajectory {s.trajectory_id}: an empty prompt has no context to score its first token")
        # SGLang never scores the token at logprob_start_len (its first entry is padded None): start one before
        body = {"input_ids": s.tokens, "return_logprob": True, "logprob_start_len": start - 1,
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False}}
        async with limit:
            try:
                async with session.post(f"{url}/generate", json=body) as resp:
                    if resp.status != 200:
                        raise EngineError(f"OPD teacher {url}: HTTP {resp.status}: {(await resp.text())[:300]}")
                    reply = await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise EngineError(f"OPD teacher {url}: {type(exc).__name__}: {exc}") from exc
        entries = (reply.get("meta_info") or {}).get("input_token_logprobs") if isinstance(reply, dict) else None
        if not isinstance(entries, list) or len(entries) != s.response_length + 1:
            got = len(entries) if isinstance(entries, list) else "no"
            raise EngineError(f"OPD teacher {url}: {got} input_token_logprobs for trajectory {s.trajectory_id}'s "
                              f"{s.response_length} response tokens and the prompt's last (does it honour "
                              "logprob_start_len?)")
        first = entries[0]
        if not isinstance(first, list) or len(first) < 2 or first[1] != s.tokens[start - 1]:
            raise EngineError(f"OPD teacher {url}: scored {first!r} where trajectory {s.trajectory_id}'s prompt ends "
                              f"with token {s.tokens[start - 1]} (SGLang's [logprob, token id, text])")
        out = []
        for entry, want in zip(entries[1:], s.response_tokens):
            lp, tok = (entry[0], entry[1]) if isinstance(entry, list) and len(entry) >= 2 else (None, None)
            if tok != want or isinstance(lp, bool) or not isinstance(lp, (int, float)):
                raise EngineError(f"OPD teacher {url}: scored {entry!r} where trajectory {s.trajectory_id} has "
                                  f"token {want} (SGLang's [logprob, token id, text])")
            out.append(float(lp))
        return out

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return list(await asyncio.gather(*[one(session, s) for s in samples]))


async def score_with_teacher(cfg, samples) -> None:
    """Before a training step (--use-opd --opd-type sglang): the served teacher's logprobs onto
    each trainable sample, metadata["teacher_logprobs"]. Nothing when the teacher is not served."""
    if not teacher_is_served(cfg.algo):
        return
    url = served_url("teacher")
    if url is None:
        raise EngineError("--opd-type sglang: no teacher engine is serving (start_served_models was not run)")
    for s, lps in zip(samples, await teacher_logprobs(url, samples, timeout_s=cfg.rollout.request_timeout_s)):
        if lps is not None:
            s.metadata["teacher_logprobs"] = lps


async def no_task_reward(args, sample, **kwargs) -> float:
    """Reward 0 for every sample: slime's on-policy-distillation scripts (their reward function and
    post-process hook, agentrl/slime_args.py slime_opd) train on the teacher's term alone."""
    return 0.0

