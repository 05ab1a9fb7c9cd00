"""Nothing hsextract did not write is ever deleted, emptied or chmod'ed (issue 20, items 4-5).

A user's files are planted where hsextract writes -- an existing ``dump.dir``, a
/dev/shm-like shared mount (a dir under tmp_path that the test declares a mount point:
never the real /dev/shm), an adopted dump dir that later received someone's files, the
demo's ``model.path`` -- and each test checks they survive byte for byte and that the run
refuses, naming the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_demo import make_workdir, snakemake_cmd

from hsextract import config as config_mod
from hsextract.config import RUN_MARKER
from hsextract.errors import ConfigError
from hsextract.server import ServerError, prepare_dump_dir
from hsextract.stale import delete_stale, preview

RID = "chunk_00001-000003-0123abcd"  # the client's request-id form (client.extract_dump)


def _plant(d: Path) -> dict[str, tuple[bytes, int]]:
    """The issue's tree: notes.txt and keepme/data.bin; returns their bytes and modes."""
    (d / "keepme").mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_bytes(b"my notes\n")
    (d / "keepme" / "data.bin").write_bytes(b"\x00\x01" * 50)
    os.chmod(d, 0o755)
    return _files(d)


def _files(d: Path) -> dict[str, tuple[bytes, int]]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(d))] = (p.read_bytes(), p.stat().st_mode)
    return out


