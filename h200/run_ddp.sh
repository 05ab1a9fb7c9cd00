#!/usr/bin/env bash
# On the device's 2-GPU machine (kind nvidia-h100-x2, carry .devcarry/ddp, built by
# h200/build_ddp.sh): install those wheels, run the multi_gpu tests -- speculators' own
# Trainer under DDP (2 ranks, NCCL, a GPU each) reading a run in progress under a budget,
# tests/live/test_stream_ddp_live.py -- in one call, bring the logs back.
#   bash h200/run_ddp.sh                 # the three tests (~5 min estimated, never run yet)
#   bash h200/run_ddp.sh -k rank0        # extra pytest arguments
# Output under $OUT: live.log (everything), logs.tar.xz (each torchrun job's output, the
# ranks' batch/ack/result records, the checkpoints' training_state.json).
set -u
D=.devcarry/ddp
BT=/tmp/hsextract-ddp   # pytest's --basetemp: every job runs in a directory under it
: "${OUT:=/tmp/hsextract-ddp-out}"; mkdir -p "$OUT"
T0=$(date +%s)
# End what an earlier call left (a call cut at its limit leaves torchrun's ranks): every
# process whose working directory is under $BT, by pid.
end_left() {
  python3 - "$BT" "$1" <<'PY'
import os, signal, sys
root, when = os.path.realpath(sys.argv[1]), sys.argv[2]
for e in os.listdir("/proc"):
    if not e.isdigit() or int(e) == os.getpid():
        continue
    try:
        cwd = os.readlink(f"/proc/{e}/cwd")
    except OSError:
        continue
    if cwd == root or cwd.startswith(root + "/"):
        print(f"{when}: SIGKILL {e} (cwd {cwd})", flush=True)
        try:
            os.kill(int(e), signal.SIGKILL)
        except ProcessLookupError:
            pass
PY
}
end_left "before the tests"
# NVLink multicast stays off, in every process the tests start (they inherit this env).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf /tmp/ddpsite
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ddpsite "$D"/wheels/*.whl \
  2>&1 | grep -v "^WARNING" | tail -3
export PYTHONPATH=/tmp/ddpsite:$PWD/src:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi -L
# The imports first: a payload that does not fit the image says so in seconds.
python3 -c "
import torch, transformers, datasets, torchdata, speculators.train.trainer
import hsextract.stream.speculators, tests.stream_speculators_rank
print('torch', torch.__version__, '| cuda devices', torch.cuda.device_count(), '| transformers',
      transformers.__version__, '| datasets', datasets.__version__, '| speculators',
      __import__('importlib.metadata').metadata.version('speculators'))
" || { echo "the payload does not import on this image: fix h200/build_ddp.sh's list" >&2; exit 3; }
set -o pipefail
LIMIT=${HSEXTRACT_TIMEOUT:-540}   # under the device's 600 s: the logs below must still come back
timeout "$LIMIT" python3 -m pytest -p no:cacheprovider -m multi_gpu -q -s -rA \
  --basetemp "$BT" tests/live/test_stream_ddp_live.py "$@" 2>&1 | tee "$OUT/live.log"; rc=$?
end_left "after the tests"
(cd /tmp && find "$(basename "$BT")" \( -name torchrun.log -o -name "*.jsonl" -o -name "result.*.json" \
  -o -name training_state.json -o -name hsextract_stream.json \) 2>/dev/null |
  tar -cJf "$OUT/logs.tar.xz" -T - 2>/dev/null)
echo "== done in $(( $(date +%s) - T0 ))s, rc=$rc"
exit $rc
