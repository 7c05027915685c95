#!/usr/bin/env bash
# The CPU's Megatron tests against the kit's megatron-core (scripts/gpu/build_kit.sh part b: the version
# the GPU machine runs), not the CPU venv's pin: the two differ (the kit's needs Python >= 3.12 by its
# metadata, but ships a cp311 wheel that imports here). Run before spending device time on a Megatron
# change. Makes a hard-linked copy of .venv (setup.sh first) with only megatron-core swapped:
#   bash scripts/gpu/kit_megatron_lane.sh              the Megatron trainer tests (tests/trainers -k megatron...)
#   bash scripts/gpu/kit_megatron_lane.sh PYTEST_ARGS  anything else, e.g. tests/trainers/test_megatron_cp.py
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd); cd "$repo"
version=$(grep -o 'megatron-core==[0-9.]*' scripts/gpu/build_kit.sh | head -1)
venv=${AGENTRL_KIT_LANE_VENV:-/tmp/agentrl-kit-megatron}
if ! "$venv/bin/python" -m pip show megatron-core 2>/dev/null | grep -qx "Version: ${version#*==}"; then
  rm -rf "$venv" && cp -al .venv "$venv"
  for f in "$venv"/bin/*; do  # the scripts' shebangs (not the python links, not binaries)
    if [ ! -L "$f" ] && [ "$(head -c 2 "$f")" = "#!" ]; then sed -i "1s|^#!.*/python[0-9.]*$|#!$venv/bin/python|" "$f"; fi
  done
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site"/megatron "$site"/megatron_core-*.dist-info  # unlink only: .venv keeps its own files
  tmp=$(mktemp -d)
  "$venv/bin/python" -m pip download -q --no-deps --ignore-requires-python "$version" -d "$tmp"
  "$venv/bin/python" -m pip install -q --no-deps --ignore-requires-python "$tmp"/*.whl
  rm -rf "$tmp"
fi
echo "megatron-core $("$venv/bin/python" -m pip show megatron-core | sed -n 's/^Version: //p') in $venv"
[ $# -gt 0 ] || set -- tests/trainers -k "megatron or moe or routing or cp" -n 2 --dist loadfile
# a temp folder of its own: it may run beside another pytest session (docs/development.md)
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$venv.pytest" "$@"
