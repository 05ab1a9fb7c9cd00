#!/usr/bin/env bash
# Builds what the live-SGLang tests need on the H200 machine into .devcarry/h200/ (ignored by
# git; name it in the device tool's `carry`).  Runs here, on the CPU machine; needs PyPI.
#   SGLANG_VERSION=0.5.16 bash h200/build.sh     # default 0.5.14
#   site.tar.xz   that SGLang release and what it needs beyond the H200 image (~35-40 MB;
#                 unpacked there to /tmp/site) -- the recipe of ../shared/sglang-h200/
#   site.version  the release site.tar.xz holds (a build for another one rebuilds it)
#   wheels/       the workflow's own dependencies the image lacks (Snakemake and its deps)
#   jitcache.tar.xz, if h200/run.sh brought one back: copy it here yourself (see README)
# What the image already has (torch 2.11, triton, numpy, pandas, safetensors, nvidia-ml-py,
# pytest, hypothesis, requests, pyyaml, jinja2 ...) is never carried: two versions of one
# package on the path break the import.  Only a release pinning the image's torch (2.11.0:
# 0.5.14 - 0.5.17) can run there; its own METADATA gives the transformers, flashinfer,
# tvm-ffi and sglang-kernel it pins.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${SGLANG_VERSION:-0.5.14}
D=.devcarry/h200
W=${HSEXTRACT_H200_WHEELS:-$HOME/.cache/hsextract/h200-wheels}
PY=${PYTHON:-python3}
mkdir -p "$D/wheels" "$W/sglang-$V" "$W/kernel" "$W/workflow"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)

