"""Agent envs: any agent program, trained through the gateway.

    from agentrl.gateway import agent_env

    @agent_env("my-agent", grader="math")           # tasks and grading from the math env
    async def my_agent(task, client):               # client: openai.AsyncOpenAI at this trajectory's session
        reply = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": task["prompt"]}])
        return reply.choices[0].message.content      # the answer the grader scores

    agentrl train --env my-agent --env-module my_agent.py

`client.base_url` and `client.api_key` are the session's, for a framework that builds its
own client. Or `@agent_env("name", command="node agent.js")`: the command runs per trajectory
in the trajectory's sandbox (`sandbox=`: "auto", "local", "docker" or a SandboxPool; the
grader env's own sandbox when it has one, so its grading sees the files the command wrote),
with OPENAI_BASE_URL (http://127.0.0.1:PORT/v1, the sandbox's loopback, bridged to this
trajectory's session: agentrl.sandboxes.bridge), OPENAI_API_KEY, AGENTRL_TASK (the task as
JSON, without its label) and AGENTRL_MESSAGES (the grader env's first messages, JSON) set,
under the sandbox's limits, `timeout_s` and an output bound (the sandbox's output_bytes); the
last line it prints is its output. `sandbox=False`: a host subprocess instead (trusted code
only: it sees the host and the whole task, label included).

The reward, first that applies: the agent raised, timed out (`timeout_s`), printed past its
output bound, exited non-zero (a command), broke its own sandbox (a command whose exec raised
`SandboxError` while the sandbox still answers: it killed the exec server, filled what the
server needs; see `_sandbox_answers`), left a file the reward function cannot read (a FIFO, a
directory, missing, too large: `AgentFileError`), or never called the endpoint: 0, the reason
in the sample's metadata["agent_fault"] (scored, not FAILED, which would let a policy veto its
group). A sandbox that cannot be had, or that no longer answers, is infrastructure: FAILED.
Else `reward(task, result)` if given (result: AgentResult, the output and the conversation);
else the `grader` env: reset with the task, one step with the output (a string; else the
last reply's text): the env's own grading (the code env's hidden tests, unchanged); else the
output itself, a number or a dict with "score".
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from agentrl.env import Env
from agentrl.errors import AgentFault, ConfigError
from agentrl.gateway.server import Gateway
from agentrl.gateway.session import Session
from agentrl.registry import get_spec, make, register_env
from agentrl.rollout.agent_loop import (TRUNCATED_MAX_TURNS, TRUNCATED_RESPONSE_LEN, LoopSettings, Renderer,
                                        trajectory_sampling_seed)
from agentrl.rollout.client import GenerateClient
from agentrl.rollout.control import RolloutControl
from agentrl.types import Sample, SampleStatus

DEFAULT_TIMEOUT_S = 600.0
CANCEL_GRACE_S = 5.0  # how long a timed-out agent gets to stop; one that ignores cancellation is left behind
COMMAND_OUTPUT_TAIL = 2000  # characters of a failed command's stderr kept in the fault reason


@dataclass
class AgentResult:
    """What a reward function sees: the agent's output and the conversation of its last request."""
    output: Any
    messages: list[dict] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # a command's sandbox, still open (read the files it wrote: `await sandbox.read_file(p)`; what the agent
    # left unreadable there raises AgentFileError, its fault)
    sandbox: Any = None


class CommandFault(Exception):
    """A command agent ended badly by its own doing (timed out, flooded, exited non-zero): reward 0."""


class AgentFileError(AgentFault):
    """A file in the agent's sandbox that a reward function reads is missing, not a regular file or
    too large: what the agent left there. Raised as FileNotFoundError, OSError or ValueError too
    (`_AgentFiles.read_file`), so a reward function that catches those still does."""


class _MissingFile(AgentFileError, FileNotFoundError):
    pass


class _UnreadableFile(AgentFileError, OSError):
    pass


class _OversizedFile(AgentFileError, ValueError):
    pass


class _AgentFiles:
    """The command's sandbox as a reward function sees it (`AgentResult.sandbox`): the sandbox,
    whose read_file errors are the agent's (`AgentFileError`); SandboxError stays itself."""

    def __init__(self, sandbox):
        self._sandbox = sandbox

    def __getattr__(self, name):
        return getattr(self._sandbox, name)

    async def read_file(self, path: str, *args, **kw) -> bytes:
        try:
            return await self._sandbox.read_file(path, *args, **kw)
        except FileNotFoundError as e:
            raise _MissingFile(f"the agent's file {path}: {e}") from None
        except OSError as e:
            raise _UnreadableFile(f"the agent's file {path}: {e}") from None
        except ValueError as e:
            raise _OversizedFile(f"the agent's file {path}: {e}") from None


