"""delete_stale: only marked dirs directly under the root go; nothing outside it, ever."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_demo import (
    kill_processes_under,
    make_workdir,
    poll,
    run_dir_of,
    run_snakemake,
    start_snakemake,
    stop_snakemake,
)

from hsextract.stale import RUN_MARKER, StaleDeletionError, active_holders, delete_stale


def _run(root: Path, name: str, size: int = 100, *, marked: bool = True, mtime: int = 0) -> Path:
    d = root / name
    (d / "hidden").mkdir(parents=True)
    (d / "hidden" / "chunk_00000.safetensors").write_bytes(b"x" * size)
    if marked:
        (d / RUN_MARKER).write_text("")
        if mtime:
            os.utime(d / RUN_MARKER, (mtime, mtime))
    return d


def _snapshot(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*")}


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """results/ with: current run, two stale runs, an unmarked dir, a symlinked run dir
    pointing outside, and a stale run holding a symlink to precious data outside."""
    outside = tmp_path / "outside"
    precious = outside / "precious"
    precious.mkdir(parents=True)
    (precious / "data.bin").write_bytes(b"p" * 50)
    (precious / RUN_MARKER).write_text("")  # marked, but outside the root
    root = tmp_path / "results"
    cur = _run(root, "cur000000000")
    old1 = _run(root, "old111111111", 10, mtime=1_000)
    old2 = _run(root, "old222222222", 20, mtime=2_000)
    (old2 / "hidden" / "escape").symlink_to(precious)
    (old2 / "link_to_file").symlink_to(precious / "data.bin")
    unmarked = _run(root, "notours", 30, marked=False)
    (root / "linked_run").symlink_to(precious)
    return dict(root=root, cur=cur, old1=old1, old2=old2, unmarked=unmarked,
                precious=precious, outside=outside)  # fmt: skip


def test_removes_exactly_the_stale_marked_runs(tree, tmp_path: Path) -> None:
    outside_before = _snapshot(tree["outside"])
    report_path = tmp_path / "report.json"
    rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=0,
                       dry_run=False, report_out=report_path)  # fmt: skip
    assert {i["path"] for i in rep["removed"]} == {str(tree["old1"]), str(tree["old2"])}
    assert rep["bytes_freed"] == 10 + 20
    assert not tree["old1"].exists() and not tree["old2"].exists()
    assert tree["cur"].is_dir() and tree["unmarked"].is_dir()
    assert (tree["root"] / "linked_run").is_symlink()  # a link is never a candidate
    assert _snapshot(tree["outside"]) == outside_before  # nothing behind the links went
    assert json.loads(report_path.read_text()) == rep


def test_report_is_written_before_removal(tree, tmp_path: Path, monkeypatch) -> None:
    from hsextract import stale

    report_path = tmp_path / "report.json"
    seen = []

    def boom(path: Path, dev: int) -> None:
        seen.append(json.loads(report_path.read_text()))
        raise OSError("disk on fire")

    monkeypatch.setattr(stale, "_remove_tree", boom)
    with pytest.raises(OSError):
        delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=0,
                     dry_run=False, report_out=report_path)  # fmt: skip
    (before,) = seen
    assert before["status"] == "planned"
    assert {i["path"] for i in before["will_remove"]} == {str(tree["old1"]), str(tree["old2"])}
    assert before["will_remove_bytes"] == 30 and before["removed"] == []


def test_keep_runs_keeps_the_newest_and_dry_run_removes_nothing(tree, tmp_path: Path) -> None:
    before = _snapshot(tmp_path)
    rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=1,
                       dry_run=True, report_out=tmp_path / "r.json")  # fmt: skip
    assert [i["path"] for i in rep["will_remove"]] == [str(tree["old1"])]
    assert rep["removed"] == [] and rep["bytes_freed"] == 0
    assert _snapshot(tmp_path) - {str(tmp_path / "r.json")} == before
    rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=1,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert [i["path"] for i in rep["removed"]] == [str(tree["old1"])]
    assert tree["old2"].exists()


def test_dotdot_in_the_configured_root_is_resolved(tree, tmp_path: Path) -> None:
    sneaky = tmp_path / "outside" / ".." / "results"
    rep = delete_stale(sneaky, "cur000000000", dump_root=None, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert rep["output_root"] == str(tree["root"].resolve())
    assert tree["precious"].exists() and (tree["precious"] / "data.bin").exists()
    # A root of "outside/.." is tmp_path itself: its children carry no marker, so nothing.
    rep = delete_stale(tmp_path / "outside" / "..", "x", dump_root=None, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r2.json")  # fmt: skip
    assert rep["removed"] == [] and tree["cur"].exists() and tree["unmarked"].exists()


@pytest.mark.parametrize("bad", ["/", "/..", "//", "home"])
def test_dangerous_roots_are_refused(tree, tmp_path: Path, monkeypatch, bad: str) -> None:
    monkeypatch.setenv("HOME", str(tree["root"]))
    root = tree["root"] if bad == "home" else Path(bad)
    with pytest.raises(StaleDeletionError, match="refusing"):
        delete_stale(root, "cur000000000", dump_root=None, keep_runs=0, dry_run=False,
                     report_out=tmp_path / "r.json")  # fmt: skip
    assert tree["old1"].exists() and not (tmp_path / "r.json").exists()


def test_mount_point_root_is_refused(tmp_path: Path) -> None:
    mount = next(p for p in (Path("/proc"), Path("/dev"), Path("/sys")) if os.path.ismount(p))
    with pytest.raises(StaleDeletionError, match="filesystem root"):
        delete_stale(mount, "x", dump_root=None, keep_runs=0, dry_run=True,
                     report_out=tmp_path / "r.json")  # fmt: skip


def _dump(shm: Path, name: str, run: Path | None, size: int = 10) -> Path:
    """A dump dir whose marker names the run that owns it (as server.prepare_dump_dir)."""
    d = shm / name
    rid = d / "chunk_00000-000001-0123abcd"  # the client's request ids (client.extract_dump)
    rid.mkdir(parents=True)
    (rid / "000000000.safetensors").write_bytes(b"p" * size)
    info = {} if run is None else {"kind": "dump", "run_dir": str(run.resolve()),
                                   "output_root": str(run.resolve().parent)}  # fmt: skip
    (d / RUN_MARKER).write_text(json.dumps(info))
    return d


def test_dump_dirs_only_of_removed_runs_and_pieces_of_current(tree, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    cur = _dump(shm, "hsextract-u-1-cur", tree["cur"], 100)  # keep dir + marker, drop pieces
    stale = _dump(shm, "hsextract-u-1-old", tree["old1"], 7)  # its run goes: it goes
    # Another checkout with the same fingerprint on this host: same name but for the root
    # tag, another output root in its marker.  Mid-extraction: every piece must stay.
    other_root = tmp_path / "elsewhere" / "results"
    other = _dump(shm, "hsextract-u-1-cur-other", _run(other_root, "cur000000000"), 9)
    unmarked = _run(shm, "somebody-else", 11, marked=False)
    before_other = _snapshot(other)
    rep = delete_stale(tree["root"], "cur000000000", dump_root=shm, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    kinds = {(i["kind"], i["path"]) for i in rep["removed"]}
    assert ("dump", str(stale)) in kinds and ("dump_pieces", str(cur)) in kinds
    assert not stale.exists()
    assert sorted(p.name for p in cur.iterdir()) == [RUN_MARKER]
    assert _snapshot(other) == before_other and unmarked.exists()
    stale_marker = len(json.dumps({"kind": "dump", "run_dir": str(tree["old1"].resolve()),
                                   "output_root": str(tree["root"].resolve())}))  # fmt: skip
    assert rep["bytes_freed"] == 10 + 20 + (7 + stale_marker) + 100


def test_legacy_dump_dir_names_match_by_root_tag(tree, tmp_path: Path) -> None:
    """Markers written before they named their run: matched by the name's root tag."""
    import hashlib

    shm = tmp_path / "shm"
    tag = hashlib.sha256(str(tree["root"].resolve()).encode()).hexdigest()[:6]
    ours = _dump(shm, f"hsextract-u-{os.getuid()}-old111111111-{tag}", None, 5)
    theirs = _dump(shm, f"hsextract-u-{os.getuid()}-old111111111-ffffff", None, 5)
    delete_stale(tree["root"], "cur000000000", dump_root=shm, keep_runs=0, dry_run=False,
                 report_out=tmp_path / "r.json")  # fmt: skip
    assert not ours.exists() and theirs.exists()


