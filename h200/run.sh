#!/usr/bin/env bash
# On the H200 machine (device tool, carry .devcarry/h200): unpack the SGLang release build.sh
# packed (0.5.14 - 0.5.17; the live tests run whichever is installed), install the
# workflow's wheels, restore the kernel cache, run the live tests (or a command), bring the
# kernel cache back.  One device call runs one group of the live tests (each well under the
# device's 600 s per command; groups in tests/live/conftest.py):
#   bash h200/run.sh --group 1            # the workflow end to end   (2: fidelity, 3: faults,
#                                         # 4: dp 2 on one GPU, 5: a DP worker killed,
#                                         # 6: the installed release end to end)
#   bash h200/run.sh --group 1 -k workflow   # extra pytest arguments after the group
#   HSEXTRACT_RUN="python3 bench/sglang_live.py" bash h200/run.sh   # anything else
# First it ends what an earlier call of this harness left running (a call killed at 600 s
# leaves its detached workflow and SGLang server on the warm machine): every process that
# carries $HSEXTRACT_LIVE_HARNESS, which this script exports to all it starts.
# Output under $OUT: live.log (everything), report.txt (what the tests show), leftovers.txt
# (what was ended, before and after the tests), jitcache.tar.xz.
set -u
D=.devcarry/h200
: "${OUT:=/tmp/hsextract-live-out}"; mkdir -p "$OUT"
T0=$(date +%s)
GROUP=
if [ "${1:-}" = "--group" ]; then GROUP=${2:?--group needs a number}; shift 2; fi
if [ -z "$GROUP" ] && [ -z "${HSEXTRACT_RUN:-}" ]; then
  echo "bash h200/run.sh --group N: every live test at once runs past the device's 600 s" \
    "(groups: tests/live/conftest.py, h200/README.md)" >&2
  exit 2
fi
MARK=HSEXTRACT_LIVE_HARNESS
# End every process (but this script) whose environment carries $MARK: TERM, then KILL what
# is left after 15 s; each is named in leftovers.txt and on the terminal.
end_marked() {
  # No pipe (a tee of this shell would carry the mark after the export): it writes both.
  env -u "$MARK" python3 - "$1" "$MARK" "$OUT/leftovers.txt" <<'PY'
import os, signal, sys, time
when, key, report = sys.argv[1], sys.argv[2].encode() + b"=", sys.argv[3]
found = {}
for e in os.listdir("/proc"):
    if not e.isdigit() or int(e) in (os.getpid(), os.getppid()):
        continue
    try:
        with open(f"/proc/{e}/environ", "rb") as f:
            if not any(v.startswith(key) for v in f.read().split(b"\0")):
                continue
        with open(f"/proc/{e}/cmdline", "rb") as f:
            found[int(e)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        continue
lines = [f"== {when}: {len(found)} process(es) started by a harness call, to end"]
lines += [f"   {pid} {cmd}" for pid, cmd in sorted(found.items())]
def kill(sig):
    for pid in found:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
def alive():
    return [p for p in found if os.path.exists(f"/proc/{p}")]
kill(signal.SIGTERM)
deadline = time.monotonic() + 15
while alive() and time.monotonic() < deadline:
    time.sleep(0.2)
if alive():
    lines.append(f"   SIGKILL to {alive()} (still running 15 s after SIGTERM)")
    kill(signal.SIGKILL)
print("\n".join(lines), flush=True)
with open(report, "a") as f:
    f.write("\n".join(lines) + "\n")
PY
}
end_marked "before the tests"
export "$MARK=$$"
# A warm machine may hold another release's site from an earlier call: unpack again then.
if [ ! -d /tmp/site/sglang ] || [ "$(cat /tmp/site/.hsextract-sglang-version 2>/dev/null)" != "$(cat "$D/site.version" 2>/dev/null)" ]; then
  rm -rf /tmp/site && xz -dc -T0 "$D/site.tar.xz" | tar -x -C /tmp
  cat "$D/site.version" > /tmp/site/.hsextract-sglang-version 2>/dev/null
fi
# pip --target keeps what an earlier call installed there (another release's kernel wheel).
rm -rf /tmp/site2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 "$D"/wheels/*.whl \
  2>&1 | grep -v "^WARNING" | tail -3
if [ -f "$D/jitcache.tar.xz" ] && [ ! -d /tmp/jitcache ]; then tar -xJf "$D/jitcache.tar.xz" -C /tmp; fi
# /tmp/site first: SGLang needs the transformers it pins (0.5.14: 5.8.1; the image's 5.17 breaks
# its import).
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD/src
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OUT
# NVLink multicast stays off, in every process the tests start (they inherit this env).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TVM_FFI_CACHE_DIR=/tmp/jitcache/tvm-ffi TRITON_CACHE_DIR=/tmp/jitcache/triton \
  FLASHINFER_WORKSPACE_BASE=/tmp/jitcache/fi
df -h /dev/shm /tmp | tail -2
echo "== ready after $(( $(date +%s) - T0 ))s: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader)"
[ -s /tmp/site/.hsextract-h200-fixups ] && sed 's/^/site fixup (h200\/site_fixups.py): /' /tmp/site/.hsextract-h200-fixups
python3 -c "import sglang, snakemake, transformers; print('sglang', sglang.__version__, '| snakemake', snakemake.__version__, '| transformers', transformers.__version__)"
set -o pipefail
# Our own limit, under the device's 600 s: the logs below must still be collected.
LIMIT=${HSEXTRACT_TIMEOUT:-540}
if [ -n "${HSEXTRACT_RUN:-}" ]; then
  timeout "$LIMIT" bash -c "$HSEXTRACT_RUN" 2>&1 | tee "$OUT/live.log"; rc=$?
else
  # The DDP test is multi_gpu only (h200/run_ddp.sh runs it, with torchdata in its payload);
  # importing it here fails on this payload, which has no torchdata (seen 2026-12-06).
  HSEXTRACT_LIVE_GROUP=$GROUP timeout "$LIMIT" python3 -m pytest -p no:cacheprovider \
    -m sglang_live -q -s -rA --ignore=tests/live/test_stream_ddp_live.py tests/live "$@" \
    2>&1 | tee "$OUT/live.log"; rc=$?
fi
# What the tests left (none, unless the limit cut them short): ended now, not by the next call.
end_marked "after the tests"
# Every workflow and server log the run left, for what the test output does not say.
find /tmp/pytest-of-* /tmp/hsextract-bench-live -name "*.log" -size -20M 2>/dev/null |
  tar -cJf "$OUT/logs.tar.xz" -T - 2>/dev/null
(cd /tmp && tar -cf - jitcache 2>/dev/null | xz -6 -T0 > "$OUT/jitcache.tar.xz")
echo "== done in $(( $(date +%s) - T0 ))s, rc=$rc"
exit $rc
