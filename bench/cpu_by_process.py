"""Where a host's CPU goes, by kind of process, while the chunk jobs work (issue 40).

Why: on the chat cell the window is full and over half of it sits in the chunk jobs after
the server's answer (~1.2 s a request, for ~15 ms of CPU), with the host ~82 % busy at its
peak. Either the jobs queue on their own GIL or on the host's cores; which cores, taken by
whom (the scheduler, its dump writers, the tokenizer, the chunk jobs, the kernel's
threads), is what this counts. A GIL profile says what a job's threads did; this says what
every process took.

It samples ``/proc/<pid>/stat`` (utime + stime of every thread of a process, in clock
ticks) and ``/proc/stat`` each ``--interval`` seconds and appends one JSON line per sample
to ``--out``: each group's CPU seconds since the last sample. A process's group is its
SGLang process title (``sglang::scheduler``...), ``chunk job`` for a workflow job that runs
``extract_chunk``, else its ``comm``. It stops at SIGTERM/SIGINT or ``--duration``.

    python3 bench/cpu_by_process.py record --out cpu.jsonl &      # beside the run
    python3 bench/cpu_by_process.py summary cpu.jsonl              # after it

``summary`` averages, in cores, over the samples where the ``--during`` group (default
``chunk job``) took at least ``--min-cores`` (the chunk jobs' working phase: an event,
not a clock), and also over the samples without it where the scheduler was busy (the bare
server's phase in a rate-table cell).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
CHUNK_JOB = "chunk job"
SCHEDULER = "sglang::scheduler"


def group_of(pid: int) -> str | None:
    """The group a process counts in, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    cmd = raw.replace(b"\0", b" ").decode(errors="replace")
    if cmd.startswith("sglang::"):
        return cmd.split()[0].split("_TP")[0].split("_DP")[0]
    if "extract_chunk" in cmd:
        return CHUNK_JOB
    if "sglang.launch_server" in cmd:
        return "sglang (http, tokenizer)"
    if "snakemake" in cmd:
        return "snakemake"
    return comm or "?"


def process_ticks() -> dict[int, int]:
    """utime + stime of every live process (all its threads, reaped children excluded)."""
    out = {}
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            stat = Path(f"/proc/{e}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(e)] = int(fields[11]) + int(fields[12])  # utime, stime: fields 14, 15
    return out


def host_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]  # idle, iowait
    total = sum(parts[:8])  # guest time is counted in user already
    return total - idle, total


def record(out: Path, interval: float, duration: float | None) -> int:
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    last, (busy0, total0) = process_ticks(), host_ticks()
    t_last, t_end = time.time(), (time.time() + duration) if duration else None
    ncpu = os.cpu_count() or 1
    with out.open("a") as f:
        while not stop and (t_end is None or time.time() < t_end):
            time.sleep(interval)  # a sampling period, not a wait for an event
            now, (busy, total), t = process_ticks(), host_ticks(), time.time()
            took: collections.Counter[str] = collections.Counter()
            for pid, ticks in now.items():
                delta = ticks - last.get(pid, 0)  # a new process: all its ticks are new
                if delta <= 0:
                    continue
                # Read anew each time: a spawned process sets its title after it starts
                # (SGLang's scheduler is "python3 -c from multiprocessing..." at first).
                took[group_of(pid) or "?"] += delta / TICK
            line = {
                "t": round(t, 3),
                "dt": round(t - t_last, 3),
                "host_busy": round((busy - busy0) / max(1, total - total0), 4),
                "ncpu": ncpu,
                "cpu_s": {g: round(s, 3) for g, s in took.most_common()},
            }
            f.write(json.dumps(line) + "\n")
            f.flush()
            last, busy0, total0, t_last = now, busy, total, t
    return 0


def summarize(lines: list[dict], during: str, min_cores: float, top: int = 12) -> dict[str, dict]:
    """Mean cores a group took over the samples of each phase: ``during`` (its group at
    ``min_cores`` or more) and ``server only`` (it below, the scheduler at 0.5 core or
    more). Each phase: its samples, seconds, the host's mean busy share and the top
    groups."""
    phases: dict[str, list[dict]] = {"during": [], "server only": []}
    for s in lines:
        dt = s["dt"] or 1.0
        if s["cpu_s"].get(during, 0.0) / dt >= min_cores:
            phases["during"].append(s)
        elif s["cpu_s"].get(SCHEDULER, 0.0) / dt >= 0.5:
            phases["server only"].append(s)
    out = {}
    for name, samples in phases.items():
        seconds = sum(s["dt"] for s in samples)
        if not seconds:
            out[name] = {"samples": 0}
            continue
        cores: collections.Counter[str] = collections.Counter()
        for s in samples:
            for g, v in s["cpu_s"].items():
                cores[g] += v / seconds
        out[name] = {
            "samples": len(samples),
            "seconds": round(seconds, 1),
            "host_busy": round(sum(s["host_busy"] * s["dt"] for s in samples) / seconds, 3),
            "ncpu": samples[0]["ncpu"],
            "cores": {g: round(c, 2) for g, c in cores.most_common(top)},
            "cores_total": round(sum(cores.values()), 2),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="sample until SIGTERM or --duration")
    rec.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    rec.add_argument("--interval", type=float, default=1.0, help="seconds a sample")
    rec.add_argument("--duration", type=float, default=None, help="seconds, then stop")
    summ = sub.add_parser("summary", help="mean cores by group over each phase")
    summ.add_argument("file", type=Path)
    summ.add_argument("--during", default=CHUNK_JOB, help="the group whose phase is averaged")
    summ.add_argument("--min-cores", type=float, default=1.0)
    summ.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        return record(args.out, args.interval, args.duration)
    lines = [json.loads(x) for x in args.file.read_text().splitlines() if x.strip()]
    result = summarize(lines, args.during, args.min_cores, args.top)
    for name, ph in result.items():
        if not ph["samples"]:
            print(f"{name}: no sample")
            continue
        print(
            f"{name}: {ph['samples']} samples, {ph['seconds']} s, host {ph['host_busy']:.0%} "
            f"busy of {ph['ncpu']} CPUs, {ph['cores_total']} cores in processes"
        )
        for g, c in ph["cores"].items():
            print(f"  {c:6.2f}  {g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
