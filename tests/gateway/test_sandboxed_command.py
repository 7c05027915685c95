"""A command agent runs in its trajectory's sandbox (local and docker backends), with no
network: OPENAI_BASE_URL is the sandbox's loopback, bridged to its own session by a unix
socket (agentrl.sandboxes.bridge). The grader (the code env's hidden tests) sees the files it
wrote; the sample holds the engine's exact tokens; another sandbox cannot reach the session;
a command that hangs or floods its output ends within its bound, reward 0, with the reason."""

import asyncio
import json
import os
import shlex
import stat
import sys
import time
from pathlib import Path

import pytest
from helpers import ScriptedEngine, settings

from agentrl.gateway import AgentRunner, Gateway, Session, agent_env
from agentrl.registry import make
from agentrl.rollout.agent_loop import Renderer
from agentrl.rollout.client import EngineClient
from agentrl.types import SampleStatus

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from envtest_helpers import sandbox_backend_or_skip  # noqa: E402

pytestmark = pytest.mark.e2e  # sandboxes and the embedded engine

# The agent: the standard library only (the base image has no `openai` package), two chat
# requests (the second sends back the first reply), a solution file, its answer last.
AGENT = r'''
import json, os, socket, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
task = json.loads(os.environ["AGENTRL_TASK"])
def chat(messages):
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": 12}).encode()
    req = urllib.request.Request(base + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]
messages = [{"role": "user", "content": task["prompt"]}]
first = chat(messages)
second = chat(messages + [first, {"role": "user", "content": "Sure?"}])
open("solution.py", "w").write("def add(a, b):\n    return a + b\n")
print(json.dumps({"replies": [first["content"], second["content"]], "host": socket.gethostname(),
                  "uid": os.getuid(), "label_seen": "label" in task, "base": base}))
'''
TASK = {"prompt": "Write add(a, b) in solution.py.", "label": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
        "metadata": {"entry_point": "add"}}

agent_env("test-gw-sbx-code", grader="code", timeout_s=120, command=f"python3 -c {shlex.quote(AGENT)}")(None)
agent_env("test-gw-sbx-hang", timeout_s=3, reward=lambda task, result: 1.0, command=(
    "python3 -c " + shlex.quote("import os, urllib.request, json; urllib.request.urlopen(urllib.request.Request("
                                "os.environ['OPENAI_BASE_URL'] + '/chat/completions', data=json.dumps({'model': 'm', 'messages': "
                                "[{'role': 'user', 'content': 'hi'}]}).encode())).read()") + "; sleep 3600"))(None)
agent_env("test-gw-sbx-flood", timeout_s=60, reward=lambda task, result: 1.0, sandbox_limits={"output_bytes": 65536},
          command="curl -s -o /dev/null -d '{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}' "
                  "\"$OPENAI_BASE_URL/chat/completions\"; yes flood")(None)


agent_env("test-gw-sbx-math", grader="math", timeout_s=60, command=(
    "curl -s -H 'Content-Type: application/json' -d '{\"model\": \"m\", \"messages\": [{\"role\": \"user\", "
    "\"content\": \"1+2?\"}]}' \"$OPENAI_BASE_URL/chat/completions\" | jq -r '.choices[0].message.content'"))(None)


class Recording:
    """The engine client, recording every generation's ids and logprobs."""

    def __init__(self, client):
        self.client, self.outputs = client, []

    async def generate(self, input_ids, sampling_params, **kw):
        result = await self.client.generate(input_ids, sampling_params, **kw)
        self.outputs.append((list(result.output_ids), list(result.logprobs)))
        return result


async def _pool(backend: str):
    """A pool as the run makes one (build.start_sandbox_pool): the tools' mounts."""
    from agentrl.sandboxes import SandboxPool
    from agentrl.tools.spec import tool_sandbox_options

    mounts, env = await asyncio.to_thread(tool_sandbox_options)
    return await SandboxPool(backend, warm=0, max_active=4, mounts=mounts, env=env).start()


