#!/usr/bin/env bash
# Samples each SGLang scheduler process of a device call with py-spy once the GPU is busy:
# where the server's own time goes with capture on vs off (issue 40, bench/README.md,
# "Request-rate table").  Start it in the background of the call it watches; it ends with
# the call (the device machine's command ends, and with it this loop).
#   bash h200/profile_scheduler.sh --build            # here: py-spy into .devcarry/pyspy
#   device run, carry [".devcarry/h200", ".devcarry/pyspy"]:
#   (bash h200/profile_scheduler.sh 2>$OUT/profile.err &); HSEXTRACT_RUN="..." bash h200/run.sh
#   python3 bench/scheduler_profile.py <the sched*.txt files that came back>
# Scheduler k (in order of start: bare, then hsextract, in a rate-table cell) gets
# $OUT/sched<k>.txt: 12 s at 200 Hz, every thread, 3 s after the GPU first shows > 60 %
# busy; py-spy's raw (collapsed) stacks, --nonblocking (the process is never paused).
# RENICE_SCHEDULER=N sets every thread of each scheduler to nice N when it is seen (root
# on the device): with the call under `nice -n 5`, the server back at 0, above the client.
# The device returns at most a few files: delete what you do not need from $OUT first.
set -uo pipefail
cd "$(dirname "$0")/.."
D=.devcarry/pyspy
if [ "${1:-}" = "--build" ]; then
  W=$(mktemp -d)
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$W" py-spy==0.4.3
  mkdir -p "$D" && unzip -o -q "$W"/py_spy-*.whl -d "$D" && rm -rf "$W"
  find "$D" -name py-spy -type f
  exit 0
fi
PS=$(find "$D" -name py-spy -type f | head -1)
[ -n "$PS" ] || { echo "no py-spy under $D: run 'bash h200/profile_scheduler.sh --build' here" >&2; exit 2; }
chmod +x "$PS"
seen=""
n=0
while true; do
  for p in $(pgrep -f "sglang::scheduler"); do
    case " $seen " in *" $p "*) continue ;; esac
    seen="$seen $p"
    n=$((n + 1))
    echo "profile: scheduler #$n pid $p $(date +%T)" >&2
    if [ -n "${RENICE_SCHEDULER:-}" ]; then
      for t in /proc/"$p"/task/*; do renice -n "$RENICE_SCHEDULER" -p "${t##*/}" >/dev/null; done
      echo "profile: scheduler #$n threads at nice $RENICE_SCHEDULER" >&2
    fi
    (
      while kill -0 "$p" 2>/dev/null; do
        u=$(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits | head -1)
        [ "${u:-0}" -gt 60 ] && break
        sleep 0.5
      done
      sleep 3
      echo "profile: recording #$n pid $p $(date +%T)" >&2
      "$PS" record -p "$p" --threads --nonblocking -r 200 -d 12 --format raw \
        -o "$OUT/sched$n.txt" >>"$OUT/profile.err" 2>&1
    ) &
  done
  sleep 1
done
