"""A workflow SIGKILLed and not rerun leaves its dump dir in RAM (/dev/shm): its markers, a
ledger, sending turns.  ``hsextract status`` of any run under the output root names such
dirs (their run holds no claim: no workflow, no live server), and the stale stage of a
later workflow under that root removes those holding only what the capture protocol
writes; one holding someone's file loses only the protocol's files.  On 51ddea2 the stale
stage kept them ("its run is kept") and status said nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from fixtures_demo import make_workdir, run_dir_of

from hsextract.budget import LEDGER_DIR, TURNS_DIR
from hsextract.config import RUN_MARKER
from hsextract.stale import delete_stale


def a_run(root: Path, name: str) -> Path:
    run = root / name
    (run / "state").mkdir(parents=True)
    (run / RUN_MARKER).write_text("{}")
    return run


def a_dump(droot: Path, run: Path, *, foreign: bool = False) -> Path:
    """A dump dir as a killed workflow leaves it: the marker naming its run, the ledger's
    lock, a sending turn (empty files), maybe a user's file."""
    d = droot / f"hsextract-me-{os.getuid()}-{run.name}-abcdef"
    (d / LEDGER_DIR).mkdir(parents=True)
    (d / LEDGER_DIR / "lock").touch()
    (d / TURNS_DIR).mkdir()
    (d / TURNS_DIR / "turn-0").touch()
    info = {"kind": "dump", "run_dir": str(run.resolve()), "output_root": str(run.parent.resolve())}
    (d / RUN_MARKER).write_text(json.dumps(info))
    if foreign:
        (d / "notes.txt").write_text("mine")
    return d


def test_status_names_unclaimed_dump_dirs_and_the_next_workflows_stale_stage_removes_them(
    tmp_path: Path,
) -> None:
    wd = make_workdir(tmp_path / "w", **{"dump.dir": "shm/dump"})
    droot = wd / "shm"
    droot.mkdir()
    current = run_dir_of(wd)
    root = current.parent
    root.mkdir(parents=True, exist_ok=True)  # the demo's model may be in place under it
    killed, other, busy = a_run(root, "aaaa"), a_run(root, "bbbb"), a_run(root, "cccc")
    gone = a_dump(droot, killed)
    mixed = a_dump(droot, other, foreign=True)
    held = a_dump(droot, busy)
    # busy's server is alive (this process stands for it): its dump dir is in use.
    live = {"pid": os.getpid(), "url": "http://127.0.0.1:1"}
    (busy / "state" / f"server.{socket.gethostname()}.live.json").write_text(json.dumps(live))

    status = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "status", "--configfile", "config.yaml"],
        cwd=wd, capture_output=True, text=True,
    )  # fmt: skip
    named = [ln for ln in status.stdout.splitlines() if ln.startswith("dump dir")]
    assert len(named) == 2, status.stdout + status.stderr
    assert str(gone) in named[0] + named[1] and str(mixed) in named[0] + named[1]
    assert "which no workflow or server holds" in named[0]
    assert any("1 file(s) not ours stay" in ln for ln in named), named
    assert str(held) not in status.stdout

    report = delete_stale(
        root, current, dump_root=droot, keep_runs=5, dry_run=False,
        report_out=tmp_path / "report.json", owner_pid=os.getpid(),
    )  # fmt: skip
    assert not gone.exists(), report
    assert sorted(p.name for p in mixed.iterdir()) == [RUN_MARKER, "notes.txt"]
    assert (held / TURNS_DIR / "turn-0").exists()  # its run's server holds it
    assert killed.is_dir() and other.is_dir()  # the runs themselves are kept (keep_runs)
