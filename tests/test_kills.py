"""A job SIGKILLed mid-work (OOM killer, scheduler preemption, ``kill -9``): no handler of
its runs, so whatever it leaves must be cleared by what runs next (issue 34, item 5).

* A chunk job killed mid-chunk leaves request dirs with pieces, its reservation in the
  dump dir's ledger (``.budget``) and the sending turns (``.turns``) in /dev/shm, i.e.
  RAM: the workflow's end clears them once nothing live uses them, and the dump dir goes
  as after a clean run.
* A merge killed mid-write leaves a full-size ``merged/.train.jsonl.tmp-<pid>`` and its
  pool workers: the workers die with it (PR_SET_PDEATHSIG), and the next merge removes
  the temp file and stops any worker that survived anyway.
* A split killed while writing a chunk file or its index, or while its workers scan,
  leaves ``.chunk_NNNNN.jsonl.tmp-<pid>`` or ``.split.json.tmp-<pid>`` and maybe workers:
  the next split removes and stops them as the merge does.

Every wait is on an event (a file appearing, a process state) under a generous deadline;
a test signals and cleans up only its own processes (its own process groups and the
processes running in its own workdir) and files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from fixtures_demo import (
    kill_processes_under,
    make_workdir,
    poll,
    run_dir_of,
    run_snakemake,
    start_snakemake,
    stop_snakemake,
    wait_until_gone,
)

from hsextract.chunks import check_chunk, sha256_file
from hsextract.records import merge_and_shuffle
from hsextract.records import split_chunks as records_split
from hsextract.status import progress_path

# --------------------------------------------------------------------------- processes


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive_as(pid: int, start: str) -> bool:
    """Still the same process (start time) and not a zombie: a zombie runs nothing, and
    a container's init may never reap an orphan's."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and fields[19] == start


def _children(pid: int) -> dict[int, str]:
    """Live children of ``pid``, with their start times."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[1] == str(pid) and fields[0] not in ("Z", "X"):
                found[int(entry)] = fields[19]
    return found


def _nothing_left_after_rerun(
    rerun: subprocess.Popen, out: Path, workers: dict[int, str], what: str
) -> None:
    """The rerun after a kill succeeds, leaves no temp file in ``out``, and the killed
    run's pool ``workers`` end (they died with it, or the rerun stopped them)."""
    output = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, output[-3000:]
    left = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert left == [], f"left by the killed {what}: {left}"
    poll(
        lambda: not any(_alive_as(p, s) for p, s in workers.items()),
        f"the killed {what}'s pool workers {sorted(workers)} to end",
        timeout=60,
    )


def _stop_own(groups: list[int], workers: dict[int, str]) -> None:
    """A test's ``finally``: its own process groups (the runs and their workers) and the
    workers it saw, by pid and start time; nothing else."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid, start in workers.items():
        if _alive_as(pid, start):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- merge


#: The merge in a process of its own, so the test can SIGKILL it: the pool even for these
#: few KB (what is under test), and with a gate its workers stop at their first copy into
#: the output (after marking that they got there), so the kill lands mid-write.  With
#: ``pdeathsig`` false the workers do not die with it, as where prctl is missing: the next
#: merge must find and stop them.
MERGE_CHILD = r"""
import json, os, sys, time
from pathlib import Path
from hsextract import records
cfg = json.loads(sys.argv[1])
records.PARALLEL_MIN_BYTES = 0
if cfg["hold"]:
    def held(*args, **kwargs):
        Path(cfg["hold"], f"writing-{os.getpid()}").touch()
        while True:
            time.sleep(3600)
    os.copy_file_range = held
if not cfg["pdeathsig"]:
    records._die_with_parent = lambda parent: None
