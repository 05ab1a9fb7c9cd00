"""Train while extracting (issue 39), the fast pieces: journal, acks, gate, reader.

Chunk files are written with the real ChunkWriter and announced through the real journal;
the workflow end to end is tests/test_stream_e2e.py.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from hsextract.chunks import ChunkWriter, sha256_file
from hsextract.stream import gate, journal
from hsextract.stream.loader import StreamLoader
from hsextract.stream.reader import StreamDataset, consumed_seqs, offsets, share

H, K = 4, 3
SHAPES = {"hidden": H, "aux": K * H, "prenorm": False, "dtype": "float32"}


def write_chunk(
    run_dir: Path, i: int, n_records: int, *, tokens: int = 3, prenorm: bool = False
) -> dict:
    """hidden/chunk_{i}.safetensors whose record j has ids [i*1000+j]*tokens and states of
    that value (with ``prenorm``, one more aux block: layer L, the pre-norm final state,
    of value -that); its sidecar."""
    path = run_dir / "hidden" / f"chunk_{i:05d}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [f"r{i}-{j}" for j in range(n_records)]
    k = K + prenorm
    meta = {"record_ids": json.dumps(ids), "aux_layers": json.dumps([1, 2, 3, 4][:k]),
            "hidden_size": str(H), "num_layers": "4"}  # fmt: skip
    w = ChunkWriter(path, [tokens] * n_records, hidden_size=H, n_aux=k, dtype=torch.float32,
                    metadata=meta)  # fmt: skip
    for j in range(n_records):
        v = float(i * 1000 + j)
        aux = torch.full((tokens, k * H), v)
        aux[:, K * H :] = -v
        w.put(j, torch.full((tokens,), i * 1000 + j, dtype=torch.int32),
              torch.ones(tokens, dtype=torch.uint8), torch.full((tokens, H), v), aux)  # fmt: skip
    sha = w.finish()
    return {"chunk": path.stem, "path": f"hidden/{path.name}", "sha256": sha,
            "records": n_records, "tokens": tokens * n_records,
            "content_digest": f"d{i}"}  # fmt: skip


def announce(run_dir: Path, side: dict, n_chunks: int) -> tuple[int, bool]:
    return journal.announce(run_dir, n_chunks=n_chunks, shapes=SHAPES, **side)


def make_run(run_dir: Path, sizes: list[int]) -> list[dict]:
    sides = [write_chunk(run_dir, i, n) for i, n in enumerate(sizes)]
    for s in sides:
        announce(run_dir, s, len(sizes))
    return sides


def wait_for(cond, timeout: float = 60.0) -> None:
    """Until ``cond()`` holds (an event seen through files), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {cond.__name__}"
        time.sleep(0.01)


def journal_lines(run_dir: Path) -> list[dict]:
    return journal.read_lines(run_dir / "stream" / "journal.jsonl")


# -- journal --------------------------------------------------------------------------


def test_a_chunk_is_announced_once_and_the_pass_ends_once(tmp_path):
    sides = [write_chunk(tmp_path, i, 2) for i in range(3)]
    assert announce(tmp_path, sides[0], 3) == (0, True)
    assert announce(tmp_path, sides[1], 3) == (1, True)
    # A job killed after announcing and rerun: the same seq, nothing appended.
    assert announce(tmp_path, sides[0], 3) == (0, False)
    assert announce(tmp_path, sides[2], 3) == (2, True)
    assert announce(tmp_path, sides[2], 3) == (2, False)
    lines = journal_lines(tmp_path)
    assert [ln["type"] for ln in lines] == ["chunk", "chunk", "chunk", "end_pass"]
    assert lines[3]["seqs"] == [0, 1, 2] and lines[3]["records"] == 6
    assert {ln["chunk"]: ln["sha256"] for ln in lines[:3]} == {
        s["chunk"]: sha256_file(tmp_path / s["path"]) for s in sides
    }


def test_a_torn_last_line_is_ignored_then_cut_by_the_next_append(tmp_path):
    sides = [write_chunk(tmp_path, i, 1) for i in range(2)]
    announce(tmp_path, sides[0], 2)
    jpath = tmp_path / "stream" / "journal.jsonl"
    with open(jpath, "ab") as f:
        f.write(b'{"type": "chunk", "seq": 1, "chu')  # a writer killed mid-append
    assert [ln["seq"] for ln in journal_lines(tmp_path)] == [0]
    assert announce(tmp_path, sides[1], 2) == (1, True)
    assert jpath.read_bytes().count(b"\n") == 3  # two chunks and the end of the pass
    assert [ln.get("seq") for ln in journal_lines(tmp_path)] == [0, 1, None]


def test_a_follower_takes_each_appended_line_once_at_the_cost_of_what_was_appended(tmp_path):
    path = tmp_path / "stream" / "journal.jsonl"
    path.parent.mkdir()
    f = journal.LineFollower(path)
    assert f.read_new() == (False, [])  # no file yet
    last = b""
    for i in range(50):
        line = {"type": "chunk", "seq": i, "pad": "x" * (i * 7)}
        journal.append_line(path, line)
        before = f.bytes_read
        assert f.read_new() == (False, [line])
        # What was appended, and the line taken before (to see a rewrite), no more.
        appended = len(json.dumps(line, sort_keys=True)) + 1
        assert f.bytes_read - before <= appended + len(last)
        last = path.read_bytes()[-appended:]
        idle = f.bytes_read
        assert f.read_new() == (False, []) and f.bytes_read == idle  # nothing new: no read
    # A torn line (a writer mid-append) is taken once complete, and only then.
    with open(path, "ab") as fh:
        fh.write(b'{"type": "chunk", "seq": 50')
    assert f.read_new() == (False, [])
    with open(path, "ab") as fh:
        fh.write(b"}\n")
    assert f.read_new() == (False, [{"type": "chunk", "seq": 50}])
    # A torn line cut off by the next writer's repair: never taken, the new line is.
    with open(path, "ab") as fh:
        fh.write(b'{"type": "chunk", "se')
    assert f.read_new() == (False, [])
    journal.append_line(path, {"type": "chunk", "seq": 51})
    assert f.read_new() == (False, [{"type": "chunk", "seq": 51}])
    # A replaced file (another inode) is read again from the top, and says so.
    tmp = path.with_name("new.jsonl")
    tmp.write_bytes(b'{"seq": 0}\n{"seq": 1}\n')
    os.replace(tmp, path)
    assert f.read_new() == (True, [{"seq": 0}, {"seq": 1}])
    # So is one cut below what was taken, or rewritten in place where it was taken.
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.write(b'{"seq": 7}\n')
    assert f.read_new() == (True, [{"seq": 7}])
    with open(path, "r+b") as fh:
        fh.write(b'{"seq": 8}\n{"seq": 9}\n')
    assert f.read_new() == (True, [{"seq": 8}, {"seq": 9}])
    path.unlink()
    assert f.read_new() == (True, [])


