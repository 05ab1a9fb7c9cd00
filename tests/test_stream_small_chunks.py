"""The reader's deal with chunks of fewer records than ranks x loader workers (issue 39):
a worker, or a whole rank, with nothing to read in a chunk moves on, and neither the
ranks' lockstep, a chunk's completion (its ack) nor a resume waits on it.

Chunks are written and announced as tests/test_stream.py does, no workflow runs.
"""

from __future__ import annotations

import threading
from collections import Counter

from hsextract.stream.reader import StreamDataset, consumed_seqs, offsets
from tests.test_stream import announce, ids_of, loader, make_run, write_chunk

#: 13 records in chunks of 1 to 3: every chunk is smaller than 2 x 2 and 3 x 2.
SIZES = [1, 2, 3, 1, 2, 3, 1]
#: (world, workers) pairs.
DEALS = ((2, 2), (3, 2))


def dataset(run_dir, rank: int, world: int) -> StreamDataset:
    return StreamDataset(run_dir, rank=rank, world=world, seed=5, timeout_s=60)


def test_small_chunks_give_every_record_once_in_lockstep_and_are_acked_exactly(tmp_path):
    """Ranks stepped together, as DDP steps them: after step s the ranks have taken
    records 0 .. s x world - 1 of the pass, in journal order; a chunk is covered (what a
    checkpoint acks) exactly once all its records are taken -- never held by a worker
    with nothing to read in it; every record once, each rank the same number of steps,
    at most one padding sample each."""
    make_run(tmp_path, SIZES)
    ends = offsets([{"records": n} for n in SIZES])[1:]
    want = [f"r{i}-{j}" for i, n in enumerate(SIZES) for j in range(n)]
    for world, workers in DEALS:
        dls = [loader(dataset(tmp_path, r, world), workers=workers) for r in range(world)]
        its = [iter(dl) for dl in dls]
        got: list[list[dict]] = [[] for _ in range(world)]
        steps = -(-len(want) // world)
        for s in range(1, steps + 1):
            for r in range(world):
                got[r].append(next(its[r]))
            covered = consumed_seqs(tmp_path, [dl.state_dict() for dl in dls])
            assert covered == [i for i, end in enumerate(ends) if end <= s * world], (world, s)
        for it in its:  # every rank ends at the same step
            assert next(it, None) is None, world
        merged = [got[r][t] for t in range(steps) for r in range(world)]
        assert [s["seq"] for s in merged if not s["pad"]] == [
            i for i, n in enumerate(SIZES) for _ in range(n)
        ], world
        assert Counter(ids_of(merged)) == Counter(want), world
        assert all(s["pad"] for s in merged[len(want) :]), world
        assert all(sum(s["pad"] for s in samples) <= 1 for samples in got), world


def ranks_with_a_one_chunk_window(run, world: int, workers: int) -> list[list[str]]:
    """Each rank's ids, ranks in threads with a barrier after each step (DDP's
    all-reduce), chunk k + 1 announced only once every rank has taken all of chunk k."""
    n = len(SIZES)
    sides = [write_chunk(run, i, size) for i, size in enumerate(SIZES)]
    announce(run, sides[0], n)
    lock = threading.Lock()
    per_seq: Counter = Counter()
    nxt = 1
    got: list[list[str]] = [[] for _ in range(world)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(world, timeout=120)

    def rank_loop(r: int) -> None:
        nonlocal nxt
        dl = None
        try:
            dl = loader(dataset(run, r, world), workers=workers)
            for sample in dl:
                with lock:
                    got[r].append(sample["id"])
                    per_seq[sample["seq"]] += 1
                    while nxt < n and per_seq[nxt - 1] == SIZES[nxt - 1]:
                        announce(run, sides[nxt], n)  # chunk k done: k + 1 goes
                        nxt += 1
                barrier.wait()
        except BaseException as exc:  # noqa: BLE001 -- the test asserts on it
            errors.append(exc)
            barrier.abort()
        finally:
            del dl  # its workers go with it

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), f"stalled: {got}"
        assert not errors, (errors, got)
    finally:
        for s in sides[nxt:]:  # a stalled loader's workers wait for these: let them end
            announce(run, s, n)
        for t in threads:
            t.join(120)
    return got


def test_small_chunks_stall_no_loader_with_only_the_next_chunk_announced(tmp_path):
    """The tightest window: a worker, or a rank, with no record in chunk k must neither
    keep chunk k from completing nor wait for a record of it, or the run stalls (the
    barrier times out).  Every record once; the ranks end at the same step."""
    for world, workers in DEALS:
        got = ranks_with_a_one_chunk_window(tmp_path / f"run{world}", world, workers)
        everything = [i for ids in got for i in ids if i != "<pad>"]
        assert Counter(everything) == Counter(
            f"r{i}-{j}" for i, m in enumerate(SIZES) for j in range(m)
        ), world
        assert len({len(ids) for ids in got}) == 1, (world, got)


def test_small_chunks_resume_mid_pass_from_a_state_dict_exactly(tmp_path):
    """Cut after any step, padding included, a resumed loader of each rank yields exactly
    what the uninterrupted one did, though most of its workers have nothing in a chunk."""
    make_run(tmp_path, SIZES)
    for world, workers in DEALS:
        for rank in range(world):
            whole = [s["id"] for s in loader(dataset(tmp_path, rank, world), workers=workers)]
            for cut in range(1, len(whole)):
                dl = loader(dataset(tmp_path, rank, world), workers=workers)
                it = iter(dl)
                first = [next(it)["id"] for _ in range(cut)]
                state = dl.state_dict()
                del it, dl
                rest = loader(dataset(tmp_path, rank, world), workers=workers, state=state)
                assert first + [s["id"] for s in rest] == whole, (world, rank, cut)
