import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError


def test_slime_flags_map_onto_the_tree():
    cfg, _ = parse_config([
        "--num-rollout", "7", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--prompt-data", "x.jsonl", "--input-key", "q", "--label-key", "a", "--no-apply-chat-template",
        "--rollout-max-response-len", "64", "--rollout-temperature", "0.7", "--advantage-estimator", "dr_grpo",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-5", "--save", "ck", "--save-interval", "2",
        "--load", "old", "--seed", "3", "--env-module", "a.py", "--env-module", "b", "--env-kwargs", '{"topk": 2}',
        "--sglang-mem-fraction-static", "0.8", "--router-policy=manual", "--sglang-enable-memory-saver",
    ])
    assert cfg.rollout.num_rollout == 7 and cfg.rollout.rollout_batch_size == 4
    assert cfg.data.prompt_data == "x.jsonl" and cfg.data.input_key == "q" and not cfg.data.apply_chat_template
    assert cfg.rollout.rollout_temperature == 0.7 and cfg.algo.advantage_estimator == "dr_grpo"
    assert cfg.algo.use_kl_loss and cfg.algo.kl_loss_coef == 0.01 and cfg.train.lr == 1e-5
    assert cfg.run.save == "ck" and cfg.run.seed == 3
    assert cfg.run.load is None  # "old" holds no checkpoint: as in slime, the run starts fresh (test_slime_scripts)
    assert cfg.run.env_module == ["a.py", "b"] and cfg.run.env_kwargs == {"topk": 2}
    assert cfg.sglang_args == {"mem-fraction-static": "0.8", "enable-memory-saver": None}
    assert cfg.router_args == {"policy": "manual"}
    assert cfg.steps_per_rollout == 2


def test_yaml_gives_the_same_keys_and_flags_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_rollout: 5\nrollout:\n  n_samples_per_prompt: 4\nglobal-batch-size: 16\nlr: 0.1\n")
    cfg, _ = parse_config(["--config", str(path), "--num-rollout", "9"])
    assert cfg.rollout.num_rollout == 9 and cfg.rollout.n_samples_per_prompt == 4
    assert cfg.train.global_batch_size == 16 and cfg.train.lr == 0.1


def test_env_default_config_sits_under_yaml_and_flags():
    cfg, _ = parse_config(["--num-rollout", "2"], env_defaults_for=lambda name, mods: {
        "num_rollout": 99, "rollout_max_response_len": 321})
    assert cfg.rollout.num_rollout == 2 and cfg.rollout.rollout_max_response_len == 321


def test_lr_default_depends_on_the_model():
    assert parse_config([])[0].train.lr == 3e-3
    assert parse_config(["--model", "/some/ckpt"])[0].train.lr == 1e-6
    # LoRA's default is set apart when only adapters train: 10x full fine-tuning's; an explicit --lr still
    # wins. The tiny model's LoRA also trains its embeddings whole (--lora-trainable-modules auto): full's rate
    assert parse_config(["--lora-rank", "8"])[0].train.lr == 3e-3
    assert parse_config(["--lora-rank", "8", "--lora-trainable-modules", "none"])[0].train.lr == 3e-2
    assert parse_config(["--lora-rank", "8", "--trainer", "megatron"])[0].train.lr == 3e-3  # the same modules: Megatron too
    assert parse_config(["--model", "/some/ckpt", "--lora-rank", "8"])[0].train.lr == 1e-5
    assert parse_config(["--lora-rank", "8", "--lr", "2e-4"])[0].train.lr == 2e-4


def test_impossible_batch_sizes_are_named():
    with pytest.raises(ConfigError, match=r"rollout_batch_size \(3\) x n_samples_per_prompt \(8\) = 24"):
        parse_config(["--rollout-batch-size", "3", "--global-batch-size", "5"])
    with pytest.raises(ConfigError, match="--num-steps-per-rollout 3 contradicts"):
        parse_config(["--num-steps-per-rollout", "3", "--global-batch-size", "32"])
    with pytest.raises(ConfigError, match="--num-steps-per-rollout 3 does not divide the 128 samples"):
        parse_config(["--num-steps-per-rollout", "3"])  # slime's: the global batch from it, when not given
    assert parse_config(["--num-steps-per-rollout", "4"])[0].train.global_batch_size == 32