def test_a_run_in_use_is_never_deleted(tree, tmp_path: Path) -> None:
    """A live server recorded in it, or a workflow holding its activity lock."""
    import socket
    import subprocess
    import sys

    from hsextract.stale import hold_run_lock

    host = socket.gethostname()
    # old1: a live server (this very process stands in for its pid).
    (tree["old1"] / "state").mkdir()
    (tree["old1"] / "state" / f"server.{host}.live.json").write_text(
        json.dumps({"pid": os.getpid()})
    )
    # old2: a workflow in another process holds the run's activity lock.
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[2]);"
        "from hsextract.stale import hold_run_lock; hold_run_lock(sys.argv[1]);"
        "print('held', flush=True); time.sleep(60)"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tree["old2"]), src],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=0,
                           dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
        assert rep["removed"] == [] and tree["old1"].exists() and tree["old2"].exists()
        why = {Path(i["path"]).name: i["why"] for i in rep["kept"]}
        assert "live server" in why["old111111111"]
        assert "running workflow" in why["old222222222"]
    finally:
        holder.kill()
        holder.wait()
    # Once the holder is gone (SIGKILL: the kernel drops its lock) and the server record
    # is of a dead process, both go.
    (tree["old1"] / "state" / f"server.{host}.live.json").write_text(json.dumps({"pid": 1 << 22}))
    rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert not tree["old1"].exists() and not tree["old2"].exists()
    # Our own lock on the current run never blocks the current run's own cleanup.
    hold_run_lock(tree["cur"])


