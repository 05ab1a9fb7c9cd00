"""A request the client gives up on leaves nothing behind: aborted, tombstoned, swept.

Against the real reference engine, held on events (fault injection): the first pass of
the request waits on a gate file, so the request outlives the client's timeout with
passes still to run, and the test opens the gate once the client has given up on it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from hsextract import server
from hsextract.capture import ABANDONED_DIR, piece_name
from hsextract.client import Client, model_geometry
from hsextract.config import load_config, typed

LENGTH, PASS = 512, 64  # 64-token chunked prefill: eight passes per request
DEADLINE_S = 120  # for each event a test waits on: generous on a loaded 2-core box


@pytest.fixture
def held_engine(demo_run, tmp_path, monkeypatch):
    """The demo model behind a reference engine whose first pass for a rid 'abandon-me*'
    waits until the test creates ``gate`` (the wait is logged to ``faults``)."""
    monkeypatch.chdir(demo_run["workdir"])
    cfg = copy.deepcopy(load_config("config.yaml"))
    cfg["server"]["chunked_prefill_size"] = PASS
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(cfg)
    gate, fault_log = tmp_path / "gate", tmp_path / "faults.jsonl"
    hold = {
        "log": str(fault_log),
        "extend": [{"rid": "abandon-me", "nth": [1], "do": "wait", "gate": str(gate)}],
    }
    monkeypatch.setenv("HSEXTRACT_FAULTS", json.dumps(hold))
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=os.getpid())
    try:
        yield {"cfg": cfg, "state": state, "dump": tmp_path / "dump", "gate": gate,
               "faults": fault_log}  # fmt: skip
    finally:
        gate.touch()  # never leave the scheduler held, whatever failed
        server.stop(state)


def _until(predicate, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.05)
    return value


def _faults(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _idle(url: str) -> dict:
    def idle() -> dict | None:
        info = requests.get(f"{url}/get_server_info", timeout=5).json()
        return info if info["running"] == 0 and info["waiting"] == 0 else None

    return _until(idle, "the engine to be idle")


def test_a_timed_out_request_is_aborted_and_leaves_no_piece(held_engine):
    cfg, state, dump, gate = (held_engine[k] for k in ("cfg", "state", "dump", "gate"))
    ids = [i % 500 for i in range(LENGTH)]
    # Held on the gate, the first attempt times out whatever its timeout: 5 s is only the
    # deadline for its first pass to run.  The retry must not time out, however slow the
    # machine: before it the client re-ensures the server (our `ensure`), which raises
    # the timeout to a generous one.
    timing = dict(request_timeout_s=5.0, retries=1, backoff_s=0.0, piece_timeout_s=60.0)
    cfg = replace(cfg, client=replace(cfg.client, **timing))
    calls = []

    def ensure() -> dict:
        calls.append(1)
        if len(calls) > 1:
            client.timeout = float(DEADLINE_S)
        return state

    client = Client(cfg, model_geometry(cfg), ensure)
    result: dict = {}

    def extract() -> None:
        try:
            result["out"] = client.extract("abandon-me", "r0", ids)
        except BaseException as exc:  # re-raised by the test thread below
            result["error"] = exc

    worker = threading.Thread(target=extract, name="extract", daemon=True)
    worker.start()
    try:
        # The first pass ran and its piece is on disk, then the request is held.
        (wait,) = _until(lambda: _faults(held_engine["faults"]), "the first pass to be held")
        rid = wait["rid"]
        first = dump / rid / piece_name(0)
        _until(lambda: first.exists() or client.abandoned, "the first pass's piece")
        assert not client.abandoned, "the client timed out before the first pass was written"
        # The client times out, aborts, tombstones and sweeps: then the engine goes on.
        _until(lambda: client.abandoned, "the client to give up on the first attempt")
        assert client.abandoned == [rid]
        gate.touch()
        worker.join(DEADLINE_S)
        assert not worker.is_alive(), "the retry never returned"
    finally:
        gate.touch()
        worker.join(DEADLINE_S)
    if "error" in result:
        raise result["error"]
    got_ids, hidden, aux = result["out"]  # attempt 2 succeeded
    assert got_ids.tolist() == ids and hidden.shape == (LENGTH, 64)
    assert len(calls) == 2 and client.abandoned == [rid]
    info = _idle(state["url"])
    # The engine stopped prefilling it after the one pass it was held on: aborted
    # part-way, not run to the end.  That pass's piece was on disk before the sweep and
    # it ran no other, so no byte of it can appear later.
    (abort,) = [a for a in info["aborted"] if a["rid"] == rid]
    assert abort["prefilled"] == PASS, abort
    assert not (dump / rid).exists(), sorted(p.name for p in dump.iterdir())
    assert (dump / ABANDONED_DIR / rid).exists()
    # Nothing of any request is left: only the marker, ledger-free here, and tombstones.
    assert sorted(p.name for p in dump.iterdir()) == [".abandoned", ".hsextract-run"]


def test_without_abort_the_server_would_recreate_the_pieces(held_engine):
    """The control: what the client did before (remove the dir, walk away) leaks."""
    state, dump, gate = (held_engine[k] for k in ("state", "dump", "gate"))
    rid = "abandon-me-control"
    body = {"input_ids": [i % 500 for i in range(LENGTH)], "rid": rid, "sampling_params": {}}
    try:
        # Held on the gate, the request outlives any timeout; 1 s keeps the test short.
        with pytest.raises(requests.Timeout):
            requests.post(f"{state['url']}/generate", json=body, timeout=1)
        _until(lambda: _faults(held_engine["faults"]), "the first pass to be held")
        shutil.rmtree(dump / rid, ignore_errors=True)
        gate.touch()
        _idle(state["url"])
    finally:
        gate.touch()
    # The passes after the walk-away wrote their pieces into a fresh dir of the rid (the
    # writer threads finish them after the engine went idle: wait for each one).
    rest = {piece_name(s) for s in range(PASS, LENGTH, PASS)}

    def written() -> list[str]:
        names = sorted(p.name for p in (dump / rid).glob("*.safetensors"))
        return names if rest <= set(names) else []

    left = _until(written, "the pieces of the passes after the walk-away")
    assert sum(Path(dump / rid / n).stat().st_size for n in left) > 0


def test_each_request_takes_the_timeout_the_client_holds_when_it_sends(tmp_path):
    """The retry above raises ``client.timeout`` in its ``ensure()``; on 51ddea2 the
    plain-HTTP path kept the timeout it was built with, so the retry still ran on 5 s and
    failed on a loaded machine.  Here the server reads, as each request arrives, the
    timeout of the client's socket: the one the client held when it sent, first on a new
    connection, then on the same kept-alive one."""
    import http.server

    cfg = typed(load_config(Path(__file__).resolve().parents[1] / "config.yaml"))
    cfg = replace(cfg, client=replace(cfg.client, request_timeout_s=5.0))
    seen: list[list[float | None]] = []
    holder: dict = {}

    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the second request reuses the socket

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            conns = holder["client"]._http._all
            seen.append([c.sock.gettimeout() for c in conns if c.sock is not None])
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    serving = threading.Thread(target=httpd.serve_forever, daemon=True)
    serving.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        state = {"url": url, "spec": {"dump_dir": str(tmp_path / "dump")}}
        client = holder["client"] = Client(cfg, None, lambda: state)  # type: ignore[arg-type]
        try:
            for timeout in (77.0, 33.0):
                client.timeout = timeout
                status, _ = client._post_json(url, "/generate", {"rid": "r"})
                assert status == 200
                assert seen[-1] == [timeout], seen
            assert len(client._http._all) == 1  # the second went over the first's socket
        finally:
            client.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
