"""Read-only trees of host files for sandboxes, staged once per content.

A sandbox must see the code it runs (a tool server, its dependencies) and nothing else of
the host: not the project's data files (a task file holds the hidden tests and reference
solutions), not the host's virtualenv, not the path it lives at. `stage_files` copies exactly
the files it is given into a content-addressed folder next to the sandboxes' state dir
(`/tmp/agentrl-stages/<hash>` by default; a tmpfs as root, see `stage_root`), world-readable,
and mounts of that folder are all a sandbox gets; `distribution_files` names the files of installed distributions and
their requirements (what `pip install X` put there), so only a package's closure is staged.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping

from .base import SandboxError, log, state_root


def stage_files(files: Mapping[str, Path | bytes]) -> Path:
    """Copy {relative path: host file or bytes} into a read-only staging folder (once per
    content: same files, same folder) and return its path."""
    h = hashlib.sha256()
    for rel, src in sorted(files.items()):
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise SandboxError(f"staged path {rel!r} must be relative and stay inside the stage")
        if isinstance(src, bytes):
            h.update(f"{rel}:bytes:".encode() + hashlib.sha256(src).digest())
        else:
            st = Path(src).stat()
            h.update(f"{rel}:{src}:{st.st_size}:{st.st_mtime_ns}".encode())
    stage = stage_root() / h.hexdigest()[:16]
    if stage.is_dir():
        return stage
    # a folder of this call's own: threads of one process stage the same content at once
    # (a pool's sandboxes starting together); the first rename wins, the others are dropped
    tmp = Path(tempfile.mkdtemp(prefix=f"{stage.name}.", suffix=".tmp", dir=stage.parent))
    for rel, src in files.items():
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if isinstance(src, bytes):
            dest.write_bytes(src)
        else:
            shutil.copyfile(src, dest)
            if os.access(src, os.X_OK):
                dest.chmod(0o755)
                continue
        dest.chmod(0o644)
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        d.chmod(0o755)
    try:
        tmp.rename(stage)
    except OSError:  # another process staged it first
        shutil.rmtree(tmp, ignore_errors=True)
    return stage


def stage_root() -> Path:
    """Where staged folders live: `agentrl-stages` next to the sandboxes' state dir. As root it
    is a tmpfs of its own (mounted once per host, kept), so a mount of a staged folder shows in a
    sandbox's /proc/self/mountinfo as "/<hash>" of a filesystem named "stage", not as a host
    path; unprivileged, a plain folder (its path shows there)."""
    import fcntl
    root = state_root().parent / "agentrl-stages"
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    if os.geteuid() != 0 or os.path.ismount(root):
        return root
    with open(state_root().parent / "agentrl-stages.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one mount, whichever process stages first
        if not os.path.ismount(root):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g,mode=0755,nosuid,nodev", "stage", str(root)],
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                log.warning("staging: cannot mount a tmpfs at %s (%s); host paths will show in sandboxes' "
                            "mountinfo", root, r.stderr.strip())
    return root


def distribution_files(*names: str) -> dict[str, Path]:
    """{path relative to site-packages: file} of the named installed distributions and,
    recursively, of what they require (markers evaluated, requested extras followed); bytecode
    and files installed outside site-packages (scripts) are left out."""
    from packaging.requirements import Requirement
    files: dict[str, Path] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(n, "") for n in names]
    while todo:
        name, extra = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SandboxError(f"staging {', '.join(names)}: distribution {name!r} is not installed") from None
        key = (dist.metadata["Name"].lower().replace("_", "-"), extra)
        if key in seen:
            continue
        seen.add(key)
        base = Path(dist.locate_file("")).resolve()
        for f in dist.files or []:
            path = Path(dist.locate_file(f)).resolve()
            if path.suffix == ".pyc" or not path.is_file() or not path.is_relative_to(base):
                continue
            files[str(path.relative_to(base))] = path
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": extra}):
                todo += [(r.name, e) for e in ("", *r.extras)]
    return files


def package_sources(package_dir: Path, dest: str, subdirs: tuple[str, ...] | None = None) -> dict[str, Path]:
    """{dest/relative path: file} of the .py files of a package folder (or only of the
    named subfolders, "" being its top level): sources only, never its data files."""
    out = {}
    for f in sorted(Path(package_dir).rglob("*.py")):
        rel = f.relative_to(package_dir)
        if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
            continue
        if subdirs is not None and ("" if rel.parent == Path(".") else str(rel.parent)) not in subdirs:
            continue
        out[f"{dest}/{rel}"] = f
    return out