def test_finished_runs_and_older_versions_are_kept_unless_asked(tree, tmp_path: Path) -> None:
    for run in (tree["old1"], tree["old2"]):  # a finished chunk: file + sidecar
        (run / "hidden" / "chunk_00000.json").write_text("{}")
    (tree["old2"] / RUN_MARKER).write_text(json.dumps({"hsextract_version": "0.1.0"}))
    rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert rep["removed"] == [] and tree["old1"].exists() and tree["old2"].exists()
    assert all("stale.delete_finished" in i["why"] for i in rep["kept"])
    rep = delete_stale(tree["root"], "cur000000000", dump_root=None, keep_runs=0, dry_run=False,
                       delete_finished=True, report_out=tmp_path / "r.json")  # fmt: skip
    assert not tree["old1"].exists() and not tree["old2"].exists()
    marker = len(json.dumps({"hsextract_version": "0.1.0"}))
    assert rep["bytes_freed"] == (10 + 2) + (20 + 2 + marker)  # chunks, sidecars, marker


def test_other_users_dirs_are_skipped_not_fatal(tree, tmp_path: Path) -> None:
    """A shared node: another user's 0700 dirs in /dev/shm and in a shared output root."""
    shm = tmp_path / "shm"
    theirs = _dump(shm, "hsextract-them-12345-old111111111-abcdef", tree["old1"], 3)
    os.chmod(theirs, 0o700)
    os.chown(theirs, 12345, 12345)
    their_run = _run(tree["root"], "their0000000")
    os.chown(their_run, 12345, 12345)
    rep = delete_stale(tree["root"], "cur000000000", dump_root=shm, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert theirs.exists() and their_run.exists()
    assert any("another user" in s for s in rep["skipped"])
    assert not tree["old1"].exists()


def test_preview_lists_what_would_go_with_sizes(tree, tmp_path: Path) -> None:
    from hsextract.stale import preview

    (tree["old2"] / "hidden" / "chunk_00000.json").write_text("{}")
    before = _snapshot(tree["root"])
    lines = preview(tree["root"], "cur000000000", dump_root=None, keep_runs=0,
                    delete_finished=False)  # fmt: skip
    assert _snapshot(tree["root"]) == before  # looks, never touches
    text = "\n".join(lines)
    assert f"remove {tree['old1']}  10 B" in text
    assert f"keep   {tree['old2']}  22 B" in text and "1 finished chunk" in text


def test_symlinked_marked_candidate_swapped_in_is_not_followed(tree, tmp_path: Path) -> None:
    """A stale run dir replaced by a symlink before removal: the link goes, not its target."""
    from hsextract import stale

    target = tree["precious"]
    os.rename(tree["old1"], tmp_path / "moved")
    tree["old1"].symlink_to(target)
    stale._remove_tree(tree["old1"], os.lstat(tree["root"]).st_dev)
    assert not tree["old1"].exists() and (target / "data.bin").exists()


def _plant_run(root: Path, name: str, like: Path | None = None, mtime: int = 1_000) -> Path:
    """An older run dir: a copy of ``like``'s finished chunks, or an unfinished one."""
    import shutil

    d = root / name
    if like is not None:
        shutil.copytree(like / "hidden", d / "hidden")
    else:
        (d / "merged").mkdir(parents=True)
        (d / "merged" / "train.jsonl").write_bytes(b"{}\n" * 10)
    (d / RUN_MARKER).write_text("{}")
    os.utime(d / RUN_MARKER, (mtime, mtime))
    return d


@pytest.mark.workflow
def test_setting_delete_finished_deletes_what_the_printed_plan_says(demo_copy) -> None:
    """Issue 20, item 9: the setting was printed as applied ('remove ... (run)') but the
    rule did not rerun under rerun-triggers [mtime], so nothing was deleted."""
    import yaml
    from fixtures_demo import run_snakemake

    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    old = _plant_run(rd.parent, "0ld000000000", like=rd)
    proc = run_snakemake(wd, "-n", "extract_all")
    assert f"keep   {old}" in proc.stderr and "set stale.delete_finished: true" in proc.stderr
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    cfg["stale"]["delete_finished"] = True
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_snakemake(wd, "-j1", "extract_all")
    printed = [ln.split()[1] for ln in proc.stderr.splitlines() if ln.startswith("  remove ")]
    assert printed == [str(old)], proc.stderr[-3000:]
    assert not old.exists(), "the printed plan said remove; the run dir is still there"
    report = json.loads((rd / "state" / "stale_deleted.json").read_text())
    assert [i["path"] for i in report["removed"]] == printed and report["delete_finished"]
    # A run that becomes deletable while the rule is up to date: the plan says so, and
    # the command it prints removes it.
    unfinished = _plant_run(rd.parent, "1ld111111111")
    proc = run_snakemake(wd, "-n", "extract_all")
    assert f"remove {unfinished}" in proc.stderr
    assert "add --forcerun delete_stale_states to this command" in proc.stderr
    run_snakemake(wd, "-j1", "extract_all", "--forcerun", "delete_stale_states")
    assert not unfinished.exists() and rd.is_dir()


# --------------------------------------------------------------------------- one workflow


_HOLD = (
    "import sys; from hsextract.stale import hold_run_lock; hold_run_lock(sys.argv[1]);"
    "print('held', flush=True); sys.stdin.read()"
)


def _holder(run: Path) -> subprocess.Popen:
    """A process holding ``run``'s activity lock until its stdin closes (then it exits
    normally) or it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_activity_lock_files_go_with_their_holder_and_a_dead_ones_with_the_next_look(
    tmp_path: Path,
) -> None:
    """Issue 38, item 13: every invocation left a ``state/active/<host>-<pid>.lock``.
    A holder that exits removes its own; one SIGKILLed cannot, and the next look
    (a claim, stale deletion) removes it -- never a live holder's."""
    run = tmp_path / "run"
    active = run / "state" / "active"
    host = socket.gethostname()
    clean, killed, live = _holder(run), _holder(run), _holder(run)
    try:
        names = {f"{host}-{p.pid}.lock" for p in (clean, killed, live)}
        assert {p.name for p in active.glob("*.lock")} == names
        clean.stdin.close()
        assert clean.wait(timeout=60) == 0
        assert not (active / f"{host}-{clean.pid}.lock").exists(), "left by a clean exit"
        killed.kill()
        killed.wait(timeout=60)
        assert (active / f"{host}-{killed.pid}.lock").exists()  # no handler ran
        users = active_holders(run)
        assert users == [f"a running workflow (pid {live.pid})"], users
        assert {p.name for p in active.glob("*.lock")} == {f"{host}-{live.pid}.lock"}
    finally:
        for p in (clean, killed, live):
            p.kill()
            p.wait()


_CLAIM = """
import os, sys, time
from hsextract.stale import RunInUseError, claim_run
while not os.path.exists(sys.argv[2]):  # all start claiming at once
    time.sleep(0.001)
try:
    claim_run(sys.argv[1])
    print("held", flush=True)
except RunInUseError as exc:
    print("refused:", exc, flush=True)
sys.stdin.read()
"""


def test_of_workflows_claiming_a_run_dir_at_once_exactly_one_holds_it(tmp_path: Path) -> None:
    """Issue 38, item 2: the check for another holder and the creation of one's own lock
    are one step (under the claim lock), so of several starting at once one goes on and
    every other is refused naming it; once it ends, the run dir can be claimed again."""
    run, go = tmp_path / "run", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLAIM, str(run), str(go)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(4)
    ]
    try:
        go.touch()
        said = {p.pid: p.stdout.readline().strip() for p in procs}
        holders = [pid for pid, line in said.items() if line == "held"]
        assert len(holders) == 1, said
        for pid, line in said.items():
            if pid != holders[0]:
                assert line.startswith("refused: run dir ") and f"pid {holders[0]} on" in line
        assert [p.name for p in (run / "state" / "active").glob("*.lock")] == [
            f"{socket.gethostname()}-{holders[0]}.lock"
        ]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    assert not list((run / "state" / "active").iterdir())  # each removed its own
    from hsextract.stale import claim_run, release_run_locks

    # The claim lock of releases before issue 57 (item 9) went in active/: it goes, unheld.
    (run / "state" / "active" / ".claim").touch()
    try:  # free again: this process may claim it
        assert claim_run(run).name == f"{socket.gethostname()}-{os.getpid()}.lock"
    finally:
        release_run_locks()
    assert not list((run / "state" / "active").iterdir())


