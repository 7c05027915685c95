#!/usr/bin/env bash
# Build (or confirm up to date) the docker base image for agentrl sandboxes:
# Debian bookworm minimal + python3 + bash + common tools, via debootstrap + docker import.
# Needs root, a Docker engine, and `apt-get install debootstrap`. Cached: a no-op when current.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! command -v debootstrap >/dev/null; then
  echo "installing debootstrap" >&2
  apt-get install -y -qq debootstrap >/dev/null
fi
exec "$PY" -m agentrl.sandboxes.cli build "$@"