def _rchar() -> int:
    """Bytes this process has read through read(2) and friends, all files together."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_readers_look_reads_what_was_appended_not_the_whole_journal(tmp_path):
    """Every reader (the dataset's poll, the samplers, the gate, status) looks through
    read_state: a look after one more announcement reads that line, not the journal."""
    make_run(tmp_path, [1, 1])
    sdir = tmp_path / "stream"
    jpath, apath = sdir / "journal.jsonl", sdir / "acks.jsonl"
    old = journal.read_lines(jpath)[0]
    with open(jpath, "ab") as fh:  # a long run's journal: 3,000 announcements
        for seq in range(3, 3003):
            fh.write((json.dumps({**old, "seq": seq}, sort_keys=True) + "\n").encode())
    journal.AckWriter(tmp_path).ack([0])
    assert len(journal.read_state(sdir).chunks) == 3002
    sizes = jpath.stat().st_size + apath.stat().st_size
    last_lines = sum(len(p.read_bytes().splitlines(keepends=True)[-1]) for p in (jpath, apath))
    journal.append_line(jpath, {**old, "seq": 3003})
    journal.AckWriter(tmp_path).ack([1])
    appended = jpath.stat().st_size + apath.stat().st_size - sizes
    before = _rchar()
    overhead = _rchar() - before  # reading /proc/self/io counts too
    before = _rchar()
    st = journal.read_state(sdir)
    cost = _rchar() - before - overhead
    assert 3003 in st.chunks and st.is_acked(1) and st.is_acked(0)
    # The appended lines, and the line each file's follower took last (a rewrite check).
    assert cost <= appended + last_lines, (cost, appended, last_lines, sizes)


def _announce_all(run_dir: str, sides: list[dict], order: list[int]) -> None:
    for i in order:
        announce(Path(run_dir), sides[i], len(sides))


def test_concurrent_announcers_give_each_chunk_one_seq(tmp_path):
    sides = [write_chunk(tmp_path, i, 1) for i in range(12)]
    ctx = mp.get_context("spawn")
    orders = [
        list(range(12)),
        list(reversed(range(12))),
        list(range(0, 12, 2)) + list(range(1, 12, 2)),
    ]
    procs = [ctx.Process(target=_announce_all, args=(str(tmp_path), sides, o)) for o in orders]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    chunks = [ln for ln in journal_lines(tmp_path) if ln["type"] == "chunk"]
    assert sorted(ln["seq"] for ln in chunks) == list(range(12))
    assert Counter(ln["chunk"] for ln in chunks) == Counter(s["chunk"] for s in sides)
    assert sum(ln["type"] == "end_pass" for ln in journal_lines(tmp_path)) == 1


def test_a_redone_chunk_with_other_bytes_is_a_revision_of_its_seq(tmp_path):
    sides = [write_chunk(tmp_path, i, 2) for i in range(2)]
    announce(tmp_path, sides[0], 2)
    redo = write_chunk(tmp_path, 0, 2, tokens=4)  # same records, other bytes
    assert announce(tmp_path, redo, 2) == (0, True)
    st = journal.read_state(tmp_path / "stream")
    assert st.chunks[0]["rev"] == 1 and st.chunks[0]["sha256"] == redo["sha256"]
    assert announce(tmp_path, sides[1], 2) == (1, True)


# -- gate -----------------------------------------------------------------------------


def settings(budget: int, **kw) -> gate.StreamSettings:
    return gate.StreamSettings(budget_gb=budget / gate.GB, poll_s=0.05, **kw)


def test_the_gates_settings_are_the_declared_stream_keys_with_their_defaults():
    """One truth: every stream.* key as declared in hsextract.settings (its default there),
    nothing else; a config without stream keys gives the gate exactly those defaults."""
    from dataclasses import fields

    from hsextract.config import typed
    from hsextract.settings import SETTINGS

    declared = {
        k.split(".", 1)[1]: s.default for k, s in SETTINGS.items() if k.startswith("stream.")
    }
    got = gate.StreamSettings(budget_gb=None)
    assert {f.name: getattr(got, f.name) for f in fields(gate.StreamSettings)} == declared
    base = {"output_root": "r", "max_seq_len": 64, "seed": 0, "engine": "reference",
            "model": {"path": "m", "dtype": "float32"}}  # fmt: skip
    cfg = typed({**base, "stream": {"budget_gb": 2.5}})
    ss = gate.settings_of(cfg)
    assert ss == gate.StreamSettings(**{**declared, "budget_gb": 2.5})
    assert ss.budget_bytes == 2_500_000_000 and ss.low_mark == SETTINGS["stream.low_mark"].default


def test_a_budget_below_the_trainer_window_is_refused_naming_the_numbers():
    """The window does not grow with the trainer's ranks (all read the same chunks): on
    8e234c9 it was ranks x prefetch + checkpoint + 1 (stream.trainer_ranks)."""
    ss = settings(int(3e9), prefetch_chunks=2, checkpoint_chunks=2)
    with pytest.raises(gate.BudgetRefused) as e:
        gate.check_window(ss, largest_chunk_bytes=int(1e9), run_bytes=int(16e9))
    msg = str(e.value)
    assert msg.startswith("stream.budget_gb 3 (3.0 GB) is smaller than the trainer's window")
    assert "(2 chunks held (all ranks and loader workers share them) + 2 chunks between " in msg
    assert "= 5 chunks, or 4 chunks / stream.low_mark 0.75 = 5.33" in msg
    assert "x 1.0 GB (the largest chunk's estimate) = 5.3 GB" in msg
    assert "\n" not in msg
    ok = settings(int(5.4e9), prefetch_chunks=2, checkpoint_chunks=2)
    gate.check_window(ok, largest_chunk_bytes=int(1e9), run_bytes=int(16e9))
    with pytest.raises(gate.BudgetRefused, match="low_mark 0.5 = 8"):
        gate.check_window(settings(int(5.4e9), prefetch_chunks=2, checkpoint_chunks=2,
                                   low_mark=0.5),
                          largest_chunk_bytes=int(1e9), run_bytes=int(16e9))  # fmt: skip
    assert not hasattr(ss, "trainer_ranks")  # nothing left to size by it


def test_the_window_is_sized_at_the_measured_bytes_per_token_not_the_raw(tmp_path):
    """Announced chunks measure the codec's real ratio (a lossless run's store ~0.65 of
    their raw bytes; here the raw bytes/token the job passes are 3x the stored).  On
    e4eb6ed the window was sized at the raw bytes/token: a budget the stored chunks hold
    was refused.  Too small a budget is still refused, naming the measured figure."""
    import re

    sides = make_run(tmp_path, [4, 4])  # announced: 12 tokens each
    size = (tmp_path / sides[0]["path"]).stat().st_size
    measured = size / sides[0]["tokens"]
    kw = dict(tokens=12, raw_bytes_per_token=int(3 * measured), largest_tokens=12, run_tokens=48)
    # Window: 1 x 1 + 1 + 1 = 3 chunks (2 / 0.75 = 2.67): 3 stored chunks, 9 at raw.
    ss = settings(int(4 * size), prefetch_chunks=1, checkpoint_chunks=1)
    got = gate.wait_for_room(tmp_path, ss, chunk="chunk_00002", **kw)
    assert got["estimate_bytes"] == int(12 * measured) + 1
    gate.release(tmp_path, "chunk_00002")
    small = settings(int(2.5 * size), prefetch_chunks=1, checkpoint_chunks=1)
    said = re.escape(f"at {measured:,.0f} B/token (the largest of the chunks announced)")
    with pytest.raises(gate.BudgetRefused, match=said):
        gate.wait_for_room(tmp_path, small, chunk="chunk_00002", **kw)


def test_before_a_lossless_chunk_is_measured_one_chunk_must_fit(tmp_path):
    """A lossless codec's ratio is unknown until a chunk is written: the first gate asks
    only that one chunk fit uncompressed (the window is checked once one is measured);
    an exact codec's window is checked at once.  On e4eb6ed both refused at raw."""
    kw = dict(tokens=1000, raw_bytes_per_token=1000, largest_tokens=1000, run_tokens=16000)
    ss = settings(2_000_000, prefetch_chunks=1, checkpoint_chunks=1)  # window: 3 MB raw
    got = gate.wait_for_room(tmp_path, ss, chunk="chunk_00000", ratio_known=False, **kw)
    assert got["estimate_bytes"] == 1000 * 1000 + gate.HEADER_SLACK
    gate.release(tmp_path, "chunk_00000")
    with pytest.raises(gate.BudgetRefused, match="smaller than the trainer's window"):
        gate.wait_for_room(tmp_path, ss, chunk="chunk_00000", **kw)  # codec none: exact
    with pytest.raises(gate.BudgetRefused, match="cannot hold the largest chunk before one"):
        gate.wait_for_room(tmp_path, settings(1_000_000), chunk="chunk_00000",
                           ratio_known=False, **kw)  # fmt: skip