@pytest.mark.workflow
def test_a_second_workflow_on_a_run_dir_in_use_is_refused_from_any_directory(
    tmp_path: Path,
) -> None:
    """Issue 38, item 2: the same config run from two directories at once (Snakemake's
    own lock is per directory) deleted a finished chunk.  The second is refused when its
    Snakefile is parsed, naming the first (pid, host, since when), and touches nothing;
    a dry run may still look; the first finishes as if alone and leaves no lock file."""
    out = tmp_path / "out"
    cfg = {
        "demo.n_records": 16,
        "n_chunks": 2,
        "output_root": str(out),
        "model.path": str(out / "demo" / "model"),
        "dump.dir": str(tmp_path / "shm" / "dump"),
        "server.health_timeout_s": 120,
    }
    first, second = make_workdir(tmp_path / "a", **cfg), make_workdir(tmp_path / "b", **cfg)
    (tmp_path / "shm").mkdir()
    # Each chunk's first pass held on a gate of its own: the first chunk is let go, the
    # second is held, so the run dir holds a finished chunk and one in flight.
    gates = {f"chunk_{c:05d}": tmp_path / f"go-{c}" for c in range(2)}
    log = tmp_path / "faults.jsonl"
    hold = {
        "log": str(log),
        "extend": [
            {"rid": chunk, "nth": [1], "do": "wait", "gate": str(gate)}
            for chunk, gate in gates.items()
        ],
    }
    proc = start_snakemake(first, "-j1", "extract_all", faults=hold)
    try:
        rd = run_dir_of(first)
        assert rd.resolve() == run_dir_of(second).resolve()  # one run dir, two directories

        def held(n: int):
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            waits = log.read_text().splitlines() if log.exists() else []
            return len(waits) >= n and json.loads(waits[n - 1])["rid"][: len("chunk_00000")]

        done = poll(lambda: held(1), "the first chunk held")
        gates[done].touch()
        poll(lambda: held(2), "the second chunk held")
        before = _files(rd)
        pieces = {str(p) for p in (tmp_path / "shm" / "dump").rglob("*")}
        assert f"hidden/{done}.safetensors" in before and pieces

        refused = run_snakemake(second, "-j1", "extract_all", check=False, timeout=300)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0, said[-3000:]
        assert "in use by another workflow" in said, said[-3000:]
        assert f"pid {proc.pid} on host {socket.gethostname()}, since " in said, said[-3000:]
        assert str(first) in said  # where the first was started
        # Nothing removed or rewritten (the held job's own writes may still land).
        assert _kept(before, _files(rd)), "the refused workflow touched the run dir"
        assert pieces <= {str(p) for p in (tmp_path / "shm" / "dump").rglob("*")}
        assert proc.poll() is None

        # A dry run touches nothing: it may plan beside a running workflow.
        assert run_snakemake(second, "-n", "extract_all").returncode == 0
        assert _kept(before, _files(rd))

        for gate in gates.values():
            gate.touch()
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-4000:]
        verified = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "verify", str(rd / "manifest.json")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert verified.returncode == 0, verified.stdout + verified.stderr
        # Issue 57, item 9: nothing left in active/ by the refused run or the finished one
        # (the claim lock lives beside it, in state/).
        assert not list((rd / "state" / "active").iterdir()), "a lock file left"
    finally:
        for gate in gates.values():
            gate.touch()
        stop_snakemake(proc)
        kill_processes_under(tmp_path)


def _kept(before: dict[str, object], after: dict[str, object]) -> bool:
    return all(after.get(name) == stat_ for name, stat_ in before.items())


def _files(rd: Path) -> dict[str, object]:
    """What a workflow wrote in a run dir: (size, mtime) of each file, and for a temporary
    (dot) file only that it is there -- the held chunk job may still append to its own.
    Not the files it or its server rewrite while held (its progress file, the logs)."""
    out: dict[str, object] = {}
    for p in rd.rglob("*"):
        rel = p.relative_to(rd)
        if not p.is_file() or rel.parts[0] in ("logs", "benchmarks") or "progress" in p.name:
            continue
        out[str(rel)] = True if p.name.startswith(".") else (p.stat().st_size, p.stat().st_mtime_ns)
    return out
