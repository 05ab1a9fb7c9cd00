"""Benchmark merge_and_shuffle against GNU shuf on the same bytes, at the seed's scale.

Generates 37,312 records / 87.8 M tokens (lengths lognormal around a mean of ~2,350, a
few at 8,192, token ids below DeepSeek-V3's 129,280) over 8 shards, half written compact
(orjson) and half in Python json.dumps style (", " separators), then times, alternately
and with a sync before each: ``shuf -o`` of the concatenated shards, and our merge in a
subprocess (validation, seeded shuffle, writes, fsync).  Peak RSS is the largest summed
RSS of the merge's process tree (parent + workers), polled every 50 ms, and at least the
kernel's per-process maximum from getrusage(RUSAGE_CHILDREN).

Usage: .venv/bin/python bench/merge.py [--repeats 3] [--keep DIR]
The last line is: ``merge/shuf wall ratio: X.XX peak_rss_gb: Y.YY`` (medians of repeats,
the peak over them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import psutil

N_RECORDS = 37_312
N_TOKENS = 87_800_000
MAX_LEN = 8192
VOCAB = 129_280
N_SHARDS = 8

CHILD = """
import json, sys, time
from pathlib import Path
from hsextract.records import merge_and_shuffle
t = time.perf_counter()
stats = merge_and_shuffle([sys.argv[1] + "/shard_*.jsonl"], Path(sys.argv[2]), max_seq_len=8192,
    overlength="truncate", seed=0, vocab_size=129280, max_reject_fraction=0.0)
print(json.dumps({"wall": time.perf_counter() - t, "records": stats["records_out"],
                  "tokens": stats["tokens_out"], "bytes": stats["bytes_out"]}))
"""


def lengths(rng: np.random.Generator) -> np.ndarray:
    """Lognormal lengths with the seed's mean, capped at MAX_LEN, summing to N_TOKENS."""
    raw = np.clip(rng.lognormal(np.log(1900), 0.65, N_RECORDS), 16, MAX_LEN)
    lens = np.clip(np.rint(raw * N_TOKENS / raw.sum()), 16, MAX_LEN).astype(np.int64)
    lens[rng.choice(N_RECORDS, 40, replace=False)] = MAX_LEN
    short = np.flatnonzero(lens < MAX_LEN - 1000)
    diff = N_TOKENS - int(lens.sum())
    fix = rng.choice(short, abs(diff), replace=True)
    np.add.at(lens, fix, 1 if diff > 0 else -1)
    return lens


def generate(data_dir: Path) -> int:
    """Write the shards; returns total bytes."""
    rng = np.random.default_rng(1)
    lens = lengths(rng)
    total = 0
    for s, idx in enumerate(np.array_split(np.arange(N_RECORDS), N_SHARDS)):
        lines = []
        for i in idx.tolist():
            n = int(lens[i])
            ids = rng.integers(0, VOCAB, n, dtype=np.int32)
            mask = np.zeros(n, np.uint8)
            mask[n // 3 :] = 1
            obj = {"id": f"rec-{i:06d}", "input_ids": ids, "loss_mask": mask, "source": "synth"}
            lines.append(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY))
        blob = b"\n".join(lines) + b"\n"
        if s % 2:
            blob = blob.replace(b",", b", ").replace(b'":', b'": ')  # json.dumps style
        (data_dir / f"shard_{s:03d}.jsonl").write_bytes(blob)
        total += len(blob)
    return total


def time_shuf(concat: Path, out: Path) -> float:
    out.unlink(missing_ok=True)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    subprocess.run(["shuf", "-o", str(out), str(concat)], check=True)
    return time.perf_counter() - t


def time_merge(data_dir: Path, out_dir: Path) -> tuple[dict, float, float]:
    """(child's report, process wall, peak RSS GB of the tree)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data_dir), str(out_dir)], stdout=subprocess.PIPE
    )
    peak = 0
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [ps, *ps.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)  # sparse: polling /proc steals CPU from a 2-core merge
    wall = time.perf_counter() - t
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"merge failed with {proc.returncode}")
    ru_max = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return json.loads(out), wall, max(peak, ru_max) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="generate into (and keep) this dir")
    args = ap.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    data = tmp / "data"
    data.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        if not list(data.glob("shard_*.jsonl")):
            size = generate(data)
            print(f"generated {N_RECORDS} records / {N_TOKENS:,} tokens, {size / 1e6:.0f} MB "
                  f"in {N_SHARDS} shards, {time.perf_counter() - t:.1f} s")  # fmt: skip
        concat = tmp / "all.jsonl"
        with open(concat, "wb") as f:
            for p in sorted(data.glob("shard_*.jsonl")):
                f.write(p.read_bytes())
        print(f"input: {concat.stat().st_size / 1e6:.0f} MB; cpus: {os.cpu_count()}")
        ratios, shufs, merges, peaks = [], [], [], []
        for r in range(args.repeats):
            s = time_shuf(concat, tmp / "shuf.out")
            rep, proc_wall, peak = time_merge(data, tmp / "merged")
            ratios.append(rep["wall"] / s)
            shufs.append(s)
            merges.append(rep["wall"])
            peaks.append(peak)
            print(f"run {r}: shuf {s:.2f} s | merge {rep['wall']:.2f} s (process incl. "
                  f"interpreter start {proc_wall:.2f} s) | {rep['records']} records, "
                  f"{rep['tokens']:,} tokens | peak RSS {peak:.2f} GB")  # fmt: skip
        print(f"median: shuf {statistics.median(shufs):.2f} s, merge "
              f"{statistics.median(merges):.2f} s")  # fmt: skip
        print(
            f"merge/shuf wall ratio: {statistics.median(ratios):.2f} peak_rss_gb: {max(peaks):.2f}"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
