"""examples/: every config resolves, and the custom env trains through --env-module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from envtest_helpers import AGENTRL, ROOT, assert_iteration_ok, train_one_iteration

EXAMPLES = ROOT / "examples"
FOLDERS = ["target_token", "math", "math_python", "search_r1", "code", "custom_env"]


@pytest.mark.e2e
@pytest.mark.parametrize("folder", FOLDERS)
def test_example_folder_is_complete_and_config_resolves(folder):
    d = EXAMPLES / folder
    readme = (d / "README.md").read_text()
    assert "agentrl train" in readme
    if folder != "custom_env":
        assert "--model /path/to/" in readme
    if folder not in ("custom_env", "target_token"):
        assert "--prompt-data" in readme
    config = yaml.safe_load((d / "config.yaml").read_text())
    proc = subprocess.run([str(AGENTRL), "train", "--config", str(d / "config.yaml"), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["run"]["env"] == config["env"]
    assert resolved["rollout"]["num_rollout"] == config["num_rollout"]


@pytest.mark.e2e
def test_custom_env_trains_via_env_module(tmp_path):
    out = tmp_path / "run"
    rows = train_one_iteration("my-env", out, "--env-module", "examples/custom_env/my_env.py")
    assert_iteration_ok(out, rows)
    assert rows[0]["turns_mean"] >= 1


def test_custom_env_by_hand():
    sys.path.insert(0, str(EXAMPLES / "custom_env"))
    try:
        import agentrl
        from agentrl.registry import import_env_module

        import_env_module(str(EXAMPLES / "custom_env" / "my_env.py"))
        env = agentrl.make("my-env")
        obs, _ = env.reset(options={"prompt": "guess", "label": 7})
        assert env.step("5")[:3] == ("Higher.", 0.0, False)
        assert env.step("I say 9")[:3] == ("Lower.", 0.0, False)
        assert env.step("hmm")[0] == "Please answer with a number."
        obs, reward, terminated, *_ = env.step("7")
        assert terminated and reward == pytest.approx(1.0 - 0.15 * 3)
    finally:
        sys.path.remove(str(EXAMPLES / "custom_env"))


def test_builtin_envs_are_registered():
    import agentrl

    names = {spec.name for spec in agentrl.list_envs()}
    assert {"target-token", "math", "search-r1", "math-python", "code"} <= names
    for name in ("math", "search-r1", "code"):
        spec = next(s for s in agentrl.list_envs() if s.name == name)
        assert spec.qualified_name.startswith("agentrl.envs.") and not spec.description.startswith("(cannot import")