records.merge_and_shuffle(
    cfg["inputs"], Path(cfg["out"]), max_seq_len=64, overlength="truncate", seed=3,
    vocab_size=None, max_reject_fraction=0.5, workers=2,
)
"""


def _child(code: str, cfg: dict) -> subprocess.Popen:
    """``code`` (MERGE_CHILD, SPLIT_CHILD) run with ``cfg`` in a process group of its own:
    the test's ``finally`` stops it and its workers, and only them."""
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def _merge_process(inputs: list[str], out: Path, hold: Path | None, pdeathsig: bool):
    cfg = {"inputs": inputs, "out": str(out), "hold": str(hold) if hold else None,
           "pdeathsig": pdeathsig}  # fmt: skip
    return _child(MERGE_CHILD, cfg)


def _shards(d: Path) -> list[str]:
    d.mkdir()
    paths = []
    for s in range(3):
        lines = []
        for k in range(200):
            n = 1 + (k * 37 + s) % 60
            rec = {"id": f"s{s}-{k}", "input_ids": [(k + i) % 500 for i in range(n)],
                   "loss_mask": [i % 2 for i in range(n)]}  # fmt: skip
            lines.append(orjson.dumps(rec))
        p = d / f"shard{s}.jsonl"
        p.write_bytes(b"\n".join(lines) + b"\n")
        paths.append(str(p))
    return paths


def _outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("train.jsonl", "rejects.jsonl")}


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["workers-die-with-it", "survivors"])
def test_merge_sigkilled_mid_write_next_merge_leaves_no_tmp_and_no_workers(
    tmp_path: Path, pdeathsig: bool
) -> None:
    inputs = _shards(tmp_path / "in")
    never_failed = merge_and_shuffle(
        inputs, tmp_path / "ref", max_seq_len=64, overlength="truncate", seed=3,
        vocab_size=None, max_reject_fraction=0.5, workers=1,
    )  # fmt: skip
    out, hold = tmp_path / "merged", tmp_path / "hold"
    hold.mkdir()
    groups = []
    workers: dict[int, str] = {}
    try:
        killed = _merge_process(inputs, out, hold, pdeathsig)
        groups.append(killed.pid)
        tmp = out / f".train.jsonl.tmp-{killed.pid}"

        def mid_write() -> bool:
            assert killed.poll() is None, killed.communicate()[0][-3000:]
            return tmp.exists() and any(hold.iterdir()) and len(_children(killed.pid)) == 2

        poll(mid_write, "the merge's workers writing train.jsonl", timeout=120)
        workers = _children(killed.pid)
        assert tmp.stat().st_size > 0  # the temp file is made at its full size at once
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)

        rerun = _merge_process(inputs, out, None, True)
        groups.append(rerun.pid)
        _nothing_left_after_rerun(rerun, out, workers, "merge")
        assert _outputs(out) == _outputs(tmp_path / "ref")
        assert json.loads((out / "stats.json").read_text()) == never_failed
    finally:
        _stop_own(groups, workers)


# --------------------------------------------------------------------------- split


#: The split in a process of its own, laid out as the workflow's (chunk files and
#: ``split.json`` in one dir), the pool even for these few KB.  ``hold`` names what it
#: stops at: the fsync of a chunk's or of the index's temp file (mid-write: the temp file
#: is on disk), or the workers' first range scan (then ``pdeathsig`` false leaves them
#: running after the kill, as where prctl is missing).
SPLIT_CHILD = r"""
import json, os, sys, time
from pathlib import Path
from hsextract import records
cfg = json.loads(sys.argv[1])
records.PARALLEL_MIN_BYTES = 0
def hang():
    Path(cfg["marks"], f"held-{os.getpid()}").touch()
    while True:
        time.sleep(3600)
if cfg["hold"] in ("chunk_00002.jsonl", "split.json"):
    real_fsync = os.fsync
    def held_fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f".{cfg['hold']}.tmp-{os.getpid()}"):
            hang()
        real_fsync(fd)
    os.fsync = held_fsync
elif cfg["hold"] == "scan":
    def held_scan(task):  # by name: the pool pickles it
        hang()
    records._scan_task = held_scan
if not cfg["pdeathsig"]:
    records._die_with_parent = lambda parent: None
d = Path(cfg["dir"])
records.split_chunks(
    Path(cfg["merged"]), [d / f"chunk_{i:05d}.jsonl" for i in range(4)], d / "split.json",
    workers=2,
)
"""