def test_fp8s_bytes_per_token_are_its_layouts(tmp_path):
    """The gate's fp8 figure before any chunk is measured is the file's own layout."""
    from hsextract.budget import stored_bytes_per_token
    from hsextract.chunkfile import ChunkLayout

    path = tmp_path / "c.safetensors"
    w = ChunkWriter(path, [5, 7], hidden_size=H, n_aux=K, dtype=torch.float32, codec="fp8",
                    metadata={"record_ids": json.dumps(["a", "b"])})  # fmt: skip
    for j, t in enumerate([5, 7]):
        w.put(j, torch.zeros(t, dtype=torch.int32), torch.ones(t, dtype=torch.uint8),
              torch.randn(t, H), torch.randn(t, K * H))  # fmt: skip
    w.finish()
    bpt, exact = stored_bytes_per_token("fp8", H, K, "float32")
    assert exact and bpt * 12 == ChunkLayout(path).stored_bytes() + 5 * 12  # + ids, mask
    assert stored_bytes_per_token("lossless", H, K, "float32") == (4 * H * (K + 1) + 5, False)


def test_the_gate_waits_for_acks_and_resumes_below_the_low_mark(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    sides = make_run(tmp_path, [4, 4, 4, 4, 4])
    size = (tmp_path / sides[0]["path"]).stat().st_size
    bpt = size // sides[0]["tokens"] + 1  # the estimate of a like chunk: about one chunk
    ss = settings(int(5 * size), low_mark=0.45, prefetch_chunks=1, checkpoint_chunks=1)
    kw = dict(tokens=12, raw_bytes_per_token=bpt, largest_tokens=12, run_tokens=72)
    passed = threading.Event()
    errors: list[BaseException] = []

    def job():
        try:
            gate.wait_for_room(tmp_path, ss, chunk="chunk_00005", **kw)
            passed.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def paused() -> bool:
        try:
            return json.loads((tmp_path / "stream" / "gate.json").read_text())["paused"]
        except FileNotFoundError:
            return False

    def gate_has_looked(path: Path) -> None:
        """The gate deleted ``path`` (acked) and finished that look (it holds the lock)."""
        wait_for(lambda: not path.exists())
        with journal.locked(tmp_path / "stream"):
            pass

    t = threading.Thread(target=job, daemon=True)
    t.start()
    try:
        # 5 chunks unacked + ~1: over 5, the gate shuts.  One ack leaves 4 + 1 <= 5 but
        # above the low mark (2.25 chunks): still shut, by hysteresis.
        wait_for(paused)
        assert not passed.is_set()
        # Its waiting line names the deadlock a trainer checkpointing too rarely makes.
        wait_for(lambda: "waiting for the trainer" in caplog.text)
        assert "less often than stream.checkpoint_chunks" in caplog.text
        assert "prefetch_chunks 1 + checkpoint_chunks 1 + 1" in caplog.text
        journal.AckWriter(tmp_path).ack([0])
        gate_has_looked(tmp_path / sides[0]["path"])
        assert not passed.is_set() and not errors
        assert paused()
        assert gate.reservations(tmp_path / "stream") == {}
        journal.AckWriter(tmp_path).ack([1, 2])  # 2 left: below the low mark
        assert passed.wait(60), errors
    finally:
        journal.AckWriter(tmp_path).ack([0, 1, 2, 3, 4])
        t.join(60)
    assert not errors
    # The acked payloads were deleted (ours: named by the journal, of its size), the
    # reservation is held until the chunk is announced.
    assert not any((tmp_path / sides[i]["path"]).exists() for i in range(3))
    est = gate.estimate_bytes(journal.read_state(tmp_path / "stream"), 12, bpt)
    assert gate.reservations(tmp_path / "stream") == {"chunk_00005": est}
    deleted = journal.read_lines(tmp_path / "stream" / "deleted.jsonl")
    assert sorted(d["seq"] for d in deleted) == [0, 1, 2]


def test_deletion_leaves_a_file_that_is_not_what_we_announced(tmp_path):
    sides = make_run(tmp_path, [2, 2])
    p = tmp_path / sides[0]["path"]
    p.write_bytes(b"a user's file now")  # not the size the journal recorded
    journal.AckWriter(tmp_path).ack([0, 1])
    st = journal.read_state(tmp_path / "stream")
    assert gate.delete_acked(tmp_path, st, 1) == [sides[1]["path"]]
    assert p.read_bytes() == b"a user's file now"


#: A chunk job past its gate (an empty run with room to spare) on another node: its host
#: name is not this machine's.
HOLDER = """
import pathlib, socket, sys
socket.gethostname = lambda: sys.argv[2]
from hsextract.stream import gate
gate.wait_for_room(pathlib.Path(sys.argv[1]), gate.StreamSettings(budget_gb=1000),
                   chunk=sys.argv[3], tokens=1, raw_bytes_per_token=10, largest_tokens=1,
                   run_tokens=1)
print("held", flush=True)
sys.stdin.read()
"""


def hold_reservation(run_dir: Path, host: str, chunk: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), host, chunk],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_dead_jobs_reservation_is_dropped_whichever_node_it_ran_on(tmp_path):
    """A SLURM cancel kills a chunk job between its gate and its announcement, on a node
    the gate's process cannot see: its bytes must come back (a pid means nothing across
    nodes), while a live job's stay reserved."""
    sdir = tmp_path / "stream"
    procs = []
    try:
        procs += [hold_reservation(tmp_path, "node-b", "chunk_00001"),
                  hold_reservation(tmp_path, "node-c", "chunk_00002")]  # fmt: skip
        est = gate.reservations(sdir)["chunk_00001"]
        ss = gate.StreamSettings(budget_gb=1000)
        gate.wait_for_room(tmp_path, ss, chunk="chunk_00003", tokens=1, raw_bytes_per_token=10,
                           largest_tokens=1, run_tokens=1)  # fmt: skip
        assert gate.reservations(sdir) == dict.fromkeys(
            ["chunk_00001", "chunk_00002", "chunk_00003"], est
        )
        procs[0].kill()
        procs[0].wait()
        assert gate.reservations(sdir) == dict.fromkeys(["chunk_00002", "chunk_00003"], est)
        assert not (sdir / gate.INFLIGHT / "chunk_00001.json").exists()
        gate.release(tmp_path, "chunk_00003")
        assert gate.reservations(sdir) == {"chunk_00002": est}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert gate.reservations(sdir) == {}


