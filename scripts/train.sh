#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the main job on the embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/agentrl train --env "${ENV:-target-token}" "$@"
