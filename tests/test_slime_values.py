"""Values in slime's scripts that agentrl refused although the flag is accepted (found by running
every `python3 train.py` line of slime's scripts/ and examples/ through the parser):

- `--moe-layer-freq [0]*3+[1]*89` (GLM-4.7, GLM-5, MiniMax-M2 model files): the list arithmetic
  Megatron evaluates;
- `--num-steps-per-rollout 4` without `--global-batch-size` (DeepSeek-R1, Kimi-K2, Moonlight):
  slime sets the global batch to rollout_batch_size x n_samples_per_prompt / steps;
- `--eval-top-p 0.7`, `--eval-top-k 1` other than the rollout's (four scripts and tau-bench):
  evaluations sample with them;
- `--eval-prompt-data PATH` alone (run-qwen3-30B-A3B-int4.sh): slime names the set `aime`."""

from types import SimpleNamespace

import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError


def test_moe_layer_freq_takes_megatrons_list_arithmetic():
    cfg, _ = parse_config(["--moe-layer-freq", "[0]*3+[1]*89"])
    assert cfg.megatron_args["moe_layer_freq"] == [0] * 3 + [1] * 89
    assert parse_config(["--moe-layer-freq", "'[1]*62'"])[0].megatron_args["moe_layer_freq"] == [1] * 62
    assert parse_config(["--moe-layer-freq", "[1,0,1]"])[0].megatron_args["moe_layer_freq"] == [1, 0, 1]
    assert parse_config(["--moe-layer-freq", "2"])[0].megatron_args["moe_layer_freq"] == 2
    for bad in ("__import__('os').system('x')", "[1]*[2]", "[0]*3+2", "[1]*10000000"):
        with pytest.raises(ConfigError, match="--moe-layer-freq: expected an int or a list"):
            parse_config(["--moe-layer-freq", bad])


def test_num_steps_per_rollout_sets_the_global_batch_as_in_slime():
    base = ["--rollout-batch-size", "128", "--n-samples-per-prompt", "8", "--num-steps-per-rollout", "4"]
    cfg, _ = parse_config(base)
    assert (cfg.train.global_batch_size, cfg.train.num_steps_per_rollout) == (256, 4)
    assert parse_config(base + ["--global-batch-size", "256"])[0].train.global_batch_size == 256
    with pytest.raises(ConfigError, match="--num-steps-per-rollout 4 contradicts the batch sizes"):
        parse_config(base + ["--global-batch-size", "32"])  # slime asserts the same
    for steps in ("2048", "3"):  # more steps than samples, or a remainder slime would drop
        with pytest.raises(ConfigError, match=f"--num-steps-per-rollout {steps} does not divide the 1024 samples"):
            parse_config(base[:-1] + [steps])
    # the warmup fraction counts the steps so derived: 0.5 x 2 rollouts x 4 steps
    cfg, _ = parse_config(base + ["--num-rollout", "2", "--lr-warmup-fraction", "0.5"])
    assert cfg.megatron_args["lr_warmup_iters"] == "4"


def test_one_eval_path_is_named_aime_as_in_slime():
    cfg, ns = parse_config(["--eval-prompt-data", "/data/aime-2024.jsonl"])
    assert cfg.eval.eval_prompt_data == ["aime", "/data/aime-2024.jsonl"]
    assert any("named 'aime'" in n for n in ns.slime_notices)
    assert parse_config(["--eval-prompt-data", "a", "a.jsonl"])[0].eval.eval_prompt_data == ["a", "a.jsonl"]


def test_evaluations_sample_with_eval_top_p_and_top_k(tiny_model):
    from agentrl.build import build_group_runner
    from agentrl.models import load_tokenizer
    from agentrl.rollout.control import RolloutControl

    cfg, _ = parse_config(["--model", str(tiny_model), "--rollout-top-p", "0.9", "--rollout-top-k", "50",
                           "--eval-top-p", "0.7", "--eval-top-k", "1"])
    assert (cfg.eval.eval_top_p, cfg.eval.eval_top_k) == (0.7, 1)
    tokenizer, env = load_tokenizer(str(tiny_model)), SimpleNamespace(stop=None, max_turns=1)

    def sampling(**kw):
        runner = build_group_runner(cfg, tokenizer, None, None, None, RolloutControl(), None, **kw)
        return {k: runner.settings_for(env).sampling_params[k] for k in ("top_p", "top_k")}

    assert sampling() == {"top_p": 0.9, "top_k": 50}  # the rollout
    assert sampling(evaluation=True, top_p=cfg.eval.eval_top_p, top_k=cfg.eval.eval_top_k) == {"top_p": 0.7, "top_k": 1}
    assert parse_config(["--eval-top-p", "0.7"])[0].eval.eval_top_k is None  # unset: the rollout's
