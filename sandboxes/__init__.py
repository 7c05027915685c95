"""agentrl.sandboxes — isolated environments where agent code, tool servers and graders run.

Quick use::

    from agentrl.sandboxes import create, SandboxLimits

    async with create(backend="auto", limits=SandboxLimits(memory_mb=512)) as sb:
        await sb.write_file("main.py", "print(6 * 7)")
        r = await sb.exec("python3 main.py", timeout=10)
        r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated   # 0, "42\n", "", False, False

    # sync scripts
    with create_sync(backend="local") as sb:
        print(sb.exec("echo hi").stdout)

Backends (`resolve_backend(name)` maps the CLI's `--sandbox docker|local|auto`):
  * "docker": a container per sandbox via the Docker SDK. Needs an engine and the base
    image (no registry: build it once with `agentrl sandbox build`, cached).
  * "local": bubblewrap namespaces on the host (apt-get install bubblewrap).
  * "auto": docker when an engine answers (and the CLI is there), else local; logged.

Isolation defaults (both backends): no network (`network=True` to opt in), read-only root,
private writable /work (size-capped) and /tmp, memory / CPU / pids / wall-time / output
limits (`SandboxLimits`), commands as a non-root uid (`Sandbox.uid`: 1000 in a local
sandbox's user namespace, a uid of its own per docker container) with no capabilities,
no-new-privileges, a clean environment (nothing of the host's env leaks in). Processes a
command leaves behind are killed when `exec` returns. The servers inside (exec, MCP tools)
start isolated from the workdir (`python3 -I`, cwd /) under `base.SERVER_IDENTITY`: not
dumpable, and on docker a uid pair the agent's uid cannot signal. A sandbox whose server
was restarted is `tainted` (a pool never reuses it). docs/security.md (the threat model)
says what holds for which deployment.

Failures: a failing command is an `ExecResult`; a broken sandbox raises `SandboxError`
(mark the trajectory failed, don't score it). A missing image raises `ImageNotFoundError`.

Tool servers inside the sandbox: `sb.spawn(argv)` returns an asyncio Process with
stdin/stdout pipes; `sb.spawn_argv(argv)` is the equivalent host command line (for an MCP
stdio client). The built-in tool servers need `agentrl.tools.spec.tool_sandbox_options()`
mounts (their sources and the mcp SDK's closure only, staged by `stage.py`);
`agentrl_source_mounts()` makes all of agentrl importable (never where an agent runs: with
site_packages it shows the host's virtualenv).

Graders: mount the grader's files read-only (`mounts={host_dir: "/grader"}`); the agent
cannot change them. Run the grader in a fresh sandbox (or on the host) for full trust.

Pool: `SandboxPool` keeps warm sandboxes, bounds concurrency, resets state per
trajectory and gives every member of a GRPO group the same starting files.

Cleanup: sandboxes are labelled with run id and owner pid; `reap()` removes those whose
owner is gone (run automatically at the first sandbox of a process, and at exit for its
own). CLI: `agentrl.sandboxes.cli:main(["build" | "ls" | "reap" ...])`.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .base import (RUN_ID, ExecResult, ImageNotFoundError, Sandbox, SandboxError, SandboxFileError,
                   SandboxLimits, SyncSandbox, run_sync, still_answers)
from .backends import BACKENDS, create, create_sync, resolve_backend
from .docker_backend import DEFAULT_IMAGE, DockerSandbox, engine_available
from .local_backend import LocalSandbox, local_available
from .pool import SandboxPool, default_max_active

__all__ = ["create", "create_sync", "resolve_backend", "reap", "agentrl_source_mounts",
           "Sandbox", "SyncSandbox", "SandboxLimits", "ExecResult", "SandboxError", "SandboxFileError",
           "ImageNotFoundError", "SandboxPool", "default_max_active", "DEFAULT_IMAGE", "RUN_ID", "still_answers"]

log = logging.getLogger("agentrl.sandboxes")


def reap(everything: bool = False) -> dict[str, list[str]]:
    """Remove the sandboxes of dead owner processes on every available backend."""
    from . import docker_backend, local_backend
    out = {"local": local_backend.reap(everything)}
    if engine_available()[0]:
        out["docker"] = docker_backend.reap(everything)
    return out


def agentrl_source_mounts(inside: str = "/opt/agentrl", site_packages: bool = True
                          ) -> tuple[dict[str, str], dict[str, str]]:
    """(mounts, env) that make the host's agentrl package importable inside a sandbox.
    The installed package's .py sources, design-card folders included (agentrl.tools is the
    repo's tools/), are staged once (`stage.stage_files`: sources only, never data files such
    as a task file's hidden tests), mounted read-only at `inside`; PYTHONPATH points there.
    `import agentrl` needs the core's dependencies (gymnasium, ...): with site_packages=True
    the host interpreter's whole site-packages is mounted read-only too (at `inside`-siteN),
    which shows the host's virtualenv to the sandbox: never do that where an agent runs (tool
    servers use `agentrl.tools.spec.tool_sandbox_options()`, which stages only what they need).
    It works when the sandbox's python3 has the host's minor version and libc."""
    import agentrl
    from .stage import package_sources, stage_files
    parts = {"agentrl": Path(agentrl.__path__[0]).resolve()}
    for sub in ("envs", "tools", "sandboxes", "trainers"):
        try:
            mod = __import__(f"agentrl.{sub}", fromlist=["_"])
        except Exception:
            continue
        src = Path(mod.__path__[0]).resolve()
        if src.parent != parts["agentrl"]:
            parts[f"agentrl/{sub}"] = src
    files = {}
    for dest, src in parts.items():
        files.update(package_sources(src, dest))
    mounts, path = {str(stage_files(files)): inside}, [inside]
    if site_packages:
        import sysconfig
        for key in ("purelib", "platlib"):
            site = str(Path(sysconfig.get_paths()[key]).resolve())
            if site not in mounts and Path(site).is_dir():
                mounts[site] = f"{inside}-site{len(path)}"
                path.append(mounts[site])
    return mounts, {"PYTHONPATH": ":".join(path)}
