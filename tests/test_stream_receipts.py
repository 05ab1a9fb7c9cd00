"""Snakemake stays the engine under a disk budget (issue 39): a chunk the stream deleted
after the trainer's ack is done, not missing (its sidecar is the receipt); a payload lost
before its ack, or nacked by the trainer, is redone -- announced once, or as a new
revision the reader opens.  The real workflow (reference engine, 4 chunks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from fixtures_demo import (
    kill_processes_under,
    make_workdir,
    planned_jobs,
    run_dir_of,
    run_snakemake,
    start_snakemake,
)

from hsextract.chunkfile import sha256_file
from hsextract.stream import gate, journal
from hsextract.stream.reader import StreamDataset

CONFIG = {
    "n_chunks": 4,
    "demo.n_records": 16,
    "max_seq_len": 128,
    "dump.dir": "shm/dump",
    "server.health_timeout_s": 120,
    # A budget the tiny run never fills: these tests are about deletion and redo, not waiting.
    "stream.budget_gb": 1.0,
    "stream.prefetch_chunks": 1,
    "stream.checkpoint_chunks": 1,
    "stream.poll_s": 0.2,
}


def workdir(tmp_path: Path) -> tuple[Path, Path]:
    wd = make_workdir(tmp_path / "w", **CONFIG)
    (wd / "shm").mkdir()
    return wd, run_dir_of(wd)


def rel(rd: Path, wd: Path, name: str) -> str:
    return str((rd / "hidden" / name).relative_to(wd))


def chunk_lines(rd: Path) -> list[dict]:
    return [
        ln for ln in journal.read_lines(rd / "stream" / "journal.jsonl") if ln["type"] == "chunk"
    ]


def hsextract(wd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args], cwd=wd, capture_output=True, text=True
    )


def all_ids(rd: Path) -> Counter:
    return Counter(
        json.loads(line)["id"]
        for p in sorted((rd / "chunks").glob("chunk_*.jsonl"))
        for line in p.read_text().splitlines()
    )


# -- fast: the journal and the gate, no workflow -----------------------------------------


def one_chunk(run_dir: Path, i: int = 0) -> dict:
    """A chunk file (any bytes: the journal and gate only stat and hash it) and its line."""
    p = run_dir / "hidden" / f"chunk_{i:05d}.safetensors"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(bytes(range(256)) * 4)
    return {"chunk": p.stem, "path": f"hidden/{p.name}", "sha256": sha256_file(p),
            "records": 2, "tokens": 6, "content_digest": f"d{i}"}  # fmt: skip


def test_a_redo_after_a_nack_is_a_new_revision_even_with_the_same_bytes(tmp_path):
    side = one_chunk(tmp_path)
    assert journal.announce(tmp_path, n_chunks=2, **side) == (0, True)
    assert journal.announce(tmp_path, n_chunks=2, **side) == (0, False)  # a rerun: once
    journal.AckWriter(tmp_path).nack(0, side["sha256"], "f" * 64)  # the reader's, of rev 0
    # The redo (bit-deterministic: the same bytes) answers the nack with revision 1, once.
    assert journal.announce(tmp_path, n_chunks=2, **side) == (0, True)
    assert journal.announce(tmp_path, n_chunks=2, **side) == (0, False)
    assert [ln["rev"] for ln in chunk_lines(tmp_path)] == [0, 1]
    assert journal.read_state(tmp_path / "stream").chunks[0]["rev"] == 1  # what readers open


def test_a_payload_lost_before_its_ack_keeps_its_room_and_its_redo_passes_the_gate(tmp_path):
    sides, ss = two_announced(tmp_path)  # a budget holding exactly them: a third waits
    size = (tmp_path / sides[0]["path"]).stat().st_size
    (tmp_path / sides[0]["path"]).unlink()  # lost before its ack
    st = journal.read_state(tmp_path / "stream")
    assert gate.unacked_bytes(tmp_path, st, 1) == 2 * size  # its room stays held
    kw = {"tokens": 1, "raw_bytes_per_token": 1, "largest_tokens": 1, "run_tokens": 3}
    # Its redo passes at once, though the budget is full (the trainer waits for it) ...
    got = gate.wait_for_room(tmp_path, ss, chunk="chunk_00000", **kw)
    assert got["redo"] and not gate.reservations(tmp_path / "stream")
    # ... while a new chunk (as big: 6 tokens) would not fit: the gate shuts for it.
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (
            gate.wait_for_room(tmp_path, ss, chunk="chunk_00002", **{**kw, "tokens": 6}),
            done.set(),
        ),  # fmt: skip
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 60
    while not gate.summary(tmp_path)["paused"]:
        assert time.monotonic() < deadline, "the gate never shut for the new chunk"
        time.sleep(0.01)
    assert not done.is_set()
    journal.AckWriter(tmp_path).ack([0, 1])
    assert done.wait(60), "the gate did not open after the acks"
    t.join(60)


def test_stream_gc_frees_what_was_acked_after_the_last_job_and_names_what_it_leaves(
    tmp_path, monkeypatch, capsys
):
    """Acks that land after the last chunk job ran: no gate looks again, so on e4eb6ed the
    payloads stayed (no command).  `hsextract stream gc` frees them by the producer's
    rules, and leaves a file whose bytes changed (same size: only the sha256 tells) or
    that is not the size announced, naming each; `hsextract status` names the command."""
    from hsextract.cli import main

    wd = make_workdir(tmp_path / "w", **CONFIG)
    monkeypatch.chdir(wd)  # the commands in-process, as a user runs them in the workdir

    def hsx(*args: str) -> tuple[int, str]:
        rc = main([*args, "--configfile", "config.yaml"])
        return rc, capsys.readouterr().out

    rd = wd / hsx("run-dir")[1].strip()
    sides = [one_chunk(rd, i) for i in range(3)]
    for s in sides:
        journal.announce(rd, n_chunks=3, **s)
    journal.AckWriter(rd).ack([0, 1, 2])
    changed = rd / sides[1]["path"]
    data = bytearray(changed.read_bytes())
    data[0] ^= 0xFF
    was = changed.stat()
    changed.write_bytes(bytes(data))
    # Written in place; a later mtime even if the clock's tick has not moved since its
    # announcement (the gate's stat tells a file written to since by inode and mtime).
    os.utime(changed, ns=(was.st_atime_ns, was.st_mtime_ns + 10**9))
    users = rd / sides[2]["path"]
    users.write_bytes(b"a user's file")

    status = hsx("status")[1]
    assert "2 payload(s) acknowledged by the trainer" in status, status
    assert "`hsextract stream gc --configfile " in status

    rc, out = hsx("stream", "gc")
    assert rc == 0, out
    assert not (rd / sides[0]["path"]).exists()
    assert changed.read_bytes() == bytes(data) and users.read_bytes() == b"a user's file"
    assert f"left {sides[1]['path']}: its bytes are not the announced sha256" in out
    assert f"left {sides[2]['path']}: 13 bytes, announced 1024" in out
    assert "freed 1 payload(s) acknowledged by the trainer, 1.02e-06 GB" in out
    deleted = journal.read_lines(rd / "stream" / "deleted.jsonl")
    assert [(d["chunk"], d["why"], d["sha256"]) for d in deleted] == [
        ("chunk_00000", "ack", sides[0]["sha256"])
    ]
    sample = journal.read_lines(rd / "stream" / "usage.jsonl")[-1]
    assert sample["event"] == "gc" and sample["payload_bytes"] == 1024 + 13


def two_announced(run_dir: Path) -> tuple[list[dict], gate.StreamSettings]:
    """Chunks 0 and 1 of 3 announced (the pass goes on), and a budget holding exactly
    them: a third chunk's gate shuts until acks come."""
    sides = [one_chunk(run_dir, i) for i in range(2)]
    for s in sides:
        journal.announce(run_dir, n_chunks=3, **s)
    size = (run_dir / sides[0]["path"]).stat().st_size
    ss = gate.StreamSettings(budget_gb=(2 * size + 10) / 1e9, prefetch_chunks=1,
                             checkpoint_chunks=1, low_mark=0.9, poll_s=0.05)  # fmt: skip
    return sides, ss


