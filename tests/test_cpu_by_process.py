"""bench/cpu_by_process.py: a busy process is counted in its group, in cores, over the
phase the summary picks (the samples where that group worked)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "cpu_by_process.py"
#: Spins until its stdin closes; "extract_chunk" in its argv makes it a chunk job's group.
BUSY = "import select, sys\nwhile not select.select([sys.stdin], [], [], 0)[0]: pass\n"


def _samples(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def test_a_spinning_chunk_job_is_counted_near_one_core(tmp_path: Path) -> None:
    out = tmp_path / "cpu.jsonl"
    rec = busy = None
    try:
        rec = subprocess.Popen(
            [sys.executable, str(SCRIPT), "record", "--out", str(out), "--interval", "0.2"]
        )
        busy = subprocess.Popen(
            [sys.executable, "-c", BUSY, "extract_chunk"], stdin=subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        # The event: three samples that saw the spinning job.
        while sum("chunk job" in s["cpu_s"] for s in _samples(out)) < 3:
            assert time.monotonic() < deadline, f"no chunk job sampled: {_samples(out)[-3:]}"
            assert rec.poll() is None, "the recorder ended"
            time.sleep(0.05)
    finally:
        for p in (busy, rec):
            if p is not None and p.poll() is None:
                p.terminate() if p is rec else p.stdin.close()
        for p in (busy, rec):
            if p is not None:
                p.wait(timeout=30)
    assert rec.returncode == 0  # SIGTERM ends it cleanly
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "summary", str(out), "--min-cores", "0.3"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    mod_lines = _samples(out)
    during = [s for s in mod_lines if s["cpu_s"].get("chunk job", 0) / s["dt"] >= 0.3]
    assert during, mod_lines
    cores = sum(s["cpu_s"]["chunk job"] for s in during) / sum(s["dt"] for s in during)
    # One spinning thread: about one core (the machine's other load may take some of it).
    assert 0.3 <= cores <= 1.2, cores
    assert "chunk job" in done.stdout.split("server only")[0], done.stdout
    assert all(0.0 <= s["host_busy"] <= 1.0 for s in mod_lines)
