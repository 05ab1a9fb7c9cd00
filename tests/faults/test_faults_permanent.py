"""Permanent faults of the dump protocol fail the chunk at once, with the evidence.

A corrupt piece, a coverage gap after the request completed, broken token parity: none
of these is retried (a retry would hide a broken server or capture).  The message names
the chunk, the record, the rid and the file or ranges; the rerun, fault gone, equals an
uninterrupted run.
"""

from __future__ import annotations

import re

from faultkit import FaultRun, fault_test


def one_piece_fault(run: FaultRun, do: str, **extra) -> tuple[str, dict]:
    """Arm one piece fault on the 2nd request of chunk_00001; return the output and it."""
    spec = run.spec(piece=[{"rid": "chunk_00001", "nth": [2], "do": do, **extra}])
    out = run.fail(spec)
    fired = [e for e in run.fault_log() if e["fault"] == do]
    assert len(fired) == 1, run.fault_log()
    return out, fired[0]


def assert_not_retried(run: FaultRun) -> None:
    log = run.log("extract_chunk_00001.log")
    assert "retry" not in log, log


@fault_test
def test_corrupt_piece_fails_at_once_naming_the_file(run: FaultRun):
    # A truncated piece, then (second faulted run) a piece with a garbage header.
    out, fault = one_piece_fault(run, "truncate")
    present = run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        f"(rid {fault['rid']})",
        f"corrupt dump piece {fault['file']}",
        "permanent, not retried",
    )
    assert present == ["chunk_00000"]
    assert_not_retried(run)
    (run.tmp / "faults.jsonl").unlink()
    out, fault = one_piece_fault(run, "bad_header")
    run.assert_failed_cleanly(
        out, f"(rid {fault['rid']})", f"corrupt dump piece {fault['file']}: unreadable"
    )
    assert_not_retried(run)
    run.rerun_matches()


@fault_test
def test_piece_missing_after_completion_is_a_gap_not_retried(run: FaultRun):
    out, fault = one_piece_fault(run, "drop")
    run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        f"dump pieces of {fault['rid']} cover ",
        "after the request completed, not [0, ",
        "client.piece_timeout_s",
    )
    # The evidence: which ranges were there, and that the dropped one is not among them.
    m = re.search(r"cover (\[.*?\]) after the request completed, not \[0, (\d+)\)", out)
    assert m, out[-3000:]
    dropped = int(fault["file"].rsplit("/", 1)[1].split(".")[0])
    assert f"({dropped}, " not in m.group(1), m.group(0)
    assert_not_retried(run)
    run.rerun_matches()


@fault_test
def test_token_parity_broken_fails_at_once(run: FaultRun):
    out, fault = one_piece_fault(run, "flip_id")
    run.assert_failed_cleanly(
        out,
        "chunk chunk_00001: record ",
        f"(rid {fault['rid']}): token parity broken: dumped ids differ from the ids sent",
        "first differing positions [",
    )
    # The flipped token is the first one of the piece: its position is reported.
    start = int(fault["file"].rsplit("/", 1)[1].split(".")[0])
    assert f"first differing positions [{start}]" in out, out[-3000:]
    assert out.count(f"(rid {fault['rid']})") == out.count("token parity broken")  # said once
    assert_not_retried(run)
    run.rerun_matches()
