#!/usr/bin/env bash
# Create (or reuse) .venv and install agentrl with every dependency. Idempotent: a second
# run with nothing changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# System tools: bubblewrap (local sandbox backend), debootstrap (docker sandbox image),
# chromium (the `agentrl inspect` report's browser test).
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "note: ${missing[*]} not installed (needs root: apt-get install ${missing[*]}); sandboxes may be unavailable" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.agentrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # setuptools' banner for every editable install ("folders ... with the same name as your package") is noise here
  PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi
echo "agentrl installed in $(pwd)/.venv (enter it with: source .venv/bin/activate)"
