"""Which backend runs a sandbox (`resolve_backend`) and making one (`create`, `create_sync`).
Apart from the package's __init__ so that the pool can use them without importing its own
package back (an import cycle)."""
from __future__ import annotations

import logging
from typing import Mapping

from .base import Sandbox, SandboxError, SandboxLimits, SyncSandbox, run_sync
from .docker_backend import DEFAULT_IMAGE, DockerSandbox, engine_available
from .local_backend import LocalSandbox, local_available

log = logging.getLogger("agentrl.sandboxes")
BACKENDS = ("docker", "local", "auto")
_auto_choice: str | None = None


def resolve_backend(name: str = "auto") -> str:
    """"docker" | "local" | "auto" -> "docker" or "local". Raises SandboxError when the
    named backend cannot work here; "auto" picks docker if an engine answers, else local,
    and logs which (once per process)."""
    global _auto_choice
    if name not in BACKENDS:
        raise SandboxError(f"unknown sandbox backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "docker":
        ok, why = engine_available()
        if not ok:
            raise SandboxError(f"--sandbox docker: no Docker engine answers ({why}). Start dockerd "
                               "or set DOCKER_HOST, or use --sandbox local / auto.")
        return "docker"
    if name == "local":
        ok, why = local_available()
        if not ok:
            raise SandboxError(f"--sandbox local: {why}")
        return "local"
    if _auto_choice is None:
        ok, why = engine_available()
        if ok:
            log.warning("sandbox backend auto -> docker (engine %s)", why)
            _auto_choice = "docker"
        else:
            ok_local, how = local_available()
            if not ok_local:
                raise SandboxError(f"--sandbox auto: no Docker engine ({why}) and no local "
                                   f"sandbox ({how})")
            log.warning("sandbox backend auto -> local %s: no Docker engine answers (%s)", how, why)
            _auto_choice = "local"
    return _auto_choice


def create(backend: str = "auto", image: str | None = None, limits: SandboxLimits | None = None, *,
           network: bool = False, mounts: Mapping[str, str] | None = None,
           env: Mapping[str, str] | None = None, **limit_fields) -> Sandbox:
    """A new sandbox (not started yet): `async with create(...) as sb` or `sb = await create(...)`.

    backend: "docker" | "local" | "auto". image: docker image tag (default the base image;
    ignored by local). limits: SandboxLimits, or its fields as keywords (memory_mb=512, ...).
    network: allow network. mounts: {host_path: path_inside}, always read-only.
    env: extra environment variables inside (the host's environment never leaks in).
    """
    limits = limits or SandboxLimits()
    if limit_fields:
        from dataclasses import replace
        limits = replace(limits, **limit_fields)
    kind = resolve_backend(backend)
    cls = DockerSandbox if kind == "docker" else LocalSandbox
    return cls(image=image or (DEFAULT_IMAGE if kind == "docker" else None), limits=limits,
               network=network, mounts=mounts, env=env)


def create_sync(backend: str = "auto", image: str | None = None,
                limits: SandboxLimits | None = None, **kw) -> SyncSandbox:
    """Blocking variant of create(): a started SyncSandbox, usable as a context manager."""
    sb = create(backend, image, limits, **kw)
    run_sync(sb.start(), sb.start_timeout_s + 120)
    return SyncSandbox(sb)