def test_the_summary_names_what_waits_for_the_trainer(tmp_path):
    sides = make_run(tmp_path, [2, 3])
    journal.AckWriter(tmp_path).ack([0])
    info = gate.summary(tmp_path, budget_bytes=int(1e9))
    assert info["unacked"] == 1 and info["acked"] == 1
    assert info["unacked_bytes"] == (tmp_path / sides[1]["path"]).stat().st_size
    assert info["oldest_unacked"]["chunk"] == "chunk_00001"
    assert "chunk_00001 (seq 1)" in gate.waiting_text(info)


def test_disk_in_use_is_sampled_through_a_streamed_run_and_its_peak_reported(tmp_path):
    """A producer (gate, chunk written, announced by the chunk job's own after_chunk) fills
    the budget and waits; a trainer reads and acks chunk by chunk.  The samples in
    stream/usage.jsonl cover every step, and the report's peak is their maximum, within
    the budget."""
    from hsextract import report
    from hsextract.records import INDEX_FORMAT
    from hsextract.stream import producer

    n, records, tokens = 8, 4, 400
    index = tmp_path / "chunks" / "index.json"
    index.parent.mkdir()
    entries = [
        {"path": f"chunks/chunk_{i:05d}.jsonl", "tokens": records * tokens} for i in range(n)
    ]
    index.write_text(json.dumps({"format": INDEX_FORMAT, "chunks": entries}))
    scratch = write_chunk(tmp_path / "scratch", 0, records, tokens=tokens)
    size = (tmp_path / "scratch" / scratch["path"]).stat().st_size
    bpt = size // scratch["tokens"] + 1
    # A window of 3 chunks (1 rank x 1 open + 1 between checkpoints + 1): room for ~3.5.
    ss = settings(int(3.5 * records * tokens * bpt), prefetch_chunks=1, checkpoint_chunks=1)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for i in range(n):
                gate.wait_for_room(tmp_path, ss, chunk=f"chunk_{i:05d}", tokens=records * tokens,
                                   raw_bytes_per_token=bpt, largest_tokens=records * tokens,
                                   run_tokens=n * records * tokens)  # fmt: skip
                side = write_chunk(tmp_path, i, records, tokens=tokens)
                producer.after_chunk(ss, run_dir=tmp_path, sidecar=side, index=index,
                                     hidden=tmp_path / side["path"], shapes=SHAPES)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    acks = journal.AckWriter(tmp_path)
    try:
        wait_for(lambda: gate.summary(tmp_path)["paused"] or bool(errors))
        assert not errors and gate.summary(tmp_path)["announced"] == 3
        prev = None
        for s in StreamDataset(tmp_path, timeout_s=60):
            if prev is not None and s["seq"] != prev:
                acks.ack([prev])  # a checkpoint per chunk
            prev = s["seq"]
        acks.ack([prev])
    finally:
        acks.ack(list(range(n)))
        t.join(60)
    assert not errors and not t.is_alive()

    samples = report.read_usage(tmp_path)
    events = Counter(s["event"] for s in samples)
    assert events["pass"] == n and events["announce"] == n and events["wait"] >= 1
    assert events["delete"] >= 1
    assert any(s["paused"] for s in samples) and not samples[-1]["paused"]
    assert all(s["budget_bytes"] == ss.budget_bytes for s in samples)
    peak = max(s["unacked_bytes"] for s in samples)
    assert 3 * size <= peak <= ss.budget_bytes  # the budget filled, never passed
    out = tmp_path / "report" / "disk_in_use.png"
    section = report.stream_section(tmp_path, out)
    assert section is not None and f"Peak unacknowledged chunk bytes {peak:,} (" in section
    assert f"of the budget {ss.budget_bytes:,} (" in section and ", within it." in section
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out.unlink()
    # The report rule's step puts it in run.html, the figure inline and beside it.
    for name in ("manifest", "stats", "gate", "patch"):
        (tmp_path / f"{name}.json").write_text('{"chunks": []}' if name == "manifest" else "{}")
    figs = {
        k: tmp_path / "report" / f"{k}.png" for k in ("lengths", "rejects", "chunks", "activations")
    }
    files = {k: tmp_path / f"{k}.json" for k in ("manifest", "stats", "gate", "patch", "server")}
    report.make_all(**files, out={**figs, "run": tmp_path / "report" / "run.html"})
    page = (tmp_path / "report" / "run.html").read_text()
    assert f"Peak unacknowledged chunk bytes {peak:,} (" in page
    assert "data:image/png;base64," in page and out.read_bytes()[:4] == b"\x89PNG"
    # An offline run has no samples and no section.
    assert report.stream_section(tmp_path / "scratch", tmp_path / "none.png") is None