class AgentEnv(Env):
    """An env played by an agent program through the gateway (see the module docstring); built
    by `agent_env`. The agent loop does not step it: the run's AgentRunner plays it."""

    agent: Callable[..., Awaitable[Any]] | None = None
    command: str | None = None
    reward: Callable[[dict, AgentResult], Any] | None = None
    grader: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    tool_parser: str | None = "hermes"
    max_turns = 32
    tasks: Callable[..., Any] | None = None
    #: where a command runs: a backend name or a SandboxPool; None: a host subprocess (or no command)
    sandbox: Any = None
    sandbox_limits: dict[str, Any] = {}  # SandboxLimits fields of the sandboxes made for it

    def __init__(self, **grader_kwargs):
        given = grader_kwargs.pop("sandbox", None)  # the run's pool (build.tool_kwargs), or --env-kwargs'
        if given is not None and self.command is not None and self.sandbox:
            self.sandbox = given
        elif given is None and self.command is not None and hasattr(self.sandbox, "get"):
            given = self.sandbox  # the decorator's own pool (an image of the user's): the grader's too
        if given is not None and self.grader is not None and _takes_sandbox(self.grader):
            grader_kwargs["sandbox"] = given  # one pool for the grader's sandbox and the command's
        self.grader_kwargs = grader_kwargs  # --env-kwargs, for the grader env

    @classmethod
    def dataset(cls, **kwargs):
        if cls.tasks is not None:
            return cls.tasks(**kwargs)
        if cls.grader is not None:
            return get_spec(cls.grader).load().dataset(**kwargs)
        return None

    async def areset(self, *, seed=None, options=None):
        raise TypeError(f"{type(self).__name__} is an agent env: its agent plays it through the gateway "
                        "(agentrl.gateway.AgentRunner), not the agent loop")

    async def astep(self, action):
        raise TypeError(f"{type(self).__name__} is an agent env: it has no step")


def _takes_sandbox(env_name: str) -> bool:
    params = inspect.signature(get_spec(env_name).load()).parameters
    return "sandbox" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def agent_env(name: str, *, command: str | None = None, reward: Callable | None = None, grader: str | None = None,
              tasks: Callable | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, tool_parser: str | None = "hermes",
              max_turns: int = 32, description: str | None = None, sandbox: Any = "auto",
              sandbox_limits: dict | None = None):
    """Register an agent env: decorate `async def agent(task, client)`, or call with `command=`
    (and no function: ``agent_env("name", command="...")(None)``). `sandbox` and
    `sandbox_limits` are a command's (see the module docstring); `sandbox=False`: on the host."""
    if sandbox is True or (isinstance(sandbox, str) and sandbox not in ("auto", "local", "docker")) or \
            (sandbox and not isinstance(sandbox, str) and not hasattr(sandbox, "get")):
        raise TypeError(f"@agent_env({name!r}): sandbox must be 'auto', 'local', 'docker', a SandboxPool or False, "
                        f"got {sandbox!r}")

    def decorator(fn):
        if command is None and not inspect.iscoroutinefunction(fn):
            raise TypeError(f"@agent_env({name!r}): {getattr(fn, '__name__', fn)!r} must be an `async def "
                            "agent(task, client)`")
        if command is not None and fn is not None:
            raise TypeError(f"@agent_env({name!r}): give a command or a function, not both")
        needs_label = bool(grader and getattr(get_spec(grader).load(), "needs_label", False))
        attrs = {"agent": staticmethod(fn) if fn else None, "command": command,
                 "reward": staticmethod(reward) if reward else None, "grader": grader,
                 "tasks": staticmethod(tasks) if tasks else None, "timeout_s": float(timeout_s),
                 "tool_parser": tool_parser, "max_turns": int(max_turns), "needs_label": needs_label,
                 "sandbox": (sandbox or None) if command is not None else None,
                 "sandbox_limits": dict(sandbox_limits or {}),
                 "description": description or ((inspect.getdoc(fn) or "").split("\n")[0] if fn else
                                                f"agent command: {command}"),
                 "__module__": getattr(fn, "__module__", __name__)}
        cls = type(f"AgentEnv_{name.replace('-', '_')}", (AgentEnv,), attrs)
        register_env(name)(cls)
        return fn if fn is not None else cls

    return decorator