async def _play(tokenizer, client, name, *, sandbox, max_len=256):
    runner = AgentRunner(renderer=Renderer(tokenizer, True), client=client, settings_for=lambda env: settings(max_len))
    try:
        return await runner(make(name, sandbox=sandbox), dict(TASK), trajectory_id="g0-s0", group_id=0, index=0,
                            seed=0, env_name=name)
    finally:
        await runner.aclose()


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_command_in_the_sandbox_records_exact_tokens_and_is_graded_on_its_files(tokenizer, engine, backend):
    sandbox_backend_or_skip(backend)

    async def go():
        pool = await _pool(backend)
        try:
            async with EngineClient(engine.url) as client:
                recording = Recording(client)
                return await _play(tokenizer, recording, "test-gw-sbx-code", sandbox=pool), recording
        finally:
            await pool.close()

    samples, recording = asyncio.run(go())
    assert len(samples) == 1, [s.metadata for s in samples]
    sample = samples[0]
    assert "agent_fault" not in sample.metadata, sample.metadata
    assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), sample.metadata
    assert sample.metadata["sandbox"] == backend
    out = json.loads(sample.metadata["agent_output"])
    assert out["host"] == "sandbox" and out["uid"] != 0 and not out["label_seen"]  # inside, not root, no hidden tests
    assert out["base"].startswith("http://127.0.0.1:") and out["base"].endswith("/v1")
    # the grader's hidden tests ran on the solution.py the command wrote in the sandbox
    assert sample.reward == 1.0
    # two requests, one unbroken sample: the trained tokens are the engine's own, with its logprobs
    assert len(recording.outputs) == 2 and sample.metadata["env_metrics"]["gateway_prefix_breaks"] == 0.0
    trained = [(t, lp) for t, lp, m in zip(sample.response_tokens, sample.rollout_logprobs, sample.loss_mask) if m]
    assert trained == [(t, lp) for ids, lps in recording.outputs for t, lp in zip(ids, lps)]
    replies = [m["content"] for m in sample.messages if m["role"] == "assistant"]
    assert out["replies"] == replies  # what the agent read is the text of those tokens


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_another_sandbox_cannot_reach_a_session(tokenizer, backend):
    """Sandbox B's process: A's socket is not in its view, the bridge dir does not list, the
    gateway's TCP port is unreachable (no network), and A's key sent over B's socket lands in B's
    own session: the socket names the session."""
    sandbox_backend_or_skip(backend)
    from agentrl.sandboxes import bridge, create

    probe = r'''
import json, os, socket, sys, urllib.request
a_inside, a_key, tcp = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
try:
    s = socket.socket(socket.AF_UNIX); s.connect(a_inside); out["a_socket"] = "connected"
except OSError as e:
    out["a_socket"] = type(e).__name__
try:
    out["listing"] = os.listdir("/agentrl")
except OSError as e:
    out["listing"] = type(e).__name__
host, port = tcp.rsplit(":", 1)
try:
    socket.create_connection((host.split("//")[1], int(port)), timeout=3); out["tcp"] = "connected"
except OSError as e:
    out["tcp"] = type(e).__name__
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].replace("/v1", "/s/%s/v1" % a_key) + "/chat/completions",
    data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Authorization": "Bearer " + a_key, "Content-Type": "application/json"})
out["reply"] = json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]["content"]
print(json.dumps(out))
'''

    async def go():
        engine_a, engine_b = ScriptedEngine(tokenizer, ["I am A"]), ScriptedEngine(tokenizer, ["I am B"])
        gateway = await Gateway().start()
        sa, sb_ = (Session(trajectory_id=t, group_id=0, env_name="test", task={}, renderer=Renderer(tokenizer, True),
                           client=e, settings=settings(), tool_parser=None) for t, e in (("a", engine_a), ("b", engine_b)))
        _, key_a = gateway.open(sa)
        _, key_b = gateway.open(sb_)
        box_a, box_b = create(backend), create(backend)
        await asyncio.gather(box_a.start(), box_b.start())
        try:
            (host_a, inside_a), (host_b, inside_b) = bridge.socket_path(box_a), bridge.socket_path(box_b)
            await gateway.bind(key_a, host_a, getattr(box_a, "host_uid", box_a.uid))
            await gateway.bind(key_b, host_b, getattr(box_b, "host_uid", box_b.uid))
            mode = os.stat(host_a)
            argv = ["python3", "-c", probe, inside_a, key_a, gateway.url]
            r = await box_b.exec(bridge.forwarder_argv(inside_b, shlex.join(argv), 1 << 16), timeout=60)
            return r, mode, sa.requests, sb_.requests, getattr(box_a, "host_uid", box_a.uid)
        finally:
            await asyncio.gather(box_a.close(), box_b.close())
            await gateway.aclose()

    r, mode, requests_a, requests_b, uid_a = asyncio.run(go())
    assert r.exit_code == 0, r
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["a_socket"] == "FileNotFoundError"  # A's bridge dir is not mounted in B
    assert out["listing"] == "PermissionError"  # B's own dir: pass through to a known name, never list
    assert out["tcp"] != "connected"  # no network: the gateway's TCP port is out of reach
    assert out["reply"] == "I am B" and (requests_a, requests_b) == (0, 1)
    assert stat.S_IMODE(mode.st_mode) == 0o600  # only the sandbox's own uid may connect
    if os.geteuid() == 0:
        assert mode.st_uid == uid_a


@pytest.mark.parametrize("backend", ["local", "docker"])
@pytest.mark.parametrize("name, reason, bound_s", [
    ("test-gw-sbx-hang", "timeout: the agent ran past 3 s", 3),
    ("test-gw-sbx-flood", "output flood: the command printed past 65536 bytes and was stopped", 0)])
def test_a_command_that_hangs_or_floods_ends_within_its_bound(tokenizer, backend, name, reason, bound_s):
    sandbox_backend_or_skip(backend)
    engine = ScriptedEngine(tokenizer, ["hello"])
    t0 = time.monotonic()
    samples = asyncio.run(_play(tokenizer, engine, name, sandbox=backend))
    took = time.monotonic() - t0
    assert len(engine.calls) == 1 and len(samples) == 1
    sample = samples[0]
    assert sample.metadata["agent_fault"] == reason and sample.reward == 0.0  # the reward function never ran
    assert sample.status == SampleStatus.COMPLETED and sample.num_trained_tokens > 0  # scored 0, trained on
    assert sample.metadata["agent_command_s"] < bound_s + 5, sample.metadata  # the command itself
    assert took < bound_s + 120, took  # with the sandbox's start and stop, on a loaded machine


def test_a_command_with_a_grader_without_sandbox_gets_one_from_the_pool(tokenizer):
    """The math grader has no sandbox: the command gets one of the run's pool (curl and jq, no Python)."""
    sandbox_backend_or_skip("local")
    engine = ScriptedEngine(tokenizer, ["so \\boxed{3}"])

    async def go():
        pool = await _pool("local")
        try:
            samples = await _play(tokenizer, engine, "test-gw-sbx-math", sandbox=pool)
            return samples, pool.metrics()
        finally:
            await pool.close()

    samples, metrics = asyncio.run(go())
    assert len(samples) == 1 and "agent_fault" not in samples[0].metadata, samples[0].metadata
    assert samples[0].metadata["agent_output"] == "so \\boxed{3}" and samples[0].reward == 1.0
    assert samples[0].metadata["sandbox"] == "local" and metrics["acquired"] == 1
