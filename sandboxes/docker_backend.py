"""Docker backend: one container per sandbox, through the Docker SDK for Python.

The container's pid 1 is `REAPER` (python3, as root: it only reaps orphans), with a read-only
root, all capabilities dropped but SETUID/SETGID/SETPCAP (which only the servers' start uses,
see base.SERVER_IDENTITY: commands run as uid 1000 with an empty bounding set), no-new-privileges, no network (unless asked), tmpfs
/work (uid 1000, size-capped) and /tmp, and memory / CPU / pids limits. Commands run as
uid 1000 through the exec server, started with `docker exec -i` (the docker CLI).
Host directories are mounted read-only with `mounts={host_dir: path_inside}`; that needs
the engine on this machine (the usual case).

What /proc/self/mountinfo shows of the host: docker bind-mounts /etc/hosts, /etc/hostname and
/etc/resolv.conf from its data root (/var/lib/docker/containers/<id>/...), so the container
gets its own from the staging tmpfs instead (`_etc_mounts`, as root: they show as "/<hash>/hosts"
of a filesystem named "stage"), and a cgroup namespace of its own (no /docker/<id> paths).
The pid 1 is the image's own python3, not docker-init (`--init` bind-mounts the host's
/usr/bin/tini-static, whose path mountinfo showed). Where staging is a plain host folder (not
root), the staged folders are copied into an image of their own instead of bound
(`_staged_image`). What still shows: the root filesystem's driver and the host's block device
(on the overlay2 driver, its options name docker's data root: inherent, docs/security.md);
where staging is a plain folder, docker's own /etc files and the bridge folder.

Every container carries labels (`agentrl.sandbox`, `agentrl.run_id`, `agentrl.owner_pid`,
`agentrl.owner_start`, `agentrl.owner_host`) so `reap()` can remove the containers of
processes that are gone, even after SIGKILL.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Mapping, Sequence

from . import bridge
from .local_backend import claim_host_uid, release_host_uid, release_orphan_claims
from .base import (OWNER_PID, OWNER_START, RUN_ID, WORKDIR, ImageNotFoundError,
                   Sandbox, SandboxError, cap_stderr, inodes_for, ipc_sysctls, kill_cgroup, log, owner_alive,
                   reap_once)

DEFAULT_IMAGE = "agentrl-sandbox:bookworm"
LABEL = "agentrl.sandbox"
# The container's main process, pid 1: root, not the agent's uid, so it cannot kill it; and docker
# gives `docker exec -u 0` the container's capabilities only when its user is root
MAIN_UID = 0
# pid 1: reaps every orphan reparented to it (SIGCHLD blocked and waited for, so none is missed;
# a wake-up a minute at most); signals without a handler do not reach a pid 1
REAPER = ("import os, signal\n"
          "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
          "while True:\n"
          "    try:\n"
          "        while os.waitpid(-1, os.WNOHANG)[0]:\n"
          "            pass\n"
          "    except ChildProcessError:\n"
          "        pass\n"
          "    signal.sigtimedwait({signal.SIGCHLD}, 60)\n")
CGROOT = Path("/sys/fs/cgroup")
HOST = socket.gethostname()

_client = None
_client_lock = threading.Lock()


def docker_client(timeout: float = 60):
    """The shared Docker SDK client; SandboxError if no engine answers."""
    global _client
    with _client_lock:
        if _client is None:
            try:
                import docker
            except ImportError as e:
                raise SandboxError("the docker backend needs the Docker SDK: pip install docker") from e
            try:
                client = docker.from_env(timeout=timeout, max_pool_size=32)
                client.ping()
            except Exception as e:
                raise SandboxError(
                    f"no Docker engine answers ({type(e).__name__}: {e}). Start dockerd, set "
                    "DOCKER_HOST, or use the local backend (--sandbox local).") from None
            _client = client
        return _client


def engine_available(timeout: float = 3.0) -> tuple[bool, str]:
    """(True, version) if a Docker engine answers within `timeout` s, else (False, why)."""
    try:
        import docker
        client = docker.from_env(timeout=timeout)
        version = client.version().get("Version", "?")
        client.close()
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    if shutil.which("docker") is None:
        return False, "the docker CLI is not installed (apt-get install docker.io)"
    return True, version


class DockerSandbox(Sandbox):
    backend = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, **kw):
        super().__init__(**kw)
        self.image = image
        self.container = None
        self.bridge_dir: Path | None = None  # mounted at bridge.INSIDE (see bridge.py)
        if shutil.which("docker") is None:
            raise SandboxError("the docker backend needs the docker CLI (apt-get install docker.io)")

    async def _boot(self) -> None:
        reap_once("docker", reap)
        await asyncio.to_thread(self._create)

    def _create(self) -> None:
        import docker.errors
        client = docker_client()
        try:
            client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(
                f"docker image {self.image!r} not found and there is no registry to pull from. "
                f"Build the base image with `agentrl sandbox build` (or `bash scripts/build_sandbox_image.sh`), "
                f"or build your own with `agentrl sandbox build --dockerfile PATH --tag {self.image}`.") from None
        image, binds = self._staged_image(client)
        lim = self.limits
        shm_mb = min(lim.tmp_mb, 64)
        # the agent's uid: one of its own per container, claimed like a local sandbox's host uid. Without
        # a user namespace it is the host's uid, and the kernel counts per-user objects (inotify
        # instances and watches) per uid: with one uid for all, one container could take them all
        self.uid = claim_host_uid(self.id)
        labels = {LABEL: "1", "agentrl.run_id": RUN_ID, "agentrl.owner_pid": str(OWNER_PID),
                  "agentrl.owner_start": str(OWNER_START), "agentrl.owner_host": HOST,
                  "agentrl.sandbox_id": self.id}
        from docker.types import Ulimit
        self.bridge_dir = bridge.make_dir(bridge.docker_dir(self.id))
        try:
            self.container = client.containers.run(
                image, ["python3", "-I", "-c", REAPER], name=f"agentrl-{self.id}", detach=True,
                init=False, user=f"{MAIN_UID}:{MAIN_UID}", labels=labels, hostname="sandbox",
                read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges:true"],
                # only for the servers' start (base.SERVER_IDENTITY), which drop them at once; the
                # main process and every command run as non-root uids, where they mean nothing
                cap_add=["SETUID", "SETGID", "SETPCAP"],
                network_mode="bridge" if self.network else "none",
                # without a network docker still copies the host's resolv.conf in: show nothing of it
                dns=None if self.network else ["127.0.0.1"],
                mem_limit=f"{lim.memory_mb}m", memswap_limit=f"{lim.memory_mb}m",
                nano_cpus=int(lim.cpus * 1e9), pids_limit=lim.pids,
                ulimits=[Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                         Ulimit(name="core", soft=0, hard=0)],
                # file counts capped with the sizes (inodes_for): empty files cost kernel memory too
                tmpfs={WORKDIR: f"size={lim.workdir_mb}m,nr_inodes={inodes_for(lim.workdir_mb)},uid={self.uid},"
                                f"gid={self.uid},mode=0755,exec",
                       "/tmp": f"size={lim.tmp_mb}m,nr_inodes={inodes_for(lim.tmp_mb)},mode=1777,exec",
                       "/dev/shm": f"size={shm_mb}m,nr_inodes={inodes_for(shm_mb)},mode=1777,nosuid,nodev,noexec"},
                volumes={**{h: {"bind": s, "mode": "ro"} for h, s in binds.items()}, **self._etc_mounts(),
                         str(self.bridge_dir): {"bind": bridge.INSIDE, "mode": "ro"}},
                cgroupns="private",
                # SysV IPC: an IPC namespace of its own, its objects capped (docker lets these sysctls
                # be set only with a private one); not inherited from the daemon's default mode
                ipc_mode="private", sysctls=ipc_sysctls(lim),
                environment={**self.env, "AGENTRL_SANDBOX_UID": str(self.uid)}, working_dir=WORKDIR)
        except docker.errors.APIError as e:
            raise SandboxError(f"docker sandbox {self.id}: cannot start a container of "
                               f"{self.image!r}: {e.explanation or e}") from None

    def _staged_image(self, client) -> tuple[str, dict[str, str]]:
        """(the image to run, the mounts to bind). A bind mount shows its source's path in the
        container's /proc/self/mountinfo; the staged folders' (`stage.stage_files`) is a host temp
        dir unless staging is a tmpfs of its own (root). Where it is not, the staged mounts are
        copied into an image of their own on top of `self.image` instead (built once per content,
        `STAGED_REPO`:<hash>, root-owned and read-only like the rest of the root): nothing of them
        is bound, and they cost no container memory. Other mounts are bound as given."""
        from .stage import stage_root
        root = stage_root().resolve()
        staged = {h: s for h, s in self.mounts.items() if Path(h).resolve().is_relative_to(root)}
        if not staged or os.path.ismount(root):
            return self.image, dict(self.mounts)
        # the key names staged paths from the staging root: their content's hash, not where staging is
        key = {str(Path(h).resolve().relative_to(root)): s for h, s in staged.items()}
        return (_staged_image(client, self.image, staged, key),
                {h: s for h, s in self.mounts.items() if h not in staged})

    def _etc_mounts(self) -> dict[str, dict]:
        """/etc/hosts, /etc/hostname (and, without a network, /etc/resolv.conf) from the staging
        tmpfs in place of docker's own, whose source paths name its data root; {} where staging is
        a plain folder (not root), whose path would show as well."""
        from .local_backend import OWN_ETC
        from .stage import stage_files, stage_root
        if not os.path.ismount(stage_root()):
            return {}
        files = {"hosts": OWN_ETC["hosts"].encode(), "hostname": OWN_ETC["hostname"].encode()}
        if not self.network:
            files["resolv.conf"] = b"nameserver 127.0.0.1\n"
        stage = stage_files(files)
        return {str(stage / name): {"bind": f"/etc/{name}", "mode": "ro"} for name in files}

    def spawn_argv(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                   cwd: str | None = None, server: bool = False) -> list[str]:
        if self.container is None:
            raise SandboxError(f"sandbox {self.id} has no container")
        user = "0:0" if server else f"{self.uid}:{self.uid}"
        flags = ["-i", "-u", user, "-w", cwd or WORKDIR]
        for k, v in (env or {}).items():
            flags += ["-e", f"{k}={v}"]
        return cap_stderr(["docker", "exec", *flags, self.container.id, *argv])

    async def _alive(self) -> bool:
        if self.container is None:
            return False
        try:
            await asyncio.to_thread(self.container.reload)
        except Exception:
            return False
        return self.container.status == "running"

    async def _kill_all(self) -> bool:
        return await asyncio.to_thread(self._kill_all_sync)

    def _kill_all_sync(self) -> bool:
        """Kill, from the host, every process of the container's cgroup but its pid 1 (`REAPER`);
        needs root on the host (else False: the container is not reused)."""
        if os.geteuid() != 0 or self.container is None:
            return False
        try:
            self.container.reload()
            init = int(self.container.attrs["State"]["Pid"])
        except Exception:
            return False
        cgroup = _pids_cgroup(init)
        if not init or cgroup is None:
            return False
        return kill_cgroup(cgroup, keep=frozenset({init}))

    async def _destroy(self) -> None:
        await asyncio.to_thread(self._destroy_sync)

    def _destroy_sync(self) -> None:
        bridge.remove_dir(self.bridge_dir)
        if self.container is None:
            release_host_uid(self.uid)
            return
        import docker.errors
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise
        self.container = None
        release_host_uid(self.uid)  # its processes are gone with it


STAGED_REPO = "agentrl-staged"  # images of a base image plus staged folders (`DockerSandbox._staged_image`)
_staged_lock = threading.Lock()


def _staged_image(client, base: str, staged: Mapping[str, str], key: Mapping[str, str]) -> str:
    """The tag of `base` with the staged folders or files {host path: path inside} copied in
    (root-owned, modes kept); built once: the tag is a hash of the base image's id and of `key`
    ({path from the staging root: path inside}; a staged path names its content's hash, see
    stage.stage_files)."""
    import hashlib
    import io
    import tarfile
    import docker.errors
    base_id = client.images.get(base).id
    h = hashlib.sha256(base_id.encode())
    for rel, inside in sorted(key.items()):
        h.update(f"{rel}:{inside}\0".encode())
    tag = f"{STAGED_REPO}:{h.hexdigest()[:16]}"
    with _staged_lock:
        try:
            client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        dockerfile = [f"FROM {base_id}"]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i, (host, inside) in enumerate(sorted(staged.items())):
                if not inside.startswith("/") or any(c in inside for c in "\n\"\\"):
                    raise SandboxError(f"mount target {inside!r} (of {host}) must be an absolute path")
                tar.add(host, arcname=f"s{i}", filter=_root_owned)
                dockerfile.append(f'COPY ["s{i}", "{inside}"]')
            data = ("\n".join(dockerfile) + "\n").encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        buf.seek(0)
        try:
            client.images.build(fileobj=buf, custom_context=True, tag=tag, pull=False, rm=True, forcerm=True,
                                labels={LABEL + ".staged": "1"})
        except docker.errors.BuildError as e:
            lines = "".join(x.get("stream", "") or x.get("error", "") for x in e.build_log)
            raise SandboxError(f"building the staged image {tag} on {base!r} failed: {e.msg}\n{lines[-2000:]}") from None
        except docker.errors.APIError as e:
            raise SandboxError(f"building the staged image {tag} on {base!r} failed: {e.explanation or e}") from None
    log.info("docker sandbox: staged folders copied into image %s (staging is not a tmpfs here)", tag)
    return tag


def _root_owned(info):
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _pids_cgroup(pid: int) -> Path | None:
    """The cgroup of `pid` that lists its threads: v1's pids hierarchy, or v2's unified one."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctls, path = line.split(":", 2)
        if "pids" in ctls.split(","):
            d = CGROOT / "pids" / path.lstrip("/")
        elif ctls == "" and (CGROOT / "cgroup.controllers").exists():
            d = CGROOT / path.lstrip("/")
        else:
            continue
        if d.is_dir() and d != CGROOT and d != CGROOT / "pids":
            return d
    return None


