"""``hsextract status``: a finished run, a run in progress (real Snakemake, a reference
engine held mid-chunk), a failed chunk, and the pieces it is computed from."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures_demo import (
    kill_processes_under,
    make_workdir,
    poll,
    run_dir_of,
    snakemake_cmd,
    start_snakemake,
    stop_snakemake,
)

from hsextract import status
from hsextract.config import read_config
from hsextract.errors import HsextractError
from hsextract.status import ProgressFile, progress_path

pytestmark = pytest.mark.workflow

SMALL = {"demo.n_records": 24, "n_chunks": 4}


def hsx_status(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "status", *args],
        cwd=workdir, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def status_json(workdir: Path) -> dict:
    proc = hsx_status(workdir, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_a_finished_run_is_all_done_with_eta_zero(demo_copy):
    wd = demo_copy["workdir"]
    st = status_json(wd)
    manifest = demo_copy["manifest"]
    n = len(manifest["chunks"])
    tokens = sum(c["tokens"] for c in manifest["chunks"])
    assert st["finished"] and st["manifest"]
    assert (st["chunks_done"], st["chunks_total"]) == (n, n)
    assert st["tokens_done"] == st["tokens_total"] == tokens
    assert st["eta_s"] == 0.0 and st["in_flight"] == []
    assert st["overall_tok_s"] > 0
    assert st["workflow_pids"] == []
    assert not st["server"]["alive"] and st["last_error"] is None
    text = hsx_status(wd).stdout
    assert f"chunks    {n} of {n} done (100%)" in text
    assert "eta       0s: every chunk is extracted (manifest.json written)" in text
    assert "server    not running" in text and "error     none" in text


def test_a_run_in_progress_reports_counts_rate_eta_and_its_server(tmp_path):
    # One request at a time (one sending turn: no vacant turns' share, client._Window),
    # and each chunk's third record held on a gate of its own (its first pass waits): a
    # status then sees that chunk in flight, two records done.
    wd = make_workdir(
        tmp_path / "w", **SMALL, **{"client.requests_in_flight": 1, "client.sending_jobs": 1}
    )
    gates = {f"chunk_{c:05d}": tmp_path / f"go-{c}" for c in range(4)}
    fault_log = tmp_path / "faults.jsonl"
    hold = {
        "log": str(fault_log),
        "extend": [
            {"rid": f"{chunk}-000002-", "nth": [1], "do": "wait", "gate": str(gate)}
            for chunk, gate in gates.items()
        ],
    }
    proc = start_snakemake(wd, "-j1", "extract_all", faults=hold)
    mid = text = None
    try:

        def held() -> str | None:
            assert proc.poll() is None, "the workflow ended before a mid-run status"
            log = fault_log.read_text().splitlines() if fault_log.exists() else []
            chunks = [json.loads(x)["rid"][: len("chunk_00000")] for x in log]
            return next((c for c in chunks if not gates[c].exists()), None)

        while mid is None:
            chunk = poll(held, "a chunk held mid-run", 400)
            if status_json(wd)["chunks_done"] > 0:
                # Records done within the progress file's interval are written when it
                # is up: poll for them (seconds), the chunk stays held meanwhile.
                def progressed() -> dict | None:
                    st = status_json(wd)
                    return st if any(f["tokens_done"] for f in st["in_flight"]) else None

                mid = poll(progressed, f"{chunk}'s records done in the status", 60)
                text = hsx_status(wd).stdout
            gates[chunk].touch()  # the first chunk run has nothing done yet: go on
        for gate in gates.values():
            gate.touch()
        out, _ = proc.communicate(timeout=400)
    finally:
        for gate in gates.values():
            gate.touch()
        stop_snakemake(proc, signal.SIGINT)  # Ctrl-C, as a person would
    assert proc.returncode == 0, out[-4000:]

    assert mid["chunks_total"] == 4 and not mid["finished"]
    assert mid["split_done"] and mid["tokens_total"] > mid["tokens_done"] > 0
    assert mid["recent_tok_s"] > 0 and mid["overall_tok_s"] > 0
    assert mid["eta_s"] is not None and 0 < mid["eta_s"] < math.inf
    assert mid["workflow_pids"] and mid["last_error"] is None
    srv = mid["server"]
    assert srv["recorded"] and srv["alive"] and srv["healthy"], srv
    assert srv["url"].startswith("http://127.0.0.1:")
    (flight,) = mid["in_flight"]
    assert flight["chunk"].startswith("chunk_") and flight["tokens_total"] > 0
    assert "workflow  running" in text and "in flight" in text and "alive and healthy" in text
    assert flight["chunk"] == chunk and flight["phase"] == "sending"
    # The progress file of the chunk in flight moved before the chunk was done.
    assert 0 < flight["tokens_done"] < flight["tokens_total"], flight

    end = status_json(wd)
    assert end["finished"] and end["eta_s"] == 0.0 and end["in_flight"] == []
    assert not end["server"]["alive"] and end["workflow_pids"] == []
    rd = run_dir_of(wd)
    assert not list((rd / "hidden").glob(".*progress*")), "progress files must go"
    for sc in (rd / "hidden").glob("chunk_*.json"):
        meta = json.loads(sc.read_text())
        assert meta["started_at"] < meta["finished_at"] <= time.time()


def test_a_failed_chunk_is_the_last_error_and_leaves_no_progress_file(tmp_path):
    wd = make_workdir(tmp_path / "w", **SMALL)
    flip = {"piece": [{"rid": "chunk_00001", "nth": [1], "do": "flip_id"}]}
    env = {**os.environ, "HSEXTRACT_FAULTS": json.dumps(flip)}
    proc = subprocess.run(
        snakemake_cmd(wd, "-j1", "extract_all"), capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode != 0
    st = status_json(wd)
    err = st["last_error"]
    assert err["chunk"] == "chunk_00001" and err["rule"] == "extract_chunk", err
    assert "token parity broken" in err["message"] and err["log"].endswith(
        "extract_chunk_00001.log"
    )
    assert not st["finished"] and st["chunks_done"] < st["chunks_total"]
    assert st["eta_s"] is None and st["workflow_pids"] == []
    text = hsx_status(wd).stdout
    assert "error     chunk_00001 (" in text and "token parity broken" in text
    assert "no workflow is running" in text
    assert not progress_path(run_dir_of(wd) / "hidden" / "chunk_00001.safetensors").exists()


# --------------------------------------------------------------------------- the pieces


def test_rate_counts_busy_time_once_and_windows_proportionally():
    # Two chunks side by side over [0, 10] (-j 2), 1000 tokens each; then idle; then one
    # chunk over [100, 110].
    spans = [(0.0, 10.0, 1000.0), (0.0, 10.0, 1000.0), (100.0, 110.0, 500.0)]
    assert status._rate(spans, -math.inf, 200.0) == pytest.approx(2500 / 20)
    assert status._rate(spans, 105.0, 200.0) == pytest.approx(250 / 5)
    assert status._rate(spans, 50.0, 90.0) is None  # idle: no rate, not zero


def test_progress_file_is_rate_limited_atomic_and_removed(tmp_path):
    chunk = tmp_path / "hidden" / "chunk_00007.safetensors"
    p = ProgressFile(chunk, interval_s=3600)
    path = progress_path(chunk)
    assert path.name == ".chunk_00007.progress.json"
    p.set_total(100, 4)
    p.add(10)  # within the interval: kept in memory only
    data = json.loads(path.read_text())
    assert (data["tokens_done"], data["tokens_total"], data["pid"]) == (0, 100, os.getpid())
    assert data["phase"] == "sending"
    p.set_phase("waiting")  # a phase change is written at once, interval or not
    assert json.loads(path.read_text())["phase"] == "waiting"
    p.interval_s = 0
    p.add(20)
    assert json.loads(path.read_text())["tokens_done"] == 30
    assert [q.name for q in path.parent.iterdir()] == [path.name]  # no temp file left
    p.remove()
    p.add(5)  # after removal nothing is written again
    assert not path.exists()


def test_progress_file_is_never_more_than_its_interval_behind(tmp_path):
    """A record done within the interval is written once it is up, with no later record
    to carry it (the next one may take minutes)."""
    chunk = tmp_path / "hidden" / "chunk_00003.safetensors"
    p = ProgressFile(chunk, interval_s=0.5)
    path = progress_path(chunk)
    try:
        p.add(10)  # just after the first write: held back
        assert json.loads(path.read_text())["tokens_done"] == 0
        deadline = time.monotonic() + 60
        while json.loads(path.read_text())["tokens_done"] != 10:
            assert time.monotonic() < deadline, "the held-back record was never written"
            time.sleep(0.05)
    finally:
        p.remove()
    assert not path.exists()


def test_progress_file_never_fails_the_chunk(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = ProgressFile(blocker / "hidden" / "chunk_00000.safetensors")  # parent is a file
    p.add(3)
    p.remove()


def test_in_flight_ignores_a_dead_writer(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    now = time.time()
    for name, pid in (("chunk_00000", dead.pid), ("chunk_00001", os.getpid())):
        progress_path(hidden / f"{name}.safetensors").write_text(
            json.dumps(
                {
                    "chunk": name,
                    "pid": pid,
                    "host": socket.gethostname(),
                    "started_at": now - 5,
                    "updated_at": now,
                    "tokens_done": 7,
                    "tokens_total": 9,
                }
            )  # fmt: skip
        )
    got = status._in_flight(hidden, {"chunk_00000", "chunk_00001", "chunk_00002"})
    assert [(f.chunk, f.tokens_done) for f in got] == [("chunk_00001", 7)]
    assert got[0].phase == "sending"  # a file from before phases were written


def test_last_error_reads_hsextract_errors_and_tracebacks(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "extract_chunk_00003.log").write_text(
        "chunk_00003:  10%|#  | 1/10\rchunk_00003:  20%|##  | 2/10\n"
        "2026-01-01 10:00:00,000 WARNING retry 1/3\n"
        "ERROR [extract_chunk]: chunk chunk_00003: gave up after 4 attempts\n"
    )
    (logs / "merge_and_shuffle.log").write_text(
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "    boom()\n"
        "    ^^^^^^\n"
        "ValueError: boom\n"
    )
    (logs / "server.log").write_text("ERROR [x]: the server's own log is not a rule's\n")
    os.utime(logs / "merge_and_shuffle.log", (1, 1))
    os.utime(logs / "server.log", (2**31, 2**31))
    err = status.last_error(logs)
    assert (err.chunk, err.rule) == ("chunk_00003", "extract_chunk")
    assert err.message == "chunk chunk_00003: gave up after 4 attempts"
    # A done chunk's log is history; the older traceback is then the last error.
    err = status.last_error(logs, {"chunk_00003"})
    assert (err.rule, err.chunk, err.message) == ("merge_and_shuffle", None, "ValueError: boom")


def test_status_before_the_data_stage(tmp_path):
    wd = make_workdir(tmp_path / "w")
    st = status_json(wd)
    assert not st["split_done"] and st["chunks_total"] == 4 and st["tokens_total"] is None
    assert st["eta_s"] is None and not st["finished"]
    assert "the data stage has not run yet" in hsx_status(wd).stdout


def test_status_of_a_copied_run_uses_the_sidecars_times(demo_copy, monkeypatch):
    """A copy or restore gives the sidecars new mtimes; their own times still give the rate."""
    rd = demo_copy["run_dir"]
    for sc in (rd / "hidden").glob("chunk_*.json"):
        os.utime(sc, (0, 0))
    monkeypatch.chdir(demo_copy["workdir"])
    st = status.collect(read_config("config.yaml"))
    assert st.chunks_done == st.chunks_total and st.eta_s == 0.0
    metas = [json.loads(sc.read_text()) for sc in (rd / "hidden").glob("*.json")]
    busy = sum(m["finished_at"] - m["started_at"] for m in metas)  # -j1: no overlap
    assert st.overall_tok_s == pytest.approx(st.tokens_done / busy, rel=0.01)


@pytest.mark.parametrize("kind", ["missing", "not-yaml", "a-list", "a-directory"])
def test_status_on_a_missing_or_broken_configfile_is_one_sentence(tmp_path, kind):
    """`hsextract status --configfile F` with F missing, not YAML, not a mapping of
    settings or a directory: non-zero, one sentence on stderr naming F, no traceback."""
    cfg = tmp_path / "my.yaml"
    if kind == "not-yaml":
        cfg.write_text("model: [path,\n")
    elif kind == "a-list":
        cfg.write_text("- model\n- inputs\n")
    elif kind == "a-directory":
        cfg.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "status", "--configfile", str(cfg)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsextract: error: "), proc.stderr
    assert "my.yaml" in lines[0], lines[0]


def test_a_chunk_job_killed_mid_chunk_is_the_error_until_the_chunk_is_redone(tmp_path):
    """Issue 38, item 13: after a chunk job was SIGKILLed (no handler: no error logged,
    its progress file left) status said `error none`.  It names the interrupted chunk
    and its dead job; once a rerun redoes the chunk, the error is gone."""
    wd = make_workdir(tmp_path / "w", **SMALL, **{"client.requests_in_flight": 1})
    gate, log = tmp_path / "gate", tmp_path / "faults.jsonl"
    hold = {
        "log": str(log),
        "extend": [{"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": str(gate)}],
    }
    proc = start_snakemake(wd, "-j1", "extract_all", faults=hold)
    try:
        rd = run_dir_of(wd)
        progress = progress_path(rd / "hidden" / "chunk_00001.safetensors")

        def held() -> bool:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            return log.exists() and '"fault": "wait"' in log.read_text() and progress.exists()

        poll(held, "chunk_00001 held mid-chunk")
        job = json.loads(progress.read_text())["pid"]
        assert b"extract_chunk" in Path(f"/proc/{job}/cmdline").read_bytes()
        os.kill(job, signal.SIGKILL)
        gate.touch()
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode != 0, out[-4000:]

        st = status_json(wd)
        assert [f["chunk"] for f in st["interrupted"]] == ["chunk_00001"], st["interrupted"]
        assert st["interrupted"][0]["pid"] == job and st["in_flight"] == []
        err = st["last_error"]
        assert (err["rule"], err["chunk"]) == ("extract_chunk", "chunk_00001"), err
        assert f"its job (pid {job} on {socket.gethostname()})" in err["message"], err
        assert "interrupted" in err["message"] and "redoes it" in err["message"], err
        text = hsx_status(wd).stdout
        assert "error     none" not in text and "chunk_00001 interrupted" in text, text

        rerun = subprocess.run(snakemake_cmd(wd, "-j1", "extract_all"),
                               capture_output=True, text=True, timeout=600)  # fmt: skip
        assert rerun.returncode == 0, rerun.stderr[-4000:]
        st = status_json(wd)
        assert st["finished"] and st["interrupted"] == [] and st["last_error"] is None, st
        assert "error     none" in hsx_status(wd).stdout
    finally:
        gate.touch()
        stop_snakemake(proc, signal.SIGKILL)
        kill_processes_under(wd)


def test_an_error_a_job_recovered_from_is_not_the_runs_error(tmp_path):
    """Issue 38, item 13: status kept showing errors already fixed.  A job that logged
    an error (or a library's traceback) and then succeeded ends its log with the line
    run_step writes on success: what is above it is history; a failure still shows."""
    from types import SimpleNamespace

    from hsextract.smk import run_step

    logs = tmp_path / "logs"
    logs.mkdir()

    def recovers(_sm) -> None:
        print("Traceback (most recent call last):\n  File 'x'\nValueError: retried, then fine")
        print("ERROR [launch_server]: the first try failed")

    def fails(_sm) -> None:
        raise HsextractError("the merge failed for good")

    stdout, stderr = sys.stdout, sys.stderr
    try:
        run_step(SimpleNamespace(log=[str(logs / "launch_server.log")], rule="launch_server"),
                 recovers)  # fmt: skip
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    assert status.last_error(logs) is None
    try:
        with pytest.raises(SystemExit):
            run_step(SimpleNamespace(log=[str(logs / "merge_and_shuffle.log")],
                                     rule="merge_and_shuffle"), fails)  # fmt: skip
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    err = status.last_error(logs)
    assert (err.rule, err.message) == ("merge_and_shuffle", "the merge failed for good")
