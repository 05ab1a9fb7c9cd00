"""Benchmark planning: ``snakemake -n extract_all`` of our workflow vs a bare one-rule workflow.

For each ``n_chunks`` (default 1,000 and 10,000) it times, in the same run and with the
same Snakemake, two dry runs in fresh temp dirs:

* ours: ``snakemake -s Snakefile -n extract_all --config n_chunks=N`` in a workdir holding
  the repo's ``config.yaml`` (the embedded demo config; a fresh ``results/``), with a
  poisoned ``torch`` first on PYTHONPATH so the plan provably loads no model;
* bare: a generated Snakefile with ``rule all`` asking for N files and one rule making
  them (``touch``), i.e. the same number of jobs of the same kind, nothing else.

Both print their full plan to a file, as a user's ``snakemake -n`` prints it; wall time is
measured around the whole process (Python start, parse, DAG, output).

Usage: .venv/bin/python bench/plan.py [--sizes 1000 10000] [--repeats 1]
Last line: ``plan/bare wall ratio @10000: X.XX`` (medians over repeats).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BARE = """N = int(config["n_jobs"])


rule all:
    input:
        expand("out/{i:05d}.txt", i=range(N)),


rule make:
    output:
        "out/{i}.txt",
    shell:
        "touch {output}"
"""


def planned(stdout: str, rule: str) -> int:
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == rule and parts[1].isdigit():
            return int(parts[1])
    return -1


def dry_run(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    return wall, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="hsextract-bench-plan-"))
    try:
        poison = tmp / "poison" / "torch"
        poison.mkdir(parents=True)
        (poison / "__init__.py").write_text("raise ImportError('the dry run imported torch')\n")
        env = {**os.environ, "PYTHONPATH": str(poison.parent)}
        bare_dir = tmp / "bare"
        bare_dir.mkdir()
        (bare_dir / "Snakefile").write_text(BARE)
        smk = [sys.executable, "-m", "snakemake"]
        rows = {}
        for n in args.sizes:
            ours_t, bare_t = [], []
            for rep in range(args.repeats):
                wd = tmp / f"ours-{n}-{rep}"
                wd.mkdir()
                shutil.copy(REPO / "config.yaml", wd / "config.yaml")
                cmd = [*smk, "-s", str(REPO / "Snakefile"), "-n", "extract_all"]
                t, out = dry_run([*cmd, "--config", f"n_chunks={n}"], wd, env, tmp / "ours.log")
                jobs = planned(out, "extract_chunk")
                if jobs != n or (wd / "results").exists():
                    raise SystemExit(f"ours planned {jobs} extract_chunk jobs (want {n}) or wrote")
                ours_t.append(t)
                shutil.rmtree(bare_dir / ".snakemake", ignore_errors=True)
                t, out = dry_run(
                    [*smk, "-n", "--config", f"n_jobs={n}"], bare_dir, env, tmp / "bare.log"
                )
                if planned(out, "make") != n:
                    raise SystemExit(f"bare planned {planned(out, 'make')} jobs, want {n}")
                bare_t.append(t)
                print(f"n={n:>6} rep {rep}: ours {ours_t[-1]:7.2f} s  bare {t:6.2f} s", flush=True)
            rows[n] = (statistics.median(ours_t), statistics.median(bare_t))
        ver = subprocess.run([*smk, "--version"], capture_output=True, text=True).stdout.strip()
        print(f"snakemake {ver}; ours = Snakefile + demo config.yaml, fresh results/, no torch")
        for n, (o, b) in rows.items():
            print(f"n_chunks={n:>6}: ours {o:7.2f} s, bare one-rule {b:6.2f} s, ratio {o / b:5.2f}")
        last = max(rows)
        print(f"plan/bare wall ratio @{last}: {rows[last][0] / rows[last][1]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
