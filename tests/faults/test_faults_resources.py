"""The workflow killed, the /dev/shm budget, a full disk, a chunk input changed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from faultkit import FaultRun, fault_test
from fixtures_demo import kill_processes_under, wait_until_gone

from hsextract.server import read_json


@fault_test
def test_workflow_sigkilled_mid_chunk_watchdog_stops_the_server(run: FaultRun):
    # Hold chunk_00001 open so the kill lands mid-chunk, server alive: the server stops
    # after its first pass over chunk_00001's requests, on a gate never opened.  That pass
    # wrote their first pieces, and no request of it can finish (a request is answered, and
    # its pieces read, after its last pass), so the pieces stay until the kill -- an event,
    # where a hung request plus "some other record's pieces seen in time" was a race that
    # the wider window of a job alone (client._Window: every record in flight) lost in CI.
    held = {"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": str(run.tmp / "never")}
    spec = run.spec(extend=[held])
    proc = run.popen("-j1", "extract_all", faults=spec)
    dump = run.workdir / "shm" / "dump"
    try:
        # Kill once the server is held with pieces in the dump dir, so the rerun has both a
        # temp file and stale pieces to clear.
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            waiting = any(e.get("fault") == "wait" for e in run.fault_log())
            if waiting and any(dump.glob("chunk_00001-*")):
                break
            time.sleep(0.01)
        assert proc.poll() is None and run.fault_log(), "the run never reached the fault"
        live = next(run.run_dir.glob("state/server.*.live.json"))
        server = read_json(live)
        assert server and run.processes(), "no server running mid-chunk"
        # What an OOM killer or a scheduler preemption does: no onerror handler runs.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # The server runs in its own session, so the kill did not reach it: the watchdog did.
    run.assert_no_processes_left()
    assert f"owner {server['owner_pid']} gone, stopping server group" in run.log("server.log")
    assert run.assert_chunks_sound(allow_tmp=True) == ["chunk_00000"]
    assert list(run.hidden.glob(".chunk_00001.*.tmp")), "expected the killed writer's temp file"
    assert any(dump.glob("chunk_00001-*")), "expected in-flight pieces of the killed run"
    assert dump.stat().st_mode & 0o777 == 0o700  # the dump dir is private
    # Snakemake's own directory lock outlives a SIGKILL; it says so, and how to clear it.
    locked = run.extract_all()
    assert locked.returncode != 0 and "--unlock" in locked.output, locked.output[-3000:]
    assert run.snakemake("--unlock").returncode == 0
    run.rerun_matches()  # also: no temp chunk file of the killed writer is left behind
    log = run.log("extract_chunk_00001.log")
    assert "removed temporary files of an interrupted attempt" in log, log
    assert "removed dump pieces of an interrupted earlier attempt" in log, log
    leftovers = sorted(p.name for p in dump.iterdir()) if dump.exists() else []
    assert leftovers in ([], [".hsextract-run"]), f"dump pieces remain: {leftovers}"


def _stopped_mid_chunk(run: FaultRun, sig: int) -> tuple[dict, str]:
    """Hold chunk_00001 on the server (its first pass waits for a gate never opened), send
    ``sig`` to the Snakemake process alone, and wait for everything under the workdir to
    end.  Returns the server's live state at the signal and what Snakemake printed."""
    gate = run.tmp / "gate"
    spec = run.spec(extend=[{"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": str(gate)}])
    proc = run.popen("-j1", "extract_all", faults=spec)
    try:
        deadline = time.monotonic() + 300
        while not any(e["fault"] == "wait" for e in run.fault_log()):
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "chunk_00001 never reached the server"
            time.sleep(0.05)
        server = read_json(next(run.run_dir.glob("state/server.*.live.json")))
        assert server and server["owner_pid"] == proc.pid, server
        os.kill(proc.pid, sig)
        out = proc.communicate(timeout=120)[0]
        # The job and the server are not in the signalled process: they end on their own
        # (onerror, or the watchdog and the job's refusal to relaunch), or the test fails.
        left = wait_until_gone(run.workdir, timeout=60)
        assert not left, f"still running after Snakemake got signal {sig}: {left}"
    finally:
        gate.touch()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_processes_under(run.workdir)
    return server, out


@fault_test
def test_snakemake_alone_sigkilled_mid_chunk_no_server_outlives_it(run: FaultRun):
    """Issue 20, item 7: the orphaned chunk job went on, relaunched the server with init
    as its owner, and that server ran forever.  Now the watchdog stops the server and the
    job refuses to start another one, naming why."""
    server, _ = _stopped_mid_chunk(run, signal.SIGKILL)
    log = run.log("server.log")
    assert f"owner {server['owner_pid']} gone, stopping server group" in log, log[-3000:]
    assert log.count(" start: ") == 2, log[-3000:]  # the baseline's and this run's: no relaunch
    chunk_log = run.log("extract_chunk_00001.log")
    assert f"the workflow that owns this run (pid {server['owner_pid']}" in chunk_log, chunk_log
    assert run.assert_chunks_sound(allow_tmp=True) == ["chunk_00000"]
    assert run.snakemake("--unlock").returncode == 0  # Snakemake's lock outlives a SIGKILL
    run.rerun_matches()