def _split_process(merged: Path, out: Path, marks: Path, hold: str | None, pdeathsig: bool):
    cfg = {"merged": str(merged), "dir": str(out), "marks": str(marks), "hold": hold,
           "pdeathsig": pdeathsig}  # fmt: skip
    return _child(SPLIT_CHILD, cfg)


@pytest.mark.parametrize(
    ("hold", "pdeathsig"),
    [("chunk_00002.jsonl", True), ("split.json", True), ("scan", False)],
    ids=["mid-chunk-write", "mid-index-write", "surviving-workers"],
)
def test_split_sigkilled_next_split_leaves_no_tmp_and_no_workers(
    tmp_path: Path, hold: str, pdeathsig: bool
) -> None:
    """A split SIGKILLed while writing a chunk file, while writing its index, or while
    its workers scan (workers that outlive it): the next split leaves no temp file and no
    worker, and writes what a split that was never killed writes."""
    merge_and_shuffle(
        _shards(tmp_path / "in"), tmp_path / "merged", max_seq_len=64, overlength="truncate",
        seed=3, vocab_size=None, max_reject_fraction=0.5, workers=1,
    )  # fmt: skip
    merged = tmp_path / "merged" / "train.jsonl"
    ref, out, marks = tmp_path / "ref", tmp_path / "chunks", tmp_path / "marks"
    marks.mkdir()
    records_split(merged, [ref / f"chunk_{i:05d}.jsonl" for i in range(4)],
                              ref / "split.json", workers=1)  # fmt: skip
    groups = []
    workers: dict[int, str] = {}
    try:
        killed = _split_process(merged, out, marks, hold, pdeathsig)
        groups.append(killed.pid)

        def held() -> bool:
            assert killed.poll() is None, killed.communicate()[0][-3000:]
            if not any(marks.iterdir()):
                return False
            return hold != "scan" or len(_children(killed.pid)) == 2

        poll(held, f"the split held at {hold}", timeout=120)
        workers = _children(killed.pid)
        if hold != "scan":
            assert (out / f".{hold}.tmp-{killed.pid}").is_file()
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)

        rerun = _split_process(merged, out, marks, None, True)
        groups.append(rerun.pid)
        _nothing_left_after_rerun(rerun, out, workers, "split")
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
        for p in ref.iterdir():
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    finally:
        _stop_own(groups, workers)


# --------------------------------------------------------------------------- chunk job


def test_dump_dir_cleanup_spares_a_live_jobs_pieces_and_foreign_files(tmp_path: Path) -> None:
    """What the workflow's end removes after a killed chunk job, and what it never does:
    pieces while a live job holds a reservation, or a file hsextract did not write."""
    from hsextract.config import RUN_MARKER
    from hsextract.server import remove_dump_dir_if_empty

    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    (dump / RUN_MARKER).write_text(json.dumps({"kind": "dump", "run_dir": str(tmp_path)}))
    piece = dump / "chunk_00001-000003-0123abcd" / "000000000.safetensors"
    piece.parent.mkdir()
    piece.write_bytes(b"p" * 64)
    code = (
        "import time; from pathlib import Path; from hsextract.budget import SharedByteBudget; "
        f"SharedByteBudget(Path({str(dump)!r}), 1 << 20).acquire(64); print('held', flush=True); "
        "time.sleep(600)"
    )
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "held"
        assert not remove_dump_dir_if_empty(dump)  # a live job's request: its pieces stay
        assert piece.exists()
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        job.kill()
        job.wait()
    (dump / "notes.txt").write_text("someone's file")
    assert not remove_dump_dir_if_empty(dump)  # the killed job's things go, not the notes
    assert sorted(p.name for p in dump.iterdir()) == [RUN_MARKER, "notes.txt"]
    (dump / "notes.txt").unlink()
    assert remove_dump_dir_if_empty(dump)
    assert not dump.exists()


