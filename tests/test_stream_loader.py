"""The trainer's loader and checkpoint schedule: a state taken after a pass ended resumes
to nothing of that pass, a state not of ours is refused, a deleted chunk's message says
whose checkpoint acked it, ``checkpoint_due`` is the declared ``checkpoint_chunks`` in
chunks (not steps), and a waiting reader says why it waits.

Chunks are written with the real ChunkWriter and announced through the real journal
(tests/test_stream.py's helpers); the gate and its deletion are the real ones.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from hsextract.stream import gate, journal
from hsextract.stream.checkpoints import LATE_CHECKPOINT, late_checkpoint_text
from hsextract.stream.loader import StreamLoader
from hsextract.stream.reader import (
    StreamDataset,
    checkpoint_due,
    consumed_seqs,
    worker_states,
)
from hsextract.stream.reader import offsets as offsets_of
from tests.test_stream import (
    _Said,
    announce,
    consume_in_thread,
    make_run,
    settings,
    write_chunk,
)

SIZES = [5, 1, 7, 3, 2, 6, 5]  # 29 records: rank 1 of 2 ends its pass with a padding sample
ALL = Counter(f"r{i}-{j}" for i, n in enumerate(SIZES) for j in range(n))


def ids(samples) -> list[str]:
    return [s["id"] for s in samples]  # "<pad>" for padding


def stream(run_dir: Path, rank: int, world: int = 2) -> StreamDataset:
    return StreamDataset(run_dir, rank=rank, world=world, seed=1, timeout_s=60)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_after_its_pass_ended_resumes_to_nothing_of_it(tmp_path, workers):
    """The trainer's last checkpoint follows its loop: resumed from it, every rank reads
    nothing more of the pass (padding included), then the whole next pass after
    set_pass -- also when set_pass comes before the first iteration.  torchdata's own
    loader read the whole pass again with workers (15 of 15 records of rank 0); without,
    a resume at the next pass read nothing of it (the state's pass won)."""
    make_run(tmp_path, SIZES)
    ends = []
    for rank in range(2):
        dl = StreamLoader(stream(tmp_path, rank), batch_size=None, num_workers=workers)
        assert len(list(dl)) == 15  # 29 records: 15 steps a rank, rank 1's last a pad
        ends.append(dl.state_dict())
    again: list[str] = []
    for rank in range(2):
        ds = stream(tmp_path, rank)
        dl = StreamLoader(ds, batch_size=None, num_workers=workers)
        dl.load_state_dict(ends[rank])
        assert ids(dl) == [], (rank, workers)
        ds.set_pass(2)  # the trainer's next epoch
        again += ids(dl)
        # A trainer resuming at the next epoch: set_pass before it iterates at all.
        ds = stream(tmp_path, rank)
        dl = StreamLoader(ds, batch_size=None, num_workers=workers)
        dl.load_state_dict(ends[rank])
        ds.set_pass(2)
        assert len(list(dl)) == 15, (rank, workers)
    assert Counter(i for i in again if i != "<pad>") == ALL and again.count("<pad>") == 1
    # What the end state covers: every chunk (rank 0 acks it all after that checkpoint).
    assert consumed_seqs(tmp_path, ends) == list(range(len(SIZES)))


def test_a_state_not_made_by_the_stream_loader_is_refused_at_resume(tmp_path):
    make_run(tmp_path, [2, 2])
    plain = StatefulDataLoader(stream(tmp_path, 0, world=1), batch_size=None, num_workers=0)
    list(plain)
    dl = StreamLoader(stream(tmp_path, 0, world=1), batch_size=None, num_workers=0)
    with pytest.raises(journal.StreamError, match=r"not made by hsextract\.stream\.StreamLoader"):
        dl.load_state_dict(plain.state_dict())
    dl.load_state_dict({})  # torchdata's "start afresh" stays allowed
    assert Counter(ids(dl)) == Counter(f"r{i}-{j}" for i in range(2) for j in range(2))


def _ack_and_free(run_dir: Path, states: list[dict]) -> list[int]:
    """Rank 0's ack of what ``states`` cover, then the workflow's deletion of it."""
    seqs = consumed_seqs(run_dir, states)
    journal.AckWriter(run_dir).ack(seqs, step=7)
    with journal.locked(run_dir / "stream"):
        gone = gate.delete_acked(run_dir, journal.read_state(run_dir / "stream"), 1)
    assert len(gone) == len(seqs)
    return seqs


def test_a_deleted_chunk_says_whose_checkpoint_acked_it(tmp_path):
    """A trainer resumed through torchdata's own loader from the checkpoint after its loop
    reads the pass again (2 workers) and meets the chunks that very checkpoint acked: the
    reader says so and names the fix, instead of blaming another trainer.  Resumed from
    an older checkpoint than the one whose ack freed the chunk: it says that."""
    make_run(tmp_path, SIZES)
    plain = StatefulDataLoader(stream(tmp_path, 0, world=1), batch_size=None, num_workers=2)
    it = iter(plain)
    early = [next(it) for _ in range(3)]
    assert {s["seq"] for s in early} == {0}
    old = plain.state_dict()  # an older checkpoint, in chunk 0
    list(it)
    end = plain.state_dict()
    assert _ack_and_free(tmp_path, [end]) == list(range(len(SIZES)))
    again = StatefulDataLoader(stream(tmp_path, 0, world=1), batch_size=None, num_workers=2)
    again.load_state_dict(end)
    with pytest.raises(journal.StreamError) as err:
        list(again)
    said = str(err.value)
    assert "chunk_00000 (seq 0) is announced but" in said
    assert "a checkpoint acknowledged it at step 7" in said
    assert "started its pass at the beginning instead of from that checkpoint" in said
    assert "hsextract.stream.StreamLoader" in said and "another trainer" not in said
    # The same checkpoint through the stream's loader: nothing more, nothing missing.
    ours = StreamLoader(stream(tmp_path, 0, world=1), batch_size=None, num_workers=2)
    ours.load_state_dict({**end, "hsextract_stream_loader": 1})
    assert ids(ours) == []
    # Resumed from the older checkpoint (bare, in this process): a later one freed it.
    ds = stream(tmp_path, 0, world=1)
    ds.load_state_dict(old["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"])
    with pytest.raises(journal.StreamError, match="a later one than the checkpoint this trainer "
                       "resumed from; resume from the latest checkpoint"):  # fmt: skip
        list(ds)


def test_a_payload_removed_before_any_ack_says_to_redo_it(tmp_path):
    sides = make_run(tmp_path, [2, 2])
    (tmp_path / sides[0]["path"]).unlink()
    with pytest.raises(journal.StreamError, match="no checkpoint acknowledged it.*extract_all"):
        list(stream(tmp_path, 0, world=1))


def _covered_total(run_dir: Path, states: list[dict | None]) -> int:
    """Chunks a checkpoint holding every rank's ``states`` covers, over the passes so far
    (``keep``: each pass reads the run's chunks again)."""
    if states[0] is None:
        return 0
    pass_ = min(int(w["pass"]) for s in states for w in worker_states(s) if w is not None)
    return (pass_ - 1) * len(SIZES) + len(consumed_seqs(run_dir, states))


@pytest.mark.parametrize("workers", [0, 2])
def test_checkpoint_due_is_the_declared_chunks_not_a_step_count(tmp_path, workers):
    """Every rank, from its own loader state after each step, says the same: a checkpoint
    is due once ``checkpoint_chunks`` chunks are covered (consumed_seqs of all ranks'
    states, the acks' own rule) since the last checkpoint's.  Chunks of different sizes:
    the steps between due checkpoints differ.  Into the next pass, the previous one's
    uncheckpointed chunks count."""
    make_run(tmp_path, SIZES)
    world, every = 2, 2
    dss = [stream(tmp_path, r) for r in range(world)]
    dls = [StreamLoader(ds, batch_size=None, num_workers=workers) for ds in dss]
    last: list[dict | None] = [None] * world
    gaps, step, at = [], 0, 0
    for pass_, steps in ((1, 15), (2, 4)):
        for ds in dss:
            ds.set_pass(pass_)
        its = [iter(dl) for dl in dls]
        for _ in range(steps):
            for it in its:
                next(it)
            step += 1
            states = [dl.state_dict() for dl in dls]
            due = [
                checkpoint_due(
                    tmp_path,
                    states[r],
                    last[r],
                    checkpoint_chunks=every,
                    rank=r,
                    world=world,
                    timeout_s=60,
                )
                for r in range(world)
            ]
            assert due[0] == due[1], (pass_, step)  # no collective needed to agree
            new = _covered_total(tmp_path, states) - _covered_total(tmp_path, last)
            assert due[0] == (new >= every), (pass_, step, new)
            assert dls[1].checkpoint_due(every, since=last[1]) == due[1]
            if due[0]:
                gaps.append(step - at)
                at, last = step, states
        for it in its:  # the pass's end (pass 1), as a loop sees it; pass 2 left open
            if pass_ == 1:
                assert list(it) == []
    assert len(set(gaps)) > 1, gaps  # chunks of 5, 1, 7, ... records: steps != chunks
    assert len(gaps) >= 4


def test_a_waiting_reader_says_why_and_its_timeout_names_it(tmp_path):
    """No workflow running: the reader's warning and its timeout say no chunk job is in
    flight.  The workflow's gate shut on acks of chunks this trainer read (it checkpoints
    less often than declared: both wait for good): the warning says that."""
    sides = [write_chunk(tmp_path, i, 2) for i in range(3)]
    announce(tmp_path, sides[0], 3)
    with pytest.raises(journal.StreamError, match="no chunk job is in flight: is the workflow"):
        list(StreamDataset(tmp_path, timeout_s=0.01))
    said = _Said("no chunk job is in flight")
    logging.getLogger("hsextract").addHandler(said)
    got: list = []
    errors: list[Exception] = []
    t = job = late = None
    try:
        ds = StreamDataset(tmp_path, timeout_s=60)
        ds.REPORT_S = 0.0  # warn at once (a real reader: after a minute)
        t = consume_in_thread(iter(ds), got, errors)
        assert said.event.wait(60) and not errors, errors
        announce(tmp_path, sides[1], 3)
        # A chunk job shut out by the budget: chunks 0 and 1 are read and unacked.
        size = (tmp_path / sides[0]["path"]).stat().st_size
        ss = settings(int(2.5 * size), low_mark=0.5, prefetch_chunks=0, checkpoint_chunks=1)
        kw = dict(tokens=6, raw_bytes_per_token=size // 6 + 1, largest_tokens=6, run_tokens=18)
        late = _Said(LATE_CHECKPOINT, module="reader")  # the gate logs it too
        logging.getLogger("hsextract").addHandler(late)
        kw["chunk"] = sides[2]["chunk"]
        job = threading.Thread(target=gate.wait_for_room, args=(tmp_path, ss), kwargs=kw)
        job.daemon = True
        job.start()
        assert late.event.wait(60), "the reader never named the late checkpoint"
    finally:
        journal.AckWriter(tmp_path).ack([0, 1])  # the checkpoint: the gate opens
        if job is not None:
            job.join(60)
            gate.release(tmp_path, sides[2]["chunk"])
        announce(tmp_path, sides[2], 3)
        if t is not None:
            t.join(60)
        for h in (said, late):
            if h is not None:
                logging.getLogger("hsextract").removeHandler(h)
    assert not errors and t is not None and not t.is_alive(), errors
    assert job is not None and not job.is_alive()
    assert Counter(ids(got)) == Counter(f"r{i}-{j}" for i in range(3) for j in range(2))
    assert "2 chunk(s) this pass read (seqs 0..1) are not acknowledged" in late.message
    # The gate's own words for the same deadlock name the window.
    text = late_checkpoint_text(8, 2, 13)
    assert "13 chunk(s) unacknowledged against the 11 of its window" in text
    assert LATE_CHECKPOINT in text


def test_the_example_trainer_resumed_from_its_final_checkpoint_trains_nothing_twice(tmp_path):
    """tests/stream_trainer.py (2 DDP ranks over gloo, 2 loader workers each) trains the
    pass, checkpoints after its loop, acks it all; resumed from that checkpoint it trains
    nothing: its record list and step count stay as they were, each record once, and
    ``--checkpoint-chunks`` checkpointed when chunks, not steps, said so.  Through
    torchdata's own loader (51ddea2) the resumed trainer trained the whole pass again."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    make_run(run, SIZES)
    out = tmp_path / "trainer"
    script = Path(__file__).parent / "stream_trainer.py"
    base = [sys.executable, str(script), "--run-dir", str(run), "--out", str(out),
            "--ckpt-every", "1000", "--checkpoint-chunks", "2"]  # fmt: skip
    for resume in (False, True):
        res = subprocess.run(base + (["--resume"] if resume else []), capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        done = json.loads((out / "done.json").read_text())
        if not resume:
            first = done
            acks = journal.read_lines(run / "stream" / "acks.jsonl")
    trained = [i for rank in done["trained"] for i in rank]
    assert Counter(trained) == ALL  # every record once, none again after the resume
    assert done == first and done["step"] == 15
    # A checkpoint at each step t once 2 more chunks end at or before record 2t (both
    # ranks past them), then the one after the loop: steps 3, 8, 12, not any one period.
    ends, want, seen = offsets_of([{"records": n} for n in SIZES])[1:], [], 0
    for t in range(1, 16):
        covered = sum(1 for e in ends if e <= 2 * t)
        if covered - seen >= 2:
            want.append(t)
            seen = covered
    assert want == [3, 8, 12]
    assert [a["step"] for a in acks if a["type"] == "ack"] == [*want, 15]