def test_bad_values_and_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="--rollout-batch-size: .*got 'many'"):
        parse_config(["--rollout-batch-size", "many"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_rollout: 3\nnot_a_key: 1\n")
    with pytest.raises(ConfigError, match="bad.yaml: unknown key 'not_a_key'"):
        parse_config(["--config", str(bad)])
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1,\nb: 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: malformed YAML"):
        parse_config(["--config", str(broken)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])


def test_the_veto_needs_the_importance_ratio():
    with pytest.raises(ConfigError, match="--rs-veto-threshold .* add --use-tis"):
        parse_config(["--rs-veto-threshold", "1e-4"])
    with pytest.raises(ConfigError, match="--tis-level .* add --use-tis"):
        parse_config(["--tis-level", "geometric"])
    with pytest.raises(ConfigError, match="--rs-veto-threshold: .*less than 1"):
        parse_config(["--use-tis", "--rs-veto-threshold", "2"])
    cfg, _ = parse_config(["--use-tis", "--tis-mode", "mask", "--rs-veto-threshold", "1e-4"])
    assert cfg.algo.rs_veto_threshold == 1e-4


@pytest.mark.parametrize("argv, message", [
    (["--tis-mode", "mask"], "--tis-mode shapes the --use-tis importance weights, which is off: add --use-tis"),
    (["--opd-type", "megatron"], "--opd-type shapes on-policy distillation, which is off: add --use-opd"),
    (["--opd-teacher-load", "/x"], "--opd-teacher-load shapes on-policy distillation"),
    (["--opd-kl-coef", "0.5"], "--opd-kl-coef shapes on-policy distillation"),
    (["--difficulty-revisit-prob", "0.3"], "--difficulty-revisit-prob .* add --difficulty-window"),
    (["--overlong-max-len", "8"], "--overlong-max-len shapes the overlong penalty, which is off"),
    (["--overlong-penalty-factor", "0.5"], "--overlong-penalty-factor shapes the overlong penalty, which is off"),
    (["--difficulty-window", "2", "--n-samples-per-prompt", "1", "--global-batch-size", "16"],
     "--difficulty-window .* --n-samples-per-prompt 1"),
    (["--custom-rm-path", "agentrl.judge:llm_judge"], "agentrl.judge:llm_judge needs the judge: --judge-url"),
    (["--rm-type", "llm-judge"], "--rm-type llm-judge needs the judge: --judge-url"),
    (["--rm-type", "llm-judge", "--judge-url", "host:30000/v1"], "--judge-url host:30000/v1: not an http"),
])
def test_a_flag_whose_feature_is_off_is_named(argv, message):
    """A flag that only shapes a feature left off would be silently ignored: refused, naming what to add."""
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


def test_the_features_flags_together_are_taken(tmp_path):
    cfg, _ = parse_config(["--overlong-buffer-len", "4", "--overlong-penalty-factor", "0.5", "--difficulty-window", "2",
                           "--use-tis", "--tis-level", "geometric", "--tis-clip-low", "0.99", "--tis-clip", "1.01"])
    assert cfg.algo.overlong_max_len == cfg.rollout.rollout_max_response_len and cfg.data.difficulty_window == 2


def test_a_runs_config_yaml_loads_back(tmp_path):
    """config.yaml holds every field, each feature's own flags at their defaults when it is off:
    none of the off-feature checks above may refuse it."""
    cfg, _ = parse_config(["--num-rollout", "3"])
    cfg.dump(tmp_path / "config.yaml")
    again, _ = parse_config(["--config", str(tmp_path / "config.yaml")])
    assert again == cfg