if [ ! -f "$D/site.tar.xz" ] || [ "$(cat "$D/site.version" 2>/dev/null)" != "$V" ]; then
  S="$W/sglang-$V"   # one directory per release: the install below takes every wheel in it
  ls "$S"/sglang-"$V"-*.whl >/dev/null 2>&1 ||
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$S" "sglang==$V"
  pin() {  # the ==version the sglang wheel's METADATA pins for distribution $1
    unzip -p "$S"/sglang-"$V"-*.whl "sglang-$V.dist-info/METADATA" |
      sed -n -E "s/^Requires-Dist: $1(\[[^]]*\])?==([^ ;]+).*/\2/p" | head -1
  }
  TORCH=$(pin torch)
  if [ "$TORCH" != "2.11.0" ]; then
    echo "sglang $V pins torch $TORCH; the H200 image has torch 2.11.0 and cannot take another:" \
      "only 0.5.14 - 0.5.17 run live there (the others are source-checked in CI)" >&2
    exit 2
  fi
  KV=$(pin sglang-kernel)
  # Versions the recipe found to work with the image's torch 2.11.0+cu130; the four that
  # SGLang pins itself come from its METADATA.
  SGLANG=(transformers=="$(pin transformers)" flashinfer-python=="$(pin flashinfer_python)"
    apache-tvm-ffi=="$(pin apache-tvm-ffi)" tokenizers==0.22.2 orjson==3.13.0 pybase64==1.5.1
    starlette==0.50.0 fastapi==0.128.0 uvicorn==0.54.0 python-multipart==0.0.34 pydantic==2.14.4
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    ipython==9.18.1 traitlets==5.16.1 pyzmq==27.3.0 openai==2.6.1 sniffio==1.3.1 distro==1.9.0
    partial-json-parser==0.2.1.1.post7 dill==0.4.1 compressed-tensors==0.20.1 loguru==0.7.3
    gguf==0.19.0 msgspec==0.23.0 setproctitle==1.3.8 jsonschema==4.26.0 referencing==0.37.0
    rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 soundfile==0.13.1 cffi==2.1.1
    pycparser==3.12)
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$S" "${SGLANG[@]}"
  # The wheel's platform tag differs between releases (0.4.4: manylinux2014): find it by name.
  kwheel() { ls "$W"/kernel/sglang_kernel-"$KV"-*.whl 2>/dev/null | head -1; }
  [ -n "$(kwheel)" ] || "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/kernel" "sglang-kernel==$KV"
  K=$(kwheel)
  # Without FA3 (flash_ops, 1.1-1.8 GB), FlashMLA, InfLLM and the SM100 build: serve with
  # --attention-backend triton (sgl_kernel imports only sm90/common_ops on Hopper).
  "$PY" h200/slim_kernel.py "$K" "$W/slim"
  # A stage of its own: two builds at once (two releases, two worktrees) must not share one.
  STAGE=$(mktemp -d /tmp/hsx-h200-stage.XXXXXX)
  trap 'rm -rf "$STAGE"' EXIT
  "$PY" -m pip install -q --no-deps --no-compile --target "$STAGE/site" "${PLAT[@]}" \
    "$S"/*.whl "$W/slim/$(basename "$K")"
  # 0.5.16 on: the HTTP server's function-call parsers import xgrammar unconditionally
  # (inkling_detector, kimik3_detector); the image has none.  Its static library and C++
  # headers are for building against it, not for the import.
  if grep -qsE "^(from|import) xgrammar" "$STAGE"/site/sglang/srt/function_call/*.py; then
    XG="$W/sglang-$V/extra"
    ls "$XG"/xgrammar-"$(pin xgrammar)"-*.whl >/dev/null 2>&1 ||
      "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$XG" "xgrammar==$(pin xgrammar)"
    "$PY" -m pip install -q --no-deps --no-compile --target "$STAGE/site" "${PLAT[@]}" "$XG"/xgrammar-*.whl
    rm -rf "$STAGE"/site/xgrammar/lib "$STAGE"/site/xgrammar/include
  fi
  # Imports the payload cannot satisfy on paths the live tests never run (see the script).
  "$PY" h200/site_fixups.py "$STAGE/site" "$V"
  # Not on the text-serving path: the diffusion runtime, the test suite, the gRPC core, the
  # embedded Rust server (0.5.17 on; SGLANG_RUST_SERVER only).
  (cd "$STAGE/site" && rm -rf sglang/multimodal_gen sglang/test bin share tools \
    sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so \
    sglang/srt/server/_core.cpython-312-x86_64-linux-gnu.so && \
    find . -name __pycache__ -prune -exec rm -rf {} +)
  echo "$V" > "$STAGE/site/.hsextract-sglang-version"
  (cd "$STAGE" && tar -cf - site | xz -9e -T0 > "$OLDPWD/$D/site.tar.xz.tmp")
  mv "$D/site.tar.xz.tmp" "$D/site.tar.xz"
  echo "$V" > "$D/site.version"
fi

# --- the workflow: Snakemake 9.27.1 and what the image and the SGLang site lack ------------
WORKFLOW=(snakemake==9.27.1 snakemake-interface-common==1.23.0
  snakemake-interface-executor-plugins==9.4.0 snakemake-interface-storage-plugins==4.4.1
  snakemake-interface-report-plugins==1.3.0 snakemake-interface-logger-plugins==2.1.0
  snakemake-interface-scheduler-plugins==2.0.2 argparse-dataclass==2.0.0 throttler==1.2.3
  conda-inject==1.3.2 configargparse==1.9.0 docutils==0.22.4 dpath==2.2.0 gitpython==3.2.1
  gitdb==4.0.12 smmap==5.0.3 humanfriendly==10.0 immutables==0.21 nbformat==5.11.1
  fastjsonschema==2.22.3 jupyter-core==5.9.1 platformdirs==4.14.9 smart-open==7.7.1
  sqlmodel==0.0.37 sqlalchemy==2.0.58 greenlet==3.5.6 tenacity==9.2.1 yte==1.9.4)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" --platform any -d "$W/workflow" "${WORKFLOW[@]}"
# connection_pool 0.0.3 is published as an sdist only: build its (pure-Python) wheel here.
ls "$W"/workflow/connection_pool-0.0.3-*.whl >/dev/null 2>&1 ||
  "$PY" -m pip wheel -q --no-deps -w "$W/workflow" connection_pool==0.0.3
# zstandard (the lossless chunk codec; SGLang >= 0.5.15 imports it too) is compiled: the
# image has none.
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/workflow" zstandard==0.25.0
rm -f "$D"/wheels/*.whl
cp "$W"/workflow/*.whl "$D/wheels/"
echo "sglang $(cat "$D/site.version")"
du -sh "$D"/site.tar.xz "$D"/wheels