# -- reader ---------------------------------------------------------------------------


def ids_of(samples) -> list[str]:
    return [s["id"] for s in samples if not s["pad"]]


def loader(ds, workers=2, state=None):
    dl = StreamLoader(ds, batch_size=None, num_workers=workers)
    if state is not None:
        dl.load_state_dict(state)
    return dl


def test_ranks_and_workers_yield_every_record_once_in_lockstep(tmp_path):
    """Every rank reads the same chunk at the same time, each its share of its records:
    step t of rank r is record t x world + r of the pass (journal order, each chunk
    shuffled), so the ranks' t-th samples are at most one chunk boundary apart and the
    padding is at most one sample.  On 8e234c9 each chunk went to one rank (rank 1 read
    chunks 1, 2 and 5 only), so the window grew with the ranks."""
    sizes = [5, 1, 7, 3, 2, 6, 5]  # 29 records
    make_run(tmp_path, sizes)
    want = [f"r{i}-{j}" for i, n in enumerate(sizes) for j in range(n)]
    for world, workers in ((2, 2), (3, 2)):
        per_rank = [list(loader(StreamDataset(tmp_path, rank=r, world=world, seed=3,
                                              timeout_s=60), workers=workers))
                    for r in range(world)]  # fmt: skip
        everything = [i for samples in per_rank for i in ids_of(samples)]
        assert Counter(everything) == Counter(want), (world, workers)
        steps = -(-len(want) // world)
        assert [len(samples) for samples in per_rank] == [steps] * world
        pads = [s for samples in per_rank for s in samples if s["pad"]]
        assert len(pads) == steps * world - len(want)
        assert all(int(p["loss_mask"].sum()) == 0 for p in pads)
        # Interleaved step by step, the ranks' samples are the pass in journal order.
        merged = [samples[t] for t in range(steps) for samples in per_rank]
        seqs = [s["seq"] for s in merged if not s["pad"]]
        assert seqs == sorted(seqs) and Counter(seqs) == dict(enumerate(sizes)), (world, seqs)
        assert all(s["pad"] for s in merged[len(want) :])
    # Deterministic: the same split and order again; another seed shuffles otherwise.
    first = ids_of(loader(StreamDataset(tmp_path, rank=0, world=2, seed=3, timeout_s=60)))
    again = ids_of(loader(StreamDataset(tmp_path, rank=0, world=2, seed=3, timeout_s=60)))
    assert again == first
    other = ids_of(loader(StreamDataset(tmp_path, rank=0, world=2, seed=4, timeout_s=60)))
    assert other != first  # the same chunk at each step, another of its records:
    assert [i.split("-")[0] for i in other] == [i.split("-")[0] for i in first]


def test_a_loader_reads_on_with_only_its_window_of_chunks_announced(tmp_path):
    """The gate announces chunk k + 2 only once the trainer has all of chunk k (its
    window): the loader must finish chunk k with no more announced.  On 8e234c9 a rank's
    workers took chunk positions w, w + 3, ... afresh in every chunk, so with 7-record
    chunks worker 0 took 3 of each and the others 2: the others ran chunks ahead, the
    loader (one sample from each worker in turn) waited on one of them for a chunk not
    announced, and chunk k never completed -- the H200 bench's stall (14 chunks unacked,
    no ack for minutes, 6 consumer workers)."""
    n, size, ahead = 12, 7, 2
    sides = [write_chunk(tmp_path, i, size) for i in range(n)]
    for s in sides[:ahead]:
        announce(tmp_path, s, n)
    got: Counter = Counter()
    errors: list[Exception] = []
    done = threading.Event()
    stop = threading.Event()

    def trainer() -> None:
        dl = None
        try:
            dl = iter(loader(StreamDataset(tmp_path, timeout_s=120), workers=3))
            per: Counter = Counter()
            nxt = ahead
            for sample in dl:
                if stop.is_set():
                    break
                got[sample["id"]] += 1
                per[sample["seq"]] += 1
                while nxt < n and per[nxt - ahead] == size:  # chunk k complete: k + 2 goes
                    announce(tmp_path, sides[nxt], n)
                    nxt += 1
        except Exception as exc:  # noqa: BLE001 -- the test asserts on it
            errors.append(exc)
        finally:
            del dl  # its workers go with it
            done.set()

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    try:
        assert done.wait(120), f"stalled after {sum(got.values())} of {n * size} records"
        assert not errors, errors
        assert sum(got.values()) == n * size and set(got.values()) == {1}
    finally:
        stop.set()
        for s in sides:  # a stalled loader's workers wait for these: let them end
            announce(tmp_path, s, n)
        t.join(120)


def count_hashes(tmp_path: Path, monkeypatch) -> Path:
    """chunkfile.sha256_file counted: the file named gets a line per hash, from whichever
    worker process took it."""
    from hsextract import chunkfile

    hashed = tmp_path / "hashed"
    real = chunkfile.sha256_file

    def counted(path, *a, **k):
        with open(hashed, "a") as f:
            f.write(f"{Path(path).name}\n")
        return real(path, *a, **k)

    monkeypatch.setattr(chunkfile, "sha256_file", counted)
    return hashed


def test_a_loaders_workers_hash_each_chunk_once_between_them(tmp_path, monkeypatch):
    """Workers split each chunk's records, so each used to hash every chunk (twice: once
    against the journal, once more at open), a whole read per worker per chunk."""
    import gc

    sizes = [4, 6, 5]
    make_run(tmp_path / "run", sizes)
    hashed = count_hashes(tmp_path, monkeypatch)
    ds = StreamDataset(tmp_path / "run", seed=1, timeout_s=60)
    got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=3,
                                           multiprocessing_context="fork"))  # fmt: skip
    assert Counter(ids_of(got)) == Counter(f"r{i}-{j}" for i, n in enumerate(sizes)
                                           for j in range(n))  # fmt: skip
    assert sorted(hashed.read_text().split()) == [f"chunk_{i:05d}.safetensors" for i in range(3)]
    # One verdict per chunk file (its identity and sha256), in a dir of its own.
    verdicts = Path(ds.verified)
    assert len(list(verdicts.glob("*.ok"))) == 3
    del ds, got
    gc.collect()
    assert not verdicts.exists()  # the loader's own temp dir, gone with it


