"""delete_stale: only marked dirs directly under the root go; nothing outside it, ever."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hsextract.stale import RUN_MARKER, StaleDeletionError, delete_stale


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


def test_dump_dirs_only_of_removed_runs_and_pieces_of_current(tree, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    cur = _run(shm, "hsextract-u-1-cur000000000")  # current: keep dir + marker, drop pieces
    stale = _run(shm, "hsextract-u-1-old111111111", 7)
    foreign = _run(shm, "hsextract-u-1-feedfeedfeed", 9)  # maybe a live run elsewhere
    unmarked = _run(shm, "somebody-else", 11, marked=False)
    rep = delete_stale(tree["root"], "cur000000000", dump_root=shm, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    kinds = {(i["kind"], i["path"]) for i in rep["removed"]}
    assert ("dump", str(stale)) in kinds and ("dump_pieces", str(cur)) in kinds
    assert not stale.exists()
    assert sorted(p.name for p in cur.iterdir()) == [RUN_MARKER]
    assert foreign.exists() and unmarked.exists()
    assert rep["bytes_freed"] == 10 + 20 + 7 + 100


def test_symlinked_marked_candidate_swapped_in_is_not_followed(tree, tmp_path: Path) -> None:
    """A stale run dir replaced by a symlink before removal: the link goes, not its target."""
    from hsextract import stale

    target = tree["precious"]
    os.rename(tree["old1"], tmp_path / "moved")
    tree["old1"].symlink_to(target)
    stale._remove_tree(tree["old1"], os.lstat(tree["root"]).st_dev)
    assert not tree["old1"].exists() and (target / "data.bin").exists()