def test_a_dump_dir_holding_files_is_refused_by_the_workflow_naming_it(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False, **{"dump.dir": "scratch/mine"})
    mine = wd / "scratch" / "mine"
    before = _plant(mine)
    proc = subprocess.run(
        snakemake_cmd(wd, "-j1", "extract_all"), capture_output=True, text=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["keepme", "notes.txt"]  # no marker
    assert mine.stat().st_mode & 0o777 == 0o755  # not chmod'ed
    assert _files(mine) == before  # nothing deleted or rewritten
    assert proc.returncode != 0, out[-3000:]
    assert "dump.dir scratch/mine is not empty and was not created by hsextract" in out
    assert "keepme, notes.txt" in out and "set dump.dir to a new or empty directory" in out
    assert not (wd / "results").exists()  # refused before any stage ran


def test_prepare_dump_dir_adopts_only_an_empty_or_marked_dir(tmp_path):
    mine = tmp_path / "mine"
    before = _plant(mine)
    with pytest.raises(ServerError, match=f"dump.dir {mine} is not empty"):
        prepare_dump_dir(mine, owner=str(tmp_path / "results" / "fp"))
    assert _files(mine) == before and mine.stat().st_mode & 0o777 == 0o755
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    prepare_dump_dir(empty, owner=str(tmp_path / "results" / "fp"))  # adopted
    assert empty.stat().st_mode & 0o777 == 0o700 and (empty / RUN_MARKER).is_file()
    (empty / "notes.txt").write_text("mine")  # marked: still ours, and the note stays
    prepare_dump_dir(empty, owner=str(tmp_path / "results" / "fp"))
    assert (empty / "notes.txt").read_text() == "mine"


def test_a_shared_mount_like_dev_shm_is_never_adopted_or_emptied(tmp_path, monkeypatch):
    """/dev/shm itself as dump.dir: as root it was chmod'ed 0700, marked, then emptied."""
    shm = tmp_path / "shm"  # stands in for /dev/shm: a mount point holding others' files
    _plant(shm)
    (shm / "other-user-dump").mkdir()
    (shm / "other-user-dump" / "000000000.safetensors").write_bytes(b"theirs")
    before = _files(shm)
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(shm) or real_ismount(p))
    with pytest.raises(ServerError, match=f"dump.dir {shm} is refused: .* is a filesystem root"):
        prepare_dump_dir(shm, owner=str(tmp_path / "results" / "fp"))
    with pytest.raises(ConfigError, match="is a filesystem root"):
        config_mod.check_dump_dir({"dump": {"dir": str(shm)}})
    assert _files(shm) == before and not (shm / RUN_MARKER).exists()
    assert shm.stat().st_mode & 0o777 == 0o755
    # Marked by an older hsextract that adopted it: stale deletion still never empties it.
    run = tmp_path / "results" / "cur000000000"
    run.mkdir(parents=True)
    marker = {"kind": "dump", "run_dir": str(run), "output_root": str(run.parent)}
    (shm / RUN_MARKER).write_text(json.dumps(marker))
    rep = delete_stale(tmp_path / "results", run.name, dump_root=tmp_path, keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert rep["removed"] == [] and _files(shm).keys() - {RUN_MARKER} == before.keys()
    assert all(_files(shm)[k] == v for k, v in before.items())
    assert any(s.startswith(f"{shm}: ") and "filesystem root" in s for s in rep["skipped"])


@pytest.mark.parametrize("shared", ["/dev/shm", "/tmp", "/", "home"])
def test_shared_dirs_as_dump_dir_are_refused_from_the_path_alone(shared, tmp_path, monkeypatch):
    """Checked from the path: nothing in the real /dev/shm or /tmp is read or changed."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = str(tmp_path) if shared == "home" else shared
    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--config", f"dump={{dir: {path}}}"],
        cwd=make_workdir(tmp_path / "w"), capture_output=True, text=True,
        env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 1 and f"dump.dir {path} is refused" in proc.stderr
    with pytest.raises(ConfigError, match=f"dump.dir {path} is refused: "):
        config_mod.check_dump_dir({"dump": {"dir": path}})


def test_stale_deletion_removes_only_what_the_capture_protocol_writes(tmp_path):
    """An adopted dump dir that later got someone's files: the pieces go, the files stay."""
    root = tmp_path / "results"
    cur, old = root / "cur000000000", root / "old111111111"
    for run in (cur, old):
        run.mkdir(parents=True)
        (run / RUN_MARKER).write_text("")
    scratch = tmp_path / "scratch"
    dumps = {}
    for name, run in (("mine", cur), ("old", old)):
        d = scratch / name
        _plant(d)  # someone's files, then some beside ours in our own subdirs
        for sub in (RID, ".abandoned", ".budget", ".turns"):
            (d / sub).mkdir()
        (d / RID / "mine.txt").write_text("planted beside a piece")
        (d / ".budget" / "notes.md").write_text("not a reservation")
        (d / "link").symlink_to(tmp_path / "elsewhere")
        dumps[name] = (d, _files(d))
        marker = {"kind": "dump", "run_dir": str(run), "output_root": str(root)}
        (d / RUN_MARKER).write_text(json.dumps(marker))
        (d / RID / "000000000.safetensors").write_bytes(b"p" * 10)  # a piece
        (d / RID / ".000000257.4242.tmp").write_bytes(b"t" * 3)  # its temporary name
        (d / "chunk_00002-000000-89abcdef").mkdir()  # pieces only: the dir goes too
        (d / "chunk_00002-000000-89abcdef" / "000000000.safetensors").write_bytes(b"q" * 5)
        for sub, ours in ((".abandoned", RID), (".budget", "lock"), (".turns", "turn-0")):
            (d / sub / ours).write_text("")
    lines = preview(root, cur.name, dump_root=scratch, keep_runs=0, delete_finished=False)
    rep = delete_stale(root, cur.name, dump_root=scratch, keep_runs=0, dry_run=False,
                       report_out=tmp_path / "r.json")  # fmt: skip
    assert not old.exists()
    for d, user in dumps.values():
        assert {k: v for k, v in _files(d).items() if k != RUN_MARKER} == user
        assert (d / "link").is_symlink() and (d / RUN_MARKER).is_file()
        assert not (d / "chunk_00002-000000-89abcdef").exists()
        assert sorted(p.name for p in (d / RID).iterdir()) == ["mine.txt"]
        assert sorted(p.name for p in (d / ".budget").iterdir()) == ["notes.md"]
        assert not (d / ".abandoned").exists() and not (d / ".turns").exists()
    kept = {i["path"]: i["why"] for i in rep["kept"] if i["kind"] == "foreign"}
    mine = dumps["mine"][0]
    for p in (mine / "notes.txt", mine / "keepme", mine / RID / "mine.txt", mine / "link"):
        assert "not written by hsextract" in kept[str(p)], kept
    assert {(i["kind"], Path(i["path"]).name) for i in rep["removed"]} == {
        ("run", "old111111111"),
        ("dump_pieces", "mine"),
        ("dump_pieces", "old"),
    }
    assert rep["bytes_freed"] == 2 * (10 + 3 + 5)
    text = "\n".join(lines)
    assert f"keep   {mine / 'notes.txt'}" in text and f"remove {mine}  18 B  (dump_pieces)" in text


def test_a_removed_runs_dump_dir_with_only_our_files_goes_entirely(tmp_path):
    root = tmp_path / "results"
    (root / "cur000000000").mkdir(parents=True)
    d = tmp_path / "scratch" / "old"
    (d / RID).mkdir(parents=True)
    (d / RID / "000000000.safetensors").write_bytes(b"p")
    gone_run = str(root / "old111111111")  # its run was removed by hand: an orphan
    (d / RUN_MARKER).write_text(json.dumps({"run_dir": gone_run, "output_root": str(root)}))
    rep = delete_stale(root, "cur000000000", dump_root=tmp_path / "scratch", keep_runs=0,
                       dry_run=False, report_out=tmp_path / "r.json")  # fmt: skip
    assert not d.exists() and [i["kind"] for i in rep["removed"]] == ["dump"]


def test_stale_recognises_exactly_the_names_the_writers_use(tmp_path):
    """stale spells the protocol's names (capture imports torch); pin them to the writers."""
    from hsextract import budget, capture, stale

    assert stale._PIECE.fullmatch(capture.piece_name(257))
    assert stale.ABANDONED_DIR == capture.ABANDONED_DIR
    assert stale._DOT_DIRS.keys() == {capture.ABANDONED_DIR, budget.LEDGER_DIR, budget.TURNS_DIR}
    ledger = budget.SharedByteBudget(tmp_path, 100)
    try:
        token = ledger.acquire(10)
        assert stale._DOT_DIRS[budget.LEDGER_DIR].fullmatch(token)
        names = {p.name for p in (tmp_path / budget.LEDGER_DIR).iterdir()} - {"lock"}
        (lease,) = names  # the process's lease, <pid>-<start>-<seq>-<bytes>
        assert stale._DOT_DIRS[budget.LEDGER_DIR].fullmatch(lease) and lease.endswith("-10")
        with ledger._tlock:  # a waiting mark, as a waiting request's ledger visit makes it
            ledger._set_mark(12345, 67)
        marks = {p.name for p in (tmp_path / budget.LEDGER_DIR).iterdir()} - names - {"lock"}
        (mark,) = marks
        assert stale._DOT_DIRS[budget.LEDGER_DIR].fullmatch(mark) and mark.endswith("x67-0")
        assert budget._marks_in([mark]) == [(12345, 67)]
    finally:
        ledger.close()
    turn = budget.SendingTurn(tmp_path, 1)
    turn.acquire()
    turn.release()
    assert all(stale._DOT_DIRS[budget.TURNS_DIR].fullmatch(p.name)
               for p in (tmp_path / budget.TURNS_DIR).iterdir())  # fmt: skip


def _tree(root: Path, skip: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` but those under ``skip``: its mtime and bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and skip not in p.parents:
            out[str(p.relative_to(root))] = (p.stat().st_mtime_ns, p.read_bytes())
    return out


def test_spaces_quotes_and_dollars_in_paths_touch_nothing_outside_the_run(demo_run, tmp_path):
    """Issue 38, item 1: on 51ef369 chunk_index's unquoted `cp {input} {output} 2> {log}`
    split ``output_root`` at its spaces, so `2> <root>/victim` emptied a user's file named by
    the path's first word.  Every path of the run, and the inputs', holds a space, both
    quotes and a `$`; the run finishes and no file outside its output_root changed."""
    import shutil

    import yaml
    from fixtures_demo import own_config, run_snakemake

    odd = "y 'a b' \"$HOME\" $x"
    data = tmp_path / f"in {odd}"
    shutil.copytree(demo_run["workdir"] / "results" / "demo" / "data", data)
    out = tmp_path / f"victim {odd}"
    # The first word of each path, and what the unquoted shell made of the rest.
    (tmp_path / "victim").write_text("precious\n")
    (tmp_path / "y").write_text("mine too\n")
    cfg = own_config(demo_run, tmp_path, n_chunks=2, inputs=[str(data / "shard_*.jsonl")])
    cfg["output_root"] = str(out)
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(cfg))
    before = _tree(tmp_path, out)
    proc = run_snakemake(tmp_path, "-j1", "extract_all", "--configfile", str(tmp_path / "my.yaml"))
    after = _tree(tmp_path, out)
    snakemake_meta = tmp_path / ".snakemake"
    changed = [
        name
        for name in before.keys() | after.keys()
        if before.get(name) != after.get(name) and snakemake_meta not in (tmp_path / name).parents
    ]
    assert changed == [], f"files outside the run changed: {changed}\n{proc.stderr[-2000:]}"
    assert (tmp_path / "victim").read_text() == "precious\n"
    (manifest,) = out.glob("*/manifest.json")
    verify = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "verify", str(manifest)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