def test_the_ranks_of_a_torchrun_job_on_one_node_hash_each_chunk_once_between_them(
    tmp_path, monkeypatch
):
    """Every rank reads every chunk now, so with a verdict dir per rank each chunk was
    hashed once per rank on the node (twice here on 4b80054, the merge of the pass-wide
    deal).  Under torchrun (its env) the node's ranks share one dir, removed with the
    last reader using it; with no torchrun each reader keeps its own."""
    import gc

    sizes = [4, 6, 5]
    make_run(tmp_path / "run", sizes)
    hashed = count_hashes(tmp_path, monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}-{tmp_path.name}")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ranks = [StreamDataset(tmp_path / "run", rank=r, world=2, seed=1, timeout_s=60)
             for r in range(2)]  # fmt: skip
    shared = Path(ranks[0].verified)
    assert Path(ranks[1].verified) == shared and shared.parent == Path(tempfile.gettempdir())
    got = [s for ds in ranks for s in loader(ds, workers=2)]
    assert Counter(ids_of(got)) == Counter(f"r{i}-{j}" for i, n in enumerate(sizes)
                                           for j in range(n))  # fmt: skip
    assert sorted(hashed.read_text().split()) == [f"chunk_{i:05d}.safetensors" for i in range(3)]
    del ranks, got
    gc.collect()
    assert not shared.exists()  # the readers using it went: so did the dir
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    alone = [StreamDataset(tmp_path / "run", rank=r, world=2) for r in range(2)]
    assert Path(alone[0].verified) != Path(alone[1].verified)