@fault_test
def test_snakemake_sigtermed_mid_chunk_leaves_nothing_running(run: FaultRun):
    """SIGTERM to Snakemake alone (a scheduler's or an admin's `kill`): no server, no job."""
    _stopped_mid_chunk(run, signal.SIGTERM)
    assert run.assert_chunks_sound(allow_tmp=True) == ["chunk_00000"]
    run.snakemake("--unlock")  # whether or not Snakemake removed its lock on the way out
    run.rerun_matches()


@fault_test
def test_shm_budget_below_the_largest_request_fails_naming_it(run: FaultRun):
    run.set_config(**{"dump.shm_budget_gb": 0.0001})  # ~105 KB: below every request here
    out = run.fail()
    run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: the longest record (",
        "MiB of dump space, more than dump.shm_budget_gb=0.0001 (0.10 MiB); raise it",
    )
    run.set_config(**{"dump.shm_budget_gb": 2.0})
    run.rerun_matches()


def _mount_tmpfs(path, size: int) -> bool:
    """A tmpfs of ``size`` bytes at ``path``, if this machine lets us mount one."""
    if shutil.which("mount") is None:
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return proc.returncode == 0


def _disk_full(run: FaultRun, try_mount: bool) -> None:
    kept = {f.name: f for f in run.hidden.glob("chunk_00000.*")}
    size0 = sum(f.stat().st_size for f in kept.values())
    size1 = run.baseline["sizes"]["hidden/chunk_00001.safetensors"]
    aside = run.tmp / "aside"
    aside.mkdir()
    for name, f in kept.items():
        shutil.move(f, aside / name)
    # Room for chunk_00000 (already there) and a quarter of chunk_00001.
    mounted = try_mount and _mount_tmpfs(run.hidden, size0 + size1 // 4 + 64 * 1024)
    try:
        for name in kept:
            shutil.copy2(aside / name, run.hidden / name)  # mtimes kept: still up to date
        spec = None
        if not mounted:  # no mount here: the writer raises ENOSPC at its 3rd record
            spec = run.spec(chunk_write=[{"chunk": "chunk_00001", "nth": [3], "do": "enospc"}])
        print(f"disk full by {'a small tmpfs' if mounted else 'injection at the writer'}")
        out = run.fail(spec)
        run.assert_failed_cleanly(
            out,
            "chunk chunk_00001: disk full writing ",
            "hidden/chunk_00001.safetensors (No space left on device;",
            "the partial file was removed; free space there (or move output_root), then rerun",
        )
        if mounted:  # free space, as the message says, and rerun
            subprocess.run(["mount", "-o", "remount,size=64m", str(run.hidden)], check=True)
        else:
            assert [e["fault"] for e in run.fault_log()] == ["enospc"]
        run.rerun_matches()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(run.hidden)], check=False)


@fault_test
def test_disk_full_while_writing_a_chunk(run: FaultRun):
    """A real full disk where the machine allows a tmpfs mount, else ENOSPC at the writer."""
    _disk_full(run, try_mount=True)


@fault_test
def test_disk_full_injected_at_the_writer(run: FaultRun):
    """The fallback for machines without mounts, exercised everywhere."""
    _disk_full(run, try_mount=False)


@fault_test
def test_chunk_input_truncated_or_edited_after_split(run: FaultRun):
    chunk = run.run_dir / "chunks" / "chunk_00001.jsonl"
    original = chunk.read_bytes()
    chunk.write_bytes(original[: len(original) // 2])  # truncated mid-line
    out = run.fail()
    run.assert_failed_cleanly(
        out,
        f"chunk {chunk.relative_to(run.workdir)} changed after split_chunks: sha256",
        f"({len(original) // 2} bytes, index says {len(original)}); delete ",
        "the next run rebuilds it from merged/train.jsonl",
    )
    # Edited, same length: one token id changed.
    i = original.index(b'"input_ids":[') + len(b'"input_ids":[')
    edited = original[:i] + (b"1" if original[i : i + 1] != b"1" else b"2") + original[i + 1 :]
    chunk.write_bytes(edited)
    out = run.fail()
    run.assert_failed_cleanly(
        out, "changed after split_chunks", f"({len(original)} bytes, index says {len(original)})"
    )
    # The advice followed: the edited file deleted, the rerun rebuilds it from train.jsonl
    # and equals an uninterrupted run, with nothing else redone.
    chunk.unlink()
    run.rerun_matches()
    assert chunk.read_bytes() == original
