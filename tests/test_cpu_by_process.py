"""bench/cpu_by_process.py: a busy process is counted in its group, in cores, over the
phase the summary picks (the samples where that group worked).  Only this test's own
processes are asserted on: other tests may run chunk jobs beside it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "cpu_by_process.py"
#: Names itself (its comm, its group) after argv[1], then spins until its stdin closes.
BUSY = (
    "import select, sys\n"
    "open('/proc/self/comm', 'w').write(sys.argv[1])\n"
    "print('named', flush=True)\n"
    "while not select.select([sys.stdin], [], [], 0)[0]: pass\n"
)


def _module():
    spec = importlib.util.spec_from_file_location("cpu_by_process", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _samples(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def test_a_process_running_extract_chunk_is_a_chunk_job() -> None:
    # Popen returns while the kernel may still be setting up the new image (its cmdline
    # empty): each child's first line says it runs, and only then is it read.  Two
    # children, not this process, because pytest's own cmdline may name this test.
    up = "import sys; print('up', flush=True); sys.stdin.read()"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", up, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        for arg in ("extract_chunk", "other_work")
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == b"up"
        assert _module().group_of(children[0].pid) == "chunk job"
        assert _module().group_of(children[1].pid) != "chunk job"
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=30)


def test_a_spinning_process_is_counted_near_one_core(tmp_path: Path) -> None:
    out = tmp_path / "cpu.jsonl"
    group = f"cpuprobe{os.getpid() % 10**6}"  # this test's own: no other process has it
    rec = busy = None
    try:
        rec = subprocess.Popen(
            [sys.executable, str(SCRIPT), "record", "--out", str(out), "--interval", "0.2"]
        )
        busy = subprocess.Popen(
            [sys.executable, "-c", BUSY, group], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert busy.stdout.readline().strip() == b"named"
        deadline = time.monotonic() + 60
        # The event: three samples that saw the spinning process under its name.
        while sum(group in s["cpu_s"] for s in _samples(out)) < 3:
            assert time.monotonic() < deadline, f"{group} not sampled: {_samples(out)[-3:]}"
            assert rec.poll() is None, "the recorder ended"
            time.sleep(0.05)
    finally:
        if busy is not None:
            busy.stdin.close()
            busy.wait(timeout=30)
        if rec is not None:
            rec.terminate()
            rec.wait(timeout=30)
    assert rec.returncode == 0  # SIGTERM ends it cleanly
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "summary", str(out), "--during", group,
         "--min-cores", "0.3"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = _samples(out)
    during = [s for s in lines if s["cpu_s"].get(group, 0) / s["dt"] >= 0.3]
    assert during, lines
    cores = sum(s["cpu_s"][group] for s in during) / sum(s["dt"] for s in during)
    # One spinning thread: about one core (the machine's other load may take some of it).
    assert 0.3 <= cores <= 1.2, cores
    assert group in done.stdout.split("server only")[0], done.stdout
    assert all(0.0 <= s["host_busy"] <= 1.0 for s in lines)
