"""`agentrl train` with the models it serves beside the policy (agentrl.teacher): an OPD teacher
in an engine group of its own (--use-opd --opd-type sglang --opd-teacher-load, embedded on the
CPU) and an LLM judge in another (--rm-type llm-judge --judge-load). The run ends cleanly; every
trained sample carries the teacher's logprob of each response token and the judge's verdict;
the reverse KL to a teacher that differs from the policy is reported and positive."""

import json
import shutil
import subprocess

import pytest
import torch

from spine_helpers import agentrl_cli, run_env

pytestmark = pytest.mark.e2e  # the lane: runs agentrl end to end (docs/development.md, "Test lanes")


def test_train_with_a_served_teacher_and_a_served_judge(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    teacher = tmp_path / "teacher"  # the tiny model with every logit x4: another distribution
    shutil.copytree(tiny_model, teacher)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(4)
    model.save_pretrained(teacher)
    out = tmp_path / "run"
    done = subprocess.run([agentrl_cli(), "train", "--env", "target-token", "--model", str(tiny_model),
                           "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "4", "--use-opd", "--opd-type", "sglang", "--opd-teacher-load",
                           str(teacher), "--rm-type", "llm-judge", "--judge-load", str(tiny_model),
                           "--output-dir", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=run_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Unclosed client session" not in done.stderr  # the judge's sessions are closed with the run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["opd_reverse_kl"] > 0 for r in rows)
    for line in (out / "trajectories" / "rollout_00001.jsonl").read_text().splitlines():
        t = json.loads(line)
        assert len(t["metadata"]["teacher_logprobs"]) == len(t["response_tokens"])
        assert all(lp <= 0 for lp in t["metadata"]["teacher_logprobs"])
        assert t["metadata"]["judge"]["reason"]  # the tiny judge writes no verdict: 0 with the reason
    assert (out / "logs" / "teacher").is_dir() and (out / "logs" / "judge").is_dir()
    startup = json.loads((out / "run.json").read_text())["startup"]  # their start-up is timed, before the policy's
    assert startup["served_models"][0] < startup["served_models"][1] <= startup["engines"][0]
