"""What comparing the inputs by identity costs: the stat on every invocation, the sha256
the merge records for ``hsextract verify``.

On the merge bench's data (bench/merge.py: the seed's 37,312 records / 87.8 M tokens,
~805 MB in 8 shards), warm page cache:

* ``input_identity`` of the shards (what rules/common.smk does at every parse), and of
  1,000 empty files, for a dataset split finer;
* sha256 of the shards in one process (what ``verify`` re-reads, per core);
* the merge with its per-input sha256 and with the hashing stubbed out, alternately in
  fresh processes: the difference is what recording the hash costs the merge.

Usage: .venv/bin/python bench/input_identity.py [--repeats 3] [--keep DIR]
The last line is: ``merge +sha256: X.XX s (Y.Y%) on Z MB; at 80 GB: ~A s merge, ~B s verify``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from merge import generate  # noqa: E402

from hsextract.records import _sha256_file, input_identity  # noqa: E402

CHILD = """
import json, sys, time
from pathlib import Path
from hsextract import records
def no_hash(path):  # by reference into the fork workers: a lambda does not pickle
    return ""
if sys.argv[3] == "off":
    records._sha256_file = no_hash
t = time.perf_counter()
records.merge_and_shuffle([sys.argv[1] + "/shard_*.jsonl"], Path(sys.argv[2]), max_seq_len=8192,
    overlength="truncate", seed=0, vocab_size=129280, max_reject_fraction=0.0)
print(json.dumps({"wall": time.perf_counter() - t}))
"""


def merge_wall(data: Path, out: Path, hashing: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(data), str(out), hashing],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout)["wall"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="generate into (and keep) this dir")
    args = ap.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    data = tmp / "data"
    data.mkdir(parents=True, exist_ok=True)
    try:
        if not list(data.glob("shard_*.jsonl")):
            generate(data)
        shards = sorted(data.glob("shard_*.jsonl"))
        size = sum(p.stat().st_size for p in shards)
        for p in shards:
            p.read_bytes()  # warm cache
        t = time.perf_counter()
        for _ in range(100):
            input_identity(shards)
        stat_ms = (time.perf_counter() - t) / 100 * 1e3
        many = tmp / "many"
        many.mkdir(exist_ok=True)
        empties = [many / f"s{i:04d}.jsonl" for i in range(1000)]
        for e in empties:
            e.touch()
        t = time.perf_counter()
        input_identity(empties)
        stat_1000_ms = (time.perf_counter() - t) * 1e3
        print(f"input_identity: {len(shards)} shards {stat_ms:.3f} ms, 1000 files "
              f"{stat_1000_ms:.1f} ms")  # fmt: skip
        t = time.perf_counter()
        for p in shards:
            _sha256_file(p)
        hash_s = time.perf_counter() - t
        rate = size / hash_s
        print(f"sha256 of {size / 1e6:.0f} MB, one process: {hash_s:.2f} s ({rate / 1e9:.2f} GB/s)")
        on, off = [], []
        for r in range(args.repeats):
            off.append(merge_wall(data, tmp / "merged", "off"))
            on.append(merge_wall(data, tmp / "merged", "on"))
            print(f"run {r}: merge without sha256 {off[-1]:.2f} s, with {on[-1]:.2f} s")
        m_on, m_off = statistics.median(on), statistics.median(off)
        delta = m_on - m_off
        scale = 80e9 / size
        print(
            f"merge +sha256: {delta:.2f} s ({delta / m_off:.1%}) on {size / 1e6:.0f} MB; at 80 GB: "
            f"~{delta * scale:.0f} s merge, ~{80e9 / rate:.0f} s verify"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
