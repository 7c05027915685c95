"""SGLang servers for rollout: placement on GPUs, the command line, and its validation.

Every SGLang server argument passes through with the `--sglang-` prefix
(`--sglang-mem-fraction-static 0.8` -> `--mem-fraction-static 0.8`) and is checked
against the installed SGLang's own argument parser (`ServerArgs.add_cli_args`), so new
SGLang arguments need no change here and a misspelt one fails before anything starts.
agentrl sets the arguments it owns itself: --model-path, --host, --port, --tp-size
(from --rollout-num-gpus-per-engine), and --random-seed / --dtype unless given.

Placement: engine i gets GPUs [(i * tp + j) % num_gpus for j < tp] through
CUDA_VISIBLE_DEVICES (mapped through the parent's own CUDA_VISIBLE_DEVICES). With more
engines than GPUs, engines share GPUs; they then start one after the other and engine k
(1-based) of n on a GPU gets --mem-fraction-static k * F / n, where F is the fraction of
the GPU all of them may take together (--sglang-mem-fraction-static, default 0.8): SGLang
sizes its KV pool from the memory free when it starts, so each engine then ends up with
about F / n of the GPU. An engine restarted there finds the others up, so it gets F.

Prefill/decode disaggregation (slime's --prefill-num-servers N): engines 0..N-1 get SGLang's
`--disaggregation-mode prefill --disaggregation-bootstrap-port P` (a free port each), the rest
`--disaggregation-mode decode`, each on GPUs of its own; the router pairs them (router.py). The
prefill engines take --prefill-sglang-args over the --sglang-* ones, the decode engines
--decode-sglang-args (slime's --sglang-config gives its prefill and decode groups their own).

Engines are started through `python -m agentrl.engines.sglang_server`, which is SGLang's
`python -m sglang.launch_server` plus one response header naming the engine (see there).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache

from agentrl.engines.launch import ENGINE_ENV
from agentrl.errors import ConfigError

# arguments agentrl sets from its own flags: giving them as --sglang-* is an error
OWNED = {
    "model-path": "--model (or --hf-checkpoint)",
    "host": "(agentrl binds engines to 127.0.0.1)",
    "port": "(agentrl picks free ports)",
    "tp-size": "--rollout-num-gpus-per-engine",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "tp": "--rollout-num-gpus-per-engine",
    "base-gpu-id": "(agentrl places engines with CUDA_VISIBLE_DEVICES)",
    "disaggregation-mode": "--prefill-num-servers",
    "disaggregation-bootstrap-port": "(agentrl picks free ports)",
}
DEFAULT_SHARED_MEM_FRACTION = 0.8


@dataclass
class EnginePlan:
    index: int
    port: int
    gpus: list[int]  # physical GPU ids (after the parent's CUDA_VISIBLE_DEVICES)
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    start_after: int | None = None  # index of an engine that must be healthy first (shared GPU)
    restart_argv: list[str] | None = None  # a restart on a shared GPU finds the others up: it takes F / n
    worker_type: str = "regular"  # --prefill-num-servers: "prefill" or "decode"
    bootstrap_port: int | None = None  # a prefill engine's KV-transfer bootstrap port (the router needs it)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def sglang_parser() -> argparse.ArgumentParser:
    """The installed SGLang's own server-argument parser."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise ConfigError(
            f"--rollout-engine sglang: SGLang is not importable here ({exc}). Install it on the GPU machine "
            "(pip install 'agentrl[gpu]', i.e. sglang>=0.5.15), or attach to running servers with "
            "--rollout-engine-urls URL ..."
        ) from None
    parser = argparse.ArgumentParser(prog="sglang serve", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


@lru_cache(maxsize=1)
def _installed_parser() -> argparse.ArgumentParser:
    return sglang_parser()


def normalize_args(args: dict[str, str | None]) -> dict[str, str | None]:
    """YAML keys may use underscores; the command line uses dashes."""
    return {k.replace("_", "-").lstrip("-"): v for k, v in args.items()}


def validate_sglang_args(args: dict[str, str | None], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """--sglang-* arguments -> SGLang argv, checked against SGLang's parser. Raises
    ConfigError naming the flag (with close matches) for an unknown one, a flag given a
    value it cannot take, or a value missing."""
    parser = parser or _installed_parser()
    actions = {s: a for a in parser._actions for s in a.option_strings}
    argv: list[str] = []
    for name, value in normalize_args(args).items():
        if name in OWNED:
            raise ConfigError(f"--sglang-{name}: agentrl sets --{name} itself; use {OWNED[name]}")
        action = actions.get(f"--{name}")
        if action is None:
            known = [s[2:] for s in actions if s.startswith("--")]
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join('--sglang-' + c for c in close)}?" if close else ""
            raise ConfigError(f"--sglang-{name}: the installed SGLang has no server argument --{name}{hint}")
        takes_value = action.nargs != 0
        if value is None and takes_value and action.nargs not in ("?", "*"):
            raise ConfigError(f"--sglang-{name}: SGLang's --{name} needs a value")
        if value is not None and not takes_value:
            if str(value).lower() in ("true", "1", "yes"):
                value = None  # YAML `enable-memory-saver: true`
            elif str(value).lower() in ("false", "0", "no"):
                continue
            else:
                raise ConfigError(f"--sglang-{name}: SGLang's --{name} is a switch and takes no value (got {value!r})")
        argv.append(f"--{name}")
        if value is not None:
            argv += str(value).split() if action.nargs in ("+", "*") else [str(value)]
    try:  # SGLang's own checks of types and choices, without starting anything
        parser.parse_args(["--model-path", "x"] + argv)
    except SystemExit:
        raise ConfigError(f"invalid --sglang-* arguments for the installed SGLang: {' '.join(argv)} "
                          "(SGLang's message is printed above)") from None
    return argv


# SGLang 0.5.15 captures prefill CUDA graphs for 58 token counts by default: 23 s of a 1.5B engine's
# start-up (65 s of a 7B TP=2 one) for no rollout gain: 54.3k / 52.5k tok/s with them, 54.2k / 54.1k
# without (1.5B colocated, 256 x 1024 tokens, 1x H200, 2026-12-03, `startup_1p5b`). Off unless one of
# these is given; --sglang-cuda-graph-backend-prefill breakable is SGLang's default back.
PREFILL_GRAPH_FLAGS = frozenset(
    "--" + f for f in ("disable-prefill-cuda-graph", "cuda-graph-backend-prefill", "cuda-graph-config",
                       "cuda-graph-max-bs-prefill", "cuda-graph-bs-prefill", "cuda-graph-tc-compiler",
                       "disable-cuda-graph", "enable-breakable-cuda-graph", "disable-piecewise-cuda-graph",
                       "enforce-piecewise-cuda-graph", "piecewise-cuda-graph-tokens", "piecewise-cuda-graph-compiler",
                       "piecewise-cuda-graph-max-tokens"))


def with_rollout_defaults(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """An engine's checked SGLang argv with agentrl's rollout defaults where the user set nothing
    of the kind and the installed SGLang has the flag: prefill CUDA graphs off (PREFILL_GRAPH_FLAGS)."""
    parser = parser or _installed_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if "--disable-prefill-cuda-graph" in known and not given & PREFILL_GRAPH_FLAGS:
        argv = [*argv, "--disable-prefill-cuda-graph"]
    return argv


def arg_value(value) -> str | None | bool:
    """A YAML/JSON value (slime's --sglang-config overrides, --prefill-sglang-args) as a --sglang-*
    value: None or true a bare switch (None), false not given (False), a list its words, a mapping
    its JSON, anything else its text."""
    if value is None or value is True:
        return None
    if value is False:
        return False
    if isinstance(value, list):
        return " ".join(map(str, value))
    return json.dumps(value) if isinstance(value, dict) else str(value)


def merged_args(shared: dict[str, str | None], own: dict) -> dict[str, str | None]:
    """--sglang-* arguments with one worker type's own over them (--prefill-sglang-args,
    --decode-sglang-args, as `arg_value` reads them: false drops the shared argument)."""
    out = normalize_args(shared)
    for name, value in normalize_args(own).items():
        value = arg_value(value)
        if value is False:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def engine_types(cfg) -> dict[str, dict]:
    """The engine types a run launches, each with its own SGLang arguments: {"all": {}}, or with
    prefill/decode engines {"prefill": --prefill-sglang-args, "decode": --decode-sglang-args}."""
    r = cfg.rollout
    return {"prefill": r.prefill_sglang_args, "decode": r.decode_sglang_args} if r.prefill_num_servers else {"all": {}}


def engine_arg_values(cfg, name: str) -> dict[str, str | None]:
    """One SGLang argument (`name` as SGLang spells it, e.g. "mem-fraction-static") as each engine
    type of `engine_types` is launched with it (the type's own arguments over the shared --sglang-*).
    A type that does not get the argument is left out. Code that reads an engine setting reads it
    here, so a value given for one worker type only is not missed."""
    out = {}
    for kind, own in engine_types(cfg).items():
        args = merged_args(cfg.sglang_args, own)
        if name in args:
            out[kind] = args[name]
    return out


def visible_gpus() -> list[int]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(x) for x in env.split(",") if x.strip() != ""]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:
        return []


def plan_engines(*, num_engines: int | None, num_gpus: int | None, gpus_per_engine: int, gpu_ids: list[int],
                 ports: list[int], model_path: str, sglang_argv: list[str], seed: int, dtype: str | None = None,
                 engine_ids: list[str] | None = None, prefill: int = 0,
                 bootstrap_ports: list[int] | None = None,
                 worker_argv: dict[str, list[str]] | None = None) -> list[EnginePlan]:
    """Which GPUs and which command line each engine gets. prefill > 0 (slime's
    --prefill-num-servers): engines 0..prefill-1 run SGLang's --disaggregation-mode prefill (each on
    its bootstrap_ports[i]), the rest --disaggregation-mode decode, as slime launches them;
    worker_argv["prefill"] / ["decode"], where given, is those engines' SGLang argv instead of
    sglang_argv."""
    num_gpus = num_gpus or len(gpu_ids)
    if num_gpus < 1:
        raise ConfigError("--rollout-engine sglang needs GPUs and none are visible (CUDA_VISIBLE_DEVICES / "
                          "torch.cuda.device_count()); attach to running servers with --rollout-engine-urls instead")
    if num_gpus > len(gpu_ids):
        raise ConfigError(f"--rollout-num-gpus {num_gpus}: only {len(gpu_ids)} GPUs are visible ({gpu_ids})")
    if num_gpus % gpus_per_engine and num_gpus > gpus_per_engine:
        raise ConfigError(f"--rollout-num-gpus {num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                          f"{gpus_per_engine}")
    if gpus_per_engine > num_gpus:
        raise ConfigError(f"--rollout-num-gpus-per-engine {gpus_per_engine} > --rollout-num-gpus {num_gpus}")
    n = num_engines or max(1, num_gpus // gpus_per_engine)
    if prefill and (n <= prefill or n * gpus_per_engine > num_gpus):
        raise ConfigError(f"--prefill-num-servers {prefill}: {n} engines of {gpus_per_engine} GPU(s) on {num_gpus} "
                          "GPU(s); prefill/decode disaggregation needs at least one decode engine, and every engine "
                          "on GPUs of its own (slime: 'No decode GPUs')")
    at = sglang_argv.index("--mem-fraction-static") if "--mem-fraction-static" in sglang_argv else None
    shared_total = float(sglang_argv[at + 1]) if at is not None else DEFAULT_SHARED_MEM_FRACTION
    placements = [[gpu_ids[(i * gpus_per_engine + j) % num_gpus] for j in range(gpus_per_engine)] for i in range(n)]
    sharers: dict[int, list[int]] = {}
    for i, gpus in enumerate(placements):
        sharers.setdefault(gpus[0], []).append(i)
    plans = []
    for i, gpus in enumerate(placements):
        argv = [sys.executable, "-m", "agentrl.engines.sglang_server", "--model-path", str(model_path),
                "--host", "127.0.0.1", "--port", str(ports[i]), "--tp-size", str(gpus_per_engine)]
        worker, bootstrap = "regular", None
        if prefill:
            worker = "prefill" if i < prefill else "decode"
        extra = list((worker_argv or {}).get(worker, sglang_argv))
        if "--random-seed" not in extra:
            extra += ["--random-seed", str(seed + i)]
        if dtype and "--dtype" not in extra:
            extra += ["--dtype", dtype]
        if prefill:
            extra += ["--disaggregation-mode", worker]
            if worker == "prefill":
                bootstrap = bootstrap_ports[i]
                extra += ["--disaggregation-bootstrap-port", str(bootstrap)]
        group = sharers[gpus[0]]
        start_after, restart_argv = None, None
        if len(group) > 1:
            k = group.index(i) + 1
            fraction = round(k * shared_total / len(group), 4)
            restart_argv = argv + _drop_flag(extra, "--mem-fraction-static") + [
                "--mem-fraction-static", str(round(shared_total, 4))]
            extra = _drop_flag(extra, "--mem-fraction-static") + ["--mem-fraction-static", str(fraction)]
            start_after = group[k - 2] if k > 1 else None
        env = {**ENGINE_ENV, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
               "AGENTRL_ENGINE_ID": (engine_ids[i] if engine_ids else f"http://127.0.0.1:{ports[i]}")}
        plans.append(EnginePlan(index=i, port=ports[i], gpus=gpus, argv=argv + extra, env=env, start_after=start_after,
                                restart_argv=restart_argv, worker_type=worker, bootstrap_port=bootstrap))
    return plans


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok == flag:
            skip = True
            continue
        if tok.startswith(flag + "="):
            continue
        out.append(tok)
    return out


def sglang_log_hint(log_tail: str) -> str:
    """A sentence for the commonest start failures."""
    if "no GPU memory for the KV cache" in log_tail or "Not enough memory" in log_tail:
        return ("\nhint: the GPU memory left is too small; lower the engines per GPU or raise "
                "--sglang-mem-fraction-static (shared GPUs: it is their total).")
    if "CUDA out of memory" in log_tail:
        return "\nhint: CUDA out of memory: fewer engines per GPU, or a smaller --sglang-mem-fraction-static."
    return ""

