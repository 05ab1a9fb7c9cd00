"""The send loop's share of the server's window (issue 34): the jobs holding a sending
turn send for the turns nobody holds, and give that share back once a job takes one.

CPU only: the turns on a temporary dump dir, and one chunk through the reference engine.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from hsextract import server
from hsextract.budget import SendingTurn
from hsextract.chunks import ChunkReader
from hsextract.client import _Window, extract_chunk
from hsextract.config import load_config, typed


def test_held_count_counts_every_live_turn_and_takes_none(tmp_path):
    mine, a, b = (SendingTurn(tmp_path, 4, poll_s=0.001) for _ in range(3))
    mine.acquire()
    assert mine.held_count() == 1
    a.acquire()
    b.acquire()
    assert mine.held_count() == 3
    b.release()
    assert mine.held_count() == 2
    # The probe leaves every free turn free: two more jobs still get one each.
    c, d = SendingTurn(tmp_path, 4), SendingTurn(tmp_path, 4)
    c.acquire()
    d.acquire()
    assert {mine.index, a.index, c.index, d.index} == {0, 1, 2, 3}
    assert mine.held_count() == 4
    for t in (mine, a, c, d):
        t.release()


def test_window_takes_the_vacant_turns_share_and_gives_it_back(tmp_path):
    """base 2 per turn, 4 turns: alone a job may have 8 in flight; with two others
    sending ceil(8 / 3) = 3; once a fourth job takes the last turn, 2 -- and a request
    over the limit waits for one of its own to finish."""
    mine = SendingTurn(tmp_path, 4)
    mine.acquire()
    window = _Window(mine, 2, cap=64, probe_s=0.0)
    assert window.most == 8
    # Never past what the server runs at once (server.max_running_requests), nor below
    # the job's own share.
    assert _Window(mine, 2, cap=5).most == 5 and _Window(mine, 2, cap=1).most == 2
    assert window.limit() == 8
    others = [SendingTurn(tmp_path, 4) for _ in range(3)]
    others[0].acquire()
    others[1].acquire()
    assert window.limit() == 3
    for _ in range(3):
        window.acquire()
    others[2].acquire()
    assert window.limit() == 2
    # Over the limit (3 in flight, limit 2): the next request waits until two are done.
    passed = threading.Event()

    def one_more() -> None:
        window.acquire()
        passed.set()

    t = threading.Thread(target=one_more)
    t.start()
    window.release()  # 2 in flight: still at the limit
    assert window.active == 2
    window.release()  # 1 in flight: room for one
    assert passed.wait(10)
    t.join()
    assert window.active == 2 and window.peak == 3
    for o in others:
        o.release()
    mine.release()


@pytest.mark.parametrize("others_sending", [0, 3])
def test_a_job_sends_for_vacant_turns_only(demo_run, tmp_path, monkeypatch, others_sending):
    """client.requests_in_flight 1, sending_jobs 4.  Alone, the job keeps up to 4 requests
    in flight (the three vacant turns' share); with the three other turns held by live
    jobs, never more than its own 1.  Either way the chunk holds the workflow's states."""
    workdir, rd = demo_run["workdir"], demo_run["run_dir"]
    monkeypatch.chdir(workdir)
    cfg = copy.deepcopy(load_config(workdir / "config.yaml"))
    cfg["client"]["requests_in_flight"] = 1
    cfg["client"]["sending_jobs"] = 4
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(cfg)
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=__import__("os").getpid())
    chunk = max(demo_run["manifest"]["chunks"], key=lambda c: c["records"])  # most requests
    name = Path(chunk["path"]).stem
    held = [SendingTurn(tmp_path / "dump", 4) for _ in range(others_sending)]
    try:
        for t in held:
            t.acquire()
        sidecar = extract_chunk(
            cfg,
            chunk_path=rd / "chunks" / f"{name}.jsonl",
            index_path=rd / "chunks" / "index.json",
            out_path=tmp_path / f"{name}.safetensors",
            sidecar_path=tmp_path / f"{name}.json",
            ensure=lambda: state,
            progress=False,
        )
    finally:
        for t in held:
            t.release()
        server.stop(state)
    base, peak = sidecar["window"]
    assert base == 1
    if others_sending:
        assert peak == 1
    else:
        assert sidecar["records"] >= 4
        assert 1 < peak <= 4
    got, want = ChunkReader(tmp_path / f"{name}.safetensors"), ChunkReader(rd / chunk["path"])
    assert got.record_ids == want.record_ids
    for j in range(len(want.record_ids)):
        a, b = got[j], want[j]
        assert torch.equal(a["input_ids"], b["input_ids"]), (name, j)
        for key in ("hidden_states", "aux_hidden_states"):  # other batches: float32 noise
            assert (a[key] - b[key]).abs().max().item() <= 1e-5, (name, j, key)


def test_a_job_takes_its_turn_only_once_ready_to_send(demo_run, tmp_path, monkeypatch):
    """The server answered, the records loaded and the chunk file open before the turn is
    taken: a job's start cost overlaps the other jobs' sending, never a turn's."""
    from hsextract import budget, chunks

    workdir, rd = demo_run["workdir"], demo_run["run_dir"]
    monkeypatch.chdir(workdir)
    cfg = copy.deepcopy(load_config(workdir / "config.yaml"))
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(cfg)
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=__import__("os").getpid())
    seen: list[str] = []
    writer_init, turn_acquire = chunks.ChunkWriter.__init__, budget.SendingTurn.acquire

    def init(self, *a, **k):
        seen.append("writer")
        writer_init(self, *a, **k)

    def acquire(self):
        seen.append("turn")
        return turn_acquire(self)

    def ensure():
        seen.append("server")
        return state

    monkeypatch.setattr(chunks.ChunkWriter, "__init__", init)
    monkeypatch.setattr(budget.SendingTurn, "acquire", acquire)
    name = Path(demo_run["manifest"]["chunks"][0]["path"]).stem
    try:
        extract_chunk(
            cfg,
            chunk_path=rd / "chunks" / f"{name}.jsonl",
            index_path=rd / "chunks" / "index.json",
            out_path=tmp_path / f"{name}.safetensors",
            sidecar_path=tmp_path / f"{name}.json",
            ensure=ensure,
            progress=False,
        )
    finally:
        server.stop(state)
    assert seen[:3] == ["server", "writer", "turn"], seen
