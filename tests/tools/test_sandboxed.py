"""The built-in servers inside sandboxes (agentrl.sandboxes): stdio through bubblewrap
(local) or `docker exec -i` (docker), with the agentrl sources and the host's site-packages
mounted read-only. Skipped, with the reason, where a backend cannot run here."""
import json
import sys
from pathlib import Path

import pytest

from agentrl.tools import ToolEnv
from tools_fixtures import arun  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from envtest_helpers import sandbox_backend_or_skip  # noqa: E402


class SandboxedEnv(ToolEnv):
    builtin_tools = ("python", "bash", "files")
    sandbox_limits = {"memory_mb": 1024}


LIST_PROCS = """import os
for p in os.listdir('/proc'):
    try:
        print(open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ').decode())
    except OSError:
        pass
"""


def call(name, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.mark.parametrize("backend", ["local", "docker"])
@pytest.mark.slow
def test_builtin_servers_in_sandbox(arun, backend):
    sandbox_backend_or_skip(backend)
    env = SandboxedEnv(sandbox=backend)
    try:
        _, info = arun(env.areset(options={"prompt": "hi"}))
        assert env.sandbox_instance is not None and env.sandbox_instance.backend == backend
        assert env.workdir == "/work"
        obs, *_ = arun(env.astep(call("python", code="import os, sys\nn = 5\n(os.getcwd(), os.getuid(), sys.path[1:2])")))
        cwd, uid, _ = eval(obs[0]["content"])
        assert (cwd, uid) == ("/work", env.sandbox_instance.uid)  # local 1000, docker one per container
        obs, *_ = arun(env.astep(call("python", code="n * 2")))  # state persists inside the sandbox
        assert obs[0]["content"] == "10"
        # the model's code does not see the mounts that make the server run
        obs, *_ = arun(env.astep(call("python", code="import importlib.util\nimportlib.util.find_spec('mcp') is None")))
        assert obs[0]["content"] == "True"
        arun(env.write_file("data.txt", "from the env\n"))
        obs, *_ = arun(env.astep(call("bash", command="cat data.txt; touch /etc/x 2>/dev/null || echo read-only root")
                                 + call("read_file", path="/work/data.txt")))
        assert obs[0]["content"] == "from the env\nread-only root\n[exit code: 0]"
        assert obs[1]["content"] == "from the env\n"
        obs, *_ = arun(env.astep(call("python", code="import time\ntime.sleep(20)", timeout=1)))
        assert "TimeoutError" in obs[0]["content"]
        obs, *_ = arun(env.astep(call("python", code="'back'")))
        assert obs[0]["content"] == "'back'"
        # stopping the tools leaves no server or interpreter process behind in the sandbox (docker:
        # one pid namespace, where `docker exec` would not pass a kill on; local: each spawn has its
        # own pid namespace, which dies with its bwrap)
        sb = env.sandbox_instance
        arun(env.toolset.close())
        ps = arun(sb.exec(["python3", "-c", LIST_PROCS]))
        assert "agentrl.tools" not in ps.stdout and "_python_worker" not in ps.stdout, ps.stdout
    finally:
        arun(env.aclose())
    assert env.sandbox_instance is None


def test_env_takes_sandboxes_from_a_pool(arun):
    sandbox_backend_or_skip("local")
    from agentrl.sandboxes import SandboxPool
    from agentrl.tools.spec import tool_sandbox_options

    class PythonEnv(ToolEnv):
        builtin_tools = ("python",)

    assert PythonEnv.tool_names == ("python",) and SandboxedEnv.tool_names[:3] == ("python", "bash", "read_file")
    mounts, env_vars = tool_sandbox_options()
    pool = SandboxPool("local", warm=1, max_active=2, mounts=mounts, env=env_vars)
    arun(pool.start())
    try:
        env = PythonEnv(sandbox=pool)
        for _ in range(2):  # a reused env: a fresh sandbox and interpreter per trajectory
            arun(env.areset(options={"prompt": "hi"}))
            obs, *_ = arun(env.astep(call("python", code="import os\nprint(sorted(os.listdir('.')))\nopen('f', 'w')")))
            assert obs[0]["content"].startswith("[]")
            arun(env.aclose())
            assert env.sandbox_instance is None
        assert pool.metrics()["active"] == 0
    finally:
        arun(pool.close())


def test_the_pool_starts_the_next_trajectorys_tool_servers_ahead_and_a_grader_gets_a_plain_sandbox(arun):
    """A trajectory's reset takes tool servers the pool started when the previous trajectory gave its
    sandbox back (a fresh interpreter all the same: started after the sandbox's reset, for one
    trajectory); nothing is started while a batch's resets run; a plain get() (the code env's grader)
    takes a sandbox that was not made ready, so no start is wasted; the pool's close ends the servers
    it started."""
    sandbox_backend_or_skip("local")
    import asyncio

    from agentrl.sandboxes import SandboxPool
    from agentrl.tools.spec import tool_sandbox_options

    class PythonEnv(ToolEnv):
        builtin_tools = ("python",)

    async def settled(pool):
        for _ in range(600):  # the pool's background starts end within a minute even on a loaded machine
            if not pool._ready_bg and not pool._bg:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the pool's background work did not end")

    async def scenario():
        mounts, env_vars = tool_sandbox_options()
        pool = await SandboxPool("local", warm=2, max_active=3, mounts=mounts, env=env_vars).start()
        try:
            env = PythonEnv(sandbox=pool)
            await env.areset(options={"prompt": "hi"})  # the first: nothing ready yet
            assert pool.metrics()["ready_taken"] == 0
            obs, *_ = await env.astep(call("python", code="x = 41\nprint(x + 1)"))
            assert obs[0]["content"].startswith("42")
            await settled(pool)
            assert not pool._ready  # nothing made ready while the batch's resets may still run
            await env.aclose()  # it ended: one idle sandbox made ready for the next trajectory (itself
            await settled(pool)  # when it was kept; here two were idle already, so it was closed)
            assert len(pool._ready) == 1 and set(pool._ready) <= set(pool._idle), pool.metrics()
            first = next(iter(pool._ready))
            taken = pool.metrics()["ready_taken"]
            grader = await pool.get()  # a plain get: not the ready one
            assert grader is not first and first in pool._ready
            await pool.release(grader)
            await settled(pool)
            await env.areset(options={"prompt": "again"})
            assert pool.metrics()["ready_taken"] == taken + 1 and pool.metrics()["ready_wasted"] == 0
            assert env.sandbox_instance is first
            obs, *_ = await env.astep(call("python", code="print('x' in globals())"))
            assert obs[0]["content"].startswith("False"), obs  # a fresh interpreter
            await env.aclose()
            await settled(pool)
            assert pool._ready  # made ready again, for the next trajectory
        finally:
            await pool.close()
        assert not pool._ready and not pool._ready_bg

    arun(scenario())
