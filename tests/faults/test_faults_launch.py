"""Early start: ``launch_server`` starts the server and returns; the chunk jobs start while
it loads and wait for it (``ensure()``).  A load that fails is reported by the first chunk
job that sees it, recorded in the live state file, and every other chunk job of the run
fails at once with the same message; the rerun, fault gone, equals an uninterrupted run.

Each scenario redoes both chunks under ``-j2`` with a new launch record (server.json
removed, so ``launch_server`` runs and starts the server itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from faultkit import FaultRun, fault_test
from fixtures_demo import poll

from hsextract.status import progress_path


def fresh_launch(run: FaultRun) -> None:
    """Both chunks to redo, and no launch record: launch_server starts the server."""
    for f in run.hidden.glob("chunk_*"):
        f.unlink()
    (run.run_dir / "state" / "server.json").unlink()


def status(run: FaultRun) -> tuple[dict, str]:
    def hsx(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "status", *args],
            cwd=run.workdir, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    return json.loads(hsx("--json")), hsx()


def phase(run: FaultRun, chunk: str) -> str | None:
    try:
        return json.loads(progress_path(run.hidden / f"{chunk}.safetensors").read_text())["phase"]
    except (OSError, ValueError, KeyError):
        return None


@fault_test
def test_chunk_jobs_start_while_the_server_loads_and_wait_for_it(run: FaultRun):
    fresh_launch(run)
    loaded = run.tmp / "loaded"
    spec = run.spec(load=[{"do": "wait", "gate": str(loaded)}])
    proc = run.popen("-j2", "extract_all", faults=spec)
    try:
        poll(lambda: any(e["fault"] == "load_wait" for e in run.fault_log()), "the load to begin")
        # launch_server has returned without waiting: its record is written, and both
        # chunk jobs run, waiting for the server.
        poll(
            lambda: all(phase(run, c) == "server" for c in ("chunk_00000", "chunk_00001")),
            "both chunk jobs waiting for the server",
        )
        launched = json.loads((run.run_dir / "state" / "server.json").read_text())
        assert "healthy_at" not in launched and launched["pid"] and launched["started_at"]
        st, text = status(run)
        assert st["server"]["starting"] and not st["server"]["healthy"], st["server"]
        assert "server    starting: " in text and "(waiting for the server)" in text, text
    finally:
        load_ends_after = time.time()  # the load waits on this file
        loaded.touch()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]
    assert len(run.assert_chunks_sound()) == 2  # the bytes of an uninterrupted run
    chunks = ("chunk_00000", "chunk_00001")
    sidecars = [json.loads((run.hidden / f"{c}.json").read_text()) for c in chunks]
    healthy_at = {s["server"]["healthy_at"] for s in sidecars}
    assert len(healthy_at) == 1 and None not in healthy_at, healthy_at
    assert {s["server"]["pid"] for s in sidecars} == {launched["pid"]}  # not replaced
    for s in sidecars:
        assert s["waited_for_server_s"] > 0
        # Extraction, not load: after the load was let go.  (Not against healthy_at: that
        # is stamped by whichever process records the server healthy, which under load can
        # be after a chunk job saw it answer: seen under xdist, 0.5 s late.)
        assert s["started_at"] >= load_ends_after, (s["started_at"], load_ends_after)
    assert run.log("server.log").count("start: ") == 1 + 1  # the baseline's and this one
    run.assert_no_processes_left()


@fault_test
def test_a_server_dying_while_it_loads_fails_every_chunk_job_with_its_log(run: FaultRun):
    fresh_launch(run)
    starts = run.log("server.log").count("start: ")
    out = run.snakemake("-j2", "extract_all", faults=run.spec(load=[{"do": "exit", "code": 3}]))
    assert out.returncode != 0, out.output[-4000:]
    words = "injected fault: the engine exits with code 3 while loading"
    run.assert_failed_cleanly(out.output, "server exited", "before becoming healthy", words)
    assert [e["fault"] for e in run.fault_log()] == ["load_exit"]  # one server, one failure
    for chunk in ("chunk_00000", "chunk_00001"):  # each job says it, neither relaunched
        log = run.log(f"extract_{chunk}.log")
        assert "before becoming healthy" in log and words in log, log[-3000:]
    assert run.log("server.log").count("start: ") == starts + 1
    st, text = status(run)
    assert words in st["server"]["failed"] and "server    failed: " in text, text
    run.rerun_matches(first_chunk_kept=False)  # a new workflow run starts afresh
