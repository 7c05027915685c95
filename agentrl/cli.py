"""`agentrl` command line. Parses first, imports torch and friends only when needed."""

from __future__ import annotations

import signal
import sys

from agentrl.errors import AgentRLError

USAGE = """usage: agentrl COMMAND [ARGS]   (agentrl COMMAND --help: its flags; agentrl --version)

commands:
  train     train on an env (agentrl train --env target-token; --help lists every flag)
  eval      evaluate a model or checkpoint on eval sets, no training (train's flags, plus --eval-limit)
  sft       supervised fine-tuning on chat data, loss on the assistant turns (agentrl sft --prompt-data F.jsonl)
  envs      list registered envs (envs list) or describe one (envs show NAME)
  sandbox   build the sandbox image, list or reap sandboxes (agentrl sandbox --help)
  tools     list or call the tools of an MCP server (agentrl tools --help)
  inspect   write a self-contained HTML report of a run (agentrl inspect RUN_DIR)
  model     build a real pretrained model offline (agentrl model get smollm2-135m-instruct [DIR])
  demos     expert demonstrations of a built-in env, for sft (agentrl demos --env math --n 64 --out F.jsonl)
"""


def version() -> str:
    """The installed distribution's version."""
    from agentrl import __version__

    return __version__


def _env_defaults(env_name: str, env_modules: list[str]) -> dict:
    from agentrl.registry import get_spec, import_env_module

    for module in env_modules:
        import_env_module(module)
    return dict(getattr(get_spec(env_name).load(), "default_config", {}) or {})


def suggest_flags(parser):
    """argparse's "unrecognized arguments" error, plus the nearest known flag of each
    ("--num-rolout: did you mean --num-rollout?")."""
    import difflib

    plain_error = parser.error
    known = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]

    def error(message: str):
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                # a high cutoff: a far-off hint (--rotary-base -> --ray-address) misleads more than none
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8) if flag.startswith("--") else []
                if close:
                    message += f"\n{flag}: did you mean {close[0]}?"
        plain_error(message)

    parser.error = error
    return parser


def cmd_train(argv: list[str]) -> int:
    from agentrl.config import build_parser, parse_config

    cfg, ns = parse_config(argv, env_defaults_for=_env_defaults, parser=suggest_flags(build_parser()))
    for notice in ns.slime_notices:  # slime flags accepted with no effect here, each with why
        print(f"agentrl train: {notice}", file=sys.stderr)
    import os

    os.environ.update(ns.slime_environ)  # --wandb-key/-team/-host, never written to config.yaml
    if getattr(ns, "dry_run", False):
        import yaml

        dry_run_checks(cfg)
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0
    if cfg.train.loss_type == "sft_loss":  # slime's way to ask for SFT
        from agentrl.sft import sft

        sft(cfg)
        return 0
    from agentrl.train import train

    train(cfg)
    return 0


def cmd_sft(argv: list[str]) -> int:
    """agentrl sft --prompt-data FILE.jsonl [--model DIR] [--trainer torch|megatron] [--num-epoch N] ...:
    the same flags as train; --input-key defaults to messages."""
    from agentrl.config import parse_config
    from agentrl.sft import SFT_DEFAULTS, sft_parser

    cfg, ns = parse_config(argv, env_defaults_for=lambda env, modules: dict(SFT_DEFAULTS),
                           parser=suggest_flags(sft_parser()))
    if getattr(ns, "dry_run", False):
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0
    from agentrl.sft import sft

    sft(cfg)
    return 0


def eval_parser():
    from agentrl.config import build_parser

    parser = build_parser("agentrl eval", "Evaluate a model (--model) or checkpoint (--load) on the eval sets "
                                          "(--eval-prompt-data), else on --prompt-data or the env's own tasks; "
                                          "no training. Takes train's flags.")
    parser.add_argument("--eval-limit", type=_positive_int, metavar="N",
                        help="Without --eval-prompt-data: evaluate the first N tasks of --prompt-data or of the "
                             "env (default: every row of --prompt-data, or 32 env tasks)")
    return parser


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_eval(argv: list[str]) -> int:
    """agentrl eval --env NAME [--model DIR | --load CKPT] [--prompt-data F | --eval-prompt-data NAME F ...]
    [--eval-limit N]: the same flags as train; no training."""
    from agentrl.config import parse_config

    cfg, ns = parse_config(argv, env_defaults_for=_env_defaults, parser=suggest_flags(eval_parser()))
    for notice in ns.slime_notices:  # --load with no checkpoint there evaluates the reference: say so
        print(f"agentrl eval: {notice}", file=sys.stderr)
    from agentrl.evaluation import evaluate_checkpoint

    evaluate_checkpoint(cfg, limit=getattr(ns, "eval_limit", None))
    return 0