# --------------------------------------------------------------------------- chunk job (workflow)


#: Small and quick (the fault suite's config): 16 records in 2 chunks, a dump dir of its
#: own inside the workdir so nothing else's pieces are in sight.
CHUNK_CONFIG = {
    "demo.n_records": 16,
    "n_chunks": 2,
    "dump.dir": "shm/dump",
    "server.health_timeout_s": 120,
}


@pytest.mark.workflow
def test_chunk_job_sigkilled_mid_chunk_leaves_nothing_in_the_dump_dir(tmp_path: Path) -> None:
    """The server is held after chunk_00001's first pass (its piece on disk), the chunk
    job holding a reservation and a turn; only that job is SIGKILLed.  Snakemake goes on
    to its error handler; when it ends nothing of the job is left in the dump dir, which
    goes as after a clean run, and so after the rerun that redoes the chunk."""
    workdir = make_workdir(tmp_path / "w", **CHUNK_CONFIG)
    (workdir / "shm").mkdir()
    dump = workdir / "shm" / "dump"
    gate, log = tmp_path / "gate", tmp_path / "faults.jsonl"
    faults = {
        "log": str(log),
        "extend": [{"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": str(gate)}],
    }
    proc = start_snakemake(workdir, "-j1", "extract_all", faults=faults)
    try:
        rd = run_dir_of(workdir)
        progress = progress_path(rd / "hidden" / "chunk_00001.safetensors")

        def held_mid_chunk() -> bool:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            waiting = log.exists() and '"fault": "wait"' in log.read_text()
            return (
                waiting
                and progress.exists()
                and any(dump.glob("chunk_00001-*/*.safetensors"))
                and any((dump / ".budget").glob("*-*-*-*"))
                and any((dump / ".turns").glob("turn-*"))
            )

        poll(held_mid_chunk, "chunk_00001 held on the server with a piece written")
        job = json.loads(progress.read_text())["pid"]
        cmdline = Path(f"/proc/{job}/cmdline").read_bytes()
        cwd = os.readlink(f"/proc/{job}/cwd")
        assert b"extract_chunk" in cmdline and cwd.startswith(str(workdir)), (cmdline, cwd)
        assert any((dump / ".budget").glob(f"{job}-*")), "the job holds no reservation"
        os.kill(job, signal.SIGKILL)
        gate.touch()  # the server finishes the dead job's request: more pieces of it
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode != 0, out[-4000:]
        left = wait_until_gone(workdir)
        assert not left, f"still running after the failed run: {left}"
        leftovers = [str(p.relative_to(dump)) for p in dump.rglob("*")] if dump.exists() else []
        assert not dump.exists(), f"the killed chunk job's leftovers in {dump}: {leftovers}"

        run_snakemake(workdir, "-j1", "extract_all")
        assert not dump.exists(), f"{dump} left after the rerun: {sorted(dump.rglob('*'))}"
        manifest = json.loads((rd / "manifest.json").read_text())
        assert [c["path"] for c in manifest["chunks"]] == [
            "hidden/chunk_00000.safetensors",
            "hidden/chunk_00001.safetensors",
        ]
        for c in manifest["chunks"]:
            assert sha256_file(rd / c["path"]) == c["sha256"]
            check_chunk(rd / c["path"], expect_records=c["records"])
        assert not wait_until_gone(workdir), "a server outlived the rerun"
    finally:
        gate.touch()
        stop_snakemake(proc, signal.SIGKILL)
        kill_processes_under(workdir)