GATE_KW = {"tokens": 1, "raw_bytes_per_token": 1, "largest_tokens": 1, "run_tokens": 3}


def gate_in_thread(run_dir: Path, ss: gate.StreamSettings, chunk: str, out: dict):
    """``chunk``'s gate on a thread: ``out["done"]`` is set once it passed or raised."""
    out["done"] = threading.Event()

    def job():
        try:
            out["got"] = gate.wait_for_room(run_dir, ss, chunk=chunk, **{**GATE_KW, "tokens": 6})
        except Exception as exc:  # noqa: BLE001 -- the test asserts on it
            out["error"] = exc
        finally:
            out["done"].set()

    t = threading.Thread(target=job, daemon=True)
    t.start()
    return t


#: A chunk job past its gate, writing: its partial file and spill, then it waits to be killed.
JOB = """
import os, sys
from pathlib import Path
from hsextract.stream import gate
rd, chunk = Path(sys.argv[1]), sys.argv[2]
ss = gate.StreamSettings(budget_gb=float(sys.argv[3]), prefetch_chunks=1, checkpoint_chunks=1,
                         low_mark=0.9, poll_s=0.05)
gate.wait_for_room(rd, ss, chunk=chunk, tokens=100, raw_bytes_per_token=1, largest_tokens=100,
                   run_tokens=300)
h = rd / "hidden"
h.mkdir(exist_ok=True)
(h / f".{chunk}.safetensors.{os.getpid()}.tmp").write_bytes(b"x" * 100_000)
(h / f".{chunk}.safetensors.{os.getpid()}.spill.tmp").write_bytes(b"x" * 20_000)
print("writing", flush=True)
sys.stdin.read()
"""


