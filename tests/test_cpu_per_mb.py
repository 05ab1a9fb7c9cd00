"""bench/cpu_per_mb.py runs end to end on tiny pieces: each tree's steps are read, the
chunk's sha256 agrees between trees, and the ratio line is printed (the bench is the
figure issue 60's per-byte work is judged by, so it must not rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cpu_per_mb_two_trees(tmp_path: Path) -> None:
    src = str(REPO / "src")
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "cpu_per_mb.py"),
            f"--src={src},{src}",
            "--tokens=16",
            "--hidden=64",
            "--layers=2",
            "--requests=6",
            "--rounds=1",
            f"--work-root={tmp_path}",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "chunk sha256 identical in every run and tree" in out
    assert "checks+copy ms/MB:" in out.splitlines()[-1]
    for step in ("assemble", "pread", "finite", "stats", "write", "sha256", "alone: read"):
        assert f"  {step} " in out
    assert list(tmp_path.iterdir()) == []  # the bench removes what it made
