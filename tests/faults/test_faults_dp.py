"""A data-parallel worker dying mid-chunk (``sglang.dp_size`` 2, one worker SIGKILLed).

What SGLang 0.5.14 does then: nothing.  Its launcher watches the DP controller, not the
schedulers the controller starts, and the controller never polls them
(``data_parallel_controller.py`` ``event_loop``), so the server keeps answering /health
and every request routed to the dead worker waits forever.  The reference engine's DP
front behaves the same.  What hsextract does: the client times out on those requests
(transient), and ``ensure()`` counts the server's DP workers, finds one gone, replaces the
server and retries: the run completes, equal to the uninterrupted dp 1 run, nothing left.
"""

from __future__ import annotations

from faultkit import FaultRun, fault_test


@fault_test
def test_a_dp_worker_killed_mid_chunk_is_replaced_and_the_run_completes(run: FaultRun):
    run.set_config(**{"sglang.dp_size": 2})
    # After the first pass of one record of chunk_00001 (it has more passes to run), the
    # worker that ran it SIGKILLs itself; "once": the replacement server's workers are clean.
    spec = run.spec(
        once=str(run.tmp / "fired"),
        extend=[{"rid": "chunk_00001-000003", "nth": [1], "do": "kill"}],
    )
    res = run.extract_all(spec)
    assert res.returncode == 0, res.output[-6000:]
    fired = [e for e in run.fault_log() if e["fault"] == "kill"]
    assert len(fired) == 1, run.fault_log()
    log = run.log("extract_chunk_00001.log")
    assert "1 of its 2 data-parallel worker processes are gone" in log, log[-4000:]
    assert "client.request_timeout_s" in log  # how the loss showed: a request never answered
    # Both chunks equal the dp 1 baseline byte for byte; chunk_00000 untouched; no server
    # or worker left; a rerun has nothing to redo.
    assert run.assert_chunks_sound() == ["chunk_00000", "chunk_00001"]
    run.assert_no_processes_left()
    run.rerun_matches()
