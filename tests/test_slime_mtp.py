"""slime's multi-token-prediction flags. `--mtp-num-layers N` (scripts/models/mimo-7B-rl.sh,
run-glm4.7-30B-A3B.sh) is checked against the checkpoint's config.json and handed to the Megatron
trainer, which builds MiMo's MTP layers (trainers/megatron/mtp.py; tests/trainers/test_megatron_mtp.py
trains them); `--enable-mtp-training` (with `--mtp-loss-scaling-factor`) trains them beside the
policy. A model whose MTP layers the trainer does not map (GLM-4.x's glm4_moe, DeepSeek-V3) is
refused naming why, as is a config without MTP layers."""

import json

import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError

MIMO = dict(model_type="mimo", hidden_size=4096, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=640000, vocab_size=151680,
            tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=32768, num_nextn_predict_layers=1)


def model(tmp_path, **hf):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


def test_mtp_num_layers_is_checked_against_config_json_and_handed_to_megatron(tmp_path):
    base = ["--hf-checkpoint", model(tmp_path, **MIMO), "--rm-type", "math", "--add-qkv-bias"]
    cfg, ns = parse_config(base + ["--mtp-num-layers", "1"])
    assert cfg.train.trainer == "megatron" and cfg.megatron_args["mtp_num_layers"] == "1"
    assert not [n for n in ns.slime_notices if n.startswith("--mtp-num-layers")]
    with pytest.raises(ConfigError, match=r"--mtp-num-layers 2 differs from .*config.json \(1\)"):
        parse_config(base + ["--mtp-num-layers", "2"])
    (tmp_path / "qwen2").mkdir()
    dense = model(tmp_path / "qwen2", **{**MIMO, "model_type": "qwen2", "num_nextn_predict_layers": 0})
    with pytest.raises(ConfigError, match="--mtp-num-layers 1: .*config.json has no value to check it against"):
        parse_config(["--hf-checkpoint", dense, "--rm-type", "math", "--mtp-num-layers", "1"])
    _, ns = parse_config(base + ["--mtp-num-layers", "1", "--trainer", "torch"])
    assert any(n.startswith("--mtp-num-layers: accepted, no effect here: the torch trainer builds no")
               for n in ns.slime_notices)


def test_enable_mtp_training_with_slimes_meaning_for_mimo(tmp_path):
    base = ["--hf-checkpoint", model(tmp_path, **MIMO), "--rm-type", "math", "--mtp-num-layers", "1"]
    cfg, ns = parse_config(base + ["--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2"])
    m = cfg.megatron_args
    assert m["mtp_num_layers"] == "1" and "enable_mtp_training" in m and m["mtp_loss_scaling_factor"] == "0.2"
    assert not [n for n in ns.slime_notices if "mtp" in n]
    _, ns = parse_config(base + ["--mtp-loss-scaling-factor", "0.2"])
    assert any(n.startswith("--mtp-loss-scaling-factor: accepted, no effect here") for n in ns.slime_notices)
    with pytest.raises(ConfigError, match="--enable-mtp-training needs --mtp-num-layers N"):
        parse_config(["--hf-checkpoint", str(tmp_path), "--rm-type", "math", "--trainer", "megatron",
                      "--enable-mtp-training"])
    with pytest.raises(ConfigError, match="--enable-mtp-training: the MTP layers are trained by the Megatron trainer"):
        parse_config(base + ["--enable-mtp-training", "--trainer", "torch"])


def test_mtp_of_a_model_the_trainer_does_not_map_is_refused_naming_why(tmp_path):
    glm = model(tmp_path, **{**MIMO, "model_type": "glm4_moe"})
    with pytest.raises(ConfigError, match="--enable-mtp-training: .* is model_type 'glm4_moe'; the Megatron trainer "
                                          "builds and trains the multi-token-prediction layers of mimo only"):
        parse_config(["--hf-checkpoint", glm, "--rm-type", "math", "--mtp-num-layers", "1", "--enable-mtp-training"])


def test_the_megatron_trainer_refuses_mtp_layers_it_does_not_map():
    """megatron_args given another way (a YAML's megatron_args) stop at the model config, not at
    the first forward."""
    from types import SimpleNamespace

    from agentrl.trainers.megatron.args import parse_megatron_args
    from agentrl.trainers.megatron.families.common import Family
    from agentrl.trainers.megatron.model import transformer_config

    hf = SimpleNamespace(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0)
    margs = parse_megatron_args({"mtp_num_layers": "1"})
    with pytest.raises(ConfigError, match="mtp_num_layers: model family 'qwen3' has no multi-token-prediction layers"):
        transformer_config(hf, Family("qwen3", False, True), margs, dtype="float32", device="cpu")
    margs = parse_megatron_args({"enable_mtp_training": None})
    with pytest.raises(ConfigError, match="--enable-mtp-training needs the MTP layers built"):
        transformer_config(hf, Family("qwen3", False, True), margs, dtype="float32", device="cpu")


def test_slimes_mimo_eagle_script_runs_unchanged(tmp_path, monkeypatch):
    """scripts/run-mimo-7B-rl-eagle.sh (slime 624b824) as bash builds its arguments, over MiMo-7B-RL's
    config.json: the Megatron trainer builds and trains the MTP layer, TP 2 with sequence parallelism."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from slime_scripts import script_args, slime_checkout

    (tmp_path / "slime").mkdir()
    slime = slime_checkout(tmp_path / "slime")
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    monkeypatch.chdir(slime)
    args = [str(tmp_path) + a if a.startswith(("/root/", "/tmp/")) else a
            for a in script_args(slime, "scripts/run-mimo-7B-rl-eagle.sh", scratch=tmp_path)]
    folder = Path(args[args.index("--hf-checkpoint") + 1])
    folder.mkdir(parents=True)
    model(folder, **MIMO)
    cfg, _ = parse_config(args)
    m = cfg.megatron_args
    assert (cfg.train.trainer, m["mtp_num_layers"], m["mtp_loss_scaling_factor"], m["tensor_model_parallel_size"]) == \
        ("megatron", "1", "0.2", "2")
    assert "enable_mtp_training" in m and "sequence_parallel" in m
    assert cfg.sglang_args["speculative-algorithm"] == "EAGLE"
