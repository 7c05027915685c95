"""`agentrl --help` and each command's own: every flag explained by its config field's
docstring, choices shown, a command's help its own, `--version`. In-process and fast:
parsing imports neither torch nor the engines."""

import re
import subprocess
import sys

import pytest

from agentrl.cli import main
from agentrl.config import SECTIONS


def raw_help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def help_of(capsys, *argv) -> str:
    return " ".join(raw_help(capsys, *argv).split())  # argparse wraps lines: compare with one space


def test_train_help_explains_a_flag_with_its_field_docstring(capsys):
    text = help_of(capsys, "train")
    assert text.startswith("usage: agentrl train")
    # RolloutConfig.rollout_batch_size's docstring, then its default
    assert "--rollout-batch-size VALUE Prompts per iteration. (default: 16)" in text
    assert "--sandbox {docker,local,auto} Sandbox backend for envs with tools" in text
    assert "--dtype {float32,bfloat16,float16} Training and embedded-engine dtype." in text


def test_every_config_field_has_a_docstring(capsys):
    """What --help prints for a flag is its field's docstring: none may be missing."""
    missing = [f"{section}.{name}" for section, cls in SECTIONS.items()
               for name, info in cls.model_fields.items() if not info.description]
    assert not missing
    entries = re.split(r"\n  (?=--)", raw_help(capsys, "train"))  # one per flag: its names, then its help
    for cls in SECTIONS.values():
        for name, info in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            entry = " ".join(next(e for e in entries if re.match(re.escape(flag) + r"\b(?!-)", e)).split())
            assert " ".join(info.description.split()[:4]) in entry, (flag, entry)


def test_eval_help_is_its_own_with_eval_limit(capsys):
    text = help_of(capsys, "eval")
    assert text.startswith("usage: agentrl eval")
    assert "--eval-limit N Without --eval-prompt-data: evaluate the first N tasks" in text
    assert "--eval-prompt-data NAME PATH" in text  # train's flags too


def usage_error(capsys, *argv) -> str:
    """What argparse prints when it rejects argv (exit status 2)."""
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_eval_limit_without_a_value_is_a_usage_error(capsys):
    assert ("agentrl eval: error: argument --eval-limit: expected one argument"
            in usage_error(capsys, "eval", "--eval-limit"))
    assert "argument --eval-limit: must be at least 1, got 0" in usage_error(capsys, "eval", "--eval-limit", "0")


def test_sft_help_lists_no_rl_flags(capsys):
    text = help_of(capsys, "sft")
    assert text.startswith("usage: agentrl sft")
    assert "--prompt-data" in text and "--num-epoch" in text and "--global-batch-size" in text
    for rl_flag in ("--num-rollout ", "--rollout-batch-size", "--advantage-estimator", "--eval-interval"):
        assert rl_flag not in text
    # and does not take them
    assert "unrecognized arguments: --rollout-batch-size" in usage_error(
        capsys, "sft", "--prompt-data", "x.jsonl", "--rollout-batch-size", "4")


def test_top_level_help_and_version(capsys):
    assert main(["--help"]) == 0
    assert "agentrl --version" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert re.fullmatch(r"agentrl \S+\n", capsys.readouterr().out)


def test_version_from_the_installed_command():
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"agentrl {version('agentrl')}\n"
