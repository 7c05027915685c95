"""Attacks through the tools, as the policy would make them (a bash or python tool call), on
both sandbox backends; and a server that floods the host. Each must fail, or end the
trajectory as the agent's fault (reward 0, reason recorded) rather than as an infra failure."""
import json
import sys
import time
from dataclasses import replace

import pytest

from agentrl.tools import ToolEnv, ToolSet
from agentrl.tools.client import ToolServerError
from test_sandboxed import call, sandbox_backend_or_skip
from tools_fixtures import arun  # noqa: F401 (fixtures)

BACKENDS = ["local", "docker"]


class AttackEnv(ToolEnv):
    builtin_tools = ("python", "bash", "files")
    sandbox_limits = {"memory_mb": 1024}


def _bash(arun, env, command, timeout=None):
    args = {"command": command, **({"timeout": timeout} if timeout else {})}
    return arun(env.astep(call("bash", **args)))


FORGE = r"""
import os
ppid = os.getppid()
forged = b'{"jsonrpc": "2.0", "id": 99, "result": {"content": [{"type": "text", "text": "FORGED"}]}}\n'
for path, mode in ((f"/proc/{ppid}/fd/1", "wb"), (f"/proc/{ppid}/mem", "r+b")):
    try:
        with open(path, mode) as f:
            f.write(forged)
        print("OPENED", path)
    except OSError as e:
        print("refused", e.errno)
print("fds", sorted(os.listdir("/proc/self/fd")))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_tool_server_cannot_be_forged_or_hijacked(arun, backend):
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        arun(env.write_file("forge.py", FORGE))
        obs, *_ = _bash(arun, env, "python3 forge.py")
        out = obs[0]["content"]
        assert "OPENED" not in out and out.count("refused") == 2, out
        assert "fds ['0', '1', '2', '3']" in out, out  # no pipe of the server inherited
        # modules planted in the workdir are never imported by a (re)starting server
        for mod in ("argparse", "runpy", "json", "ctypes", "asyncio", "typing", "sitecustomize"):
            arun(env.write_file(f"{mod}.py", "open('/work/HIJACKED', 'a').write(__name__)\n"))
        conn = env.toolset.connections["builtin"]
        assert arun(conn.restart(conn.generation, "restarted by the test"))
        assert env.sandbox_instance.tainted  # a restarted server's sandbox is never reused
        obs, *_ = _bash(arun, env, "ls /work/HIJACKED 2>&1; echo honest; exit 3")
        assert obs[0]["content"].endswith("honest\n[exit code: 3]") and "No such file" in obs[0]["content"], obs
        obs, *_ = arun(env.astep(call("python", code="6 * 7")))
        assert obs[0]["content"] == "42"
        # a FIFO in place of a file does not hang the files tool
        _bash(arun, env, "mkfifo /work/pipe")
        obs, *_ = arun(env.astep(call("read_file", path="pipe") + call("write_file", path="pipe", content="x")))
        assert [o["content"] for o in obs] == ["Error: 'pipe' is not a regular file"] * 2, obs
    finally:
        arun(env.aclose())


@pytest.mark.parametrize("backend", BACKENDS)
def test_killing_the_tool_server_is_the_agents_fault(arun, backend):
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        if backend == "docker":  # the server's uid pair is out of the agent's reach
            obs, reward, done, _, info = _bash(arun, env, "kill -9 $PPID; echo after")
            assert "Operation not permitted" in obs[0]["content"] and not done, obs
            obs, *_ = _bash(arun, env, "kill -9 -1; echo survived")
            assert "survived" in obs[0]["content"] and not env.sandbox_instance.tainted
            return
        # local (one uid per user namespace): the first kill costs a restart (the call is retried)...
        once = "[ -e /work/once ] || { touch /work/once; kill -9 $PPID; }; echo after"
        obs, reward, done, _, info = _bash(arun, env, once)
        assert not done and obs[0]["content"].startswith("after\n[exit code: 0]") and "was restarted" in \
            obs[0]["content"], (obs, info)
        assert env.sandbox_instance.tainted
        # ... the next one the episode: scored 0 with the reason, not an infrastructure failure
        obs, reward, done, _, info = _bash(arun, env, "rm /work/once; " + once)
        assert (obs, reward, done) == ([], 0.0, True)
        assert "ToolServerKilledError" in info["agent_fault"], info
    finally:
        arun(env.aclose())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_asking_for_a_long_timeout_is_not_a_hung_server(arun, backend):
    """A call asking for a timeout longer than the env's tool_timeout (the servers accept up to 600 s)
    is cut at tool_timeout by the tool itself: an honest long computation times out as a tool
    result, never as a hung server (restart, then 0 as the agent's fault)."""
    sandbox_backend_or_skip(backend)

    class Short(AttackEnv):
        tool_timeout = 1.0  # each of the 4 calls waits this out: well short of the 6 s sleeps

    env = Short(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        for action in (call("bash", command="sleep 6; echo late", timeout=60),
                       call("python", code="import time\ntime.sleep(6)", timeout=60)) * 2:
            obs, reward, done, _, info = arun(env.astep(action))
            assert not done and "agent_fault" not in info, info
            assert "timed out" in obs[0]["content"].lower() or "timeouterror" in obs[0]["content"].lower(), obs
            assert "restarted" not in obs[0]["content"] or "interpreter was restarted" in obs[0]["content"], obs
        assert not env.sandbox_instance.tainted
    finally:
        arun(env.aclose())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bash_leftovers_and_background_output(arun, backend):
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        t0 = time.monotonic()
        obs, *_ = _bash(arun, env, "setsid sleep 1001 & (setsid sh -c 'sleep 1002' &); "
                                   "python3 -c 'import os\nif os.fork() == 0:\n os.setsid()\n os.execvp(\"sleep\", [\"sleep\", \"1003\"])'; "
                                   "(sleep 30; echo late) & echo done", timeout=20)
        took = time.monotonic() - t0
        assert obs[0]["content"] == "done\n[exit code: 0]" and took < 8, (obs, took)  # finished, not timed out
        obs, *_ = _bash(arun, env, "ps -eo args | grep -c '[s]leep 100' || true")
        assert obs[0]["content"].startswith("0\n"), obs
        # the python tool's interpreter is not a leftover of a bash call
        arun(env.astep(call("python", code="x = 5")))
        _bash(arun, env, "true")
        obs, *_ = arun(env.astep(call("python", code="x")))
        assert obs[0]["content"] == "5"
    finally:
        arun(env.aclose())


FLOOD = """import sys
sys.stdout.write("x" * (48 << 20))
sys.stdout.flush()
sys.stdin.read()
"""


def test_a_huge_line_costs_the_host_little(arun, tmp_path):
    """A server (or the agent's code holding its pipe) writing a 48 MB line without a newline:
    the host reads it in linear time and closes the connection at the line bound."""
    server = tmp_path / "flood.py"
    server.write_text(FLOOD)
    tools = ToolSet([f"flood={sys.executable} {server}"], start_timeout=60)
    cpu0, t0 = time.process_time(), time.monotonic()
    with pytest.raises(ToolServerError):
        arun(tools.start())
    cpu = time.process_time() - cpu0
    assert cpu < 2.0 and time.monotonic() - t0 < 30, (cpu, time.monotonic() - t0)


NOTIFY_FLOOD = """import sys
line = '{"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}}\\n'
while True:
    sys.stdout.write(line * 1000)
    sys.stdout.flush()
"""


def test_a_flood_of_lines_is_cut_off(arun, tmp_path):
    """A server sending valid short messages as fast as it can (each one the host would parse and
    dispatch): the host closes the connection at the rate bound instead of spending a core on it."""
    server = tmp_path / "notify_flood.py"
    server.write_text(NOTIFY_FLOOD)
    tools = ToolSet([f"flood={sys.executable} {server}"], start_timeout=60)
    cpu0, t0 = time.process_time(), time.monotonic()
    with pytest.raises(ToolServerError):
        arun(tools.start())
    took, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert took < 20 and cpu < 5.0, (took, cpu)  # not the whole start_timeout: the bound closed it


FLIP = """import os, sys
work, outside = sys.argv[1], sys.argv[2]
tmp, x = os.path.join(work, ".swap"), os.path.join(work, "x")
while True:
    for link in (False, True):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if link:
            os.symlink(outside, tmp)
        else:
            open(tmp, "w").write("regular")
        os.replace(tmp, x)
"""


def test_files_tool_checks_what_it_opened(tmp_path):
    """A process of the agent (the python tool's interpreter lives between calls) swapping a file for a
    symlink between the files tool's path check and its open: the tool reads and writes only regular
    files inside the workdir, whatever the path became (in a sandbox: not /proc/self/fd/1, its own
    channel to the host)."""
    import asyncio
    import subprocess
    from agentrl.tools.files_server import build_server

    work, outside = tmp_path / "work", tmp_path / "outside.txt"
    work.mkdir()
    outside.write_text("secret-outside")
    server = build_server(work)
    flipper = subprocess.Popen([sys.executable, "-c", FLIP, str(work), str(outside)])

    async def hammer() -> list[str]:
        seen = []
        for i in range(1500):
            for name, args in (("write_file", {"path": "x", "content": f"HIJACKED {i}"}), ("read_file", {"path": "x"}),
                               ("edit_file", {"path": "x", "old_string": "secret", "new_string": "HIJACKED"})):
                try:
                    seen.append(str(await server.call_tool(name, args)))
                except Exception as e:  # noqa: BLE001 - refusals are what this expects
                    seen.append(str(e))
        return seen

    try:
        seen = asyncio.run(hammer())
    finally:
        flipper.kill()
        flipper.wait()
    assert outside.read_text() == "secret-outside"
    assert not [s for s in seen if "secret-outside" in s]
    assert any("is not a regular file" in s or "outside the working directory" in s for s in seen)


def test_agent_fault_is_scored_not_failed(arun):
    """An AgentFault raised anywhere in a step (a grader that finds the agent sabotaged its own
    solution) ends the episode with reward 0 and the reason, instead of raising."""
    from agentrl.errors import AgentFault

    class Sabotaged(ToolEnv):
        function_tools = ()

        async def final_answer(self, action):
            raise AgentFault("solution.py is a FIFO")

    env = Sabotaged()
    arun(env.areset(options={"prompt": "hi"}))
    obs, reward, done, trunc, info = arun(env.astep("my answer"))
    assert (obs, reward, done, trunc) == ([], 0.0, True, False) and info == {"agent_fault": "AgentFault: solution.py is a FIFO"}
    arun(env.aclose())
    json.dumps(info)  # recorded as is in the sample's metadata


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_a_restart_the_agent_broke_is_its_fault(arun, backend):
    """chmod 000 on the workdir, then the tool server killed: the restarted server cannot enter the
    workdir. What the agent did: reward 0 with the reason, never ToolServerError (a FAILED group).
    On docker the agent's uid cannot kill the server: its calls fail as tool errors, and it goes on."""
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        obs, reward, done, _, info = arun(env.astep(call("bash", command="chmod 000 /work; kill -9 $PPID")))
        if backend == "docker":
            assert not done and "Operation not permitted" in obs[0]["content"], (obs, info)
            obs, reward, done, _, info = arun(env.astep(call("bash", command="echo hi")))
            assert not done and obs[0]["content"].startswith("Error"), (obs, info)  # no cwd: a tool error
            return
        assert (obs, reward, done) == ([], 0.0, True), (obs, info)
        assert "could not start" in info["agent_fault"] and "Permission denied" in info["agent_fault"], info
    finally:
        arun(env.aclose())


PLANT_HOOKS = r"""
import os, sys
hook = "open('/work/HOOK-RAN', 'a').write(__name__ + ' ')\n"
user_site = os.path.expanduser("~/.local/lib/python%d.%d/site-packages" % sys.version_info[:2])
os.makedirs(user_site, exist_ok=True)
for path in (user_site + "/usercustomize.py", user_site + "/sitecustomize.py", "/work/sitecustomize.py",
             "/work/usercustomize.py"):
    open(path, "w").write(hook)
open(user_site + "/zz.pth", "w").write("import os; open('/work/HOOK-RAN', 'a').write('pth ')\n")
for rc in (".bashrc", ".bash_profile", ".profile", ".bash_login"):
    open("/work/" + rc, "w").write("echo STARTUP-FILE-RAN\n")
print(os.environ["HOME"], user_site)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_startup_hooks_planted_in_the_workdir_never_run(arun, backend):
    """usercustomize/sitecustomize/.pth files in the user site under HOME (the workdir) and shell
    startup files: the python tool's interpreter, restarted after the agent's code ended it, and the
    bash tool's shells start isolated (python -I, bash --norc --noprofile) and run none of them."""
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        arun(env.write_file("plant.py", PLANT_HOOKS))
        obs, *_ = _bash(arun, env, "python3 -I plant.py")
        assert obs[0]["content"].startswith("/work /work/.local/lib/python"), obs
        obs, *_ = arun(env.astep(call("python", code="import os; os._exit(3)")))
        assert "died" in obs[0]["content"], obs
        obs, *_ = arun(env.astep(call("python", code="import os, sys\n"
                                      "(os.path.exists('/work/HOOK-RAN'), sys.flags.no_user_site)")))
        assert obs[0]["content"] == "(False, 1)", obs
        obs, *_ = _bash(arun, env, "echo plain; ls /work/HOOK-RAN 2>&1 | grep -c 'No such'")
        assert obs[0]["content"] == "plain\n1\n[exit code: 0]", obs
    finally:
        arun(env.aclose())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_graders_interpreter_runs_no_planted_hook(arun, backend):
    """The code env grades the agent's files in a sandbox with child.py under `python3 -I`: a
    sitecustomize.py or usercustomize.py among them never runs before the solution loads."""
    sandbox_backend_or_skip(backend)
    from agentrl.envs.code_env.grader import HiddenTests, grade
    hook = "import sys; sys.modules['builtins'].HOOKED = True\n"
    files = {"solution.py": "import builtins\ndef f():\n    return getattr(builtins, 'HOOKED', False)\n",
             "sitecustomize.py": hook, "usercustomize.py": hook,
             ".local/lib/python3.11/site-packages/usercustomize.py": hook,
             ".local/lib/python3.11/site-packages/sitecustomize.py": hook}
    result = arun(grade(files, HiddenTests(["assert f() is False"]), sandbox=backend))
    assert (result.passed, result.total) == (1, 1), result


HOLD_FDS = """import os
fds = []
try:
    while True:
        fds.append(os.open('/dev/null', os.O_RDONLY))
except OSError as e:
    print(len(fds) > 500, e.errno)
"""
FILL_DISK = """try:
    with open('/work/fill', 'wb') as f:
        while True:
            f.write(b'0' * (1 << 20))
except OSError as e:
    print('full', e.errno)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_exhausted_fds_and_a_full_disk_are_the_agents_problem(arun, backend):
    """The python tool's interpreter holding every fd it may, and the workdir filled: the calls that
    fail say why, as tool results; the tools and the episode go on."""
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        if backend == "docker" or env.sandbox_instance.mounted:  # (local, not root: the host's disk)
            obs, *_ = arun(env.astep(call("python", code=FILL_DISK)))
            assert "full 28" in obs[0]["content"], obs  # ENOSPC
            obs, reward, done, _, info = arun(env.astep(call("write_file", path="more.txt", content="x" * 100000)))
            assert not done and obs[0]["content"].startswith("Error"), (obs, info)
        obs, *_ = arun(env.astep(call("python", code=HOLD_FDS)))
        assert obs[0]["content"] == "True 24", obs  # EMFILE
        obs, reward, done, _, info = arun(env.astep(call("bash", command="rm -f /work/fill; echo ok")
                                                    + call("python", code="len(fds)")))
        assert not done and obs[0]["content"] == "ok\n[exit code: 0]" and int(obs[1]["content"]) > 500, obs
        assert not env.sandbox_instance.tainted
    finally:
        arun(env.aclose())


@pytest.mark.e2e  # about 25 s a backend: waits out stopped servers and their restarts
@pytest.mark.parametrize("backend", BACKENDS)
def test_stopping_the_tool_server_is_bounded_and_the_agents_fault(arun, backend):
    """SIGSTOP to the tool server (its process and every process of the agent's uid): no answer
    comes, and no exit either. Each call is bounded by tool_timeout plus a restart, and never
    raises: a stopped server is restarted (the call reports it) or the episode ends as the agent's
    fault (reward 0, reason recorded); docker: the server's uid is out of the agent's reach."""
    sandbox_backend_or_skip(backend)

    class Short(AttackEnv):
        tool_timeout = 2.0

        def server_specs(self):
            # the client waits tool_timeout plus a grace for an answer (builtin_spec: 30 s, for a
            # loaded machine); a stopped server never answers, so each stop waited out 32 s. 8 s of
            # grace here: a stop still takes the whole wait, an honest call is done well within it
            return [replace(s, timeout_s=self.tool_timeout + 8) for s in super().server_specs()]

    env = Short(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        for command in ("kill -STOP $PPID; echo after", "kill -STOP -1; echo after") * 2:
            t0 = time.monotonic()
            obs, reward, done, _, info = _bash(arun, env, command)
            elapsed = time.monotonic() - t0
            assert elapsed < 90, (elapsed, obs, info)
            if done:
                assert (obs, reward) == ([], 0.0) and info.get("agent_fault"), (obs, info)
                assert backend == "local", info
                return
            if backend == "docker":
                assert "Operation not permitted" in obs[0]["content"] or "after" in obs[0]["content"], obs
                assert not env.sandbox_instance.tainted
        assert backend == "docker"  # local: the second stopped server ends the episode
        obs, *_ = _bash(arun, env, "echo alive")
        assert obs[0]["content"].startswith("alive"), obs
    finally:
        arun(env.aclose())


SOLUTION_TASK = {"prompt": "Write `double(x)`.", "label": ["assert double(2) == 4", "assert double(0) == 0"],
                 "metadata": {"entry_point": "double"}}
# What solution.py can be besides a file: each is read in the agent's sandbox by a short-lived
# process with a timeout, and refused or cut, never read without end by the host
SOLUTION_TRAPS = {
    "a symlink to an endless device": "ln -s /dev/zero solution.py",
    "a symlink to the reader's own memory": "ln -s /proc/self/mem solution.py",
    "a symlink to a FIFO no one writes": "mkfifo /tmp/f; ln -s /tmp/f solution.py",
    "a directory": "mkdir solution.py",
    "a symlink loop": "ln -s solution.py solution.py",
    # time of check to time of use: a process the agent left keeps rewriting it, past 1 MiB
    "a file rewritten and grown while it is read":
        "(while :; do head -c 3000000 /dev/zero | tr '\\0' 'x' > solution.py; "
        "echo 'def double(x): return 2 * x' > solution.py; done) >/dev/null 2>&1 &",
}


@pytest.mark.e2e  # a code episode per trap on each backend
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_solution_file_that_is_not_a_plain_file(arun, backend):
    """solution.py as a device, /proc/self/mem, a FIFO, a directory, a loop, or a file a leftover
    process keeps rewriting: each episode ends within bound with reward 0 and the reason in
    `solution_files_skipped` (or, for the rewritten one, a consistent read of one version), never
    an exception out of the env."""
    sandbox_backend_or_skip(backend)
    from agentrl.envs.code_env import CodeEnv
    for trap, command in SOLUTION_TRAPS.items():
        env = CodeEnv(sandbox=backend, answer_in_message=False)
        try:
            arun(env.areset(seed=0, options=SOLUTION_TASK))
            obs, *_ = _bash(arun, env, command + "; sleep 0.5; echo planted")
            assert "planted" in obs[0]["content"], (trap, obs)
            t0 = time.monotonic()
            obs, reward, done, _, info = arun(env.astep("done"))
            assert done and time.monotonic() - t0 < 120, (trap, info)
            if trap.startswith("a file rewritten"):  # whichever version it read: judged as that
                assert reward in (0.0, 1.0) and ("solution_files_skipped" in info or "passed" in info), info
            else:
                assert reward == 0.0 and info.get("solution_files_skipped"), (trap, info)
        finally:
            arun(env.aclose())


INJECT_ENV = r"""
import os
os.makedirs("/work/bin", exist_ok=True)
for name in ("ls", "python3", "bash", "sh"):
    with open("/work/bin/" + name, "w") as f:
        f.write("#!/bin/sh\necho HIJACKED-" + name + "\n")
    os.chmod("/work/bin/" + name, 0o755)
open("/work/env.sh", "w").write("echo BASH-ENV-RAN\n")
os.environ.update(PATH="/work/bin:" + os.environ["PATH"], BASH_ENV="/work/env.sh", ENV="/work/env.sh",
                  PYTHONSTARTUP="/work/env.sh", PYTHONPATH="/work", LD_PRELOAD="/work/nothing.so")
os.putenv("PROMPT_COMMAND", "echo PROMPT-RAN")
"injected"
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_environment_set_by_one_call_reaches_no_other_command(arun, backend):
    """Variables the agent sets in the python tool's interpreter (PATH ahead to planted binaries,
    BASH_ENV, ENV, PYTHONPATH, LD_PRELOAD...) stay in that interpreter: the bash tool's next
    command, and the interpreter after a restart, run with the server's environment."""
    sandbox_backend_or_skip(backend)
    env = AttackEnv(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        obs, *_ = arun(env.astep(call("python", code=INJECT_ENV)))
        assert obs[0]["content"] == "'injected'", obs
        obs, *_ = _bash(arun, env, "ls -d /work; python3 -c 'print(1)'; echo \"[$LD_PRELOAD][$BASH_ENV][$PATH]\"")
        out = obs[0]["content"]
        assert "HIJACKED" not in out and "BASH-ENV-RAN" not in out and "PROMPT-RAN" not in out, out
        assert "/work\n1\n[][][" in out and "/work/bin" not in out, out
        obs, *_ = arun(env.astep(call("python", code="import os; os._exit(3)")))
        obs, *_ = arun(env.astep(call("python", code="import os, subprocess\n"
                                      "(os.environ.get('LD_PRELOAD'), '/work/bin' in os.environ['PATH'], "
                                      "subprocess.run(['ls', '-d', '/work'], capture_output=True, text=True).stdout)")))
        assert obs[0]["content"] == "(None, False, '/work\\n')", obs
    finally:
        arun(env.aclose())


class GradedInTheSandbox(AttackEnv):
    """Grades as a repository task would: the agent's answer read from its sandbox, a check written
    there and run there, after the agent's turns."""
    sandbox_limits = {"memory_mb": 512, "workdir_mb": 16, "tmp_mb": 16}

    async def final_answer(self, action):
        answer = await self.read_file("answer.txt", max_bytes=1 << 16)
        await self.write_file("check.py", "print(open('answer.txt').read().strip() == '42')\n")
        r = await self.sandbox_instance.exec(["python3", "-I", "check.py"], timeout=20)
        return [], float(answer.strip() == b"42" and r.stdout.strip() == "True"), True, False, {}


# what the agent does to its own sandbox before it answers: name -> (bash command, the fault's type)
BREAK_THE_GRADING = {
    "honest": ("echo 42 > answer.txt", None),
    "no answer": ("true", "SandboxFileMissing"),
    "answer is a FIFO": ("mkfifo answer.txt", "SandboxFileRefused"),
    "answer is a directory": ("mkdir answer.txt", "SandboxFileRefused"),
    "answer is too large": ("head -c 100000 /dev/zero > answer.txt", "SandboxFileTooLarge"),
    "chmod 000 the workdir": ("echo 42 > answer.txt; chmod 000 /work", "SandboxFileRefused"),
    "fill the workdir": ("echo 42 > answer.txt; cat /dev/zero > /work/fill 2>/dev/null", "SandboxFileRefused"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_grading_the_agent_broke_in_its_sandbox_is_its_fault(arun, backend):
    """Whatever the agent did to its sandbox that makes the env's own reads, writes or execs there
    fail (its answer missing, a FIFO, a directory, too large; the workdir chmod 000 or full) ends
    the episode as its fault: reward 0, the reason recorded, the sandbox never reused. Raised, it
    would make the trajectory FAILED: a group the policy could veto."""
    sandbox_backend_or_skip(backend)
    for name, (command, fault) in BREAK_THE_GRADING.items():
        env = GradedInTheSandbox(sandbox=backend)
        try:
            arun(env.areset(options={"prompt": "hi"}))
            _bash(arun, env, command)
            if name == "fill the workdir" and backend == "local" and not env.sandbox_instance.mounted:
                continue  # local, not root, without a mount namespace: the host's disk, not a tmpfs
            obs, reward, done, _, info = arun(env.astep("my answer"))
            if fault is None:
                assert (reward, done, info) == (1.0, True, {}), (name, info)
                continue
            assert (obs, reward, done) == ([], 0.0, True), (name, obs, reward, info)
            assert info["agent_fault"].startswith(fault), (name, info)
            assert env.sandbox_instance.tainted, name
        finally:
            arun(env.aclose())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sandbox_that_died_under_the_grading_is_infrastructure(arun, backend):
    """The other side of the rule: the sandbox torn down from the host (its container or namespaces
    gone, nothing the agent did) while the env grades in it raises SandboxError: FAILED, masked."""
    from agentrl.sandboxes import SandboxError

    sandbox_backend_or_skip(backend)
    env = GradedInTheSandbox(sandbox=backend)
    try:
        arun(env.areset(options={"prompt": "hi"}))
        _bash(arun, env, "echo 42 > answer.txt")
        arun(env.sandbox_instance._destroy())
        with pytest.raises(SandboxError, match="died"):
            arun(env.astep("my answer"))
    finally:
        arun(env.aclose())


def test_only_errors_of_the_trajectorys_own_sandbox_that_still_answers_are_the_agents(arun):
    """SandboxError from the trajectory's sandbox while it answers a ping: the agent's fault. From
    another sandbox (the grader's own), or while the trajectory's answers no ping: raised."""
    from agentrl.sandboxes import SandboxError

    class Box:
        id, tainted, answers = "sbx-agent", "", True

        async def ping(self):
            if not self.answers:
                raise SandboxError("sandbox sbx-agent died during ping", "sbx-agent")

        def taint(self, why):
            self.tainted = why

    class Grades(ToolEnv):
        async def final_answer(self, action):
            raise SandboxError(f"sandbox {action}: cannot restart after exec", action)

    for raised_by, answers, is_fault in (("sbx-agent", True, True), ("sbx-grader", True, False),
                                         ("sbx-agent", False, False)):
        env, box = Grades(), Box()
        arun(env.areset(options={"prompt": "hi"}))
        box.answers, env.sandbox_instance = answers, box
        if is_fault:
            obs, reward, done, _, info = arun(env.astep(raised_by))
            assert (obs, reward, done) == ([], 0.0, True) and box.tainted, info
            assert info["agent_fault"] == "SandboxError: sandbox sbx-agent: cannot restart after exec", info
        else:
            with pytest.raises(SandboxError):
                arun(env.astep(raised_by))
        env.sandbox_instance = None
        arun(env.aclose())