def cmd_envs(argv: list[str]) -> int:
    import argparse

    from agentrl.registry import description_of, get_spec, import_env_module, list_envs

    parser = argparse.ArgumentParser(prog="agentrl envs")
    parser.add_argument("action", choices=["list", "show"])
    parser.add_argument("name", nargs="?")
    parser.add_argument("--env-module", action="append", default=[])
    args = parser.parse_args(argv)
    for module in args.env_module:
        import_env_module(module)
    if args.action == "list":
        specs = list_envs()
        width = max((len(s.name) for s in specs), default=4)
        for spec in specs:
            print(f"{spec.name:<{width}}  {spec.description}  [{spec.source}]")
        return 0
    if not args.name:
        parser.error("envs show needs an env NAME")
    spec = get_spec(args.name)
    cls = spec.load()
    import inspect

    print(f"name:        {spec.name}")
    print(f"class:       {spec.qualified_name}")
    print(f"registered:  {spec.source}")
    print(f"description: {spec.description or description_of(cls)}")
    print(f"max turns:   {getattr(cls, 'max_turns', None) or 'until it terminates (safety limit: agentrl.env.SAFETY_MAX_TURNS)'}")
    print(f"tool parser: {getattr(cls, 'tool_parser', None)}")
    print(f"tools:       {', '.join(getattr(cls, 'tool_names', ()) or ()) or '(none declared statically)'}")
    has_data = getattr(cls, "dataset", None) is not None and cls.dataset.__func__ is not _base_dataset()
    print("dataset:     " + ("built-in task generator/dataset" if has_data else
                             "none: each group's episode comes from its seed (reset(seed=..., options=None)), "
                             "or give --prompt-data"))
    print(f"defaults:    {getattr(cls, 'default_config', {}) or '{}'}")
    try:  # a class's signature is its constructor's, without self; eval_str: `bool`, not `'bool'`
        options = inspect.signature(cls, eval_str=True).parameters
    except (NameError, TypeError, SyntaxError):
        options = inspect.signature(cls).parameters
    print(f"options:     {', '.join(map(str, options.values())) or '(none)'}")
    doc = inspect.getdoc(cls)
    if doc:
        print("\n" + doc)
    return 0


def _base_dataset():
    from agentrl.env import Env

    return Env.dataset.__func__


def _delegate(module: str):
    def run(argv: list[str]) -> int:
        import importlib

        return int(importlib.import_module(module).main(argv) or 0)

    return run


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "sft": cmd_sft,
    "envs": cmd_envs,
    "sandbox": _delegate("agentrl.sandboxes.cli"),
    "tools": _delegate("agentrl.tools.cli"),
    "inspect": _delegate("agentrl.inspect"),
    "model": _delegate("agentrl.model_get"),
    "demos": _delegate("agentrl.demos"),
}


def _prints_only(args: list[str]) -> bool:
    return not args or args[0] in ("envs", "--version") or "-h" in args or "--help" in args


def dry_run_checks(cfg) -> None:
    """What --dry-run checks beyond the config: every hook imported with slime's arguments (a typo
    in a path fails here), the Megatron flags typed by megatron-core's own config fields, the
    model family known, --ref-load readable when a KL term reads it."""
    from agentrl.rollout.slime import check_hooks
    from agentrl.algorithms import needs_reference
    from agentrl.slime_args import check_family, check_reference, read_hf_config

    check_hooks(cfg)
    if cfg.run.ref_load and needs_reference(cfg.algo):  # read only for a KL term, as in slime
        check_reference(cfg.run.ref_load, cfg.train.trainer, start=cfg.model.model)
    if cfg.train.trainer == "megatron":
        from agentrl.trainers.megatron.args import parse_megatron_args

        parse_megatron_args(dict(cfg.megatron_args))
        if cfg.model.model:
            check_family(read_hf_config(cfg.model.model, []), cfg.model.model)


def main(argv: list[str] | None = None) -> int:
    if argv is None and _prints_only(sys.argv[1:]):
        # `agentrl envs list | head` ends quietly, like any Unix tool. Only there: with SIGPIPE's
        # default, a write into the pipe of a child that exited (an MCP server over stdio) killed
        # a training run on the spot (exit -13), its cleanup and all.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"agentrl {version()}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"agentrl: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except AgentRLError as exc:
        print(f"agentrl {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
