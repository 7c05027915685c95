"""Building sandbox images without a registry.

`build_base_image()` makes the base image (`agentrl-sandbox:bookworm`: Debian minimal +
python3, bash and common tools) from Debian packages: `debootstrap` into a temp dir, then
`docker import` of the tree. It needs root, `debootstrap` (apt-get install debootstrap)
and a reachable Debian mirror; it takes about a minute or two.

`build_dockerfile_image(path)` builds a user's Dockerfile (its FROM must be an image
already present, such as the base image).

Both are cached: the image carries the label `agentrl.recipe` = a hash of its recipe
(package list, suite, Dockerfile and context), and a build whose image already has that
hash is skipped. `ensure_image()` builds the base image only when it is missing or stale.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from .base import SandboxError, log
from .docker_backend import DEFAULT_IMAGE, docker_client

SUITE = "bookworm"
MIRROR = os.environ.get("AGENTRL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = sorted([
    "python3", "python3-venv", "bash", "coreutils", "procps", "psmisc", "ca-certificates",
    "git", "curl", "less", "patch", "diffutils", "findutils", "grep", "sed", "gawk", "tar",
    "gzip", "xz-utils", "bzip2", "unzip", "file", "jq", "bc",
])
RECIPE_VERSION = 1  # bump when the build steps change
RECIPE_LABEL = "agentrl.recipe"


def base_recipe_hash() -> str:
    recipe = {"suite": SUITE, "packages": PACKAGES, "variant": "minbase", "v": RECIPE_VERSION}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def image_recipe(tag: str) -> str | None:
    """The recipe hash of a present image, "" if it has none, None if it is absent."""
    import docker.errors
    try:
        return docker_client().images.get(tag).labels.get(RECIPE_LABEL, "")
    except docker.errors.ImageNotFound:
        return None


def build_base_image(tag: str = DEFAULT_IMAGE, force: bool = False,
                     echo: Callable[[str], None] = print) -> bool:
    """Build the base image from Debian packages. Returns False when it was up to date."""
    want = base_recipe_hash()
    if not force and image_recipe(tag) == want:
        echo(f"{tag} is up to date (recipe {want})")
        return False
    if os.geteuid() != 0:
        raise SandboxError("building the base image runs debootstrap, which needs root "
                           "(sudo agentrl sandbox build)")
    if shutil.which("debootstrap") is None:
        raise SandboxError("building the base image needs debootstrap: apt-get install debootstrap")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="agentrl-image-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
               SUITE, str(rootfs), MIRROR]
        echo(f"building {tag}: {' '.join(cmd[:2])} ... {SUITE} ({len(PACKAGES)} packages)")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr)[-3000:]
            log_file = rootfs / "debootstrap" / "debootstrap.log"
            if log_file.exists():
                tail += "\n" + log_file.read_text()[-3000:]
            raise SandboxError(f"debootstrap failed (exit {r.returncode}):\n{tail}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / junk).glob("*"):
                if f.is_file():
                    f.unlink()
        (rootfs / "work").mkdir(exist_ok=True)
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tar), "."],
                       check=True, capture_output=True, timeout=600)
        repo, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
        changes = [f"LABEL {RECIPE_LABEL}={want}", 'CMD ["sleep", "infinity"]', "WORKDIR /work",
                   "ENV LANG=C.UTF-8",
                   "ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"]
        echo(f"importing {tar.stat().st_size >> 20} MiB into docker as {tag}")
        docker_client(timeout=600).api.import_image_from_file(
            str(tar), repository=repo, tag=version, changes=changes)
    if image_recipe(tag) != want:
        raise SandboxError(f"docker import did not produce {tag} with recipe {want}")
    echo(f"built {tag} in {time.time() - t0:.0f}s")
    return True


def _context_hash(dockerfile: Path, context: Path) -> str:
    h = hashlib.sha256(dockerfile.read_bytes())
    for f in sorted(context.rglob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(context)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_dockerfile_image(dockerfile: str | Path, tag: str, context: str | Path | None = None,
                           force: bool = False, echo: Callable[[str], None] = print) -> bool:
    """Build a user Dockerfile (no pulls: FROM must be present locally). Cached by a hash
    of the Dockerfile and its context's file names, sizes and mtimes."""
    import docker.errors
    dockerfile = Path(dockerfile).resolve()
    if not dockerfile.is_file():
        raise SandboxError(f"Dockerfile {dockerfile} not found")
    context = Path(context).resolve() if context else dockerfile.parent
    want = _context_hash(dockerfile, context)
    if not force and image_recipe(tag) == want:
        echo(f"{tag} is up to date (recipe {want})")
        return False
    echo(f"building {tag} from {dockerfile}")
    try:
        docker_client(timeout=1800).images.build(
            path=str(context), dockerfile=str(dockerfile), tag=tag, labels={RECIPE_LABEL: want},
            pull=False, rm=True, forcerm=True)
    except docker.errors.BuildError as e:
        lines = "".join(x.get("stream", "") or x.get("error", "") for x in e.build_log)
        hint = ""
        if "pull access denied" in lines or "not found" in lines:
            hint = (f"\n(no registry here: the FROM image must exist locally; build the base with "
                    f"`agentrl sandbox build` and use FROM {DEFAULT_IMAGE})")
        raise SandboxError(f"building {tag} failed: {e.msg}\n{lines[-3000:]}{hint}") from None
    echo(f"built {tag}")
    return True


def ensure_image(tag: str = DEFAULT_IMAGE, echo: Callable[[str], None] = log.info) -> None:
    """Make sure the base image exists and is current (builds it if not; cached)."""
    if tag != DEFAULT_IMAGE:
        if image_recipe(tag) is None:
            raise SandboxError(f"image {tag!r} not found; build it with `agentrl sandbox build "
                               f"--dockerfile PATH --tag {tag}`")
        return
    build_base_image(tag, echo=echo)
