"""The default tiny model is built on first use: two processes that start on a fresh machine at
once (two `agentrl train`, or pytest-xdist's workers) both end with the one model."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_two_processes_build_the_tiny_model_at_once(tmp_path):
    code = "from agentrl.models import build_tiny_model, load_tokenizer; p = build_tiny_model(); " \
           "print(p, len(load_tokenizer(str(p))))"
    env = {**os.environ, "AGENTRL_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert outs[0][0] == outs[1][0]
    models = tmp_path / "models"
    assert [d.name for d in models.iterdir()] == [os.path.basename(outs[0][0].split()[0])]  # no leftover tmp folder
