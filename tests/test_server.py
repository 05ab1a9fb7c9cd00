"""Server lifetime: start, early death, health timeout, ensure/relaunch, watchdog, dump dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from hsextract import server
from hsextract.procs import pid_alive
from hsextract.server import ServerError, ServerSpec

# A minimal process that speaks /health and /get_model_info: the lifecycle code must not
# care which engine it manages.  (The reference engine itself is exercised end to end in
# test_workflow.py and test_fidelity.py.)
HEALTH_SERVER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok" if self.path == "/health" else json.dumps({"engine": "stub"}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
"""


def spec_for(tmp_path: Path, argv: list[str], *, port: int = 0, timeout: float = 20) -> ServerSpec:
    return ServerSpec(
        engine="stub",
        argv=argv,
        env={},
        host="127.0.0.1",
        port=port,
        log_path=str(tmp_path / "server.log"),
        fingerprint="fp-test",
        dump_dir=str(tmp_path / "dump"),
        health_timeout_s=timeout,
        extra={"port_auto": True},
    )


def health_spec(tmp_path: Path) -> ServerSpec:
    port = server.free_port()
    return spec_for(tmp_path, [sys.executable, "-c", HEALTH_SERVER, "--port", str(port)], port=port)


def wait_dead(pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_early_death_reports_exit_code_and_log_tail(tmp_path):
    code = "import sys; print('CUDA out of memory, tried to allocate', flush=True); sys.exit(3)"
    spec = spec_for(tmp_path, [sys.executable, "-c", code, "--port", "1"])
    with pytest.raises(ServerError) as exc:
        server.start(spec, owner=os.getpid())
    assert "code 3" in str(exc.value) and "CUDA out of memory" in str(exc.value)
    assert "server.log" in str(exc.value)


def test_health_timeout_stops_the_process(tmp_path):
    spec = spec_for(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)", "--port", "1"],
                    timeout=1.0)  # fmt: skip
    with pytest.raises(ServerError, match="health_timeout_s"):
        server.start(spec, owner=os.getpid())
    out = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True)
    assert out.stdout.strip() == "", "the unhealthy server was left running"


def test_stop_kills_the_whole_process_group(tmp_path):
    # A server that forks a worker, like SGLang's TP ranks: the worker must go too.
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n" + HEALTH_SERVER
    )
    port = server.free_port()
    spec = spec_for(tmp_path, [sys.executable, "-c", code, "--port", str(port)], port=port)
    state = server.start(spec, owner=os.getpid())
    try:
        deadline = time.monotonic() + 60
        while True:  # until the worker has been forked
            pgrep = ["pgrep", "-g", str(state["pgid"])]
            members = subprocess.run(pgrep, capture_output=True, text=True).stdout.split()
            if len(members) >= 2:
                break
            assert time.monotonic() < deadline, f"the worker never started: {members}"
            time.sleep(0.05)
    finally:
        server.stop(state)
    assert not server._group_alive(state["pgid"])


