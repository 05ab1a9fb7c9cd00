"""Transient faults (HTTP 500, a hung request, a dying server) are retried with backoff.

A one-off transient fault costs a retry and the run still succeeds, bit-identical to an
uninterrupted one; a persistent one fails the chunk after ``client.retries`` retries with
a message naming the chunk, the record and the cause -- and the rerun, fault gone, equals
an uninterrupted run.
"""

from __future__ import annotations

import re
from collections import Counter

from faultkit import FaultRun, fault_test


def attempts_per_record(run: FaultRun, what: str) -> Counter:
    """How often each record (rid without its per-attempt suffix) hit the fault."""
    return Counter(e["rid"].rsplit("-", 1)[0] for e in run.fault_log() if e["fault"] == what)


@fault_test
def test_one_off_transient_faults_are_retried_and_the_run_succeeds(run: FaultRun):
    run.set_config(**{"client.request_timeout_s": 4})
    spec = run.spec(
        once=str(run.tmp / "fired"),  # the server relaunched after the kill is clean
        generate=[
            {"rid": "chunk_00001-000001", "nth": [1], "do": "500"},
            # Record 4 hangs; its retry then kills the server; its third attempt succeeds.
            {"rid": "chunk_00001-000004", "nth": [1], "do": "hang"},
            {"rid": "chunk_00001-000004", "nth": [2], "do": "kill"},
        ],
    )
    res = run.extract_all(spec)
    assert res.returncode == 0, res.output[-5000:]
    fired = [e["fault"] for e in run.fault_log()]
    assert sorted(fired) == ["500", "hang", "kill"], fired
    log = run.log("extract_chunk_00001.log")
    # Each fault was seen and retried after the first backoff (client.backoff_s = 0.2).
    assert re.search(r"HTTP 500: .*injected fault.*; retry 1/2 in 0\.2s", log), log
    assert re.search(r"no answer within 4s \(client.request_timeout_s\); retry 1/2", log), log
    assert re.search(r"connection failed: .*; retry 2/2 in 0\.4s", log), log
    # The killed server was relaunched exactly once from its record (plus this run's
    # first launch, plus the baseline's): a restarting server is a transient fault.
    starts = run.log("server.log").count(" start: ")
    assert starts == 3, run.log("server.log")[-3000:]
    manifest = run.rerun_matches()  # nothing left to do: the faulted run already finished
    assert "Nothing to be done" in manifest.output


@fault_test
def test_http_500_persistent_fails_after_retries_with_backoff(run: FaultRun):
    # One sending turn: the job's window is exactly client.requests_in_flight (8), not the
    # vacant turns' share too (client._Window), so which records were tried is exact.
    run.set_config(**{"client.sending_jobs": 1})
    spec = run.spec(generate=[{"rid": "chunk_00001", "do": "500"}])
    out = run.fail(spec)
    present = run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        "gave up after 3 attempts (client.retries=2): HTTP 500",
        "injected fault",
        "server.log",
    )
    assert present == ["chunk_00000"]  # the finished chunk is kept
    # Every record of the chunk was tried exactly retries + 1 times, with doubling backoff.
    tries = attempts_per_record(run, "500")
    assert len(tries) == 8 and set(tries.values()) == {3}, tries
    log = run.log("extract_chunk_00001.log")
    assert "retry 1/2 in 0.2s" in log and "retry 2/2 in 0.4s" in log, log
    run.rerun_matches()


@fault_test
def test_hung_server_times_out_and_fails_after_retries(run: FaultRun):
    run.set_config(**{"client.request_timeout_s": 3, "client.retries": 1, "client.sending_jobs": 1})
    spec = run.spec(generate=[{"rid": "chunk_00001", "do": "hang"}])
    out = run.fail(spec)
    run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        "gave up after 2 attempts (client.retries=1): no answer within 3s "
        "(client.request_timeout_s)",
    )
    tries = attempts_per_record(run, "hang")
    assert len(tries) == 8 and set(tries.values()) == {2}, tries
    run.set_config(**{"client.request_timeout_s": 8, "client.retries": 2})
    run.rerun_matches()


@fault_test
def test_server_killed_mid_chunk_is_relaunched_then_the_chunk_fails(run: FaultRun):
    # Every server process SIGKILLs itself when record 3 of chunk_00001 reaches it; one
    # request in flight makes the sequence exact: kill, relaunch, kill, give up.  One
    # sending turn, so the window is that one request, not the vacant turns' share too
    # (client._Window): with three in flight, the kill cut another record's answer
    # mid-body (the CI run of 2026-12-05; test_answer_cut_mid_body_... covers that case).
    run.set_config(
        **{"client.retries": 1, "client.requests_in_flight": 1, "client.sending_jobs": 1}
    )
    spec = run.spec(generate=[{"rid": "chunk_00001-000003", "nth": [1], "do": "kill"}])
    out = run.fail(spec)
    run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        "gave up after 2 attempts (client.retries=1): connection failed",
    )
    kills = [e for e in run.fault_log() if e["fault"] == "kill"]
    assert len(kills) == 2 and kills[0]["pid"] != kills[1]["pid"], kills
    assert "retry 1/1 in 0.2s" in run.log("extract_chunk_00001.log")
    run.set_config(**{"client.retries": 2, "client.requests_in_flight": 8})
    run.rerun_matches()


@fault_test
def test_answer_cut_mid_body_is_retried_then_the_chunk_fails(run: FaultRun):
    """A server that dies mid-answer (status line and headers sent, no body) is a connection
    failure, retried like one: not an unclassified error blamed on the chunk file (it was
    reported as "cannot write ...safetensors: Connection broken: IncompleteRead")."""
    run.set_config(
        **{"client.retries": 1, "client.requests_in_flight": 1, "client.sending_jobs": 1}
    )
    spec = run.spec(generate=[{"rid": "chunk_00001-000003", "do": "cut"}])
    out = run.fail(spec)
    run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        "gave up after 2 attempts (client.retries=1): connection failed mid-answer",
        "IncompleteRead",
    )
    assert "cannot write" not in out, out[-3000:]
    assert attempts_per_record(run, "cut") == Counter({"chunk_00001-000003": 2})
    assert "retry 1/1 in 0.2s" in run.log("extract_chunk_00001.log")
    run.set_config(**{"client.retries": 2, "client.requests_in_flight": 8})
    run.rerun_matches()
