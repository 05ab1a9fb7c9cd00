#!/usr/bin/env bash
# One rate-table cell in one device call, with its probes, and $OUT pruned to what the
# device tool brings back (at most 8 files): issue 40's calls as they were run on 2026-12-07.
#   device run, carry [".devcarry/h200"] (and ".devcarry/pyspy" with GIL=1):
#   CELL=chat-7b-5aux bash h200/rate_call.sh
#   CELL=chat-7b-5aux GIL=1 VARIANT="j8:client.sending_jobs=8,client.requests_in_flight=82,client.tokens_in_flight=10537" bash h200/rate_call.sh
# Beside the cell: bench/cpu_by_process.py (each kind of process's cores while the chunk
# jobs work, and while the bare server does); with GIL=1, py-spy --gil on every chunk job
# 75 s after its start (h200/profile_scheduler.sh).  BUDGET_S (default 520): the cell's
# --budget-s; the call needs ~40 s more (the payload's unpack, the summaries).
# On stdout: the cell's result lines, the CPU summary, the GIL summary (GIL=1), and per run
# (as shipped, each variant) the ratio, the server's dry passes and where the requests were
# (in_flight_mean).  Left in $OUT: rate_table.csv (copy it over bench/tables/), .json,
# rate_table-logs.tar.xz, cpu.jsonl, run.out, jitcache.tar.xz, profiles.tar.xz (GIL=1).
set -u
cd "$(dirname "$0")/.."
: "${OUT:?run on the device machine: its \$OUT is where the files come back from}"
CELL=${CELL:?CELL=<a cell of bench/rate_table.py, e.g. chat-7b-5aux>}
BUDGET=${BUDGET_S:-520}
python3 bench/cpu_by_process.py record --out "$OUT/cpu.jsonl" --duration $((BUDGET + 60)) &
CPU=$!
PROF=
if [ "${GIL:-0}" = 1 ]; then
  PROFILE_MATCH="python.*extract_chunk" PROFILE_NAME=job PROFILE_ARGS="--gil --threads" \
    PROFILE_RATE=50 PROFILE_DELAY=75 bash h200/profile_scheduler.sh 2>"$OUT/profile.err" &
  PROF=$!
fi
RUN="python3 bench/rate_table.py --cells $CELL --csv \$OUT/rate_table.csv --budget-s $BUDGET"
[ -n "${VARIANT:-}" ] && RUN="$RUN --variant $VARIANT"
HSEXTRACT_TIMEOUT=$((BUDGET + 20)) HSEXTRACT_RUN="$RUN" bash h200/run.sh >"$OUT/run.out" 2>&1
rc=$?
kill "$CPU" 2>/dev/null
wait "$CPU" 2>/dev/null
if [ -n "$PROF" ]; then
  kill "$PROF" 2>/dev/null
  pkill -x py-spy  # by name: a `pkill -f` pattern would match this call's own shell
fi
grep -E "^== |Error" "$OUT/run.out" | tail -20
echo "== cores by kind of process"
python3 bench/cpu_by_process.py summary "$OUT/cpu.jsonl" --top 8
if ls "$OUT"/job*.txt >/dev/null 2>&1; then
  echo "== chunk jobs' GIL"
  python3 bench/scheduler_profile.py --gil 50 $(ls "$OUT"/job*.txt | head -16) | cut -c1-400
fi
echo "== where the requests were"
python3 - "$OUT/rate_table.json" <<'PY'
import json, sys
try:
    cells = json.load(open(sys.argv[1]))["cells"]
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"no rate_table.json: {exc}")
for name, cell in cells.items():
    row = cell.get("row") or {}  # none where hsextract did not extract every record
    runs = [("as shipped", cell.get("hsextract", {}), row.get("ratio_sending"))]
    runs += [(label, v.get("hsextract", {}), v.get("ratio_sending"))
             for label, v in cell.get("variants", {}).items()]
    for label, h, ratio in runs:
        server = h.get("server") or {}
        print(f"{name} {label}: ratio {ratio}, sending {h.get('sending_tok_s')} tok/s, "
              f"dry {server.get('batches_with_empty_queue')} of {server.get('prefill_batches')} "
              f"passes, in flight {h.get('in_flight_mean')}")
PY
(cd "$OUT" && ls job*.txt >/dev/null 2>&1 && tar -cJf profiles.tar.xz job*.txt $(ls profile.err 2>/dev/null))
rm -f "$OUT"/job*.txt "$OUT"/profile.err "$OUT"/live.log "$OUT"/leftovers.txt \
  "$OUT"/report.txt "$OUT"/logs.tar.xz
ls "$OUT"
exit $rc
