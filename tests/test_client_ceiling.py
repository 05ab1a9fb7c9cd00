"""The client-ceiling bench (issue 40) runs: the real chunk jobs against its stub server
take every request's pieces out of the dump dir and into chunk files.  Nothing is timed
here; the figures are the bench's (bench/README.md, "Client ceiling")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ours_alive(pid: int) -> bool:
    try:
        return "client_ceiling.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


def test_quick_run_serves_requests_and_consumes_every_piece(tmp_path):
    out, root = tmp_path / "report", tmp_path / "work"
    root.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "client_ceiling.py"), "--quick",
         "--out", str(out), "--work-root", str(root)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "client_ceiling.json").read_text())
    rows = report["rows"]
    client = [r for r in rows if r["mode"] == "client"]
    bare = [r for r in rows if r["mode"] == "bare"]
    assert [(r["length"], r["dp"]) for r in client] == [(128, 1), (128, 2)]
    assert len(bare) == len(client)  # the baseline of the same run, beside each cell
    for r in rows:
        assert r["records"] > 0 and r["requests_per_s"] > 0, r
        assert r["tokens"] == 128 * r["records"], r
        # Every request's pieces were taken out of the dump dir, none abandoned.
        assert r["leftover_request_dirs"] == 0, r
    for r in client:
        assert r.get("abandoned") == 0, r
        # The chunk files held the states the stub wrote (codec none: raw size + header).
        assert 1.0 <= r["stored_bytes_ratio"] < 1.1, r
        assert r["phase_ms_per_request"]["http: POST /generate to its answer"] > 0, r
        assert r["dp_workers_seen"] == [r["dp"], r["dp"]], r  # as hsextract.dp counts them
    text = (out / "client_ceiling.txt").read_text()
    assert "client/bare" in text and "hsextract/client.py" in text  # table and profile
    # Its work dir (records, chunk files, dump dir) is gone, and so is its stub.
    assert not Path(report["work_dir"]).exists() and list(root.iterdir()) == []
    assert not [p for r in rows for p in r["stub_pids"] if _ours_alive(p)]


def test_the_gil_estimate_is_withheld_where_the_profile_has_negative_own_times(tmp_path):
    """On the 16-core device the estimate came out negative (cProfile's per-thread times
    across a job's ~100 threads): such a profile gives no figure, a sound one gives the
    own time outside the calls that release the GIL."""
    import importlib.util
    import marshal

    spec = importlib.util.spec_from_file_location("ceiling", REPO / "bench" / "client_ceiling.py")
    ceiling = importlib.util.module_from_spec(spec)
    sys.modules["ceiling"] = ceiling
    try:
        spec.loader.exec_module(ceiling)
    finally:
        del sys.modules["ceiling"]

    def pstats_file(name: str, entries: dict) -> Path:
        path = tmp_path / name
        path.write_bytes(marshal.dumps(entries))
        return path

    py = ("client.py", 10, "one")
    sha = ("~", 0, "<method 'update' of '_hashlib.HASH' objects>")
    start = ("threading.py", 973, "start")
    zstd = ("~", 0, "<method 'compress' of 'zstandard.backend_c.ZstdCompressor' objects>")
    sound = pstats_file(
        "a.pstats",
        {py: (5, 5, 0.25, 1.0, {}), sha: (5, 5, 0.75, 0.75, {}), zstd: (3, 3, 0.5, 0.5, {})},
    )
    broken = pstats_file("b.pstats", {py: (5, 5, 0.25, 1.0, {}), start: (1, 1, -3.0, 9.0, {})})
    assert ceiling.gil_held_s([sound]) == 0.25
    assert ceiling.gil_held_s([broken]) is None
