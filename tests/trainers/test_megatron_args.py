"""Megatron's own flags pass through `agentrl train` by name and arrive typed in megatron-core's
config dataclasses."""

import dataclasses

import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError
from agentrl.trainers.megatron.flags import CORE_FIELDS, TRAINER_FLAGS, TRAINING_FLAGS, is_megatron_flag


def test_megatron_flags_pass_through_by_name():
    cfg, _ = parse_config([
        "--trainer", "megatron", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--pipeline-model-parallel-size=2", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-distributed-optimizer", "--no-gradient-accumulation-fusion",
        "--lr-decay-style", "cosine", "--lr", "1e-5", "--micro-batch-size", "4", "--max-tokens-per-gpu", "8192",
        "--sglang-mem-fraction-static", "0.5", "--advantage-estimator", "gspo",
    ])
    assert cfg.train.trainer == "megatron" and cfg.train.lr == 1e-5 and cfg.train.micro_batch_size == 4
    assert cfg.train.max_tokens_per_gpu == 8192 and cfg.algo.advantage_estimator == "gspo"
    assert cfg.megatron_args == {
        "tensor_model_parallel_size": "2", "sequence_parallel": None, "pipeline_model_parallel_size": "2",
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": "1",
        "use_distributed_optimizer": None, "no_gradient_accumulation_fusion": None, "lr_decay_style": "cosine",
    }
    assert cfg.sglang_args == {"mem-fraction-static": "0.5"}


def test_unknown_flags_still_fail():
    with pytest.raises(SystemExit):
        parse_config(["--tensor-model-parallel-sise", "2"])


def test_megatron_args_are_typed_for_megatron_core():
    from agentrl.trainers.megatron.args import parse_megatron_args

    m = parse_megatron_args({"tensor_model_parallel_size": "2", "sequence_parallel": None,
                             "recompute_granularity": "full", "recompute_num_layers": "1",
                             "use_distributed_optimizer": None, "no_gradient_accumulation_fusion": None,
                             "adam_eps": "1e-6", "lr_decay_style": "cosine", "overlap_grad_reduce": "false",
                             "recompute_modules": "core_attn,mlp"})
    assert m.tp == 2 and m.transformer["sequence_parallel"] is True
    assert m.transformer["recompute_granularity"] == "full" and m.transformer["recompute_num_layers"] == 1
    assert m.transformer["gradient_accumulation_fusion"] is False
    assert m.transformer["recompute_modules"] == ["core_attn", "mlp"]
    assert m.optimizer["use_distributed_optimizer"] is True and m.ddp["use_distributed_optimizer"] is True
    assert m.optimizer["adam_eps"] == 1e-6 and m.ddp["overlap_grad_reduce"] is False
    assert m.trainer == {"lr_decay_style": "cosine"}
    with pytest.raises(ConfigError, match="expected true/false"):
        parse_megatron_args({"sequence_parallel": "maybe"})


def test_flag_list_matches_installed_megatron_core():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for c in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)
              for f in dataclasses.fields(c)}
    # every field of the installed version passes through (the list is the union over 0.16.1 and
    # 0.19.2; callables and dtypes are set by the trainer, not by flags)
    set_by_trainer = {"timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
                      "param_sync_func", "init_method", "output_layer_init_method", "activation_func", "params_dtype",
                      "pipeline_dtype", "autocast_dtype", "config_logger_dir", "embedding_init_method",
                      "barrier_with_L1_time"}
    assert {f for f in fields - CORE_FIELDS if not f.startswith("_")} <= set_by_trainer
    assert {target for target, _ in TRAINING_FLAGS.values()} <= fields
    assert is_megatron_flag("tensor_model_parallel_size") and is_megatron_flag("transformer_impl")
    assert not is_megatron_flag("rollout_batch_size") and TRAINER_FLAGS & fields == {"transformer_impl"}


def test_scale_flags_from_slime_reach_the_trainer():
    """slime's MoE / pipeline flags: the expert layout, virtual stages given as layers per stage
    (turned into megatron-core's virtual size), and R3 (which the rollout asks the engines for)."""
    from agentrl.trainers.megatron.args import parse_megatron_args
    from agentrl.trainers.megatron.flags import wants_routing_replay

    cfg, _ = parse_config(["--trainer", "megatron", "--expert-model-parallel-size", "4",
                           "--expert-tensor-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "3", "--use-rollout-routing-replay"])
    assert wants_routing_replay(cfg.megatron_args)
    assert not wants_routing_replay({"use_rollout_routing_replay": "false"}) and not wants_routing_replay({})
    margs = parse_megatron_args(cfg.megatron_args)
    assert (margs.ep, margs.etp, margs.pp, margs.vpp(12)) == (4, 1, 2, 2) and margs.flag("use_rollout_routing_replay")
    # the launched SGLang servers are asked to return the routed experts R3 replays (not the embedded engine)
    from agentrl.build import engine_sglang_args

    assert engine_sglang_args(cfg) == {}
    sglang, _ = parse_config(["--trainer", "megatron", "--rollout-engine", "sglang", "--use-rollout-routing-replay",
                              "--sglang-mem-fraction-static", "0.5"])
    assert engine_sglang_args(sglang) == {"enable-return-routed-experts": None, "mem-fraction-static": "0.5"}
    plain, _ = parse_config(["--trainer", "megatron", "--rollout-engine", "sglang"])
    assert engine_sglang_args(plain) == {}
    with pytest.raises(ConfigError, match="do not split"):
        margs.vpp(10)
    assert parse_megatron_args({"tensor_model_parallel_size": "2"}).etp == 2  # megatron-core's default: TP
    with pytest.raises(ConfigError, match="contradicts"):
        parse_megatron_args({"pipeline_model_parallel_size": "2", "num_layers_per_virtual_pipeline_stage": "3",
                             "virtual_pipeline_model_parallel_size": "3"}).vpp(12)