def test_a_verdict_dir_not_ours_alone_is_never_trusted(tmp_path):
    """A name another user could have made first, or a symlink to a dir we do not
    control: the reader hashes in a private dir instead of taking verdicts from it."""
    from hsextract.chunkfile import VerifiedDir

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(open_dir)
    for p in (open_dir, link):
        d = VerifiedDir.shared(str(p))
        assert Path(d) != p and Path(d).parent == Path(tempfile.gettempdir())
    mine = VerifiedDir.shared(str(tmp_path / "mine"))
    assert Path(mine) == tmp_path / "mine" and (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


def test_the_reader_follows_a_run_in_progress(tmp_path):
    sizes = [3, 2, 4, 1]
    sides = [write_chunk(tmp_path, i, n) for i, n in enumerate(sizes)]
    got: list[str] = []
    waiting = threading.Event()
    ds = StreamDataset(tmp_path, rank=0, world=1, timeout_s=60)
    it = iter(ds)

    def consume():
        waiting.set()
        got.extend(s["id"] for s in it if not s["pad"])

    t = threading.Thread(target=consume, daemon=True)
    announce(tmp_path, sides[0], 4)
    t.start()
    try:
        assert waiting.wait(30)
        for s in sides[1:]:
            announce(tmp_path, s, 4)
    finally:
        t.join(60)
    assert not t.is_alive()
    assert Counter(got) == Counter(f"r{i}-{j}" for i, n in enumerate(sizes) for j in range(n))


def test_resuming_from_a_state_dict_yields_exactly_the_rest(tmp_path):
    """Cut anywhere, the padding sample included (29 records: rank 1 of 2 and rank 2 of 3
    end with one), a resumed loader yields exactly what the uninterrupted one did."""
    make_run(tmp_path, [5, 1, 7, 3, 2, 6, 5])

    def ids(samples) -> list[str]:
        return [s["id"] for s in samples]  # "<pad>" for the padding

    for rank, world in ((1, 2), (2, 3)):
        whole = ids(loader(StreamDataset(tmp_path, rank=rank, world=world, seed=1, timeout_s=60)))
        assert whole[-1] == "<pad>" and whole.count("<pad>") == 1
        for cut in (1, 4, 7, len(whole) - 1):
            dl = loader(StreamDataset(tmp_path, rank=rank, world=world, seed=1, timeout_s=60))
            it = iter(dl)
            first = [next(it) for _ in range(cut)]
            state = dl.state_dict()
            del it, dl
            rest = loader(StreamDataset(tmp_path, rank=rank, world=world, seed=1, timeout_s=60),
                          state=state)  # fmt: skip
            assert ids(first) + ids(rest) == whole, (rank, world, cut)


def test_consumed_seqs_are_the_chunks_every_worker_of_every_rank_finished(tmp_path):
    """A chunk is consumed (a checkpoint covers it: acked) only once every rank's workers
    passed it: all ranks read each chunk.  On 8e234c9 each rank's chunks were its own, and
    a chunk one rank had finished was acked while another could still need it."""
    make_run(tmp_path, [4, 4, 2, 4])  # record k of the pass: rank k % 2, worker k // 2 % 2
    dls = [loader(StreamDataset(tmp_path, rank=r, world=2, timeout_s=60)) for r in range(2)]
    its = [iter(dl) for dl in dls]

    def take(rank: int, n: int) -> list[int]:
        return [next(its[rank])["seq"] for _ in range(n)]

    def covered() -> list[int]:
        return consumed_seqs(tmp_path, [dl.state_dict() for dl in dls])

    assert covered() == []
    assert take(0, 4) == [0, 0, 1, 1]  # rank 0 is past chunk 0; rank 1 has not started
    assert covered() == []
    assert take(1, 1) == [0]  # rank 1's worker 1 still has a record of chunk 0
    assert covered() == []
    assert take(1, 1) == [0]
    assert covered() == [0]
    # Chunk 2's two records are both workers' 0 (records 8, 9): the workers 1, with
    # nothing to read there, do not hold it once the workers 0 are past it.
    assert take(0, 1) + take(1, 3) == [2, 1, 1, 2]
    assert covered() == [0, 1, 2]
    assert take(0, 1) == [3]
    assert covered() == [0, 1, 2]
    for it in its:
        list(it)
    assert covered() == [0, 1, 2, 3]
    # One rank, no workers: the dataset's own state.
    ds = StreamDataset(tmp_path, timeout_s=60)
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    it = iter(dl)
    assert [next(it)["seq"] for _ in range(5)] == [0, 0, 0, 0, 1]
    assert consumed_seqs(tmp_path, [dl.state_dict()]) == [0]


def test_a_chunk_whose_bytes_changed_is_nacked_not_trained_on(tmp_path):
    sides = make_run(tmp_path, [2, 2])
    p = tmp_path / sides[1]["path"]
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    got = []
    with pytest.raises(journal.StreamError, match="chunk_00001 \\(seq 1\\).*nacked"):
        for s in StreamDataset(tmp_path, world=1, timeout_s=60):
            got.append(s["seq"])
    assert set(got) == {0}
    nacks = journal.read_state(tmp_path / "stream").nacked
    assert list(nacks) == [1] and nacks[1]["sha256_expected"] == sides[1]["sha256"]


def nack_lines(run_dir: Path) -> list[dict]:
    return [a for a in journal.read_lines(run_dir / "stream" / "acks.jsonl") if a["type"] == "nack"]


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def consume_in_thread(it, got: list, errors: list) -> threading.Thread:
    """Iterate ``it`` on a thread into ``got``; an exception lands in ``errors``."""

    def run():
        try:
            got.extend(it)
        except Exception as exc:  # noqa: BLE001 -- the test asserts on it
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_nacked_chunk_is_waited_for_and_read_once_from_its_redo(tmp_path):
    """Bytes changed under the reader mid-pass: it nacks and waits (loader workers, a bare
    dataset, and one resumed from that one's state while it waited) for the redo, a new
    revision announced by the real journal code, and yields its records once."""
    sizes = [3, 4, 2]
    sides = [write_chunk(tmp_path, i, n) for i, n in enumerate(sizes)]
    for s in sides[:2]:
        announce(tmp_path, s, 3)  # the pass goes on: chunk 2 is still to come
    corrupt(tmp_path / sides[1]["path"])
    got: dict[str, list] = {"workers": [], "bare": [], "resumed": []}
    errors: list[Exception] = []
    threads = []
    try:
        it = iter(loader(StreamDataset(tmp_path, world=1, seed=2, timeout_s=60)))  # forks here
        threads.append(consume_in_thread(it, got["workers"], errors))
        bare = StreamDataset(tmp_path, world=1, seed=2, timeout_s=60)
        threads.append(consume_in_thread(iter(bare), got["bare"], errors))

        def three_nacks():  # both workers' and the bare reader's
            return len(nack_lines(tmp_path)) >= 3 or bool(errors)

        wait_for(three_nacks)
        state = bare.state_dict()  # a checkpoint taken while it waits for the redo
        assert state == {"pass": 1, "slot": 1, "pos": 0, "pad": 0}
        resumed = StreamDataset(tmp_path, world=1, seed=2, timeout_s=60)
        resumed.load_state_dict(state)
        threads.append(consume_in_thread(iter(resumed), got["resumed"], errors))

        def four_nacks():
            return len(nack_lines(tmp_path)) >= 4 or bool(errors)

        wait_for(four_nacks)
        assert not errors, errors
        # The redo: other bytes (4 tokens a record: a non-deterministic engine), the same
        # records, announced as revision 1 of seq 1; then the pass's last chunk.
        redo = write_chunk(tmp_path, 1, 4, tokens=4)
        assert announce(tmp_path, redo, 3) == (1, True)
        announce(tmp_path, sides[2], 3)
    finally:
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    want = Counter(f"r{i}-{j}" for i, n in enumerate(sizes) for j in range(n))
    for name in ("workers", "bare"):
        assert Counter(ids_of(got[name])) == want, name
    for s in got["workers"] + got["bare"] + got["resumed"]:
        if s["seq"] == 1:  # from the new revision only
            assert s["input_ids"].shape == (4,)
    assert ids_of(got["resumed"]) == ids_of(got["bare"])[3:]  # exactly the rest
    revs = [ln["rev"] for ln in journal_lines(tmp_path) if ln.get("seq") == 1]
    assert revs == [0, 1]
    assert {(a["seq"], a["rev"]) for a in nack_lines(tmp_path)} == {(1, 0)}


class _Said(logging.Handler):
    """Sets ``event`` when a record's message contains ``text`` (logged from ``module``
    only, if given: the gate and the reader say some of the same words)."""

    def __init__(self, text: str, module: str | None = None) -> None:
        super().__init__()
        self.text, self.module, self.event = text, module, threading.Event()
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        if self.module not in (None, record.module):
            return
        if self.text in record.getMessage():
            self.message = record.getMessage()  # the last that matched
            self.event.set()


def test_after_its_pass_a_nack_stops_unless_a_plan_took_it_up(tmp_path):
    """The pass has ended: nothing redoes the chunk, so the reader stops at once naming
    what to run; resumed after the plan of that run removed the payload for its redo, it
    waits for the redo instead, and reads it."""
    from hsextract.stream.receipts import redo_nacked

    sides = make_run(tmp_path, [2, 2])
    corrupt(tmp_path / sides[1]["path"])
    first = StreamDataset(tmp_path, world=1, timeout_s=60)
    got: list = []
    with pytest.raises(
        journal.StreamError, match="nothing will redo it.*snakemake -j1 extract_all"
    ):
        for s in first:
            got.append(s)
    state = first.state_dict()
    assert redo_nacked(tmp_path) == [sides[1]["path"]]  # the next extract_all's plan
    said = _Said("waiting for its redo")
    logging.getLogger("hsextract").addHandler(said)
    errors: list[Exception] = []
    t = None
    try:
        resumed = StreamDataset(tmp_path, world=1, timeout_s=60)
        resumed.load_state_dict(state)
        t = consume_in_thread(iter(resumed), got, errors)
        assert said.event.wait(60) and not errors, errors
        announce(tmp_path, write_chunk(tmp_path, 1, 2), 2)  # its redo: revision 1
    finally:
        if t is not None:
            t.join(60)
        logging.getLogger("hsextract").removeHandler(said)
    assert not errors and t is not None and not t.is_alive(), errors
    assert Counter(ids_of(got)) == Counter(f"r{i}-{j}" for i in range(2) for j in range(2))


def test_the_trainers_layouts(tmp_path):
    make_run(tmp_path, [2])
    s = next(iter(StreamDataset(tmp_path, layout="specforge", timeout_s=60)))
    assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.int64
    assert s["hidden_state"].shape == (1, 3, H) and s["aux_hidden_state"].shape == (1, 3, K * H)
    with pytest.raises(journal.StreamError, match="prenorm_final: true"):
        next(iter(StreamDataset(tmp_path, layout="speculators", timeout_s=60)))


def test_speculators_layout_from_a_prenorm_run(tmp_path):
    side = write_chunk(tmp_path, 0, 2, tokens=5, prenorm=True)
    announce(tmp_path, side, 1)
    s = next(iter(StreamDataset(tmp_path, layout="speculators", timeout_s=60)))
    v = float(s["input_ids"][0])
    assert s["input_ids"].dtype == torch.int64 and s["lengths"].tolist() == [5]
    assert s["hidden_states"].shape == (5, K * H) and bool((s["hidden_states"] == v).all())
    assert s["verifier_last_hidden_states"].shape == (5, H)
    assert bool((s["verifier_last_hidden_states"] == -v).all())
    assert s["position_ids"].tolist() == list(range(5))


def test_the_server_never_imports_the_stream_and_the_gate_no_torch():
    """The server process imports capture and engine: none of them reaches the stream; a
    chunk job's gate (journal, gate) costs no torch import."""
    import subprocess
    import sys

    code = (
        "import sys, hsextract.capture, hsextract.engine\n"
        "assert not [m for m in sys.modules if m.startswith('hsextract.stream')], 'server'\n"
        "for m in [m for m in sys.modules if m.startswith(('torch', 'hsextract'))]:\n"
        "    del sys.modules[m]\n"
        "import hsextract.stream.gate, hsextract.stream.journal\n"
        "assert 'torch' not in sys.modules, 'gate'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_records_are_dealt_over_ranks_and_workers_one_at_a_time():
    """The deal, on every prefix of a journal of uneven chunks: each chunk's records go
    to all ranks' workers, every one exactly once; on any prefix the ranks' records differ
    by one at most (lockstep to the record, whatever the chunk sizes); and a rank's
    records, its workers taken in turn as a loader takes them, are records r, r + world,
    ... of the pass."""
    import random

    rng = random.Random(0)
    sizes = [rng.choice([0, 1, 1, 2, 3, 9, 17]) for _ in range(120)]
    lines = [{"records": n} for n in sizes]
    off = offsets(lines)
    assert off[0] == 0 and off[-1] == sum(sizes)
    for world in (1, 2, 3, 8):
        for workers in (1, 2, 3):
            taken: dict[tuple[int, int], list[int]] = {}  # (rank, worker): records
            for i, n in enumerate(sizes):
                seen = []
                for r in range(world):
                    for w in range(workers):
                        got = share(off[i], n, rank=r, world=world, worker=w, workers=workers)
                        seen += got
                        taken.setdefault((r, w), []).extend(off[i] + j for j in got)
                assert sorted(seen) == list(range(n)), (world, workers, i)
                done = [sum(len(taken[r, w]) for w in range(workers)) for r in range(world)]
                assert max(done) - min(done) <= 1, (world, workers, i)
            for r in range(world):
                mine = [taken[r, t % workers][t // workers]
                        for t in range(sum(len(taken[r, w]) for w in range(workers)))]  # fmt: skip
                assert mine == list(range(r, off[-1], world)), (world, workers, r)


def test_siblings_take_a_mismatch_verdict_without_hashing_again(tmp_path, monkeypatch):
    from hsextract import chunkfile

    side = write_chunk(tmp_path, 0, 2)
    path, shared = tmp_path / side["path"], tmp_path / "verdicts"
    shared.mkdir()
    calls = []
    real = chunkfile.sha256_file
    monkeypatch.setattr(chunkfile, "sha256_file", lambda p, *a, **k: calls.append(p) or real(p))
    for _ in range(3):  # the verdict dir is all the sibling workers share
        with pytest.raises(chunkfile.ChunkDigestError) as err:
            chunkfile.verify_chunk_file(path, "0" * 64, shared=shared)
        assert err.value.actual == side["sha256"]
    assert len(calls) == 1


def test_a_redo_holding_other_records_stops_the_reader_in_one_sentence(tmp_path):
    from hsextract.stream.reader import open_checked

    side = write_chunk(tmp_path, 0, 3)
    announce(tmp_path, side, 1)
    dealt = journal.read_state(journal.stream_dir(tmp_path)).chunks[0]
    other = write_chunk(tmp_path, 0, 5)  # the data changed: chunk_00000 re-extracted
    other["content_digest"] = "changed"
    announce(tmp_path, other, 1)
    assert journal.read_state(journal.stream_dir(tmp_path)).chunks[0]["rev"] == 1
    with pytest.raises(journal.StreamError, match=r"revision 1 holds other records \(5"):
        open_checked(tmp_path, dealt, timeout_s=10)


def test_a_redo_renamed_in_between_the_check_and_the_open_is_checked_again(tmp_path, monkeypatch):
    from hsextract.stream import reader as reader_mod

    side = write_chunk(tmp_path, 0, 3)
    announce(tmp_path, side, 1)
    line = journal.read_state(journal.stream_dir(tmp_path)).chunks[0]
    real = reader_mod.ChunkReader
    swapped = []

    def open_after_a_redo(path, *a, **k):
        if not swapped:  # a redo (other bytes, same records) lands right after the check
            swapped.append(1)
            redo = write_chunk(tmp_path / "redo", 0, 3, tokens=4)  # other bytes
            os.replace(tmp_path / "redo" / redo["path"], path)
            announce(tmp_path, redo, 1)
        return real(path, *a, **k)

    monkeypatch.setattr(reader_mod, "ChunkReader", open_after_a_redo)
    rd, got = reader_mod.open_checked(tmp_path, line, timeout_s=10)
    assert got["rev"] == 1 and got["sha256"] == sha256_file(tmp_path / side["path"])
    assert not journal.read_state(journal.stream_dir(tmp_path)).nacked  # nothing mistaken
