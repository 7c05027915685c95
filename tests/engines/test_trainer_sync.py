"""The trainer's side of the weight sync (agentrl.weight_sync.TrainerSync), without Ray: which path
`--weight-sync-mode auto` takes, and what a rank other than 0 runs as its part of rank 0's exports."""

from types import SimpleNamespace

import pytest
import torch

from agentrl.config import parse_config
from agentrl.weight_sync import LeadingRank, TrainerSync


class RecordingTrainer:
    def __init__(self, device: str = "cpu"):
        self.device, self.calls, self.read = torch.device(device), [], 0

    def named_tensors(self):
        for name in ("a", "b"):
            self.read += 1
            yield name, torch.zeros(2)

    def save_hf(self, folder):
        self.calls.append(("save_hf", folder))

    def save_adapter(self, folder):
        self.calls.append(("save_adapter", folder))


@pytest.mark.parametrize("argv, device, mode", [
    (["--rollout-engine", "sglang"], "cuda", "distributed"),  # engines on GPUs of their own: a process group
    (["--rollout-engine", "sglang", "--colocate"], "cuda", "tensor"),  # on the trainer's GPU: CUDA IPC
    (["--rollout-engine", "sglang"], "cpu", "tensor"),
    ([], "cuda", "tensor"),  # the embedded engine
    (["--rollout-engine", "sglang", "--weight-sync-mode", "disk"], "cuda", "disk"),  # asked for: kept
])
def test_auto_mode_picks_the_path_for_where_the_engines_are(argv, device, mode):
    cfg, _ = parse_config(argv)
    trainer = SimpleNamespace(device=torch.device(device))  # no CUDA needed: only the device is read
    assert TrainerSync(cfg, trainer).mode() == mode


def test_a_rank_other_than_0_runs_the_export_it_is_asked_for():
    cfg, _ = parse_config([])
    trainer = RecordingTrainer()
    sync = TrainerSync(cfg, trainer)
    sync.take_part("save_hf", "/tmp/x")
    sync.take_part("save_adapter", "/tmp/y")
    assert trainer.calls == [("save_hf", "/tmp/x"), ("save_adapter", "/tmp/y")]
    sync.take_part("named_tensors")  # read to the end: the collectives rank 0's export is in
    assert trainer.read == 2


def test_rank_0_of_several_exports_through_a_leading_rank():
    """(The export itself waits for the other ranks' actors: tests/engines/test_tp_engines.py.)"""
    cfg, _ = parse_config([])
    trainer = RecordingTrainer()
    sync = TrainerSync(cfg, trainer)
    sync.lead(["rank 1's actor"])
    assert isinstance(sync.trainer, LeadingRank) and sync.trainer.inner is trainer
    assert sync.trainer.others == ["rank 1's actor"] and sync.trainer.device == trainer.device  # the rest passes through
