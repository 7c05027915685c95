"""`agentrl sandbox ...` commands (the agentrl CLI forwards its arguments to `main`).

  build [--tag T] [--force] [--dockerfile PATH [--context DIR]]   build an image (cached)
  ls                                                              list sandboxes
  reap [--all]                             remove sandboxes of dead runs (--all: every one)
  check [--sandbox auto|docker|local]      start a sandbox, run a command in it, report
"""
from __future__ import annotations

import argparse
import logging
import sys

from .base import SandboxError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl sandbox", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the base sandbox image (or a Dockerfile), cached")
    b.add_argument("--tag", default=None, help="image tag (default agentrl-sandbox:bookworm)")
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.add_argument("--dockerfile", default=None, help="build this Dockerfile instead of the base image")
    b.add_argument("--context", default=None, help="build context (default: the Dockerfile's folder)")
    sub.add_parser("ls", help="list agentrl sandboxes (docker containers and local dirs)")
    r = sub.add_parser("reap", help="remove sandboxes whose owner process is gone")
    r.add_argument("--all", action="store_true", help="remove every agentrl sandbox but this process's")
    c = sub.add_parser("check", help="start a sandbox and run a command in it")
    c.add_argument("--sandbox", default="auto", choices=["auto", "docker", "local"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cmd == "build":
            from .docker_backend import DEFAULT_IMAGE
            from .image import build_base_image, build_dockerfile_image
            if args.dockerfile:
                if not args.tag:
                    print("--dockerfile needs --tag", file=sys.stderr)
                    return 2
                build_dockerfile_image(args.dockerfile, args.tag, args.context, force=args.force)
            else:
                build_base_image(args.tag or DEFAULT_IMAGE, force=args.force)
        elif args.cmd == "ls":
            from . import docker_backend, local_backend
            from .base import owner_alive
            if docker_backend.engine_available()[0]:
                for c in docker_backend.list_containers():
                    lb = c.labels
                    print(f"docker  {c.name:28} {c.status:10} run={lb.get('agentrl.run_id')} "
                          f"owner={lb.get('agentrl.owner_pid')}@{lb.get('agentrl.owner_host')}")
            for d, owner in local_backend.list_dirs():
                alive = owner and owner_alive(owner.get("pid", 0), owner.get("start"))
                print(f"local   {d.name:28} {'running' if alive else 'orphaned':10} "
                      f"run={owner.get('run_id')} owner={owner.get('pid')}")
        elif args.cmd == "reap":
            from . import reap
            for backend, names in reap(everything=args.all).items():
                print(f"{backend}: removed {len(names)}")
        elif args.cmd == "check":
            from . import create_sync
            with create_sync(args.sandbox) as sb:
                r = sb.exec("id -u; python3 -c 'import sys; print(sys.version.split()[0])'", timeout=30)
                print(f"{sb.backend} sandbox {sb.id}: exit {r.exit_code}\n{r.stdout}{r.stderr}", end="")
                return 0 if r.ok else 1
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
