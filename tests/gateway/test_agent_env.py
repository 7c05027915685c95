"""@agent_env and AgentRunner: rewards from the return value, a reward function or an env's
grader; agents that raise, hang or never call end with reward 0 and a reason, within a bound;
a command line agent gets OPENAI_BASE_URL."""

import asyncio
import sys
import time

import pytest
from helpers import ScriptedEngine, settings

from agentrl.errors import ConfigError
from agentrl.gateway import AgentRunner, agent_env
from agentrl.registry import make
from agentrl.rollout.agent_loop import Renderer
from agentrl.types import SampleStatus


async def ask(client, task):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return reply.choices[0].message.content


@agent_env("test-gw-return")
async def returns_score(task, client):
    """Scores itself: 1 when the reply says yes."""
    return float((await ask(client, task)).strip() == "yes")


@agent_env("test-gw-grader", grader="math")
async def graded_by_math(task, client):
    return await ask(client, task)


@agent_env("test-gw-reward", reward=lambda task, result: {"score": len(result.messages) / 10, "turns": 1.0})
async def with_reward(task, client):
    await ask(client, task)


@agent_env("test-gw-raises")
async def raises(task, client):
    await ask(client, task)
    raise ValueError("the agent broke")


@agent_env("test-gw-hangs", timeout_s=0.5)
async def hangs(task, client):
    await ask(client, task)
    await asyncio.sleep(3600)


@agent_env("test-gw-stubborn", timeout_s=0.5)
async def ignores_cancellation(task, client):
    """Swallows the runner's cancellation (and then the event loop's at its shutdown)."""
    await ask(client, task)
    for _ in range(2):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass


@agent_env("test-gw-silent")
async def never_calls(task, client):
    return 1.0


@agent_env("test-gw-no-reward")
async def returns_text(task, client):
    await ask(client, task)
    return "not a number"


agent_env("test-gw-command", grader="math", timeout_s=60, sandbox=False, command=(
    f"{sys.executable} -c \"import json, os, openai; task = json.loads(os.environ['AGENTRL_TASK']); "
    "c = openai.OpenAI(max_retries=0); "
    "r = c.chat.completions.create(model='x', messages=[{'role': 'user', 'content': task['prompt']}]); "
    "print('log line'); print(r.choices[0].message.content)\""))(None)


def play(tokenizer, name, replies, task=None, **env_kwargs):
    engine = ScriptedEngine(tokenizer, replies)

    async def go():
        runner = AgentRunner(renderer=Renderer(tokenizer, True), client=engine, settings_for=lambda env: settings())
        try:
            return await runner(make(name, **env_kwargs), task or {"prompt": "say yes", "label": "3"}, trajectory_id="g0-s0",
                                group_id=0, index=0, seed=1, env_name=name)
        finally:
            await runner.aclose()

    return asyncio.run(go()), engine


def test_reward_from_the_return_value(tokenizer):
    samples, _ = play(tokenizer, "test-gw-return", ["yes"])
    assert len(samples) == 1 and samples[0].reward == 1.0 and samples[0].status == SampleStatus.COMPLETED
    assert samples[0].num_trained_tokens == len(tokenizer.encode("yes", add_special_tokens=False)) + 1
    samples, _ = play(tokenizer, "test-gw-return", ["no"])
    assert samples[0].reward == 0.0 and "agent_fault" not in samples[0].metadata


def test_the_engine_is_sent_the_trajectorys_sampling_seed(tokenizer):
    """As the agent loop: each request of a session carries its trajectory's sampling seed, so the
    agent's tokens depend on the run's seed and the trajectory, not on the engine's batching."""
    from agentrl.rollout.agent_loop import trajectory_sampling_seed

    _, engine = play(tokenizer, "test-gw-return", ["yes"])
    (_, params, _), = engine.calls
    assert params["sampling_seed"] == trajectory_sampling_seed(1, "g0-s0") != trajectory_sampling_seed(1, "g0-s1")
    assert trajectory_sampling_seed(1, "g0-s0") != trajectory_sampling_seed(2, "g0-s0")


@pytest.mark.parametrize("answer, reward", [("so \\boxed{3}", 1.0), ("\\boxed{4}", 0.0)])
def test_reward_from_an_env_grader(tokenizer, answer, reward):
    samples, _ = play(tokenizer, "test-gw-grader", [answer], {"prompt": "1+2?", "label": "3"})
    assert samples[0].reward == reward


