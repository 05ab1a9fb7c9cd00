"""How long `hsextract status` takes beside `hsextract --help` (the floor: Python, the
package, argparse), measured in the same run, alternated.

A status is polled from scripts and from `--watch`: it reads the run's files and must not
pay for torch or Snakemake (tests/test_newcomer.py checks that they are not imported).

    python bench/status_time.py [--workdir DIR] [--repeat N] [-- STATUS ARGS...]

DIR: a directory holding a config.yaml (a finished run's project for the figure that
matters; default: a fresh copy of the embedded demo's config, before any run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _seconds(argv: list[str], cwd: Path) -> float:
    t = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("status_args", nargs="*", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wd = args.workdir
        if wd is None:
            wd = Path(tmp)
            shutil.copy(REPO / "config.yaml", wd / "config.yaml")
        hsx = [sys.executable, "-m", "hsextract.cli"]
        runs = {
            "hsextract --help": [*hsx, "--help"],
            "hsextract status": [*hsx, "status", *args.status_args],
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for argv in runs.values():
            _seconds(argv, wd)  # warm the page cache and the bytecode
        for _ in range(args.repeat):
            for name, argv in runs.items():
                times[name].append(_seconds(argv, wd))
    help_s = statistics.median(times["hsextract --help"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:18s} median {med:6.2f} s  (min {min(ts):.2f}, n={len(ts)})  "
              f"{med / help_s:4.1f}x --help")  # fmt: skip


if __name__ == "__main__":
    main()
