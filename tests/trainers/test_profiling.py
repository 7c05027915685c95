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
    outs = [t.train_rollout(samples) for _ in range(3)]
    folder = tmp_path / "profile"
    # the profiled step's summary travels back with its metrics (the driver prints it, on any node)
    assert ["profile_summaries" in out for out in outs] == [False, True, False]
    [summary] = outs[1]["profile_summaries"]
    assert summary == (folder / "train_overall_rank0_step1.txt").read_text().split("\n", 1)[0]
    # ranked by real work: our own labelled ranges span their kernels and are left out
    ranked = summary.split("most self CPU time: ", 1)[1]
    assert not any(f"{name} " in ranked for name in ("policy_step", "train_actor", "old_logprobs", "advantages"))
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
    assert len(profiled.pop("profile_summaries")) == 1
    assert plain.keys() == profiled.keys()
    for k in plain.keys() - {"train/logprobs_s", "train/actor_s"}:  # the figures, not the clock
        assert profiled[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-7), k


def test_an_empty_step_range_is_refused(tmp_path):
    from agentrl.config import parse_config

    with pytest.raises(ConfigError, match="--profile-step-end"):
        parse_config(["--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"])
    cfg, _ = parse_config(["--use-pytorch-profiler", "--profile-target", "train_actor", "train_log_probs"])
    assert cfg.train.profile_target == ["train_actor", "train_log_probs"]
