"""A request the client gives up on leaves nothing behind: aborted, tombstoned, swept.

Against the real reference engine, with a pass made slow (fault injection) so that the
request outlives the client's timeout with passes still to run.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import requests

from hsextract import server
from hsextract.capture import ABANDONED_DIR
from hsextract.client import Client, model_geometry
from hsextract.config import load_config

SLOW_FIRST_PASS = {"extend": [{"rid": "abandon-me", "nth": [1], "do": "slow", "seconds": 6}]}


@pytest.fixture
def slow_engine(demo_run, tmp_path, monkeypatch):
    """The demo model behind a reference engine whose first pass for rid 'abandon-me*'
    is followed by a 6 s stall; 64-token chunked prefill, so a 512-token request has
    passes left when the client's 4 s timeout fires.  The retry starts after the stall
    (4 + 3 s backoff) and has 4 s for eight tiny passes: generous on a loaded 2-core box
    (a 1.5 s timeout for them once failed there)."""
    monkeypatch.chdir(demo_run["workdir"])
    cfg = copy.deepcopy(load_config("config.yaml"))
    cfg["server"]["chunked_prefill_size"] = 64
    # The retry waits out the stall (backoff 3 s), so only the first attempt times out.
    cfg["client"].update(request_timeout_s=4, retries=1, backoff_s=3.0, piece_timeout_s=10)
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    monkeypatch.setenv("HSEXTRACT_FAULTS", json.dumps(SLOW_FIRST_PASS))
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=os.getpid())
    yield cfg, state, tmp_path / "dump"
    server.stop(state)


def _idle(url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = requests.get(f"{url}/get_server_info", timeout=5).json()
        if info["running"] == 0 and info["waiting"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def test_a_timed_out_request_is_aborted_and_leaves_no_piece(slow_engine):
    cfg, state, dump = slow_engine
    ids = [i % 500 for i in range(512)]
    client = Client(cfg, model_geometry(cfg), lambda: state)
    got_ids, hidden, aux = client.extract("abandon-me", "r0", ids)  # attempt 2 succeeds
    assert got_ids.tolist() == ids and hidden.shape == (512, 64)
    (abandoned,) = client.abandoned
    info = _idle(state["url"])
    time.sleep(1.0)  # a pass still under way when the abort came has written by now
    # The engine stopped prefilling it: aborted part-way, not run to the end.
    (abort,) = [a for a in info["aborted"] if a["rid"] == abandoned]
    assert 0 < abort["prefilled"] < 512
    assert not (dump / abandoned).exists(), sorted(p.name for p in dump.iterdir())
    assert (dump / ABANDONED_DIR / abandoned).exists()
    # Nothing of any request is left: only the marker, ledger-free here, and tombstones.
    assert sorted(p.name for p in dump.iterdir()) == [".abandoned", ".hsextract-run"]


def test_without_abort_the_server_would_recreate_the_pieces(slow_engine):
    """The control: what the client did before (remove the dir, walk away) leaks."""
    cfg, state, dump = slow_engine
    rid = "abandon-me-control"
    body = {"input_ids": [i % 500 for i in range(512)], "rid": rid, "sampling_params": {}}
    with pytest.raises(requests.Timeout):
        requests.post(f"{state['url']}/generate", json=body, timeout=4)
    shutil.rmtree(dump / rid, ignore_errors=True)
    _idle(state["url"])
    time.sleep(0.5)
    left = sorted(p.name for p in (dump / rid).iterdir()) if (dump / rid).exists() else []
    assert left, "the scenario did not exercise a request outliving its client"
    assert sum(Path(dump / rid / n).stat().st_size for n in left) > 0