def test_reward_function_over_the_final_state(tokenizer):
    samples, _ = play(tokenizer, "test-gw-reward", ["hello"])
    assert samples[0].reward == {"score": pytest.approx(0.2), "turns": 1.0}  # user + assistant messages


def test_command_line_agent_gets_the_endpoint_in_its_environment(tokenizer):
    samples, engine = play(tokenizer, "test-gw-command", ["\\boxed{3}"], {"prompt": "1+2?", "label": "3"})
    assert len(engine.calls) == 1 and samples[0].reward == 1.0 and samples[0].metadata["agent_output"] == "\\boxed{3}"


@pytest.mark.parametrize("name, reason", [
    ("test-gw-raises", "the agent raised ValueError: the agent broke"),
    ("test-gw-hangs", "timeout: the agent ran past 0.5 s"),
    ("test-gw-stubborn", "timeout: the agent ran past 0.5 s"),
    ("test-gw-silent", "the agent never called the endpoint"),
])
@pytest.mark.slow
def test_a_broken_agent_ends_its_trajectory_with_reward_0_and_a_reason(tokenizer, name, reason):
    t0 = time.monotonic()
    samples, _ = play(tokenizer, name, ["yes"])
    assert time.monotonic() - t0 < 15  # the time bound, plus the grace a cancelled agent gets, plus start-up
    assert len(samples) == 1 and samples[0].reward == 0.0 and samples[0].metadata["agent_fault"] == reason
    assert samples[0].status != SampleStatus.FAILED  # the agent's fault is scored, not masked


def test_an_agent_env_without_a_reward_source_stops_the_run(tokenizer):
    with pytest.raises(ConfigError, match="reward must be a number"):
        play(tokenizer, "test-gw-no-reward", ["hi"])


def test_agent_env_lends_the_graders_tasks_and_label_requirement():
    from agentrl.registry import get_spec

    cls = get_spec("test-gw-grader").load()
    assert cls.needs_label and next(iter(cls.dataset(seed=0)))["label"] is not None
    with pytest.raises(TypeError, match="async def"):
        agent_env("test-gw-sync")(lambda task, client: None)


def test_a_command_agents_sandbox_is_shared_with_its_grader():
    """The run's pool (or the decorator's own, say of a custom image) serves the command and the
    grader env alike, so the grading sees the command's files; a grader without a sandbox gets none."""
    from agentrl.sandboxes import SandboxPool, resolve_backend

    try:
        resolve_backend("local")
    except Exception as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    pool, run_pool = SandboxPool("local", warm=0, max_active=2), SandboxPool("local", warm=0, max_active=2)
    agent_env("test-gw-own-pool", grader="code", sandbox=pool, command="true")(None)
    env = make("test-gw-own-pool")
    assert env.sandbox is pool and env.grader_kwargs["sandbox"] is pool
    env = make("test-gw-own-pool", sandbox=run_pool)  # what `agentrl train` passes (build.tool_kwargs)
    assert env.sandbox is run_pool and env.grader_kwargs["sandbox"] is run_pool
    agent_env("test-gw-math-pool", grader="math", command="true")(None)
    env = make("test-gw-math-pool", sandbox=run_pool)
    assert env.sandbox is run_pool and "sandbox" not in env.grader_kwargs  # math takes none
    assert make("test-gw-command").sandbox is None  # sandbox=False: a host subprocess


def test_a_sandbox_that_cannot_be_had_fails_the_trajectory_not_the_agent(tokenizer):
    """Infrastructure, not the agent's doing: the sample is FAILED (masked), never scored 0."""
    from agentrl.sandboxes import SandboxError

    class NoSandboxes:
        async def get(self):
            raise SandboxError("no sandbox today")

        async def release(self, sb):
            pass

    agent_env("test-gw-no-sandbox", command="true")(None)
    samples, engine = play(tokenizer, "test-gw-no-sandbox", [], {"prompt": "hi"}, sandbox=NoSandboxes())
    assert len(samples) == 1 and samples[0].status == SampleStatus.FAILED and not engine.calls
    assert samples[0].metadata["error"] == "setting up the agent's sandbox: SandboxError: no sandbox today"


