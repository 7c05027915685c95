"""Helpers of the sandbox tests: backend selection (docker skips with its reason when no
engine answers; the base image is built on demand, cached), bounded asyncio runs."""
from __future__ import annotations

import asyncio
import pytest

from agentrl.sandboxes import SandboxLimits, create
from agentrl.sandboxes.docker_backend import engine_available
from agentrl.sandboxes.local_backend import local_available
from machine_lock import machine_lock

_image_ready: bool | None = None


def backend_or_skip(name: str) -> str:
    global _image_ready
    if name == "docker":
        ok, why = engine_available()
        if not ok:
            pytest.skip(f"docker backend: no Docker engine answers ({why})")
        if _image_ready is None:
            from agentrl.sandboxes.image import ensure_image
            try:
                with machine_lock("sandbox-image"):
                    ensure_image()
                _image_ready = True
            except Exception as e:  # noqa: BLE001 - reported as the skip reason
                _image_ready = False
                pytest.fail(f"cannot build the sandbox base image: {e}")
        if not _image_ready:
            pytest.fail("the sandbox base image could not be built (see the first failure)")
    else:
        ok, why = local_available()
        if not ok:
            pytest.skip(f"local backend unavailable: {why}")
    return name


def run(coro, timeout: float = 120):
    """Run a coroutine with an overall timeout (tests never hang)."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


SMALL = SandboxLimits(memory_mb=256, pids=64, workdir_mb=64, tmp_mb=32, timeout_s=20,
                      output_bytes=64 << 10)


def sandbox(backend: str, **kw):
    kw.setdefault("limits", SMALL)
    return create(backend, **kw)
