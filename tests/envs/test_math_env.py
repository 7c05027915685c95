"""math: hand-written answers graded by math_verify, and one training iteration via the CLI."""

from __future__ import annotations

import itertools

import pytest

import agentrl
from agentrl.envs.math_env import MathEnv, generate, last_boxed

from envtest_helpers import assert_iteration_ok, train_one_iteration

TASK = {"prompt": "Ayla has 3 bags with 4 plums in each. How many plums?", "label": "12", "metadata": {}}


def test_registered_and_dataset_is_seeded():
    env = agentrl.make("math")
    assert isinstance(env, MathEnv)
    a = list(itertools.islice(MathEnv.dataset(seed=3), 20))
    b = list(itertools.islice(MathEnv.dataset(seed=3), 20))
    assert a == b and a != list(itertools.islice(MathEnv.dataset(seed=4), 20))
    for task in a:  # every label is the integer its problem asks for
        assert int(task["label"]) == int(task["label"]) and task["prompt"].endswith("?")
    assert len(list(MathEnv.dataset(seed=0, n_problems=7))) == 7


def test_correct_answer():
    env = MathEnv()
    obs, info = env.reset(seed=0, options=TASK)
    assert "\\boxed{}" in obs and obs.startswith("Ayla has 3 bags")
    obs, reward, terminated, truncated, info = env.step("3 * 4 = 12, so the answer is \\boxed{12}.")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["answer"] == "12"
    env.reset(options=TASK)
    assert env.step("\\boxed{\\frac{24}{2}}")[1] == 1.0  # equal as math, not as text
    env.reset(options=TASK)
    assert env.step("first \\boxed{7}, no wait: \\boxed{12.0}")[1] == 1.0  # the last box counts


def test_wrong_and_malformed_answers():
    env = MathEnv()
    env.reset(options=TASK)
    assert env.step("\\boxed{13}")[1:3] == (0.0, True)
    env.reset(options=TASK)
    _, reward, terminated, _, info = env.step("The answer is 12")  # no \boxed{}
    assert (reward, terminated) == (0.0, True) and "boxed" in info["error"]
    env.reset(options=TASK)
    assert env.step("\\boxed{12")[1] == 0.0  # cut off: unbalanced braces
    env.reset(options=TASK)
    assert env.step("\\boxed{" + "1" * 5000 + "}")[1] == 0.0
    relaxed = MathEnv(require_boxed=False, format_reward=0.1)
    relaxed.reset(options=TASK)
    assert relaxed.step("so\n12")[1] == 1.0
    relaxed.reset(options=TASK)
    assert relaxed.step("\\boxed{11}")[1] == 0.1


def test_async_step_and_message_prompts(run_async):
    env = MathEnv()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    obs, _ = run_async(env.areset(options={"prompt": messages, "label": 2}))
    assert obs == messages  # a formatted prompt passes through
    assert run_async(env.astep("\\boxed{2}"))[1] == 1.0


def test_last_boxed():
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} and \\fbox{2}") == "2"
    assert last_boxed("none") is None


@pytest.mark.e2e
def test_train_one_iteration(tmp_path):
    out = tmp_path / "run"
    rows = train_one_iteration("math", out, "--rollout-max-response-len", "128")
    assert_iteration_ok(out, rows)
