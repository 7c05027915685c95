"""SandboxPool: warm sandboxes, bounded concurrency, a clean start for every trajectory.

    pool = SandboxPool(backend="auto", warm=4, max_active=16, limits=SandboxLimits(...))
    await pool.start()
    async with pool.acquire(group_id="prompt-17", setup_files={"task.py": src}) as sb:
        ...                                  # the trajectory's sandbox
    pool.metrics()   # {"active": .., "warm": .., "acquire_s_p50": .., ...}
    await pool.close()

* At most `max_active` sandboxes are handed out at once (acquire waits, with a timeout;
  `max_active=None`: `default_max_active(backend)`, what the machine holds), and warm ones
  are kept only within that bound: at most `max_active` are alive
  and at most `max_creating` are being created at once (default: 4 for Docker, so its daemon
  is never flooded; the cores for local sandboxes, plain process spawns). `warm` idle
  sandboxes are made at start and kept ready; a released one is kept too (reset) while fewer
  are idle than the most the pool has had out at once, and one destroyed (tainted, as a
  grader's always is) is replaced in the background up to that many, so the next burst of
  trajectories (a rollout's next iteration) finds them warm instead of making them again
  `max_creating` at a time. Local, not root: the pool reserves its
  max_active sandboxes' shares of the user's kernel counts (processes, inotify, message
  queues) when it is made, from what live pools left (`local_backend.reserve_slots`; a
  SandboxError naming them where they left none), and frees them at close.
* A released sandbox is reset (every process killed, the exec server too, and its cgroup
  proven empty; then /work, /tmp, /dev/shm, /dev/mqueue and SysV IPC wiped) and goes back to
  the warm set only when both checks hold; if one fails (or nothing can prove the cgroup
  empty: local not root), if a server in it was restarted (`Sandbox.tainted`: the agent may
  have planted something there), or with `reuse=False`, it is destroyed and a fresh one is
  made in the background.
* `keep_ready(key, start, stop)` makes warm sandboxes ready for a kind of trajectory in the
  background (a ToolEnv: its tool servers, whose start was most of a code-env reset): a
  `get(ready=key)` prefers one made ready and `take_ready()` hands over what `start` made, a
  plain get() (a grader's) prefers one that is not. Each sandbox a `get(ready=key)` gave out
  and got back (a trajectory ended: its batch's own resets are done) makes one idle sandbox
  ready, itself when it was kept; every start is for one trajectory.
* Every member of a GRPO group starts from the same state: the first acquire of a
  `group_id` writes `setup_files` and runs `setup_cmd`, then snapshots /work (a tar);
  later members of the group get that snapshot unpacked, byte for byte, whatever
  setup_cmd would have done the second time. Snapshots of the last `max_groups` groups
  are kept (`forget_group()` drops one).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
import weakref
from collections import OrderedDict
from typing import AsyncIterator, Mapping

from . import local_backend
from .backends import create, resolve_backend
from .base import Sandbox, SandboxError, SandboxLimits, default_max_active, log


class SandboxPool:
    def __init__(self, backend: str = "auto", *, warm: int = 2, max_active: int | None = 8,
                 max_creating: int | None = None, image: str | None = None,
                 limits: SandboxLimits | None = None, network: bool = False,
                 mounts: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                 reuse: bool = True, acquire_timeout_s: float = 600.0, max_groups: int = 256,
                 snapshot_max_bytes: int = 64 << 20):
        self.backend = resolve_backend(backend)
        if max_active is None:  # sized to the machine and the backend
            max_active = default_max_active(self.backend, limits.memory_mb if limits else None)
        self.warm_target = min(warm, max_active)
        self.max_active = max_active
        self.kw = dict(image=image, limits=limits, network=network, mounts=mounts, env=env)
        self.reuse = reuse
        self.acquire_timeout_s = acquire_timeout_s
        self.max_groups = max_groups
        self.snapshot_max_bytes = snapshot_max_bytes
        self._idle: list[Sandbox] = []
        self._active: set[Sandbox] = set()
        self._slots = asyncio.Semaphore(max_active)
        if max_creating is None:
            max_creating = 4 if self.backend == "docker" else max(4, os.cpu_count() or 4)
        self._creating = asyncio.Semaphore(max_creating)
        self._groups: OrderedDict[str, tuple[bytes, Mapping | None, str | None]] = OrderedDict()
        self._bg: set[asyncio.Task] = set()
        self._unlisted = 0  # alive but in no list: being created by get(), reset or destroyed by release()
        self._peak_active = 0  # the most handed out at once: release() keeps that many warm
        self._acquire_s: list[float] = []
        # keep_ready(): (key, start, stop); each idle sandbox made ready -> (key, the start's task)
        self._ready_with = None
        self._ready: dict[Sandbox, tuple[object, asyncio.Task]] = {}
        self._ready_out: set[Sandbox] = set()  # handed out by get(ready=...)
        self._ready_due = 0  # such sandboxes given back whose successor is not being made ready yet
        self._ready_bg: set[asyncio.Task] = set()  # starts and stops under way
        self._counts = {"created": 0, "reused": 0, "destroyed": 0, "reset_failures": 0,
                        "create_failures": 0, "acquired": 0, "tainted": 0, "ready_taken": 0, "ready_wasted": 0}
        self.closed = False
        # local, not root: the pool reserves its max_active sandboxes' shares of the user's kernel counts in
        # the ledger (local_backend.reserve_slots) from what earlier pools left, so that all the live
        # sandboxes at their share leave each other and the host theirs; its sandboxes are cut from it
        self._reservation = None
        self._unreserve = None  # ends the reservation: at close, or when the pool is dropped unclosed
        if self.backend == "local" and local_backend.needs_shares():
            self._reservation = local_backend.reserve_slots(max_active, f"a pool of max_active {max_active}")
            self._unreserve = weakref.finalize(self, local_backend.release_slots, self._reservation.path)

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> "SandboxPool":
        """Create the warm sandboxes (concurrently, bounded by max_creating)."""
        need = self.warm_target - len(self._idle)
        made = await asyncio.gather(*[self._new() for _ in range(need)], return_exceptions=True)
        for sb in made:
            if isinstance(sb, BaseException):
                raise sb
            self._idle.append(sb)
        return self

    async def __aenter__(self) -> "SandboxPool":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self.closed = True
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        for sb in list(self._ready):
            self._unready(sb)
        await asyncio.gather(*self._ready_bg, return_exceptions=True)
        doomed = self._idle + list(self._active)
        self._idle, self._active = [], set()
        await asyncio.gather(*[sb.close() for sb in doomed], return_exceptions=True)
        if self._unreserve is not None:
            self._unreserve()

    async def _new(self) -> Sandbox:
        async with self._creating:
            try:
                sb = create(self.backend, **self.kw)
                if self._reservation is not None:
                    sb.reservation = self._reservation  # its share: the pool's
                await sb.start()
            except Exception:
                self._counts["create_failures"] += 1
                raise
        self._counts["created"] += 1
        return sb

    def _alive(self) -> int:
        return len(self._active) + len(self._idle) + len(self._bg) + self._unlisted

    def _refill(self) -> None:
        # as many ready as the last burst took (release() keeps that many reset ones); warm ones count
        # against max_active too: never more than max_active sandboxes alive
        if (self.closed or len(self._idle) + len(self._bg) >= max(self.warm_target, self._peak_active)
                or self._alive() >= self.max_active):
            return

        async def one():
            try:
                sb = await self._new()
            except Exception as e:
                log.warning("sandbox pool: warming a sandbox failed: %s", e)
                return
            if self.closed or len(self._active) + len(self._idle) + self._unlisted >= self.max_active:
                await sb.close()  # closed, or a get() made its own meanwhile: the bound holds
            else:
                self._idle.append(sb)
                self._ready_more()
        task = asyncio.get_running_loop().create_task(one())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # ---- ready-made state (keep_ready) ----------------------------------------------
    def keep_ready(self, key, start, stop) -> None:
        """Make released sandboxes ready for `get(ready=key)` in the background: `await start(sb)` gives
        the handle `take_ready` returns, `await stop(handle)` ends one that a get() of another kind
        took, or that the pool closes. Same key again: nothing changes; another key replaces it."""
        if self._ready_with is not None and self._ready_with[0] == key:
            return
        self._ready_with = (key, start, stop)

    def _spawn_ready(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._ready_bg.add(task)
        task.add_done_callback(self._ready_bg.discard)
        return task

    def _ready_more(self, prefer: Sandbox | None = None) -> None:
        """For each sandbox a get(ready=...) had and gave back, make one idle sandbox ready (the one
        given back when it was kept). Only then: a trajectory has ended, so its batch's own resets are
        done (a start made while they run takes their CPU: on 2 cores a first burst's resets took 15 s
        instead of 6.5), and only as many, so a grader's plain get() finds the others."""
        if self._ready_with is None or self.closed:
            return
        key, start, _ = self._ready_with
        for sb in ([prefer] if prefer in self._idle else []) + self._idle:
            if self._ready_due <= 0:
                return
            if sb not in self._ready:
                self._ready[sb] = (key, self._spawn_ready(start(sb)))
                self._ready_due -= 1

    def _unready(self, sb: Sandbox) -> None:
        """End what was made ready in `sb` (if anything), in the background."""
        entry = self._ready.pop(sb, None)
        if entry is None:
            return
        task = entry[1]
        stop = self._ready_with[2] if self._ready_with is not None else None

        async def end():  # (a start is bounded by its own timeout: not cancelled, so it ends cleanly)
            with contextlib.suppress(Exception):
                handle = await task
                if stop is not None:
                    await stop(handle)
        self._spawn_ready(end())

    async def take_ready(self, sb: Sandbox, key):
        """What keep_ready's start made in `sb` for `key` (waiting for it to finish), or None: none
        was made, it was for another key, or its start failed (the caller starts its own)."""
        entry = self._ready.get(sb)
        if entry is None:
            return None
        if entry[0] != key:
            self._unready(sb)
            return None
        del self._ready[sb]
        try:
            handle = await asyncio.shield(entry[1])  # a cancelled caller must not cut a start short
        except asyncio.CancelledError:
            self._ready[sb] = entry
            self._unready(sb)  # stopped once it has started
            raise
        except Exception as e:
            log.warning("sandbox pool: making sandbox %s ready failed (%s); the trajectory starts its own", sb.id, e)
            return None
        self._counts["ready_taken"] += 1
        return handle

    def _pick_idle(self, ready) -> Sandbox:
        """An idle sandbox: one made ready for `ready`, or for a plain get() one not made ready."""
        for i in range(len(self._idle) - 1, -1, -1):
            entry = self._ready.get(self._idle[i])
            if (entry is not None and entry[0] == ready) if ready is not None else entry is None:
                return self._idle.pop(i)
        sb = self._idle.pop()
        if sb in self._ready and (ready is None or self._ready[sb][0] != ready):
            self._counts["ready_wasted"] += 1
            self._unready(sb)
        return sb

    # ---- acquire / release ---------------------------------------------------------
    @contextlib.asynccontextmanager
    async def acquire(self, group_id: str | None = None,
                      setup_files: Mapping[str, bytes | str] | None = None,
                      setup_cmd: str | None = None) -> AsyncIterator[Sandbox]:
        """A clean sandbox for one trajectory, released (reset or destroyed) on exit.
        Members of one group_id start from identical /work contents (see module doc).
        Raises SandboxError if none can be had within acquire_timeout_s."""
        sb = await self.get(group_id, setup_files, setup_cmd)
        try:
            yield sb
        finally:
            await self.release(sb)

    async def get(self, group_id: str | None = None,
                  setup_files: Mapping[str, bytes | str] | None = None,
                  setup_cmd: str | None = None, ready=None) -> Sandbox:
        """acquire() without the context manager: pair with release(). `ready`: a keep_ready key, for
        a sandbox made ready for it where one is (take_ready then gives what was made)."""
        if self.closed:
            raise SandboxError("sandbox pool is closed")
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._slots.acquire(), self.acquire_timeout_s)
        except asyncio.TimeoutError:
            raise SandboxError(f"no sandbox free within {self.acquire_timeout_s}s "
                               f"({len(self._active)} active, max_active={self.max_active})") from None
        sb = None
        try:
            for attempt in (1, 2):
                # none idle and no room for one more: one is being warmed (we hold a slot, so the
                # others alive cannot all be handed out or released); take it rather than make another
                while not self._idle and self._bg and self._alive() >= self.max_active:
                    left = t0 + self.acquire_timeout_s - time.perf_counter()
                    if left <= 0:
                        break
                    await asyncio.wait(set(self._bg), timeout=left, return_when=asyncio.FIRST_COMPLETED)
                warm = bool(self._idle)
                if warm:
                    sb = self._pick_idle(ready)
                else:
                    self._unlisted += 1  # holds a slot already: counts as alive for _refill
                    try:
                        sb = await asyncio.wait_for(self._new(), self.acquire_timeout_s)
                    finally:
                        self._unlisted -= 1
                self._active.add(sb)
                self._peak_active = max(self._peak_active, len(self._active))
                if ready is not None:
                    self._ready_out.add(sb)
                self._refill()
                try:
                    if warm:
                        await sb.ping()
                        if sb.tainted:
                            raise SandboxError(f"tainted: {sb.tainted}")
                    await self._prepare(sb, group_id, setup_files, setup_cmd)
                    break
                except SandboxError as e:
                    if not warm or attempt == 2:
                        raise
                    # a warm sandbox that died while idle: replace it once
                    log.warning("sandbox pool: idle sandbox %s is broken (%s); replacing it", sb.id, e)
                    self._active.discard(sb)
                    self._ready_out.discard(sb)
                    self._unready(sb)
                    await sb.close()
                    self._counts["destroyed"] += 1
                    sb = None
        except BaseException:
            if sb is not None:
                self._active.discard(sb)
                self._ready_out.discard(sb)
                self._unready(sb)
                await sb.close()
            self._slots.release()
            raise
        self._acquire_s.append(time.perf_counter() - t0)
        del self._acquire_s[:-1000]
        self._counts["acquired"] += 1
        return sb

    async def _prepare(self, sb: Sandbox, group_id, setup_files, setup_cmd) -> None:
        snap = self._groups.get(group_id) if group_id is not None else None
        if snap is not None:
            data, files0, cmd0 = snap
            if (setup_files is not None and setup_files != files0) or (setup_cmd is not None and setup_cmd != cmd0):
                raise ValueError(f"group {group_id!r} was set up with different setup_files/setup_cmd")
            self._groups.move_to_end(group_id)
            if data:
                r = await sb.exec(["tar", "-C", sb.workdir, "-xf", "-"], stdin=data, timeout=120)
                if not r.ok:
                    raise SandboxError(f"restoring group {group_id!r} snapshot failed: {r.stderr[-500:]}")
            return
        for path, content in (setup_files or {}).items():
            await sb.write_file(path, content)
        if setup_cmd:
            r = await sb.exec(setup_cmd, timeout=sb.limits.timeout_s)
            if not r.ok:
                raise SandboxError(f"setup_cmd failed (exit {r.exit_code}): {r.stderr[-1000:]}")
        if group_id is not None:
            data = b""
            if setup_files or setup_cmd:
                r = await sb.exec(["tar", "-C", sb.workdir, "-cf", "-", "."], timeout=120,
                                  output_limit=self.snapshot_max_bytes)
                if not r.ok or r.truncated:
                    raise SandboxError(f"snapshot of group {group_id!r} failed or is larger than "
                                       f"{self.snapshot_max_bytes} bytes: {r.stderr[-500:]}")
                data = r.stdout_bytes
            self._groups[group_id] = (data, setup_files, setup_cmd)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)

    def forget_group(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    async def release(self, sb: Sandbox) -> None:
        """Give a sandbox back: reset and keep it warm, or destroy it."""
        if sb not in self._active:
            return
        self._active.discard(sb)
        was_ready = sb in self._ready_out
        self._ready_out.discard(sb)
        self._unready(sb)  # made ready and never taken: its start was for the trajectory that ended
        self._unlisted += 1
        keep = False
        try:
            if sb.tainted:
                self._counts["tainted"] += 1
            elif (self.reuse and not self.closed and not sb.closed
                  and len(self._idle) < max(self.warm_target, self._peak_active)):
                try:
                    keep = await sb.reset()
                except SandboxError:
                    keep = False
                if not keep:
                    self._counts["reset_failures"] += 1
            if keep:
                self._idle.append(sb)
                self._counts["reused"] += 1
            else:
                await sb.close()
                self._counts["destroyed"] += 1
        finally:
            self._unlisted -= 1
            self._slots.release()
        if not keep:
            self._refill()
        if was_ready:
            self._ready_due = min(self._ready_due + 1, self.max_active)
            self._ready_more(prefer=sb if keep else None)

    def metrics(self) -> dict:
        """Pool state for logging: active/idle counts, acquire latency, lifetime counters."""
        times = sorted(self._acquire_s)
        out = {"active": len(self._active), "warm": len(self._idle), "max_active": self.max_active,
               "creating": len(self._bg), "backend": self.backend, **self._counts}
        if times:
            out.update(acquire_s_p50=statistics.median(times),
                       acquire_s_p99=times[min(len(times) - 1, int(0.99 * len(times)))],
                       acquire_s_mean=statistics.fmean(times), acquire_s_last=self._acquire_s[-1])
        return out
