#!/usr/bin/env bash
# On the H200 machine (device tool, carry .devcarry/h200): unpack SGLang 0.5.14, install the
# workflow's wheels, restore the kernel cache, run the live tests (or a command), bring the
# kernel cache back.
#   bash h200/run.sh                      # pytest -m sglang_live tests/live
#   bash h200/run.sh -k workflow          # extra pytest arguments
#   HSEXTRACT_RUN="python3 bench/sglang_live.py" bash h200/run.sh   # anything else
# Output under $OUT: live.log (everything), report.txt (what the tests show), jitcache.tar.xz.
set -u
D=.devcarry/h200
: "${OUT:=/tmp/hsextract-live-out}"; mkdir -p "$OUT"
T0=$(date +%s)
if [ ! -d /tmp/site/sglang ]; then xz -dc -T0 "$D/site.tar.xz" | tar -x -C /tmp; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 "$D"/wheels/*.whl \
  2>&1 | grep -v "^WARNING" | tail -3
if [ -f "$D/jitcache.tar.xz" ] && [ ! -d /tmp/jitcache ]; then tar -xJf "$D/jitcache.tar.xz" -C /tmp; fi
# /tmp/site first: SGLang 0.5.14 needs transformers 5.8.1 (the image's 5.17 breaks its import).
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD/src
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OUT
# NVLink multicast stays off, in every process the tests start (they inherit this env).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TVM_FFI_CACHE_DIR=/tmp/jitcache/tvm-ffi TRITON_CACHE_DIR=/tmp/jitcache/triton \
  FLASHINFER_WORKSPACE_BASE=/tmp/jitcache/fi
df -h /dev/shm /tmp | tail -2
echo "== ready after $(( $(date +%s) - T0 ))s: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader)"
python3 -c "import sglang, snakemake, transformers; print('sglang', sglang.__version__, '| snakemake', snakemake.__version__, '| transformers', transformers.__version__)"
set -o pipefail
# Our own limit, under the device's 600 s: the logs below must still be collected.
LIMIT=${HSEXTRACT_TIMEOUT:-540}
if [ -n "${HSEXTRACT_RUN:-}" ]; then
  timeout "$LIMIT" bash -c "$HSEXTRACT_RUN" 2>&1 | tee "$OUT/live.log"; rc=$?
else
  timeout "$LIMIT" python3 -m pytest -p no:cacheprovider -m sglang_live -q -s -rA tests/live "$@" \
    2>&1 | tee "$OUT/live.log"; rc=$?
fi
# Every workflow and server log the run left, for what the test output does not say.
find /tmp/pytest-of-* /tmp/hsextract-bench-live -name "*.log" -size -20M 2>/dev/null |
  tar -cJf "$OUT/logs.tar.xz" -T - 2>/dev/null
(cd /tmp && tar -cf - jitcache 2>/dev/null | xz -6 -T0 > "$OUT/jitcache.tar.xz")
echo "== done in $(( $(date +%s) - T0 ))s, rc=$rc"
exit $rc
