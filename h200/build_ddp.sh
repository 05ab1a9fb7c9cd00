#!/usr/bin/env bash
# Builds what tests/live/test_stream_ddp_live.py (marker multi_gpu: speculators' own Trainer
# under DDP on 2 GPUs, reading a stream) needs on the device's 2-GPU machine beyond its image,
# into .devcarry/ddp/wheels/ (ignored by git; name .devcarry/ddp in the device call's carry).
# Runs here, on the CPU machine; needs PyPI.  h200/run_ddp.sh installs them there.
# The list is what the test's processes import (pytest, tests/stream_speculators_rank.py,
# speculators' Trainer, its data module, torchrun) less what the image has (torch 2.11,
# transformers 5.17 -- speculators 0.9.0 allows <= 5.19 --, numpy, pandas, pyarrow, safetensors,
# huggingface-hub, httpx, aiohttp, rich, pytest ...): never carried, since two versions of
# one package on the path break the import.  openai 2.6.1 and its jiter, distro, sniffio:
# speculators' data module imports openai; 3.x needs httpx2, which the image lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry/ddp
W=${HSEXTRACT_DDP_WHEELS:-$HOME/.cache/hsextract/ddp-wheels}
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
WHEELS=(speculators==0.9.0 hs-connectors==0.9.0 torchdata==0.11.0
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 openai==2.6.1 jiter==0.11.1 distro==1.9.0 sniffio==1.3.1
  orjson==3.13.0 zstandard==0.25.0)
mkdir -p "$W"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" --platform any -d "$W" "${WHEELS[@]}"
rm -rf "$D/wheels" && mkdir -p "$D/wheels"
for spec in "${WHEELS[@]}"; do  # only the listed versions, whatever else the cache holds
  name=${spec%%==*} version=${spec#*==}
  f=$(ls "$W"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "no wheel of $spec in $W" >&2; exit 2; }
  cp "$f" "$D/wheels/"
done
ls "$D/wheels" | wc -l
du -sh "$D/wheels"
