"""`ToolEnv`: the base class of envs whose model calls tools.

    @register_env("calc")
    class CalcEnv(ToolEnv):
        builtin_tools = ("python",)            # MCP server(s) run per trajectory
        function_tools = (lookup,)             # plain Python functions, in-process
        sandbox = "auto"                       # where the built-in servers run (None: host)
        max_turns = 6

        async def final_answer(self, action):  # the model answered without a tool call
            return [], float(self.task["label"] in action), True, False, {}

Per trajectory (`areset`) it starts a `ToolSet` (and a sandbox, when `sandbox` names a
backend) and returns ``info["tools"]``; each `astep` parses the action with the env's
`tool_parser`, runs the calls concurrently and returns the ``tool`` messages; an action
with no tool call goes to `final_answer`. `aclose` stops the servers and the sandbox. An
`AgentFault` raised in a step (the model's code killed its tool server; a grader found the
agent sabotaged its own solution), or an operation on the trajectory's sandbox that failed
while the sandbox still answers (a server that cannot restart, an exec server killed, a file
the agent left missing or unwritable), ends the episode with reward 0 and
``info["agent_fault"]``; infrastructure failures raise, and the trajectory is FAILED (masked).
External MCP servers join through the constructor (``mcp_servers=["name=cmd ..."]``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import gymnasium

from agentrl.env import Env, Message
from agentrl.errors import AgentFault
from agentrl.tools.client import ToolResult, ToolServerError, ToolSet
from agentrl.tools.parsers import aparse_tool_calls, get_parser
from agentrl.tools.spec import MCPServerSpec, as_spec, builtin_spec, tool_sandbox_options

__all__ = ["ToolEnv"]
log = logging.getLogger("agentrl.tools")
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


class ToolEnv(Env):
    """Base class of envs with tools (MCP servers and plain functions). Async; gymnasium's sync
    `reset`/`step`/`close` run the async ones on the env's own event loop (`Env._run_sync`)."""

    max_turns = 8
    tool_parser = "hermes"
    #: built-in tools ("python", "bash", "files"), served by one MCP server per trajectory
    builtin_tools: Sequence[str] = ()
    #: MCP servers: MCPServerSpec or "--mcp-server" strings ("NAME=COMMAND ARGS", "NAME=http://...")
    mcp_servers: Sequence[MCPServerSpec | str] = ()
    #: plain Python functions (or FunctionTool) offered as tools, run in-process
    function_tools: Sequence[Callable] = ()
    #: where the built-in servers run: None (host subprocesses in a temp workdir), an
    #: agentrl.sandboxes backend ("local", "docker", "auto": a sandbox per trajectory), a
    #: started Sandbox, or a SandboxPool (one sandbox from it per trajectory, released at
    #: aclose). Pools and sandboxes given in must have `tool_sandbox_options()` mounts.
    sandbox: Any = None
    #: agentrl.sandboxes.SandboxLimits fields for the sandbox this env creates
    sandbox_limits: dict[str, Any] = {}
    #: prepended as a system message at reset, if set
    system_prompt: str | None = None
    tool_timeout: float = 60.0       # seconds per call (client side; servers have their own limits too)
    max_tool_output: int = 16000     # characters per tool result; the rest is cut with a note
    max_tool_calls_per_turn: int = 16  # calls beyond it are not run; the model is told

    toolset: ToolSet | None = None
    sandbox_instance: Any = None
    task: dict[str, Any] = {}
    _own_sandbox: Any = False  # False, True (close it), or the pool to release it to

    class _ToolNames:
        """Names of the tools known without starting anything (`agentrl envs info`)."""

        def __get__(self, obj, cls) -> tuple[str, ...]:
            from agentrl.tools.spec import BUILTIN_TOOL_NAMES
            from agentrl.tools.functions import function_tool
            src = obj if obj is not None else cls
            names = [n for b in src.builtin_tools for n in BUILTIN_TOOL_NAMES.get(b, (b,))]
            names += [function_tool(f).name for f in src.function_tools]
            return tuple(names + [f"{as_spec(s).name}:*" for s in src.mcp_servers])

    tool_names = _ToolNames()

    def __init__(self, *, mcp_servers: Sequence[MCPServerSpec | str] | None = None,
                 builtin_tools: Sequence[str] | None = None, function_tools: Sequence[Callable] | None = None,
                 sandbox: Any = None, tool_parser: str | None = None, tool_timeout: float | None = None,
                 max_tool_output: int | None = None, system_prompt: str | None = None):
        """mcp_servers are added to the class's (external servers: ``--mcp-server``);
        builtin_tools / function_tools replace the class's; sandbox: a backend name, or a
        started Sandbox to use (not closed by the env; create it with
        `agentrl.tools.spec.tool_sandbox_options()` mounts)."""
        if mcp_servers:
            self.mcp_servers = [*type(self).mcp_servers, *(as_spec(s) for s in mcp_servers)]
        if builtin_tools is not None:
            self.builtin_tools = tuple(builtin_tools)
        if function_tools is not None:
            self.function_tools = tuple(function_tools)
        if sandbox is not None:
            self.sandbox = sandbox
        if tool_parser is not None:
            get_parser(tool_parser)
            self.tool_parser = tool_parser
        if tool_timeout is not None:
            self.tool_timeout = tool_timeout
        if max_tool_output is not None:
            self.max_tool_output = max_tool_output
        if system_prompt is not None:
            self.system_prompt = system_prompt

    # ---- lifecycle --------------------------------------------------------------------------
    def server_specs(self) -> list[MCPServerSpec]:
        # a call may ask for a timeout up to tool_timeout (the server cuts it there and answers):
        # a longer one would outlast the client's wait and count as a hung server, the agent's fault
        specs = [builtin_spec(*self.builtin_tools, max_timeout=self.tool_timeout)] if self.builtin_tools else []
        return specs + [as_spec(s) for s in self.mcp_servers]

    async def start_tools(self) -> ToolSet:
        specs = self.server_specs()
        toolset = None
        if hasattr(self.sandbox, "get") and hasattr(self.sandbox, "release"):  # a SandboxPool
            pool = self.sandbox
            if hasattr(pool, "keep_ready") and any(s.in_sandbox for s in specs):
                # the pool starts the next trajectories' tool servers while this one runs: their
                # start (~1 s of CPU each) was most of a reset when a batch began at once
                key, start = self._tool_starter(specs)
                pool.keep_ready(key, start, ToolSet.close)
                self.sandbox_instance, self._own_sandbox = await pool.get(ready=key), pool
                toolset = await pool.take_ready(self.sandbox_instance, key)
            else:
                self.sandbox_instance, self._own_sandbox = await pool.get(), pool
        elif self.sandbox is not None and not isinstance(self.sandbox, str):
            self.sandbox_instance, self._own_sandbox = self.sandbox, False
        elif self.sandbox and any(s.in_sandbox for s in specs):
            from agentrl.sandboxes import SandboxLimits, create
            mounts, env = await asyncio.to_thread(tool_sandbox_options)
            sb = create(self.sandbox, limits=SandboxLimits(**self.sandbox_limits), mounts=mounts, env=env)
            await sb.start()
            self.sandbox_instance, self._own_sandbox = sb, True
        elif not self.sandbox and {"python", "bash"} & set(self.builtin_tools):
            _warn_once(f"{type(self).__name__}: the built-in python/bash tools run on the host, unconfined (no "
                       "sandbox); set `sandbox = \"auto\"` (or local / docker) to confine the model's code")
        self.toolset = toolset or ToolSet(specs, self.function_tools, sandbox=self.sandbox_instance,
                                          call_timeout=self.tool_timeout, max_output_chars=self.max_tool_output)
        try:
            await self.toolset.start()  # (one the pool started is started: nothing to do)
        except BaseException:
            await self.close_tools()
            raise
        return self.toolset

    def _tool_starter(self, specs: list[MCPServerSpec]):
        """(key, start): what a pool needs to start this env's tool servers in a sandbox ahead of a
        trajectory. The key is everything the ToolSet is made of, so envs that differ get their own."""
        functions, timeout, max_output = tuple(self.function_tools), self.tool_timeout, self.max_tool_output
        key = (repr(specs), tuple(map(id, functions)), timeout, max_output)

        async def start(sb) -> ToolSet:
            toolset = ToolSet(specs, functions, sandbox=sb, call_timeout=timeout, max_output_chars=max_output)
            await toolset.start()
            return toolset
        return key, start

    async def close_tools(self) -> None:
        toolset, self.toolset = self.toolset, None
        sb, own = self.sandbox_instance, self._own_sandbox
        self.sandbox_instance, self._own_sandbox = None, False
        try:
            if toolset is not None:
                await toolset.close()
        finally:
            if sb is not None and own is True:
                await sb.close()
            elif sb is not None and own:
                await own.release(sb)

    async def aclose(self) -> None:
        await self.close_tools()

    # ---- the episode ------------------------------------------------------------------------
    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        await self.close_tools()  # a reused env starts each trajectory with fresh tool state
        gymnasium.Env.reset(self, seed=seed)  # seeds np_random (super().reset would drive areset)
        self.task = dict(options) if options else self.seeded_task()
        toolset = await self.start_tools()
        await self.setup(self.task)
        return self.initial_messages(self.task), {"tools": toolset.schemas}

    async def setup(self, task: dict[str, Any]) -> None:
        """Hook after the tools started, before the first turn (e.g. write the task's files)."""

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        prompt = task.get("prompt", "")
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if isinstance(prompt, list):
            return messages + list(prompt)
        return messages + [{"role": "user", "content": str(prompt)}]

    async def astep(self, action: str):
        """One turn. What the model's own actions broke (`AgentFault`: it killed its tool server,
        left a file the grader cannot read, ...) ends the episode with reward 0 and the reason in
        ``info["agent_fault"]``, rather than raising: a raise marks the trajectory FAILED, which
        is masked and re-run, and would let the policy veto a group it is losing. So does an
        operation on the trajectory's sandbox that failed while the sandbox still answers
        (`_broken_by_the_agent`)."""
        try:
            return await self._astep(action)
        except AgentFault as e:
            log.info("%s: the agent's actions broke its episode: %s", type(self).__name__, e)
            return [], 0.0, True, False, {"agent_fault": f"{type(e).__name__}: {e}"}
        except Exception as e:
            if not await self._broken_by_the_agent(e):
                raise
            log.info("%s: the agent broke its sandbox: %s", type(self).__name__, e)
            self.sandbox_instance.taint(f"the agent broke it: {type(e).__name__}: {str(e)[:500]}")
            return [], 0.0, True, False, {"agent_fault": f"{type(e).__name__}: {str(e)[:2000]}"}

    async def _broken_by_the_agent(self, exc: Exception) -> bool:
        """`exc` came from the trajectory's sandbox, which still answers a ping (which restarts a
        killed exec server): what broke is what the agent did there, not the infrastructure. The
        same rule as a command agent's (agentrl.gateway.agent_env). From the sandbox: a tool server
        in it that is down (it failed to restart: `chmod 000 /work`, a full disk, memory pinned);
        its exec raising SandboxError (the exec server killed and unable to restart); a file
        operation it refused (`SandboxFileError`: the agent's file missing, a FIFO, too large, a
        full or unwritable workdir). A server on the host, another sandbox (the grader's), or a
        sandbox that died or does not answer (still_answers) stays an infrastructure failure."""
        sb, toolset = self.sandbox_instance, self.toolset
        if sb is None:
            return False
        if isinstance(exc, ToolServerError):
            if toolset is None or not any(c.in_sandbox and c.session is None for c in toolset.connections.values()):
                return False
        elif "agentrl.sandboxes" in sys.modules:
            from agentrl.sandboxes import SandboxError, SandboxFileError

            if not isinstance(exc, (SandboxError, SandboxFileError)) or exc.sandbox_id != sb.id:
                return False
        else:
            return False
        from agentrl.sandboxes import still_answers

        return await still_answers(sb)

    async def _astep(self, action: str):
        if self.toolset is None:
            raise RuntimeError(f"{type(self).__name__}.astep before areset: the tools are not started")
        calls = await aparse_tool_calls(action, self.tool_parser, self.toolset.input_schemas)
        if not calls:
            return await self.final_answer(action)
        extra = calls[self.max_tool_calls_per_turn:]
        results = await self.toolset.call_many(calls[:self.max_tool_calls_per_turn])
        if extra:  # one result for all of them: a turn of 100,000 calls must not become 100,000 messages
            results.append(ToolResult("tool_call", f"Error: {len(extra)} more tool calls were not run: at most "
                                      f"{self.max_tool_calls_per_turn} tool calls per turn", is_error=True,
                                      call_id=extra[0].id))
        info = {"tool_calls": len(results), "tool_errors": sum(r.is_error for r in results),
                "tool_names": [r.name for r in results]}
        return self.tool_observation(results), 0.0, False, False, info

    def tool_observation(self, results: list[ToolResult]) -> list[Message]:
        return [r.message() for r in results]

    async def final_answer(self, action: str) -> tuple[Any, float, bool, bool, dict]:
        """The model answered without calling a tool: score it. Default: end with reward 0."""
        return [], 0.0, True, False, {}

    # ---- helpers for setup and grading --------------------------------------------------------
    @property
    def workdir(self) -> str | None:
        """Where the built-in tools work: the sandbox's workdir, or the host temp dir."""
        if self.sandbox_instance is not None:
            return self.sandbox_instance.workdir
        return self.toolset.workdir if self.toolset else None

    async def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file where the tools see it (sandbox or host workdir)."""
        if self.sandbox_instance is not None:
            await self.sandbox_instance.write_file(path, content)
            return
        full = Path(self.workdir or ".") / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(content.encode() if isinstance(content, str) else content)

    async def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """A file where the tools see it. In a sandbox, what the agent left unreadable there (missing,
        a FIFO, larger than max_bytes) raises `SandboxFileError` (also FileNotFoundError/OSError/
        ValueError): raised out of a step, the agent's fault."""
        if self.sandbox_instance is not None:
            return await self.sandbox_instance.read_file(path, max_bytes=max_bytes)
        return (Path(self.workdir or ".") / path).read_bytes()