async def _run_command(command: str, task: dict, base_url: str, api_key: str, timeout_s: float) -> str:
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
           "AGENTRL_TASK": json.dumps(task, default=str)}
    proc = await asyncio.create_subprocess_shell(command, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                 start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except BaseException:
        try:
            os.killpg(proc.pid, 9)  # the command's whole process group: it may have started others
        except ProcessLookupError:
            pass
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"the command exited with {proc.returncode}: "
                           f"{err.decode(errors='replace')[-COMMAND_OUTPUT_TAIL:]}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _require_openai() -> None:
    try:
        import openai  # noqa: F401
    except ImportError as exc:
        raise ConfigError("agent envs hand their agent an openai.AsyncOpenAI: install the openai package "
                          "(pip install 'agentrl[agents]')") from exc


class AgentRunner:
    """GroupRunner's `generate_fn` for agent envs: each trajectory is a gateway session whose
    agent runs under a time bound; returns the session's samples, scored."""

    def __init__(self, *, renderer: Renderer, client: GenerateClient, settings_for: Callable[[Env], LoopSettings],
                 control: RolloutControl | None = None, reward_fn: Callable | None = None,
                 model_name: str = "agentrl-policy", host: str = "127.0.0.1", honor_sampling: bool = False,
                 request_timeout_s: float = 600.0):
        self.renderer, self.client, self.settings_for, self.control = renderer, client, settings_for, control
        self.reward_fn, self.honor_sampling, self.request_timeout_s = reward_fn, honor_sampling, request_timeout_s
        self.gateway = Gateway(host=host, model_name=model_name)
        self._starting = asyncio.Lock()
        self._http = None  # the agents' HTTP connection pool (an httpx AsyncClient), made on first use

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.gateway.aclose()

    async def __call__(self, env: Env, task: dict, *, trajectory_id: str, group_id: int, index: int, seed: int,
                       env_name: str) -> list[Sample]:
        def failed(error: str, **meta) -> list[Sample]:
            return [Sample(prompt_tokens=[], trajectory_id=trajectory_id, group_id=group_id, env_name=env_name,
                           status=SampleStatus.FAILED, metadata={"error": error, **meta})]

        if not isinstance(env, AgentEnv):
            return failed(f"env {env_name!r} is not an agent env: a run of agent envs plays only those")
        async with self._starting:
            await self.gateway.start()
        settings = self.settings_for(env)
        session = Session(trajectory_id=trajectory_id, group_id=group_id, env_name=env_name, task=task,
                          renderer=self.renderer, client=self.client, settings=settings, tool_parser=env.tool_parser,
                          control=self.control, honor_sampling=self.honor_sampling,
                          sampling_seed=trajectory_sampling_seed(seed, trajectory_id))
        if env.agent is not None:
            _require_openai()  # missing, every agent would fail alike: say so once, loudly
        async with contextlib.AsyncExitStack() as stack:
            try:  # a command's sandbox (and its grader, reset first: the command works in the grader's sandbox)
                place = await self._place(env, task, seed, stack)
            except ConfigError:
                raise
            except Exception as exc:  # the sandbox or the grader's reset failed: infrastructure, masked
                return failed(f"setting up the agent's sandbox: {type(exc).__name__}: {exc}",
                              traceback=traceback.format_exc())
            return await self._run(env, task, session, settings, place, seed, stack)

    async def _run(self, env: AgentEnv, task: dict, session: Session, settings: LoopSettings, place: "_Place",
                   seed: int, stack: contextlib.AsyncExitStack) -> list[Sample]:
        trajectory_id, group_id, env_name = session.trajectory_id, session.group_id, session.env_name
        base_url, key = self.gateway.open(session)
        socket_inside = None
        if place.sandbox is not None:  # the session on a unix socket in the sandbox's bridge dir
            from agentrl.sandboxes import bridge

            host_path, socket_inside = bridge.socket_path(place.sandbox)
            try:
                await self.gateway.bind(key, host_path, getattr(place.sandbox, "host_uid", place.sandbox.uid))
            except BaseException:
                self.gateway.close(key)
                raise
            stack.push_async_callback(self.gateway.unbind, host_path)
        fault = tb = output = failure = None
        playing = asyncio.ensure_future(self._play(env, task, base_url, key, place, socket_inside))
        # a sandboxed command is ended by its exec's own bound (its reason said exactly); this is the backstop
        bound = env.timeout_s + (30.0 if place.sandbox is not None else 0.0)
        try:
            done, _ = await asyncio.wait({playing}, timeout=bound)
            if not done:
                fault = f"timeout: the agent ran past {env.timeout_s:g} s"
            elif isinstance(playing.exception(), CommandFault):
                fault = str(playing.exception())
            elif _is_sandbox_error(playing.exception()):
                exc = playing.exception()
                if await _sandbox_answers(place.sandbox):  # it lives: what broke its exec is the command
                    place.sandbox.taint(f"the agent's command broke it: {exc}")
                    fault = f"the agent broke its sandbox: {exc}"
                else:  # the sandbox itself is gone: infrastructure, masked
                    failure, tb = f"sandbox: {exc}", "".join(traceback.format_exception(exc))
            elif playing.exception() is not None:
                exc = playing.exception()
                fault = f"the agent raised {type(exc).__name__}: {exc}"
                tb = "".join(traceback.format_exception(exc))
            else:
                output = playing.result()
        finally:  # the trajectory ends now, even when the agent ignores its cancellation
            if not playing.done():
                playing.cancel()
                await asyncio.wait({playing}, timeout=CANCEL_GRACE_S)
            last_text = session.last_assistant_text()
            samples = self.gateway.close(key)
        fault = fault or session.fault
        if not samples:
            fault = fault or (None if failure else "the agent never called the endpoint")
            samples = [Sample(prompt_tokens=[], trajectory_id=trajectory_id, group_id=group_id, env_name=env_name,
                              metadata={"label": task.get("label"), **(task.get("metadata") or {})})]
        reward = 0.0
        if fault is None and failure is None:
            files = _AgentFiles(place.sandbox) if place.sandbox is not None else None
            try:
                reward, fault = await self._score(env, task, AgentResult(output, samples[-1].messages, samples, files),
                                                  seed, last_text, place.grader)
            except ConfigError:
                raise  # the env's definition is wrong: every trajectory would be; stop the run
            except AgentFault as exc:  # a file the agent left (or broke) that the scoring reads
                fault = f"scoring: {type(exc).__name__}: {exc}"
            except Exception as exc:  # the grader or reward function failed: infrastructure, masked
                if _is_sandbox_error(exc) and await _sandbox_answers(place.sandbox):
                    place.sandbox.taint(f"the agent broke it: {exc}")
                    fault = f"scoring: the agent broke its sandbox: {exc}"
                else:
                    failure = f"scoring: {type(exc).__name__}: {exc}"
                    tb = traceback.format_exc()
        for sample in samples:
            sample.reward = reward
            sample.metadata["agent_output"] = output if isinstance(output, (str, int, float, type(None))) else repr(output)
            sample.metadata["tool_calls"] = sum(m.get("role") == "tool" for m in sample.messages)
            if place.sandbox is not None:
                sample.metadata["sandbox"] = place.sandbox.backend
                sample.metadata["agent_command_s"] = place.command_s
            if fault is not None:
                sample.metadata["agent_fault"] = fault
                if fault.startswith("the agent raised") and tb:
                    sample.metadata["traceback"] = tb
            if failure is not None:
                sample.status = SampleStatus.FAILED
                sample.metadata["error"], sample.metadata["traceback"] = failure, tb
            elif session.aborted:
                sample.status = SampleStatus.ABORTED
            elif session.truncated:
                sample.status = SampleStatus.TRUNCATED
                sample.metadata["truncation"] = TRUNCATED_MAX_TURNS if session.requests > settings.max_turns \
                    else TRUNCATED_RESPONSE_LEN
        return samples

    async def _place(self, env: AgentEnv, task: dict, seed: int, stack: contextlib.AsyncExitStack) -> "_Place":
        """Where a sandboxed command runs: the grader env's sandbox (the grader reset with the task
        first, so its grading sees what the command wrote), else one of the agent env's own."""
        if env.command is None or not env.sandbox:
            return _Place()
        grader, messages = None, None
        if env.grader is not None:
            grader = make(env.grader, **env.grader_kwargs)
            stack.push_async_callback(grader.aclose)
            obs, _ = await grader.areset(seed=seed, options=task or None)
            messages = obs if isinstance(obs, list) else None
        sb = getattr(grader, "sandbox_instance", None)
        if sb is None:
            if hasattr(env.sandbox, "get") and hasattr(env.sandbox, "release"):  # a SandboxPool
                sb = await env.sandbox.get()
                stack.push_async_callback(env.sandbox.release, sb)
            else:
                from agentrl.sandboxes import SandboxLimits, create

                sb = create(env.sandbox, limits=SandboxLimits(**env.sandbox_limits))
                stack.push_async_callback(sb.close)
                await sb.start()
        return _Place(grader=grader, sandbox=sb, messages=messages)

    async def _play(self, env: AgentEnv, task: dict, base_url: str, key: str, place: "_Place",
                    socket_inside: str | None):
        if env.command is not None and place.sandbox is not None:
            return await _run_in_sandbox(env, place, socket_inside, task, key)
        if env.command is not None:
            return await _run_command(env.command, task, base_url, key, env.timeout_s)
        import openai

        if self._http is None:  # one connection pool for every session: a client's own costs an SSL context (~0.1 s)
            self._http = openai.DefaultAsyncHttpxClient(timeout=self.request_timeout_s)
        # not closed after the agent: closing it would close the shared pool (closed in aclose)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=self._http)
        return await env.agent(task, client)

    async def _score(self, env: AgentEnv, task: dict, result: AgentResult, seed: int, last_text: str | None,
                     grader: Env | None = None):
        """(reward, the agent's fault the grader env reported or None)."""
        info: dict = {}
        if env.reward is not None:
            out = env.reward(task, result)
            out = await out if inspect.isawaitable(out) else out
        elif env.grader is not None:
            answer = result.output if isinstance(result.output, str) else (last_text or "")
            if grader is not None:  # reset before the command ran, in its sandbox (closed by the caller)
                _, out, _, _, info = await grader.astep(answer)
            else:
                grader = make(env.grader, **env.grader_kwargs)
                try:
                    await grader.areset(seed=seed, options=task or None)
                    _, out, _, _, info = await grader.astep(answer)
                finally:
                    await grader.aclose()
        else:
            out = result.output
        fault = info.get("agent_fault") if isinstance(info, dict) else None
        if isinstance(out, dict) and "score" in out:
            return {k: float(v) for k, v in out.items()}, fault
        if isinstance(out, bool) or not isinstance(out, (int, float)):
            raise ConfigError(f"agent env {type(env).__name__}: the reward must be a number or a dict with 'score', "
                              f"got {out!r} (return one from the agent, or give reward= or grader= to @agent_env)")
        return float(out), fault


async def _sandbox_answers(sandbox) -> bool:
    """agentrl.sandboxes.still_answers, imported only when a sandbox exists (function agents never load it)."""
    if sandbox is None:
        return False
    from agentrl.sandboxes import still_answers

    return await still_answers(sandbox)


def _is_sandbox_error(exc: BaseException | None) -> bool:
    if exc is None or "agentrl.sandboxes" not in sys.modules:
        return False
    from agentrl.sandboxes import SandboxError

    return isinstance(exc, SandboxError)


async def _loopback_works(sb) -> bool:
    """Whether a fresh process in `sb` can listen on its loopback. The forwarder's "no loopback"
    exit is also what the command itself can print and exit with (the forwarder passes its exit
    code on): only a failing check here makes it the sandbox's."""
    r = await sb.exec(["python3", "-I", "-c", "import socket; socket.socket().bind(('127.0.0.1', 0))"],
                      timeout=30, cwd="/")
    return r.exit_code == 0


@dataclass
class _Place:
    """Where one trajectory's agent runs: a command's sandbox and the grader env reset in it."""
    grader: Env | None = None
    sandbox: Any = None
    messages: list | None = None  # the grader env's first messages (AGENTRL_MESSAGES)
    command_s: float | None = None  # how long the command ran


async def _run_in_sandbox(env: AgentEnv, place: _Place, socket_inside: str, task: dict, key: str) -> str:
    """Run the command in the place's sandbox behind the bridge's forwarder; its output's last line,
    or CommandFault."""
    from agentrl.sandboxes import bridge

    sb = place.sandbox
    cap = sb.limits.output_bytes
    variables = {"OPENAI_API_KEY": key,
                 "AGENTRL_TASK": json.dumps({k: v for k, v in task.items() if k != "label"}, default=str)}
    if place.messages:
        variables["AGENTRL_MESSAGES"] = json.dumps(place.messages, default=str)
    r = await sb.exec(bridge.forwarder_argv(socket_inside, env.command, cap), timeout=env.timeout_s,
                      env=variables, output_limit=cap + bridge.MARGIN)
    place.command_s = r.duration_s
    tail = r.stderr[-COMMAND_OUTPUT_TAIL:]
    if r.timed_out:
        raise CommandFault(f"timeout: the agent ran past {env.timeout_s:g} s")
    if r.exit_code == bridge.FLOOD_EXIT and bridge.FLOOD_NOTE in r.stderr:
        raise CommandFault(f"output flood: the command printed past {cap} bytes and was stopped")
    if r.exit_code == bridge.NO_LOOPBACK_EXIT and "no loopback" in r.stderr and not await _loopback_works(sb):
        from agentrl.sandboxes import SandboxError

        raise SandboxError(f"sandbox {sb.id}: {tail.strip()}")  # ours, not the agent's: a failed trajectory
    if r.exit_code != 0:
        raise CommandFault(f"the command exited with {r.exit_code}: {tail}")
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else ""
