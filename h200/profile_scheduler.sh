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
# Another process: PROFILE_MATCH (a `pgrep -f` pattern), PROFILE_NAME (the files' prefix),
# PROFILE_ARGS (py-spy's, in place of --threads), PROFILE_RATE (Hz), PROFILE_DELAY (seconds
# from its start, instead of the GPU's busy). A chunk job's GIL: the first jobs start with
# the workflow and wait for the server's load (~60 s in a rate-table cell; 6 s caught only
# that wait, 2026-12-07), so wait past it; the pattern names the job's Python process (a
# bare "extract_chunk" also matches the shells Snakemake runs it from, which py-spy refuses:
# "Failed to find python version"):
#   PROFILE_MATCH="python.*extract_chunk" PROFILE_NAME=job PROFILE_ARGS="--gil --threads" \
#   PROFILE_RATE=50 PROFILE_DELAY=75 bash h200/profile_scheduler.sh
#   python3 bench/scheduler_profile.py --gil 50 job1.txt ...   (the share it held the GIL)
# The device returns at most 8 files: pack the job*.txt files into one archive, delete the
# rest you do not need from $OUT first (and end the profiler with `pkill -x py-spy`: a
# `pkill -f` pattern also matches the device call's own shell, whose command line holds it).
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
MATCH=${PROFILE_MATCH:-sglang::scheduler}
NAME=${PROFILE_NAME:-sched}
ARGS=${PROFILE_ARGS:---threads}
RATE=${PROFILE_RATE:-200}
seen=""
n=0
while true; do
  for p in $(pgrep -f "$MATCH"); do
    case " $seen " in *" $p "*) continue ;; esac
    seen="$seen $p"
    n=$((n + 1))
    echo "profile: $NAME #$n pid $p $(date +%T)" >&2
    if [ -n "${RENICE_SCHEDULER:-}" ]; then
      for t in /proc/"$p"/task/*; do renice -n "$RENICE_SCHEDULER" -p "${t##*/}" >/dev/null; done
      echo "profile: $NAME #$n threads at nice $RENICE_SCHEDULER" >&2
    fi
    (
      if [ -n "${PROFILE_DELAY:-}" ]; then
        sleep "$PROFILE_DELAY"  # many processes: no nvidia-smi loop each (its CPU)
      else
        while kill -0 "$p" 2>/dev/null; do
          u=$(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits | head -1)
          [ "${u:-0}" -gt 60 ] && break
          sleep 0.5
        done
        sleep 3
      fi
      echo "profile: recording $NAME #$n pid $p $(date +%T)" >&2
      # $ARGS unquoted: py-spy's flags, split at spaces.
      "$PS" record -p "$p" $ARGS --nonblocking -r "$RATE" -d 12 --format raw \
        -o "$OUT/$NAME$n.txt" >>"$OUT/profile.err" 2>&1
    ) &
  done
  sleep 1
done
