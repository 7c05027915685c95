"""slime's multi-token-prediction flags. `--mtp-num-layers N` (scripts/models/mimo-7B-rl.sh,
run-glm4.7-30B-A3B.sh) is checked against the checkpoint's config.json and the layers are not
built (a notice says so): before, it reached megatron-core's TransformerConfig, and megatron-core
0.16.1's GPTModel._postprocess then clones the labels, which the trainer passes as None.
`--enable-mtp-training` stays refused, saying why."""

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


def test_mtp_num_layers_is_checked_against_config_json_and_not_handed_to_megatron(tmp_path):
    base = ["--hf-checkpoint", model(tmp_path, **MIMO), "--rm-type", "math", "--mtp-loss-scaling-factor", "0.2"]
    cfg, ns = parse_config(base + ["--mtp-num-layers", "1"])
    assert "mtp_num_layers" not in cfg.megatron_args
    assert [n for n in ns.slime_notices if n.startswith("--mtp-num-layers")] == [
        n for n in ns.slime_notices if "built without the checkpoint's multi-token-prediction layers" in n]
    assert any(n.startswith("--mtp-num-layers: accepted, no effect here") for n in ns.slime_notices)
    with pytest.raises(ConfigError, match=r"--mtp-num-layers 2 differs from .*config.json \(1\)"):
        parse_config(base + ["--mtp-num-layers", "2"])
    (tmp_path / "qwen2").mkdir()
    dense = model(tmp_path / "qwen2", **{**MIMO, "model_type": "qwen2", "num_nextn_predict_layers": 0})
    with pytest.raises(ConfigError, match="--mtp-num-layers 1: .*config.json has no value to check it against"):
        parse_config(["--hf-checkpoint", dense, "--rm-type", "math", "--mtp-num-layers", "1"])


def test_the_megatron_trainer_refuses_mtp_layers_it_would_not_build():
    """megatron_args given another way (a YAML's megatron_args) stop at the model config, not at
    the first forward."""
    from types import SimpleNamespace

    from agentrl.trainers.megatron.args import parse_megatron_args
    from agentrl.trainers.megatron.families.common import Family
    from agentrl.trainers.megatron.model import transformer_config

    hf = SimpleNamespace(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0)
    margs = parse_megatron_args({"mtp_num_layers": "1"})
    with pytest.raises(ConfigError, match="mtp_num_layers: the Megatron trainer builds no multi-token-prediction"):
        transformer_config(hf, Family("qwen3", False, True), margs, dtype="float32", device="cpu")


def test_enable_mtp_training_is_refused_saying_why():
    with pytest.raises(ConfigError, match="--enable-mtp-training: not supported by agentrl: training the "
                                          "multi-token-prediction layers needs them built"):
        parse_config(["--enable-mtp-training"])