def writing_job(run_dir: Path, chunk: str, budget_gb: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", JOB, str(run_dir), chunk, str(budget_gb)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "writing\n"  # the event: past its gate, files written
    return proc


def test_a_chunk_jobs_files_count_until_removed_and_a_dead_ones_go_at_the_next_look(tmp_path):
    """A live chunk job's partial file and spill count as max(its reservation, their
    size): a gate that fits the reservation but not the files waits.  A job SIGKILLed
    leaves them: they count in full (status names them) until the next gate or
    ``hsextract stream gc`` removes them -- only names of ours, never a link.  On 51ddea2
    they counted nothing, and stayed until that chunk's own redo."""
    budget = 150_000 / 1e9  # the job reserves ~65.6 kB (an estimate: 100 tokens + 64 KiB)
    ss = gate.StreamSettings(budget_gb=budget, prefetch_chunks=1, checkpoint_chunks=1,
                             low_mark=0.9, poll_s=0.05)  # fmt: skip
    hidden = tmp_path / "hidden"
    jobs = []
    try:
        jobs.append(writing_job(tmp_path, "chunk_00002", budget))
        hidden.joinpath(".chunk_00002.safetensors.mine.tmp").write_text("a user's")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(b"y" * 50_000)
        hidden.joinpath(".chunk_00002.safetensors.999.tmp").symlink_to(elsewhere)
        st = journal.read_state(tmp_path / "stream")
        reserved = gate.reservations(tmp_path / "stream")["chunk_00002"]
        assert reserved < 120_000
        assert gate.jobs_bytes(tmp_path, st) == {"chunk_00002": 120_000}
        # Another chunk's gate: the reservation + its estimate fit, the files do not.
        out: dict = {}
        gate_in_thread(tmp_path, ss, "chunk_00003", out)
        poll_until(lambda: gate.summary(tmp_path)["paused"], "the gate shut")
        assert not out["done"].is_set()
        jobs[0].kill()  # SIGKILL: its reservation goes, its files stay ...
        jobs[0].wait()
        assert out["done"].wait(30) and "got" in out, out  # ... until the gate's next look
        left = sorted(p.name for p in hidden.iterdir())
        assert left == [".chunk_00002.safetensors.999.tmp", ".chunk_00002.safetensors.mine.tmp"]
        assert elsewhere.stat().st_size == 50_000

        # Killed with no gate looking: counted in full, named by status, removed by gc.
        jobs.append(writing_job(tmp_path, "chunk_00004", budget))
        jobs[1].kill()
        jobs[1].wait()
        info = gate.summary(tmp_path)
        assert [Path(p).name.split(".")[1] for p in info["dead_temp_files"]] == ["chunk_00004"] * 2
        assert "temporary file(s) of chunk jobs that died" in gate.waiting_text(info)
        st = journal.read_state(tmp_path / "stream")
        assert gate.jobs_bytes(tmp_path, st)["chunk_00004"] == 120_000
        assert gate.usage_figures(tmp_path, st, ss)["jobs_bytes"] >= 120_000
        gate.gc(tmp_path, ss)
        assert not gate.summary(tmp_path)["dead_temp_files"]
        assert sorted(p.name for p in hidden.iterdir()) == left
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()
                j.wait()
        gate.release(tmp_path, "chunk_00003")


def poll_until(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_shut_gate_fails_at_once_while_the_trainer_waits_for_a_redo_nothing_runs(tmp_path):
    """Mid-pass, the trainer nacked chunk 0 and waits for its redo (acking nothing), the
    budget is full: on ae15b2b the next chunk job waited for acks forever (and the
    waiting text and status said nothing of the nack).  It fails at once in one sentence
    naming the chunk and the command that redoes it; the summary names the nack."""
    sides, ss = two_announced(tmp_path)
    journal.AckWriter(tmp_path).nack(0, sides[0]["sha256"], "f" * 64)
    out: dict = {}
    t = gate_in_thread(tmp_path, ss, "chunk_00002", out)
    try:
        assert out["done"].wait(60), "the job waited for acks that cannot come"
        info = gate.summary(tmp_path)  # what status and the waiting text say
        assert [(n["chunk"], n["seq"], n["taken_up"]) for n in info["nacked"]] == [
            ("chunk_00000", 0, False)
        ]
        said = gate.waiting_text(info)
        assert "the trainer nacked chunk_00000 (seq 0, pass 1) and waits" in said, said
    finally:
        journal.AckWriter(tmp_path).ack([0, 1])  # on ae15b2b: lets the waiting gate go
        t.join(60)
    err = out.get("error")
    assert isinstance(err, journal.StreamError), out
    msg = str(err)
    assert "\n" not in msg and "the trainer nacked chunk_00000 (seq 0, pass 1" in msg, msg
    assert f"snakemake -j1 -f {tmp_path / 'hidden' / 'chunk_00000.json'}" in msg, msg
    assert "snakemake -j1 extract_all" in msg, msg


def test_while_a_nacked_chunks_redo_runs_a_shut_gate_waits_for_it(tmp_path):
    """The rerun: the nacked chunk's redo passes the gate at once and is seen running, so
    the other jobs wait at the shut gate (no failure) and pass once the trainer, having
    read the redo, acks."""
    sides, ss = two_announced(tmp_path)
    journal.AckWriter(tmp_path).nack(0, sides[0]["sha256"], "f" * 64)
    assert gate.wait_for_room(tmp_path, ss, chunk="chunk_00000", **GATE_KW)["redo"]
    info = gate.summary(tmp_path)
    assert [n["redo_running"] for n in info["nacked"]] == [True]
    assert "chunk_00000 (seq 0, pass 1) and waits for its redo" in gate.waiting_text(info)
    usage = tmp_path / "stream" / "usage.jsonl"

    def waits():  # a look past the nack check: the job waits for acks
        return any(u["event"] == "wait" and u["chunk"] == "chunk_00002"
                   for u in journal.read_lines(usage)) or out["done"].is_set()  # fmt: skip

    out: dict = {}
    t = gate_in_thread(tmp_path, ss, "chunk_00002", out)
    try:
        deadline = time.monotonic() + 60
        while not waits():
            assert time.monotonic() < deadline, "the gate never looked"
            time.sleep(0.01)
        assert not out["done"].is_set(), out
        journal.announce(tmp_path, n_chunks=3, **sides[0])  # the redo: revision 1
        gate.release(tmp_path, "chunk_00000")
        assert gate.summary(tmp_path)["nacked"] == []
        journal.AckWriter(tmp_path).ack([0, 1])
        assert out["done"].wait(60)
    finally:
        journal.AckWriter(tmp_path).ack([0, 1])
        t.join(60)
    assert "error" not in out and out["got"]["estimate_bytes"] > 0, out


def stream_lock_free(run_dir: Path) -> bool:
    """Whether the stream's lock is free now (another open of its file: flock's own)."""
    import fcntl

    with open(run_dir / "stream" / journal.LOCK, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def acked_chunks(run_dir: Path, n: int) -> list[dict]:
    sides = [one_chunk(run_dir, i) for i in range(n)]
    for s in sides:
        journal.announce(run_dir, n_chunks=n, **s)
    journal.AckWriter(run_dir).ack(list(range(n)))
    return sides


def test_stream_gc_hashes_outside_the_lock_and_frees_only_what_is_unchanged_since(
    tmp_path, monkeypatch
):
    """A gc hashes (a payload written to since announced: here touched, same bytes) with
    the stream's lock free -- acks and every gate take it; on ae15b2b gc held it through
    every hash -- and deletes only a file whose identity did not change while hashed."""

    from hsextract import chunkfile

    sides = acked_chunks(tmp_path, 2)
    paths = [tmp_path / s["path"] for s in sides]
    for p in paths:
        os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))  # touched
    real = chunkfile.sha256_file
    lock_free: list[bool] = []

    def hash_and_probe(path):
        lock_free.append(stream_lock_free(tmp_path))
        digest = real(path)
        if Path(path) == paths[1]:  # written to while hashed: same bytes, a new mtime
            st = paths[1].stat()
            os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return digest

    monkeypatch.setattr(chunkfile, "sha256_file", hash_and_probe)
    got = gate.gc(tmp_path, gate.StreamSettings(budget_gb=1.0))
    assert lock_free == [True, True]
    assert got["deleted"] == [sides[0]["path"]] and not paths[0].exists()
    assert paths[1].exists() and got["left"] == []  # the next gc looks again
    monkeypatch.setattr(chunkfile, "sha256_file", real)
    assert gate.gc(tmp_path, gate.StreamSettings(budget_gb=1.0))["deleted"] == [sides[1]["path"]]


def test_the_gate_gc_and_status_keep_one_deletion_rule(tmp_path):
    """On ae15b2b a gate deleted a same-size payload whose bytes changed (size only), gc
    left it (its sha256) and status kept counting it as waiting for gc.  Now: a gate
    frees a payload unwritten since announced (its inode and mtime), leaves one written
    to since to gc, which frees it if its bytes are the announced ones and leaves it
    otherwise; status counts what gc would free, never what it left."""
    sides = acked_chunks(tmp_path, 3)
    unchanged, touched, changed = (tmp_path / s["path"] for s in sides)
    st0 = touched.stat()
    os.utime(touched, ns=(st0.st_atime_ns, st0.st_mtime_ns + 10**9))  # same bytes
    data = bytearray(changed.read_bytes())
    data[0] ^= 0xFF
    changed.write_bytes(bytes(data))  # same size, in place: other bytes
    os.utime(changed, ns=(st0.st_atime_ns, st0.st_mtime_ns + 10**9))
    sdir = tmp_path / "stream"
    st = journal.read_state(sdir)
    assert gate.summary(tmp_path)["acked_on_disk"] == 3  # one for the gate, two for gc
    with journal.locked(sdir):
        assert gate.delete_acked(tmp_path, st, 1) == [sides[0]["path"]]  # a gate's look
    assert touched.exists() and changed.read_bytes() == bytes(data)
    assert gate.summary(tmp_path)["acked_on_disk"] == 2
    got = gate.gc(tmp_path, gate.StreamSettings(budget_gb=1.0))
    assert got["deleted"] == [sides[1]["path"]] and not touched.exists()
    assert [p for p, _ in got["left"]] == [sides[2]["path"]]
    assert "its bytes are not the announced sha256" in got["left"][0][1]
    assert changed.read_bytes() == bytes(data)
    info = gate.summary(tmp_path)
    assert info["acked_on_disk"] == 0, info  # gc left it: nothing waits for gc
    with journal.locked(sdir):
        assert gate.delete_acked(tmp_path, journal.read_state(sdir), 1) == []
    assert gate.gc(tmp_path, gate.StreamSettings(budget_gb=1.0))["deleted"] == []
    changed.write_bytes(bytes(range(256)) * 4)  # restored: gc hashes it again, frees it
    assert gate.summary(tmp_path)["acked_on_disk"] == 1
    assert gate.gc(tmp_path, gate.StreamSettings(budget_gb=1.0))["deleted"] == [sides[2]["path"]]


def test_regenerated_counts_the_later_passes_matching_pass_1(tmp_path):
    from hsextract.stream.receipts import regenerated

    sides = [one_chunk(tmp_path, i) for i in range(2)]
    for s in sides:
        journal.announce(tmp_path, n_chunks=2, **s)
    for i, s in enumerate(sides):  # pass 2: chunk 0 the same bytes, chunk 1 others
        journal.announce(tmp_path, n_chunks=2, pass_=2, **{**s, "sha256": s["sha256"] if i == 0
                         else "e" * 64})  # fmt: skip
    assert regenerated(tmp_path) == {"2": {"chunks": 2, "matched": 1, "differ": ["chunk_00001"]}}


def test_a_later_pass_payload_lost_before_its_ack_is_planned_as_pass_1s_is(tmp_path):
    """epochs_mode regenerate: a pass-2 payload gone before its ack (its receipt there)
    is in the plan's trigger and the plan, named pass2/chunk_X; one the stream freed
    after its ack is done.  On e4eb6ed the plan scanned hidden/ only: nothing to redo."""
    from hsextract.plan import changed_note, make_plan
    from hsextract.records import INDEX_FORMAT

    fp = "f" * 12
    index = tmp_path / "chunks" / "index.json"
    index.parent.mkdir()
    entries = [{"path": f"chunks/chunk_{i:05d}.jsonl", "tokens": 6, "records": 2,
                "content_digest": f"d{i}"} for i in range(2)]  # fmt: skip
    index.write_text(json.dumps({"format": INDEX_FORMAT, "n_chunks": 2, "chunks": entries}))
    for p in (1, 2):
        for i in range(2):
            side = one_chunk(tmp_path, i)
            if p == 2:  # hidden/pass2/chunk_X, as extract_chunk_pass writes it
                src = tmp_path / side["path"]
                dst = tmp_path / "hidden" / "pass2" / src.name
                dst.parent.mkdir(exist_ok=True)
                dst.write_bytes(src.read_bytes())
                side["path"] = f"hidden/pass2/{src.name}"
            out = tmp_path / side["path"]
            meta = {"fingerprint": fp, "content_digest": f"d{i}", "bytes": out.stat().st_size,
                    "sha256": side["sha256"], "records": 2}  # fmt: skip
            out.with_suffix(".json").write_text(json.dumps(meta))
            journal.announce(tmp_path, n_chunks=2, pass_=p, **side)
    plan = tmp_path / "state" / "plan.json"
    plan.parent.mkdir()
    assert make_plan(tmp_path, index, fp, plan)["extract"] == []
    before = changed_note(tmp_path)
    # Pass 2's chunk 0 acked and freed by the stream; its chunk 1 lost before its ack.
    seqs = {(c["chunk"], c["pass"]): c["seq"] for c in chunk_lines(tmp_path)}
    journal.AckWriter(tmp_path).ack([seqs["chunk_00000", 2]], pass_=2)
    st = journal.read_state(tmp_path / "stream")
    assert gate.delete_acked(tmp_path, st, 1) == ["hidden/pass2/chunk_00000.safetensors"]
    (tmp_path / "hidden" / "pass2" / "chunk_00001.safetensors").unlink()
    assert changed_note(tmp_path) != before  # the trigger: the next extract_all plans again
    got = make_plan(tmp_path, index, fp, plan)
    assert got["extract"] == ["pass2/chunk_00001"], got
    assert "lost before the trainer's ack" in got["reasons"]["pass2/chunk_00001"]
    assert got["current"] == 2  # pass 1's chunks, as before


@pytest.mark.workflow
def test_acked_deleted_chunks_are_done_and_a_payload_lost_before_its_ack_is_redone(tmp_path):
    wd, rd = workdir(tmp_path)
    sdir = rd / "stream"
    try:
        # Chunks 0 and 1 extracted and announced; the trainer's checkpoint covers them.
        run_snakemake(wd, "-j1", rel(rd, wd, "chunk_00000.json"), rel(rd, wd, "chunk_00001.json"))
        journal.AckWriter(rd).ack([0, 1])
        # The rest: chunk 2's and 3's jobs free the acked payloads (their gates).
        run_snakemake(wd, "-j1", "extract_all")
        deleted = journal.read_lines(sdir / "deleted.jsonl")
        assert sorted(d["chunk"] for d in deleted) == ["chunk_00000", "chunk_00001"]
        assert not (rd / "hidden" / "chunk_00000.safetensors").exists()
        assert (rd / "hidden" / "chunk_00000.json").exists()  # the receipt stays

        # Done, not missing: nothing to plan, status counts them, verify accepts them.
        dry = run_snakemake(wd, "-n", "extract_all")
        assert "Nothing to be done" in dry.stdout, dry.stdout[-3000:]
        status = hsextract(wd, "status", "--configfile", "config.yaml")
        assert "chunks    4 of 4 done" in status.stdout, status.stdout + status.stderr
        manifest = json.loads((rd / "manifest.json").read_text())
        freed = [c["chunk"] for c in manifest["chunks"] if c.get("deleted_after_ack")]
        assert freed == ["chunk_00000", "chunk_00001"]
        verify = hsextract(wd, "verify", str(rd / "manifest.json"))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "2 chunk(s) deleted after the trainer's ack" in verify.stdout

        # An export would have to re-extract them: refused before anything, in one
        # sentence, by the plan of either export target and by the CLI.
        said = "2 chunk file(s) (chunk_00000, chunk_00001) were deleted after the trainer's ack"
        for target in ("export_specforge", "export_speculators"):
            dry = run_snakemake(wd, "-n", target, check=False)
            assert dry.returncode != 0 and f"hsextract: error: {rd.relative_to(wd)}: {said}" in (
                dry.stderr
            ), dry.stdout[-2000:] + dry.stderr[-3000:]
        cli = hsextract(wd, "export", "specforge", "--manifest", str(rd / "manifest.json"))
        assert cli.returncode != 0 and said in cli.stderr, cli.stderr[-2000:]
        assert not (rd / "export").exists()

        # A payload gone before its ack (seq 2, announced, not acked): planned and redone,
        # announced once.
        (rd / "hidden" / "chunk_00002.safetensors").unlink()
        dry = planned_jobs(run_snakemake(wd, "-n", "extract_all").stdout)
        assert dry.get("plan_chunks") == 1 and dry.get("extract_chunk"), dry  # plan, then redo
        stamps = {p.name: p.stat().st_mtime_ns for p in (rd / "hidden").glob("*.json")}
        res = run_snakemake(wd, "-j1", "extract_all")
        assert (res.stdout + res.stderr).count("rule extract_chunk:") == 1
        assert (rd / "hidden" / "chunk_00002.safetensors").exists()
        now = {p.name: p.stat().st_mtime_ns for p in (rd / "hidden").glob("*.json")}
        assert [n for n in sorted(now) if now[n] != stamps[n]] == ["chunk_00002.json"]

        # One chunk redone on request under a budget: its receipt named, forced (README).
        # Charged to the budget (its gate reserved it: a "pass" sample) and, acked already,
        # announced as a new revision recording its file: freed like any other (here by
        # gc: its own job leaves it to the next look).  On 51ddea2 it was never freed.
        passes = [u for u in journal.read_lines(sdir / "usage.jsonl") if u["event"] == "pass"]
        res = run_snakemake(wd, "-j1", "-f", rel(rd, wd, "chunk_00000.json"))
        assert "receipt restored" not in res.stdout + res.stderr  # forced: extracted
        usage = journal.read_lines(sdir / "usage.jsonl")
        now = [u for u in usage if u["event"] == "pass"]
        assert [u["chunk"] for u in now[len(passes) :]] == ["chunk_00000"]
        assert (rd / "hidden" / "chunk_00000.safetensors").exists()
        lines = chunk_lines(rd)
        assert Counter(ln["chunk"] for ln in lines) == {
            "chunk_00000": 2,
            **{f"chunk_{i:05d}": 1 for i in range(1, 4)},
        }
        seq = next(ln["seq"] for ln in lines if ln["chunk"] == "chunk_00000")
        assert (lines[-1]["chunk"], lines[-1]["rev"], lines[-1]["seq"]) == ("chunk_00000", 1, seq)
        assert gate.summary(rd)["acked_on_disk"] == 1  # waiting for the next look
        gc = hsextract(wd, "stream", "gc", "--configfile", "config.yaml")
        assert gc.returncode == 0, gc.stderr
        assert not (rd / "hidden" / "chunk_00000.safetensors").exists()
        freed = [d for d in journal.read_lines(sdir / "deleted.jsonl") if d["seq"] == seq]
        assert [d.get("rev", 0) for d in freed] == [0, 1]
        # No chunk to redo (the manifest follows the new sidecar, as offline).
        dry = planned_jobs(run_snakemake(wd, "-n", "extract_all").stdout)
        assert set(dry) <= {"manifest", "audit", "report_figures", "extract_all"}, dry
    finally:
        kill_processes_under(wd)


@pytest.mark.workflow
def test_a_nacked_chunk_is_redone_as_a_new_revision_the_reader_accepts(tmp_path):
    wd, rd = workdir(tmp_path)
    try:
        run_snakemake(wd, "-j1", "extract_all")
        want = all_ids(rd)
        # Under a budget, every chunk file still on disk (nothing acked): exports as always.
        dry = planned_jobs(run_snakemake(wd, "-n", "export_specforge").stdout)
        assert dry.get("export_specforge_chunk") == 4, dry
        cli = hsextract(wd, "export", "specforge", "--manifest", str(rd / "manifest.json"))
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert f"{sum(want.values())} records" in cli.stdout
        # Chunk 1's bytes rot on disk, its mtime unchanged: only the trainer's sha256 check
        # (its nack) can tell.
        p = rd / "hidden" / "chunk_00001.safetensors"
        st = p.stat()
        data = bytearray(p.read_bytes())
        data[-1] ^= 0xFF
        p.write_bytes(bytes(data))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        seq1 = next(ln for ln in chunk_lines(rd) if ln["chunk"] == "chunk_00001")["seq"]

        ds = StreamDataset(rd, world=1, timeout_s=60)
        seen: list[str] = []
        with pytest.raises(journal.StreamError, match="nacked"):
            for s in ds:
                seen.append(s["id"])
        state = ds.state_dict()  # the trainer's checkpoint: what it consumed
        assert list(journal.read_state(rd / "stream").nacked) == [seq1]

        # The next extract_all plans again (dry: the plan), removes the nacked payload and
        # its sidecar, redoes the chunk: a new revision of the same seq.
        dry = run_snakemake(wd, "-n", "extract_all")
        assert "plan_chunks" in planned_jobs(dry.stdout), dry.stdout[-3000:]
        run_snakemake(wd, "-j1", "extract_all")
        deleted = journal.read_lines(rd / "stream" / "deleted.jsonl")
        assert [(d["chunk"], d["why"]) for d in deleted] == [("chunk_00001", "nack")]
        revs = [ln for ln in chunk_lines(rd) if ln["seq"] == seq1]
        assert [ln["rev"] for ln in revs] == [0, 1]
        assert revs[1]["sha256"] == revs[0]["sha256"]  # the reference engine: bit-deterministic
        assert len(chunk_lines(rd)) == 5  # nothing else announced again
        assert "Nothing to be done" in run_snakemake(wd, "-n", "extract_all").stdout

        # The trainer resumed from its checkpoint reads the new revision: every record once.
        resumed = StreamDataset(rd, world=1, timeout_s=60)
        resumed.load_state_dict(state)
        seen += [s["id"] for s in resumed]
        assert Counter(seen) == want
    finally:
        kill_processes_under(wd)


@pytest.mark.workflow
def test_regenerate_pass_2_re_extracts_the_deleted_chunks_and_the_report_counts_matches(tmp_path):
    wd = make_workdir(
        tmp_path / "w", **CONFIG, **{"stream.epochs_mode": "regenerate", "stream.passes": 2}
    )
    (wd / "shm").mkdir()
    rd = run_dir_of(wd)
    sdir = rd / "stream"
    try:
        # Pass 1, read and acked by the trainer; then the rest: pass 2 re-extracts.
        run_snakemake(wd, "-j1", *(rel(rd, wd, f"chunk_{i:05d}.json") for i in range(4)))
        want = all_ids(rd)
        journal.AckWriter(rd).ack([0, 1, 2, 3], pass_=1)
        run_snakemake(wd, "-j1", "extract_all")
        deleted = journal.read_lines(sdir / "deleted.jsonl")
        assert sorted(d["path"] for d in deleted) == [
            f"hidden/chunk_{i:05d}.safetensors" for i in range(4)
        ]
        lines = chunk_lines(rd)
        again = [ln for ln in lines if ln["pass"] == 2]
        assert sorted(ln["chunk"] for ln in again) == [f"chunk_{i:05d}" for i in range(4)]
        assert all((rd / ln["path"]).exists() for ln in again)  # not acked yet: on disk
        first = {ln["chunk"]: ln["sha256"] for ln in lines if ln["pass"] == 1}
        assert all(ln["sha256"] == first[ln["chunk"]] for ln in again)
        ends = [ln for ln in journal.read_lines(sdir / "journal.jsonl") if ln["type"] == "end_pass"]
        assert [e["pass"] for e in ends] == [1, 2]
        page = (rd / "report" / "run.html").read_text()
        assert "pass 2 re-extracted" in page and "4 chunks, 4 with pass 1&#x27;s sha256" in page
        assert "Nothing to be done" in run_snakemake(wd, "-n", "extract_all").stdout

        # A pass-2 payload lost before its ack: planned (dry run), redone past the gate,
        # announced once -- as pass 1's (on e4eb6ed: "Nothing to be done").
        (rd / "hidden" / "pass2" / "chunk_00001.safetensors").unlink()
        dry = planned_jobs(run_snakemake(wd, "-n", "extract_all").stdout)
        assert dry.get("plan_chunks") == 1 and dry.get("extract_chunk_pass"), dry
        res = run_snakemake(wd, "-j1", "extract_all")
        out = res.stdout + res.stderr
        assert out.count("rule extract_chunk_pass:") == 1, out[-3000:]
        assert "rule extract_chunk:" not in out
        assert (rd / "hidden" / "pass2" / "chunk_00001.safetensors").exists()
        assert chunk_lines(rd) == lines  # nothing announced again
        assert "Nothing to be done" in run_snakemake(wd, "-n", "extract_all").stdout

        # The trainer's pass 2 reads the re-extracted chunks: every record once.
        ds = StreamDataset(rd, world=1, timeout_s=60, epochs_mode="regenerate")
        ds.set_pass(2)
        assert Counter(s["id"] for s in ds) == want

        # A pass-2 payload whose bytes changed on disk is planned again, as pass 1's is
        # (changed_chunks scanned hidden/ only: "Nothing to be done").
        with open(rd / "hidden" / "pass2" / "chunk_00001.safetensors", "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        dry = planned_jobs(run_snakemake(wd, "-n", "extract_all").stdout)
        assert dry.get("plan_chunks") == 1 and dry.get("extract_chunk_pass"), dry
        res = run_snakemake(wd, "-j1", "extract_all")
        out = res.stdout + res.stderr
        assert out.count("rule extract_chunk_pass:") == 1, out[-3000:]
        side = json.loads((rd / "hidden" / "pass2" / "chunk_00001.json").read_text())
        assert sha256_file(rd / "hidden" / "pass2" / "chunk_00001.safetensors") == side["sha256"]
    finally:
        kill_processes_under(wd)


def test_the_plan_hashes_nacked_payloads_outside_the_lock_and_deletes_only_unchanged_ones(
    tmp_path, monkeypatch
):
    """``redo_nacked`` (every plan calls it) hashes each nacked payload with the stream's
    lock free -- acks and every gate take it, and a payload is GBs; on 8e234c9 it hashed
    under it -- and deletes one only if it did not change while hashed (the next plan
    looks again at the other)."""

    from hsextract.stream import receipts

    sides = [one_chunk(tmp_path, i) for i in range(2)]
    for s in sides:
        journal.announce(tmp_path, n_chunks=2, **s)
    paths = [tmp_path / s["path"] for s in sides]
    for i, p in enumerate(paths):
        p.write_bytes(b"\xff" * p.stat().st_size)  # the bytes the trainer's check refused
        journal.AckWriter(tmp_path).nack(i, sides[i]["sha256"], sha256_file(p))
    real = receipts.sha256_file
    lock_free: list[bool] = []

    def hash_and_probe(path):
        lock_free.append(stream_lock_free(tmp_path))
        digest = real(path)
        if Path(path) == paths[1]:  # written to while hashed
            st = paths[1].stat()
            os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return digest

    monkeypatch.setattr(receipts, "sha256_file", hash_and_probe)
    assert receipts.redo_nacked(tmp_path) == [sides[0]["path"]]
    assert lock_free == [True, True]
    assert not paths[0].exists() and paths[1].exists()
    monkeypatch.setattr(receipts, "sha256_file", real)
    assert receipts.redo_nacked(tmp_path) == [sides[1]["path"]]  # unchanged this time
    assert receipts.redo_nacked(tmp_path) == []  # each deletion once, logged once
    deleted = journal.read_lines(tmp_path / "stream" / gate.DELETED)
    assert [(d["seq"], d["why"]) for d in deleted] == [(0, "nack"), (1, "nack")]


def killed_after_announcing(wd: Path, rd: Path, chunk: str, flog: Path) -> None:
    """Run ``chunk``'s receipt alone, the workflow SIGKILLed (its whole process group)
    right after the chunk's announcement, before Snakemake saw its job end: a deterministic
    kill (faults ``announce``), not a watcher racing the job."""
    faults = {"log": str(flog), "announce": [{"chunk": chunk, "do": "kill_group"}]}
    proc = start_snakemake(wd, "-j1", rel(rd, wd, f"{chunk}.json"), faults=faults)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == -9, out[-4000:]
    assert [json.loads(x)["chunk"] for x in flog.read_text().splitlines()][-1] == chunk
    run_snakemake(wd, "--unlock")


@pytest.mark.workflow
def test_a_chunk_announced_before_a_kill_is_restored_by_the_rerun_not_extracted_again(
    tmp_path,
):
    """Killed after a chunk's announcement, the workflow's rerun (the profile's
    rerun-incomplete: Snakemake deletes the job's receipt first) restores the receipt of
    the chunk -- acked by then (its payload freed once), or not (its payload stays, the
    very file announced) -- and extracts nothing.  On 51ddea2 the rerun extracted both
    again: the acked one's new payload was counted by nothing and stayed on disk."""
    wd, rd = workdir(tmp_path)
    sdir = rd / "stream"
    try:
        killed_after_announcing(wd, rd, "chunk_00000", tmp_path / "f0.jsonl")
        killed_after_announcing(wd, rd, "chunk_00001", tmp_path / "f1.jsonl")
        lines = {ln["chunk"]: ln for ln in chunk_lines(rd)}
        assert sorted(lines) == ["chunk_00000", "chunk_00001"]
        journal.AckWriter(rd).ack([lines["chunk_00001"]["seq"]])  # chunk 0 not acked
        kept = (rd / "hidden" / "chunk_00000.safetensors").stat()

        res = run_snakemake(wd, "-j1", "extract_all")
        said = res.stdout + res.stderr
        for c in ("chunk_00000", "chunk_00001"):
            assert f"hsextract [{c}]: announced before: receipt restored" in said, said[-4000:]
            log = (rd / "logs" / f"extract_{c}.log").read_text()
            assert "receipt restored, nothing extracted" in log, log[-2000:]
        # Chunk 0: the payload announced, untouched (same inode and mtime).
        now = (rd / "hidden" / "chunk_00000.safetensors").stat()
        assert (now.st_ino, now.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
        # Chunk 1: acked, freed once, not written again.
        assert not (rd / "hidden" / "chunk_00001.safetensors").exists()
        freed = [d["chunk"] for d in journal.read_lines(sdir / "deleted.jsonl")]
        assert freed == ["chunk_00001"], freed
        assert Counter(ln["chunk"] for ln in chunk_lines(rd)) == {
            f"chunk_{i:05d}": 1 for i in range(4)
        }
        # Done: nothing to plan, status counts every payload on disk and nothing else.
        dry = run_snakemake(wd, "-n", "extract_all")
        assert "Nothing to be done" in dry.stdout, dry.stdout[-3000:]
        status = hsextract(wd, "status", "--configfile", "config.yaml", "--json")
        stream = json.loads(status.stdout)["stream"]
        on_disk = sum(p.stat().st_size for p in (rd / "hidden").glob("*.safetensors"))
        assert stream["payload_bytes"] == on_disk and stream["temp_files"] == 0, stream
        assert json.loads(status.stdout)["chunks_done"] == 4
    finally:
        kill_processes_under(wd)