def list_containers(all_runs: bool = True) -> list:
    """Containers made by agentrl (of every run, or of this run only)."""
    filters = {"label": [LABEL] if all_runs else [LABEL, f"agentrl.run_id={RUN_ID}"]}
    return docker_client().containers.list(all=True, filters=filters)


def reap(everything: bool = False) -> list[str]:
    """Remove agentrl containers whose owner process (on this host) is gone. With
    everything=True, remove all agentrl containers except this process's own."""
    removed = []
    for c in list_containers():
        lb = c.labels
        if lb.get("agentrl.owner_host") != HOST and not everything:
            continue
        pid, start = int(lb.get("agentrl.owner_pid", 0)), lb.get("agentrl.owner_start")
        if pid == OWNER_PID and str(OWNER_START) == start:
            continue
        if not everything and owner_alive(pid, int(start) if start and start != "None" else None):
            continue
        try:
            c.remove(force=True)
            removed.append(c.name)
        except Exception as e:
            log.warning("reap: cannot remove %s: %s", c.name, e)
    release_orphan_claims()
    try:
        bridge.reap_docker_dirs({c.labels.get("agentrl.sandbox_id", "") for c in list_containers()})
    except OSError as e:
        log.warning("reap: cannot remove stale bridge dirs: %s", e)
    if removed:
        log.info("reaped %d docker sandbox(es) of dead runs: %s", len(removed), ", ".join(removed))
    return removed
