"""slime's --use-pytorch-profiler in the loop (issue #34: a profile of the train step that shows
where the time goes): only the asked-for steps are profiled, each target writes a Chrome trace
and an operator table, train_overall labels the iteration's phases, and the trainer's result is
the same with the profiler on."""

import gzip
import json

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.errors import ConfigError
from agentrl.trainers.torch_trainer import TorchTrainer
from megatron_helpers import make_samples


def trainer(tiny_model, tmp_path, **profile):
    torch.manual_seed(0)
    tc = TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=3, profile_dir=str(tmp_path / "profile"),
                     **profile)
    return TorchTrainer(str(tiny_model), train=tc, algo=AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1),
                        temperature=0.8)


def trace_names(path) -> set[str]:
    with gzip.open(path) as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_overall_profiles_only_the_asked_steps_with_each_phase_labelled(tiny_model, tmp_path):
    t = trainer(tiny_model, tmp_path, use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2,
                profile_target=["train_overall", "train_actor"])
    samples = make_samples(6)
    for _ in range(3):
        t.train_rollout(samples)
    folder = tmp_path / "profile"
    # train_actor was asked too, but inside the overall recording it is a range of that trace
    assert sorted(p.name for p in folder.iterdir()) == ["train_overall_rank0_step1.json.gz",
                                                         "train_overall_rank0_step1.txt"]
    names = trace_names(folder / "train_overall_rank0_step1.json.gz")
    # the phases (the KL loss needs the reference pass) and real work inside them
    assert {"old_logprobs", "ref_logprobs", "advantages", "train_actor", "policy_step"} <= names
    assert "aten::mm" in names or "aten::addmm" in names
    table = (folder / "train_overall_rank0_step1.txt").read_text()
    assert "Self CPU" in table and "policy_step" in table


def test_inner_targets_alone_get_traces_of_their_own(tiny_model, tmp_path):
    t = trainer(tiny_model, tmp_path, use_pytorch_profiler=True, profile_step_start=0, profile_step_end=1,
                profile_target=["train_log_probs", "train_actor"])
    t.train_rollout(make_samples(6))
    folder = tmp_path / "profile"
    assert {p.name for p in folder.glob("*.json.gz")} == {"train_log_probs_rank0_step0.json.gz",
                                                         "train_actor_rank0_step0.json.gz"}
    assert "policy_step" not in trace_names(folder / "train_log_probs_rank0_step0.json.gz")
    assert "policy_step" in trace_names(folder / "train_actor_rank0_step0.json.gz")


def test_the_step_is_the_same_with_the_profiler(tiny_model, tmp_path):
    samples = make_samples(6)
    plain = trainer(tiny_model, tmp_path / "a").train_rollout(samples)
    profiled = trainer(tiny_model, tmp_path / "b", use_pytorch_profiler=True, profile_step_start=0,
                       profile_step_end=1).train_rollout(samples)
    assert plain.keys() == profiled.keys()
    for k in plain:
        assert profiled[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-7), k


def test_an_empty_step_range_is_refused(tmp_path):
    from agentrl.config import parse_config

    with pytest.raises(ConfigError, match="--profile-step-end"):
        parse_config(["--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"])
    cfg, _ = parse_config(["--use-pytorch-profiler", "--profile-target", "train_actor", "train_log_probs"])
    assert cfg.train.profile_target == ["train_actor", "train_log_probs"]