def test_a_sandbox_that_dies_under_the_command_fails_the_trajectory(tokenizer, tmp_path):
    from agentrl.sandboxes import SandboxError, SandboxLimits

    class DyingBox:
        id, backend, uid, limits, bridge_dir = "fake", "fake", None, SandboxLimits(), tmp_path

        async def exec(self, *args, **kw):
            raise SandboxError("the container died")

    class Pool:
        async def get(self):
            return DyingBox()

        async def release(self, sb):
            pass

    agent_env("test-gw-dying-sandbox", command="true")(None)
    samples, _ = play(tokenizer, "test-gw-dying-sandbox", [], {"prompt": "hi"}, sandbox=Pool())
    assert len(samples) == 1 and samples[0].status == SampleStatus.FAILED
    assert samples[0].metadata["error"] == "sandbox: the container died" and "agent_fault" not in samples[0].metadata
    assert list(tmp_path.iterdir()) == []  # the session's socket is gone with it


def test_a_sandbox_that_still_answers_after_its_exec_raised_is_the_agents_fault(tokenizer, tmp_path):
    """The exec raised SandboxError but the sandbox answers a ping (its server restarts): what broke
    the exec is what the command did there. Scored 0 with the reason, the sandbox never reused."""
    from agentrl.sandboxes import SandboxError, SandboxLimits

    class BrokenByItsCommand:
        id, backend, uid, limits, bridge_dir, tainted = "fake", "fake", None, SandboxLimits(), tmp_path, ""

        async def exec(self, *args, **kw):
            raise SandboxError("sandbox fake: cannot restart after exec")

        async def ping(self):
            pass

        def taint(self, why):
            self.tainted = why

    box = BrokenByItsCommand()

    class Pool:
        async def get(self):
            return box

        async def release(self, sb):
            pass

    agent_env("test-gw-broken-sandbox", command="true")(None)
    samples, _ = play(tokenizer, "test-gw-broken-sandbox", [], {"prompt": "hi"}, sandbox=Pool())
    assert len(samples) == 1 and samples[0].status != SampleStatus.FAILED and samples[0].reward == 0.0
    assert samples[0].metadata["agent_fault"] == ("the agent broke its sandbox: sandbox fake: cannot restart "
                                                  "after exec"), samples[0].metadata
    assert "cannot restart" in box.tainted


def test_a_grader_that_finds_the_agent_at_fault_records_why(tokenizer):
    """A grader env's step that reports the agent's fault (info["agent_fault"], as ToolEnv does for a
    file the agent broke): the sample carries the reason, not just the 0."""
    from agentrl.env import Env
    from agentrl.registry import register_env

    @register_env("test-gw-faulting-grader")
    class FaultingGrader(Env):
        async def areset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "hi"}], {}

        async def astep(self, action):
            return [], 0.0, True, False, {"agent_fault": f"AgentFault: the agent's answer {action!r} is a FIFO"}

    @agent_env("test-gw-faulted", grader="test-gw-faulting-grader")
    async def agent(task, client):
        return await ask(client, task)

    samples, _ = play(tokenizer, "test-gw-faulted", ["yes"])
    assert samples[0].status == SampleStatus.COMPLETED and samples[0].reward == 0.0
    assert samples[0].metadata["agent_fault"] == "AgentFault: the agent's answer 'yes' is a FIFO"


def test_a_parser_past_its_bound_scores_the_trajectory_0_with_the_reason(tokenizer):
    """A user-registered tool-call parser that hangs on what the model wrote: the agent still gets
    its reply, and the trajectory scores 0 with the parser's fault, whatever the agent returns."""
    from agentrl.tools import parsers

    @parsers.register_parser("test-gw-hanging-parser", timeout=1.0)
    def hanging(text, tools):
        while True:
            time.sleep(0.05)

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    @agent_env("test-gw-parser-fault", tool_parser="test-gw-hanging-parser")
    async def with_tools(task, client):
        reply = await client.chat.completions.create(model="policy", tools=tools,
                                                     messages=[{"role": "user", "content": task["prompt"]}])
        return float(reply.choices[0].message.content == "yes")

    try:
        samples, _ = play(tokenizer, "test-gw-parser-fault", ["yes"])
    finally:
        parsers._PARSERS.pop("test-gw-hanging-parser", None)
        parsers._TIMEOUTS.pop("test-gw-hanging-parser", None)
    assert samples[0].reward == 0.0 and samples[0].status != SampleStatus.FAILED
    assert samples[0].metadata["agent_fault"].startswith("tool-call parser:"), samples[0].metadata
