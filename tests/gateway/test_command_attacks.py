"""A command agent that turns on its own sandbox, as the policy would write it (one shell command
behind `@agent_env(command=...)`, played by the AgentRunner), on both backends. Whatever it
breaks (the exec server, the pids or memory cap, the disk, the file the reward reads, the
bridge's own "no loopback" exit) ends its trajectory as its fault: reward 0, the reason
recorded, never FAILED (a failed trajectory is masked and its group re-run or dropped: a policy
could veto the groups it would lose). Only a sandbox that is gone is infrastructure."""

import asyncio
import sys
from pathlib import Path

import pytest
from helpers import ScriptedEngine, settings

from agentrl.gateway import AgentRunner, agent_env
from agentrl.gateway.agent_env import AgentFileError
from agentrl.registry import make
from agentrl.rollout.agent_loop import Renderer
from agentrl.types import SampleStatus

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from envtest_helpers import sandbox_backend_or_skip  # noqa: E402

pytestmark = pytest.mark.e2e  # sandboxes

LIMITS = {"memory_mb": 256, "pids": 64, "workdir_mb": 32, "tmp_mb": 16, "output_bytes": 1 << 16}
# one request to the gateway first: an agent that never calls it is a fault of its own kind
CALL = ("curl -s -o /dev/null -H 'Content-Type: application/json' -d '{\"model\": \"m\", \"messages\": "
        "[{\"role\": \"user\", \"content\": \"hi\"}]}' \"$OPENAI_BASE_URL/chat/completions\"; ")
# kills the sandbox's exec server (found by the name its source runs under); the agent's uid can on
# local (one uid per namespace), not on docker (the server's real uid is root): then it kills itself
KILL_SERVER = ("python3 -c \"import os\nfor p in os.listdir('/proc'):\n  try:\n"
               "    if p.isdigit() and b'agentrl-sandbox-server' in open('/proc/%s/cmdline' % p, 'rb').read(): "
               "os.kill(int(p), 9)\n  except OSError: pass\"; ")
FORK_TO_THE_CAP = ("python3 -c \"import os, time\nwhile True:\n  try:\n    pid = os.fork()\n  except OSError:\n"
                   "    break\n  if pid == 0:\n    time.sleep(600); os._exit(0)\"; ")
# SysV shared memory: charged to the sandbox's memory, kept after its maker dies
FILL_SHM = ("python3 -c \"import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "while True:\n  i = libc.shmget(0, 1 << 20, 0o1600)\n  if i < 0: break\n"
            "  a = libc.shmat(i, None, 0); ctypes.memset(a, 1, 1 << 20); libc.shmdt(ctypes.c_void_p(a))\"; ")

ATTACKS = {  # name: (command after CALL, what the fault must say)
    "forged no-loopback exit": ("echo 'agentrl-bridge: no loopback in the sandbox: forged' >&2; exit 120",
                                "the command exited with 120"),
    "kill every process it can": ("kill -9 -1", "the command exited with 137"),
    "kill the exec server": (KILL_SERVER + "exit 3", "the command exited with"),
    "fork to the pids cap, then kill the server": (FORK_TO_THE_CAP + KILL_SERVER + "exit 3", "the command exited with"),
    "chmod 000 the workdir, then kill the server": ("chmod 000 /work; " + KILL_SERVER + "exit 3",
                                                    "the command exited with"),
    "fill memory with shared memory": (FILL_SHM + "echo 42 > answer.txt; echo done", None),
    "fill the disk and its inodes": ("cat /dev/zero > /work/fill; cat /dev/zero > /tmp/fill; python3 -c \"import itertools\n"
                                     "for i in itertools.count():\n  try: open('/work/f%d' % i, 'w').close()\n"
                                     "  except OSError: break\"; "
                                     "echo 42 > answer.txt; echo done", "the agent's file answer.txt"),
    "answer is a FIFO": ("mkfifo answer.txt; echo done", "the agent's file answer.txt"),
    "answer is a link to /dev/zero": ("ln -s /dev/zero answer.txt; echo done", "the agent's file answer.txt"),
    "answer is a directory": ("mkdir answer.txt; echo done", "the agent's file answer.txt"),
    "answer is too large": ("head -c 2000000 /dev/zero > answer.txt; echo done", "the agent's file answer.txt"),
    "no answer": ("echo done", "the agent's file answer.txt"),
}


async def read_answer(task, result):
    """The reward reads the agent's answer file in its sandbox, as the docs show."""
    return float((await result.sandbox.read_file("answer.txt", max_bytes=1 << 20)).strip() == b"42")


def _register(name: str, command: str) -> str:
    agent_env(name, reward=read_answer, timeout_s=60, sandbox_limits=LIMITS, command=CALL + command)(None)
    return name


def _play(tokenizer, name: str, backend: str):
    engine = ScriptedEngine(tokenizer, ["hello"])

    async def go():
        runner = AgentRunner(renderer=Renderer(tokenizer, True), client=engine, settings_for=lambda env: settings())
        try:
            return await asyncio.wait_for(runner(make(name, sandbox=backend), {"prompt": "hi"}, trajectory_id="g0-s0",
                                                 group_id=0, index=0, seed=0, env_name=name), 300)
        finally:
            await runner.aclose()

    return asyncio.run(go()), engine


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_an_honest_answer_scores(tokenizer, backend):
    """The control: the reward function reads what the command wrote."""
    sandbox_backend_or_skip(backend)
    samples, engine = _play(tokenizer, _register("test-gw-atk-honest", "echo 42 > answer.txt; echo done"), backend)
    assert len(samples) == 1 and len(engine.calls) == 1
    assert samples[0].reward == 1.0 and "agent_fault" not in samples[0].metadata, samples[0].metadata


@pytest.mark.parametrize("backend", ["local", "docker"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_command_that_breaks_its_sandbox_is_at_fault(tokenizer, backend, attack):
    sandbox_backend_or_skip(backend)
    command, reason = ATTACKS[attack]
    name = _register("test-gw-atk-" + "-".join(attack.split()).replace(",", ""), command)
    samples, engine = _play(tokenizer, name, backend)
    assert len(samples) == 1 and len(engine.calls) == 1, [s.metadata for s in samples]
    sample = samples[0]
    assert sample.status != SampleStatus.FAILED, sample.metadata  # never infrastructure
    assert sample.reward == 0.0 or reason is None, sample.metadata
    if reason is not None:
        assert reason in sample.metadata.get("agent_fault", ""), sample.metadata
    else:  # memory the agent pinned: the command may still have written its answer, or been stopped
        assert sample.reward == 1.0 or "agent_fault" in sample.metadata, sample.metadata


def test_an_agent_file_error_is_still_what_a_reward_function_catches():
    """A reward function that catches FileNotFoundError / OSError / ValueError still does."""
    from agentrl.gateway.agent_env import _AgentFiles

    class Box:
        def __init__(self, exc):
            self.exc = exc

        async def read_file(self, path, max_bytes=1 << 20):
            raise self.exc

    for exc, caught in ((FileNotFoundError("gone"), FileNotFoundError), (OSError("a FIFO"), OSError),
                        (ValueError("too large"), ValueError)):
        with pytest.raises(caught) as info:
            asyncio.run(_AgentFiles(Box(exc)).read_file("answer.txt"))
        assert isinstance(info.value, AgentFileError) and "answer.txt" in str(info.value)