def test_watchdog_stops_server_when_owner_dies(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    state = server.start(health_spec(tmp_path), owner=owner.pid)
    assert server.health(state["url"])
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_dead(state["pid"]), "watchdog did not stop the orphaned server"
    assert wait_dead(state["watchdog_pid"])


def test_no_server_starts_once_its_owning_workflow_is_gone(tmp_path, monkeypatch):
    """Issue 20, item 7: a chunk job orphaned by a SIGKILLed Snakemake relaunched the
    server with init as its owner (the fallback to its parent), and it ran forever."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv(server.OWNER_ENV, str(gone.pid))
    monkeypatch.delenv(server.OWNER_SCOPE_ENV, raising=False)
    monkeypatch.delenv(server.OWNER_START_ENV, raising=False)
    spec = health_spec(tmp_path)
    with pytest.raises(ServerError, match=rf"the workflow that owns this run \(pid {gone.pid},"):
        server.ensure(spec, tmp_path / "state")
    assert not server.live_path(tmp_path / "state").exists()
    assert not Path(spec.log_path).exists()  # nothing was started
    # A live pid that is another process than the recorded one (reused): not the owner.
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    monkeypatch.setenv(server.OWNER_START_ENV, "1")
    with pytest.raises(ServerError, match="is gone"):
        server.owner_pid()


def test_ensure_reuses_a_live_server_and_relaunches_a_dead_one(tmp_path, monkeypatch):
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    spec = health_spec(tmp_path)
    state_dir = tmp_path / "state"
    gates = []
    first = server.ensure(spec, state_dir, gate=lambda: gates.append(1))
    try:
        assert gates == [1] and server.health(first["url"])
        again = server.ensure(spec, state_dir, gate=lambda: gates.append(1))
        assert again["pid"] == first["pid"] and gates == [1]
        os.killpg(first["pgid"], signal.SIGKILL)
        wait_dead(first["pid"])
        relaunched = server.ensure(spec, state_dir, gate=lambda: gates.append(1))
        assert relaunched["pid"] != first["pid"] and gates == [1, 1]
        assert server.health(relaunched["url"])
        assert server.read_json(server.live_path(state_dir))["pid"] == relaunched["pid"]
    finally:
        server.stop_live(state_dir)
        server.stop(first)


def test_ensure_refuses_a_server_of_another_run(tmp_path, monkeypatch):
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir = tmp_path / "state"
    spec = health_spec(tmp_path)
    first = server.start(spec)
    try:
        other = dict(first, spec={**first["spec"], "fingerprint": "another-run"})
        server.write_json(server.live_path(state_dir), other)
        state = server.ensure(spec, state_dir)
        assert state["pid"] != first["pid"]  # not reused: it serves a different fingerprint
    finally:
        server.stop_live(state_dir)
        server.stop(first)


def test_ensure_replaces_a_server_started_with_other_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir = tmp_path / "state"
    old = replace(health_spec(tmp_path), settings={"chunked_prefill_size": 257})
    first = server.ensure(old, state_dir)
    try:
        new = replace(old, settings={"chunked_prefill_size": 64})
        assert old.settings_digest != new.settings_digest
        state = server.ensure(new, state_dir)
        assert state["pid"] != first["pid"] and not pid_alive(first["pid"])
        assert state["spec"]["settings"] == {"chunked_prefill_size": 64}
        assert "chunked_prefill_size 257 -> 64" in capsys.readouterr().err
    finally:
        server.stop_live(state_dir)
        server.stop(first)


# /health answers after a delay on its first N calls, then at once: a busy server.
SLOW_HEALTH_SERVER = """
import http.server, json, sys, time
calls = [0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            calls[0] += 1
            if 1 < calls[0] <= 1 + int(sys.argv[3]):
                time.sleep(12)  # past the probe's 10 s timeout
        body = b"ok" if self.path == "/health" else json.dumps({"engine": "stub"}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
"""


def test_one_slow_health_answer_does_not_replace_a_live_server(tmp_path, monkeypatch):
    """Probes in a row (server.health_probes): a busy server is kept; one that never
    answers is replaced."""
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir = tmp_path / "state"
    port = server.free_port()
    argv = [sys.executable, "-c", SLOW_HEALTH_SERVER, "--port", str(port), "1"]
    spec = spec_for(tmp_path, argv, port=port)
    first = server.ensure(spec, state_dir)  # health call 1: at once
    try:
        # call 2 is slow (a probe times out), call 3 answers: kept.
        kept = server.ensure(spec, state_dir, probes=3, interval_s=0.1)
        assert kept["pid"] == first["pid"]
        # One probe only, and the server stalls again: replaced.
        server.stop_live(state_dir)
        argv = [sys.executable, "-c", SLOW_HEALTH_SERVER, "--port", str(port), "5"]
        spec2 = spec_for(tmp_path, argv, port=port)
        stalled = server.ensure(spec2, state_dir)
        replaced = server.ensure(spec2, state_dir, probes=1)
        assert replaced["pid"] != stalled["pid"]
    finally:
        server.stop_live(state_dir)
        server.stop(first)


def test_dump_dir_is_created_private(tmp_path):
    d = server.prepare_dump_dir(tmp_path / "dump")
    assert (d.stat().st_mode & 0o777) == 0o700


def test_dump_dir_symlink_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "dump").symlink_to(target)
    with pytest.raises(ServerError, match="symlink"):
        server.prepare_dump_dir(tmp_path / "dump")


def test_dump_dir_owned_by_another_user_refused(tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    os.chown(d, 12345, 12345)
    with pytest.raises(ServerError, match="owned by uid 12345"):
        server.prepare_dump_dir(d)


def test_spec_roundtrips_through_json(tmp_path):
    spec = health_spec(tmp_path)
    assert ServerSpec(**asdict(spec)) == spec


def test_an_automatic_sglang_port_leaves_room_for_its_grpc_port(tmp_path):
    """Seen on the live H200: SGLang 0.5.14 derives its gRPC port as port + 10000 and exits
    ("SGLANG_GRPC_PORT (68181) must be between 1 and 65535") for a port above 55535."""
    import yaml

    from hsextract.config import read_config

    cfg = yaml.safe_load(
        (Path(__file__).parents[1] / "configs" / "deepseek-v3-8xh200.yaml").read_text()
    )
    cfg["sglang"]["version"] = "0.5.14"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    cfg = read_config(tmp_path / "c.yaml")
    ports = {
        server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "l").port for _ in range(200)
    }
    assert len(ports) > 100 and max(ports) <= server.SGLANG_MAX_PORT == 55535
    assert all(server.free_port("127.0.0.1", 30001) <= 30001 for _ in range(50))


def test_automatic_ports_avoid_the_ephemeral_range(monkeypatch):
    """An automatic port is never one the kernel hands to an outgoing connection: on the
    H200 a dp-2 SGLang lost its HTTP port that way while loading (Errno 98)."""
    monkeypatch.setattr(server, "ephemeral_ports", lambda: (30000, 60999))
    ports = [server.free_port("127.0.0.1", server.SGLANG_MAX_PORT) for _ in range(200)]
    assert all(20000 <= p < 30000 for p in ports), sorted(set(ports))[-5:]
    ports = [server.free_port() for _ in range(300)]
    assert all(p < 30000 or 60999 < p <= 65535 for p in ports)
    assert any(p > 60999 for p in ports) and any(p < 30000 for p in ports)


# -- a server still loading: waited for, never replaced (launch_server does not wait) ----

# /health and the rest once the file argv[3] exists (a model still loading); with argv[4],
# it exits with that code instead (a load that fails), its last words in the log.
GATED_SERVER = (
    """
import os, sys, time
while not os.path.exists(sys.argv[3]):
    time.sleep(0.02)
if len(sys.argv) > 4:
    print("loading failed: injected for the test", flush=True)
    sys.exit(int(sys.argv[4]))
"""
    + HEALTH_SERVER
)


def gated_spec(tmp_path: Path, gate: Path, *extra: str, timeout: float = 120) -> ServerSpec:
    port = server.free_port()
    argv = [sys.executable, "-c", GATED_SERVER, "--port", str(port), str(gate), *extra]
    return spec_for(tmp_path, argv, port=port, timeout=timeout)


def in_thread(fn):
    """Run ``fn`` in a thread; the future holds its result or exception."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_ensure_waits_for_a_starting_server_and_records_when_it_became_healthy(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir, gate = tmp_path / "state", tmp_path / "loaded"
    spec = gated_spec(tmp_path, gate)
    gates = []
    first = server.ensure(spec, state_dir, gate=lambda: gates.append(1), wait=False)
    try:
        live = server.read_json(server.live_path(state_dir))
        assert live["pid"] == first["pid"] and pid_alive(first["pid"])
        assert {"pgid", "watchdog_pid", "url", "started_at", "spec"} <= set(live)
        assert "healthy_at" not in live and gates == [1]
        assert server.starting(live, spec) and not server.is_serving(live, spec)
        # Two chunk jobs find it loading: both wait (outside the lock), neither replaces it.
        waiters = [in_thread(lambda: server.ensure(spec, state_dir, gate=lambda: gates.append(1)))
                   for _ in range(2)]  # fmt: skip
        assert not any(w.done() for w in waiters)
        gate.touch()
        states = [w.result(timeout=120) for w in waiters]
        assert {s["pid"] for s in states} == {first["pid"]} and gates == [1]
        live = server.read_json(server.live_path(state_dir))
        assert live["healthy_at"] >= live["started_at"]
        assert live["model_info"] == {"engine": "stub"} and "server_version" in live
        assert {s["healthy_at"] for s in states} == {live["healthy_at"]}  # recorded once
        # Healthy now: the next ensure() reuses it as before.
        assert server.ensure(spec, state_dir)["healthy_at"] == live["healthy_at"]
    finally:
        gate.touch()
        server.stop_live(state_dir)
        server.stop(first)


def test_a_server_dying_while_it_starts_is_recorded_and_fails_every_waiter_at_once(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir, gate = tmp_path / "state", tmp_path / "loaded"
    spec = gated_spec(tmp_path, gate, "3")
    gates = []
    first = server.ensure(spec, state_dir, gate=lambda: gates.append(1), wait=False)
    try:
        waiter = in_thread(lambda: server.ensure(spec, state_dir))
        gate.touch()  # it exits with code 3 now
        with pytest.raises(ServerError) as exc:
            waiter.result(timeout=120)
        message = str(exc.value)
        assert "exited with code 3 before becoming healthy" in message
        assert "loading failed: injected for the test" in message and "server.log" in message
        live = server.read_json(server.live_path(state_dir))
        assert live["failed"] == message and live["pid"] == first["pid"]
        assert wait_dead(first["watchdog_pid"])  # stopped, watchdog too
        # The next chunk job of this workflow fails at once, with the same words, and
        # starts nothing (no gate, no new process, one start in the log).
        with pytest.raises(ServerError) as again:
            server.ensure(spec, state_dir, gate=lambda: gates.append(1))
        assert str(again.value).startswith(message + "\n") and gates == [1]
        assert "hsextract server stop` clears the record" in str(again.value)
        assert server.read_json(server.live_path(state_dir))["pid"] == first["pid"]
        assert Path(spec.log_path).read_text().count("start: ") == 1
        # A fresh workflow (another owner) starts afresh.
        owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            monkeypatch.setenv(server.OWNER_ENV, str(owner.pid))
            monkeypatch.delenv(server.OWNER_START_ENV, raising=False)
            monkeypatch.delenv(server.OWNER_SCOPE_ENV, raising=False)
            fixed = health_spec(tmp_path)  # same run and settings, the fault gone
            state = server.ensure(fixed, state_dir, gate=lambda: gates.append(1))
            assert state["pid"] != first["pid"] and "failed" not in state and gates == [1, 1]
            assert state["owner_pid"] == owner.pid and server.health(state["url"])
        finally:
            server.stop_live(state_dir)
            owner.kill()
            owner.wait()
    finally:
        server.stop(first)


def test_a_start_past_health_timeout_is_stopped_and_recorded(tmp_path, monkeypatch):
    """The wait counts from started_at: a chunk job that finds the server loading waits
    only what is left of server.health_timeout_s."""
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir, gate = tmp_path / "state", tmp_path / "never"
    spec = gated_spec(tmp_path, gate, timeout=1.0)
    first = server.ensure(spec, state_dir, wait=False)
    try:
        with pytest.raises(ServerError, match=r"not healthy after 1s \(server.health_timeout_s\)"):
            server.ensure(spec, state_dir)
        assert wait_dead(first["pid"]), "the server that never became healthy was left running"
        assert "health_timeout_s" in server.read_json(server.live_path(state_dir))["failed"]
    finally:
        server.stop_live(state_dir)
        server.stop(first)


def test_a_server_gone_before_anyone_waited_is_a_failed_start_not_relaunched(tmp_path, monkeypatch):
    """A bad flag: the server exits before the first chunk job looks.  That job reports it
    (and records it); it does not start the same broken command again."""
    monkeypatch.setenv(server.OWNER_ENV, str(os.getpid()))
    state_dir = tmp_path / "state"
    code = "import sys; print('error: unrecognized arguments: --bogus', flush=True); sys.exit(2)"
    spec = spec_for(tmp_path, [sys.executable, "-c", code, "--port", "1"])
    gates = []
    first = server.ensure(spec, state_dir, gate=lambda: gates.append(1), wait=False)
    try:
        assert wait_dead(first["pid"])
        with pytest.raises(ServerError, match="exited with code 2 before becoming healthy") as e:
            server.ensure(spec, state_dir, gate=lambda: gates.append(1))
        assert "unrecognized arguments: --bogus" in str(e.value) and gates == [1]
        assert server.read_json(server.live_path(state_dir))["failed"] == str(e.value)
    finally:
        server.stop_live(state_dir)
        server.stop(first)
