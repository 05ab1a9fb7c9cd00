"""Guarded deletion of stale hidden states (the seed deleted 924 GB by hand).

What may go, by default:

* a run dir ``<output_root>/<fingerprint>/`` of another fingerprint that carries this
  pipeline's marker, is ours (uid), is not in use -- no live server recorded in it, no
  workflow holding its activity lock -- and holds no finished chunk.  A run with finished
  chunks is kept unless ``stale.delete_finished`` is set: a changed setting, or an
  hsextract upgrade, must never silently cost a multi-TB extraction.  The seed's use
  (delete the old run before a new extraction) is that one setting;
* a dump dir of this output root (its marker names the run dir that owns it) whose run
  is removed or gone, and the leftover pieces of this run's own dump dir when nothing is
  using it.  In a dump dir only what the capture protocol writes goes (pieces, their
  temporary names, tombstones, the budget ledger, the sending turns, the marker: see
  :func:`_sort_dump`); anything else in it is someone's file, kept and reported as kept.

Never: anything not carrying the marker, not ours (skipped, not an error), reached through
a symlink, outside the resolved root, on another filesystem, or another output root's dump
dir (two checkouts of the same config on one host share a fingerprint, not a dump dir).
The root must not be ``/``, ``$HOME`` or a mount point.  The report is written before
anything is removed (what will go) and again after (what went); ``preview`` computes the
same plan without touching anything, for ``snakemake -n``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

import orjson

from hsextract.budget import LEDGER_DIR, TURNS_DIR
from hsextract.config import RUN_MARKER, marker_temp, unsafe_dir
from hsextract.errors import HsextractError
from hsextract.procs import pid_alive

__all__ = [
    "RUN_MARKER",
    "RunInUseError",
    "StaleDeletionError",
    "claim_run",
    "delete_stale",
    "hold_run_lock",
    "preview",
]

#: Per-invocation activity locks of a run dir: ``<host>-<pid>.lock``, flock'ed while alive.
ACTIVE_DIR = Path("state") / "active"


class StaleDeletionError(HsextractError):
    """The configured root is unsafe to clean, or a removal failed."""


# --------------------------------------------------------------------------- in use


#: The activity locks this process holds: path -> (fd, the pid that took it).
_HELD: dict[str, tuple[int, int]] = {}
#: Beside ``state/active``, not in it: held only while a workflow checks for another
#: holder and creates its own lock file, so two workflows starting at once cannot both see
#: none.  Never unlinked (a lock on an unlinked file serialises nothing), so it stays out
#: of ``active/``, which holds a file only while a workflow runs (issue 57, item 9).
CLAIM_LOCK = Path("state") / "claim.lock"
#: Where releases before issue 57 kept the claim lock: removed when nobody holds it.
_OLD_CLAIM = ".claim"


class RunInUseError(HsextractError):
    """Another workflow holds the run dir: two on one run dir delete each other's work."""


def claim_run(run_dir: Path, owner_pid: int | None = None) -> Path:
    """Hold ``run_dir`` for this workflow, or refuse if another workflow holds it.

    Two workflows on one run dir (the same config from two directories: Snakemake's own
    lock is per working directory) remove each other's pieces, temporary files and
    chunks as an interrupted attempt's (issue 38, item 2).  Called when the Snakefile is
    parsed, before Snakemake or a job touches anything.  The check and the creation of
    this workflow's lock file happen under :data:`CLAIM_LOCK`, so of two starting at
    once exactly one goes on.  Dead holders' files are removed on the way.
    """
    pid = owner_pid or os.getpid()
    (Path(run_dir) / ACTIVE_DIR).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / CLAIM_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a scan and a rename: never long
        _remove_unheld(str(Path(run_dir) / ACTIVE_DIR / _OLD_CLAIM))
        others = _workflow_locks(Path(run_dir), exclude_pid=pid)
        if others:
            raise RunInUseError(_in_use_sentence(Path(run_dir), others[0]))
        return hold_run_lock(run_dir, pid)
    finally:
        os.close(fd)


def _in_use_sentence(run_dir: Path, other: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other["since"]))
    where = f" (started in {other['cwd']})" if other.get("cwd") else ""
    from hsextract.commands import hsextract_command

    status = hsextract_command("status", run_dir=run_dir)
    gone = (
        f"; if no workflow runs there any more, remove {other['path']}"
        if other["host"] != socket.gethostname()
        else ""
    )
    return (
        f"run dir {os.path.abspath(run_dir)} is in use by another workflow: pid "
        f"{other['pid']} on host {other['host']}, since {since}{where}; one workflow per "
        f"run dir at a time, so wait for it to end (`{status}` shows how far it "
        f"is) or stop it, then run this again{gone}"
    )


def hold_run_lock(run_dir: Path, owner_pid: int | None = None) -> Path:
    """Mark this process as using ``run_dir`` until it exits (:func:`claim_run`).

    An exclusive ``flock`` on a per-process file: the kernel releases it when the process
    dies, SIGKILL included, so a crashed workflow never pins a run dir forever (its file
    is removed by the next one to look, :func:`_workflow_locks`).  The file is created
    and locked under a temporary name, then renamed: a lock file is never visible
    unlocked, so a cleaner that finds one unlocked knows its holder is gone, and never
    removes a live holder's.  Removed by this process at exit (:func:`release_run_locks`).
    """
    pid = owner_pid or os.getpid()
    host = socket.gethostname()
    d = Path(run_dir) / ACTIVE_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{host}-{pid}.lock"
    if str(path) in _HELD:
        return path
    info = {"pid": pid, "host": host, "since": time.time(), "cwd": os.getcwd()}
    while True:
        tmp = d / f".{path.name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(info).encode())
        try:
            os.rename(tmp, path)
        except FileNotFoundError:
            os.close(fd)  # a cleaner took the temp file before it was locked: again
            continue
        break
    if not _HELD:
        atexit.register(release_run_locks)
    _HELD[str(path)] = (fd, os.getpid())
    return path


def release_run_locks() -> None:
    """Remove this process's activity lock files, then release them (at exit).

    Unlinked while still locked: no one sees the file unlocked.  Only in the process that
    took them: a forked child that exits normally must not release its parent's.
    """
    for path, (fd, taker) in list(_HELD.items()):
        if taker != os.getpid():
            continue
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)
        del _HELD[path]


def _workflow_locks(run_dir: Path, *, exclude_pid: int | None = None) -> list[dict[str, Any]]:
    """The workflows holding a run dir: pid, host, since, cwd, path of each lock file.

    Another host's file cannot be probed from here (flock may not reach across hosts):
    it counts.  A file of this host that nobody holds is its dead holder's (see
    :func:`hold_run_lock`): removed, as is a temporary name whose creator died.
    """
    host = socket.gethostname()
    found: list[dict[str, Any]] = []
    d = run_dir / ACTIVE_DIR
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            if entry.name.startswith("."):
                if entry.name.endswith(".tmp"):
                    _remove_unheld(entry.path)
                continue
            if not entry.name.endswith(".lock"):
                continue
            lhost, _, pid = entry.name.removesuffix(".lock").rpartition("-")
            if exclude_pid is not None and lhost == host and pid == str(exclude_pid):
                continue
            if lhost == host and _remove_unheld(entry.path):
                continue  # its process is gone
            info: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                info = json.loads(Path(entry.path).read_text() or "{}")
            if not isinstance(info, dict) or not isinstance(info.get("since"), (int, float)):
                info = {}
                with contextlib.suppress(OSError):
                    info["since"] = os.stat(entry.path).st_mtime
            found.append(
                {
                    "pid": pid,
                    "host": lhost,
                    "since": info.get("since", 0.0),
                    "cwd": info.get("cwd"),
                    "path": entry.path,
                }
            )
    return found


def _remove_unheld(path: str) -> bool:
    """Unlink ``path`` if no process holds a lock on it; whether it was unheld.

    The probe's lock is kept while unlinking, and the name checked to still be that
    inode, so a file renamed into place meanwhile (held from birth) is never removed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        return True
    finally:
        os.close(fd)


def active_holders(run_dir: Path, *, exclude_pid: int | None = None) -> list[str]:
    """Who is using a run dir now: its held activity locks and its live servers."""
    run_dir = Path(run_dir)
    host = socket.gethostname()
    found: list[str] = []
    for w in _workflow_locks(run_dir, exclude_pid=exclude_pid):
        if w["host"] != host:
            found.append(f"a workflow on host {w['host']} (pid {w['pid']}; {w['path']})")
        else:
            found.append(f"a running workflow (pid {w['pid']})")
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
        for entry in os.scandir(run_dir / "state"):
            if not (entry.name.startswith("server.") and entry.name.endswith(".live.json")):
                continue
            lhost = entry.name[len("server.") : -len(".live.json")]
            try:
                state = json.loads(Path(entry.path).read_text())
            except (OSError, ValueError):
                continue
            pid = state.get("pid")
            if lhost != host:
                found.append(f"a server on host {lhost} (pid {pid}; {entry.path})")
            elif pid_alive(pid) and not state.get("failed"):  # a failed one was stopped
                found.append(f"a live server (pid {pid})")
    return found


def lock_held(path: str) -> bool:
    """Whether a process holds a lock on ``path`` (a workflow's ``state/active`` file): a
    non-blocking exclusive probe, released at once, so it sees shared and exclusive holders;
    on a read-only fd (Linux's flock needs no write access), so a reader without write
    permission on the run (``hsextract status``) can ask too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we just took
    return False


# --------------------------------------------------------------------------- safety


def _safe_root(root: Path, what: str, *, allow_mount: bool = False) -> Path:
    """Resolve ``..`` and symlinks, then refuse roots that could hold other people's data.

    ``allow_mount`` is for the dump root only: /dev/shm is a mount point by design, and
    only marked children of it are ever touched.
    """
    if not str(root):
        raise StaleDeletionError(f"{what} is empty")
    why = unsafe_dir(root, shared=False, mount=not allow_mount)
    if why:
        hint = "; use a subdirectory as output_root / dump.dir" if "mount" in why else ""
        raise StaleDeletionError(f"refusing to clean {what}={root!s}: {why}{hint}")
    return Path(os.path.realpath(os.path.abspath(root)))


def _tree_bytes(path: Path) -> int:
    """Bytes of regular files under path, without following symlinks."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in filenames + dirnames:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _candidates(root: Path) -> tuple[list[Path], list[str]]:
    """Marked real directories of ours directly under root; and what was skipped, why."""
    if not root.is_dir():
        return [], []
    found, skipped = [], []
    uid = os.getuid()
    for entry in os.scandir(root):
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue  # symlinks (to anywhere) and files are never candidates
            if entry.stat(follow_symlinks=False).st_uid != uid:
                skipped.append(f"{entry.path}: owned by another user")
                continue
            st = os.lstat(os.path.join(entry.path, RUN_MARKER))
        except FileNotFoundError:
            continue
        except PermissionError as exc:
            skipped.append(f"{entry.path}: {exc.strerror}")
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        why = unsafe_dir(Path(entry.path))  # /dev/shm itself under a dump root of /dev
        if why:
            skipped.append(f"{entry.path}: {why}")
            continue
        found.append(Path(entry.path))
    return found, skipped


def _marker(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / RUN_MARKER).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _finished_chunks(run: Path) -> int:
    """Chunk files with their sidecar: what a deletion would cost in GPU hours."""
    hidden = run / "hidden"
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
        names = {e.name for e in os.scandir(hidden)}
        return sum(
            1
            for n in names
            if n.endswith(".safetensors") and n.removesuffix(".safetensors") + ".json" in names
        )
    return 0


def _remove_tree(path: Path, dev: int) -> None:
    """rm -rf that never follows a symlink and never enters another filesystem.

    Each entry is lstat'ed before it is touched: a link is unlinked (its target stays), a
    directory on another device is refused before anything inside it is removed.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    if st.st_dev != dev:
        raise StaleDeletionError(f"{path} is on another filesystem (a mount?); not removing it")
    with os.scandir(path) as it:
        entries = [Path(e.path) for e in it]
    for child in entries:
        _remove_tree(child, dev)
    os.rmdir(path)


# What the capture protocol writes in a dump dir, by name (capture.py, client.py,
# budget.py; tests/test_user_files.py checks these against the writers).  Spelled here:
# capture imports torch, and the plan printed at every `snakemake -n` must not.
#: ``<rid>/<start:09d>.safetensors`` (capture.piece_name) and its temporary name.
_PIECE = re.compile(r"\d{9}\.safetensors|\.\d{9}\.\d+\.tmp")
#: The client's request ids: ``<chunk>-<record:06d>-<8 hex>`` (client.extract_dump).
_RID = re.compile(r"[^./\x00][^/\x00]*-[0-9a-f]{8}")
ABANDONED_DIR = ".abandoned"  # capture.ABANDONED_DIR: one empty file per abandoned rid
#: The dot dirs of a dump dir and the names inside them.
_DOT_DIRS = {
    ABANDONED_DIR: _RID,
    # budget.SharedByteBudget: a lease <pid>-<start>-<seq>-<bytes>, a waiting mark
    # <pid>-<start>-<ticket>x<bytes>-0
    LEDGER_DIR: re.compile(r"lock|\d+-(\d+|None)-\d+(x\d+)?-\d+"),
    TURNS_DIR: re.compile(r"turn-\d+"),  # budget.SendingTurn
}


def _sort_dump(dump: Path) -> tuple[list[str], list[str], list[dict[str, Any]], int]:
    """(files, dirs, foreign, bytes) of a dump dir, the marker aside.

    ``files`` and ``dirs`` are what hsextract writes there (removable: files unlinked,
    then dirs removed once empty); ``foreign`` is everything else, with the reason it is
    not ours: a user's file in an adopted ``dump.dir`` is never deleted.  Only names the
    protocol writes, of the type it writes them, on the dump dir's filesystem.
    """
    files: list[str] = []
    dirs: list[str] = []
    foreign: list[dict[str, Any]] = []
    total = 0
    dev = os.lstat(dump).st_dev

    def keep(path: str, st: os.stat_result, why: str) -> None:
        size = _tree_bytes(Path(path)) if stat.S_ISDIR(st.st_mode) else st.st_size
        foreign.append({"path": path, "kind": "foreign", "bytes": size,
                        "why": f"not written by hsextract ({why}); never removed"})  # fmt: skip

    for entry in _scan(dump):
        if entry.name == RUN_MARKER or marker_temp(entry.name):
            continue
        with contextlib.suppress(FileNotFoundError):  # gone since the scan: nothing to do
            st = entry.stat(follow_symlinks=False)
            names = _DOT_DIRS.get(entry.name) or (_PIECE if _RID.fullmatch(entry.name) else None)
            if names is None:
                keep(entry.path, st, "a name the capture protocol never writes")
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_dev != dev:
                keep(entry.path, st, "not a directory on the dump dir's filesystem")
                continue
            for child in _scan(Path(entry.path)):
                with contextlib.suppress(FileNotFoundError):
                    cst = child.stat(follow_symlinks=False)
                    if not names.fullmatch(child.name):
                        keep(child.path, cst, "a name the capture protocol never writes")
                    elif not stat.S_ISREG(cst.st_mode):
                        keep(child.path, cst, "not a regular file")
                    else:
                        files.append(child.path)
                        total += cst.st_size
            dirs.append(entry.path)
    return files, dirs, foreign, total


def _scan(path: Path) -> list[os.DirEntry[str]]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(path) as it:
        return list(it)
    return []


def _clear_dump(path: Path, *, keep_marker: bool) -> None:
    """Remove what :func:`_sort_dump` recognises; the dir and its marker too unless
    ``keep_marker`` (the current run still owns it) or someone's files are in it.  Sorted
    again here, not taken from the plan: the dir may have changed since."""
    files, dirs, foreign, _ = _sort_dump(path)
    _unlink(files, dirs)
    if keep_marker or foreign:
        return
    for entry in _scan(path):
        if marker_temp(entry.name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    (path / RUN_MARKER).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)  # not empty: a file written since; kept, found again next time


def clear_requests(dump: Path) -> None:
    """Only the request dirs' pieces of a dump dir, not its dot entries: a compute node's
    cleanup of a cancelled allocation's leftovers (``steps._with_node_cleanup``)."""
    files, dirs, _, _ = _sort_dump(dump)
    _unlink(
        [f for f in files if not Path(f).parent.name.startswith(".")],
        [d for d in dirs if not Path(d).name.startswith(".")],
    )


def clear_protocol_files(dump: Path) -> list[dict[str, Any]]:
    """Remove everything the capture protocol wrote in a dump dir but the marker (request
    dirs and their pieces, tombstones, ledger, turns); return what was kept as someone
    else's (see :func:`_sort_dump`).  The caller has made sure nothing live uses them:
    ``server.remove_dump_dir_if_empty`` holds the ledger's lock with no live reservation."""
    files, dirs, foreign, _ = _sort_dump(dump)
    _unlink(files, dirs)
    return foreign


def _unlink(files: list[str], dirs: list[str]) -> None:
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)  # a regular file, or a link swapped in since: the link goes
    for d in dirs:
        with contextlib.suppress(OSError):
            os.rmdir(d)  # not empty: a piece written since, or someone's file


# --------------------------------------------------------------------------- plan


def _plan(
    root: Path,
    current: Path,
    droot: Path | None,
    *,
    keep_runs: int,
    delete_finished: bool,
    owner_pid: int | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(to remove, kept, skipped); runs ordered newest first by their marker's mtime."""
    runs, skipped = _candidates(root)
    runs = [p for p in runs if p.name != current.name]
    runs.sort(key=lambda p: (-os.lstat(p / RUN_MARKER).st_mtime_ns, p.name))
    remove: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    deletable = []
    for p in runs:
        item: dict[str, Any] = {"path": str(p), "kind": "run", "bytes": _tree_bytes(p)}
        users = active_holders(p)
        finished = _finished_chunks(p)
        item["finished_chunks"] = finished
        if users:
            kept.append({**item, "why": "in use by " + "; ".join(users)})
        elif finished and not delete_finished:
            kept.append(
                {
                    **item,
                    "why": f"holds {finished} finished chunk(s); set stale.delete_finished: "
                    "true to delete it",
                }
            )
        else:
            deletable.append(item)
    kept += [{**i, "why": "stale.keep_runs"} for i in deletable[:keep_runs]]
    remove += deletable[keep_runs:]
    removed_runs = {str(Path(i["path"]).resolve()) for i in remove}
    if droot is not None:
        dumps, dskipped = _candidates(droot)
        skipped += dskipped
        tag = hashlib.sha256(str(root).encode()).hexdigest()[:6]
        for p in dumps:
            info = _marker(p)
            if "output_root" not in info:  # written before markers named their run
                parts = p.name.split("-")
                if len(parts) >= 5 and parts[-1] == tag and parts[-3] == str(os.getuid()):
                    info = {"output_root": str(root), "run_dir": str(root / parts[-2])}
            if info.get("output_root") != str(root):
                continue  # another output root's dump dir: not ours to touch
            run = info.get("run_dir", "")
            files, dirs, foreign, nbytes = _sort_dump(p)
            kept += foreign
            item = {"path": str(p), "kind": "dump", "run_dir": run, "bytes": nbytes}
            if run == str(current.resolve()):
                users = active_holders(current, exclude_pid=owner_pid)
                if users and (files or dirs):
                    kept.append({**item, "why": "this run's, in use by " + "; ".join(users)})
                elif files or dirs:  # the marker stays: its bytes are not freed
                    remove.append({**item, "kind": "dump_pieces"})
            elif run in removed_runs or not Path(run).is_dir():
                if not foreign:  # the dir and its marker go too
                    remove.append({**item, "bytes": nbytes + os.lstat(p / RUN_MARKER).st_size})
                elif files or dirs:  # someone's files in it: they, the dir, the marker stay
                    remove.append({**item, "kind": "dump_pieces"})
            elif not active_holders(Path(run)):
                # Its run is kept but nothing holds it (no workflow, no live server): a
                # workflow SIGKILLed and not rerun left it, in RAM.  Only what the protocol
                # writes goes (someone's file keeps the dir); the run's next server makes
                # it again.
                if not foreign:
                    remove.append({**item, "bytes": nbytes + os.lstat(p / RUN_MARKER).st_size})
                elif files or dirs:
                    remove.append({**item, "kind": "dump_pieces"})
                else:
                    kept.append({**item, "why": "holds only files not written by hsextract"})
            else:
                kept.append({**item, "why": f"its run {run} is kept"})
    return remove, kept, skipped


def unclaimed_dumps(output_root: Path, dump_root: Path) -> list[dict[str, Any]]:
    """Dump dirs of runs under ``output_root`` that no workflow or live server holds
    (``hsextract status`` names them): path, run dir, bytes, and whether someone's files
    are in it (then only its protocol files go).  A read: nothing is removed."""
    out = []
    root = Path(os.path.realpath(output_root))
    dumps, _ = _candidates(Path(dump_root))
    for p in dumps:
        info = _marker(p)
        run = str(info.get("run_dir", ""))
        if info.get("output_root") != str(root) or not run:
            continue
        if Path(run).is_dir() and active_holders(Path(run)):
            continue
        files, dirs, foreign, nbytes = _sort_dump(p)
        out.append({"path": os.path.abspath(p), "run_dir": run, "bytes": nbytes,
                    "foreign": len(foreign)})  # fmt: skip
    return out


def _write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(tmp, path)


def _roots(output_root: Path, dump_root: Path | None) -> tuple[Path, Path | None]:
    root = _safe_root(Path(output_root), "output_root")
    droot = (
        _safe_root(Path(dump_root), "dump root", allow_mount=True)
        if dump_root is not None
        else None
    )
    return root, droot


def delete_stale(
    output_root: Path,
    current_run: Path,
    *,
    dump_root: Path | None,
    keep_runs: int,
    dry_run: bool,
    report_out: Path,
    delete_finished: bool = False,
    owner_pid: int | None = None,
) -> dict[str, Any]:
    """Remove what the module doc says may go; return the report.

    ``current_run`` is this run's dir (never a candidate); ``dump_root`` the directory
    that holds dump dirs (e.g. ``/dev/shm`` or the parent of ``dump.dir``);
    ``owner_pid`` the workflow process running this deletion (its own activity lock on
    the current run does not count as another user).
    """
    if keep_runs < 0:
        raise StaleDeletionError(f"stale.keep_runs must be >= 0, got {keep_runs}")
    name = Path(current_run).name
    if not name or name in (".", ".."):
        raise StaleDeletionError(f"bad run dir {current_run!r}")
    root, droot = _roots(output_root, dump_root)
    current = root / name
    remove, kept, skipped = _plan(
        root,
        current,
        droot,
        keep_runs=keep_runs,
        delete_finished=delete_finished,
        owner_pid=owner_pid,
    )
    report: dict[str, Any] = {
        "output_root": str(root),
        "dump_root": str(droot) if droot else None,
        "fingerprint": name,
        "dry_run": dry_run,
        "keep_runs": keep_runs,
        "delete_finished": delete_finished,
        "status": "planned",
        "will_remove": remove,
        "will_remove_bytes": sum(i["bytes"] for i in remove),
        "kept": kept,
        "skipped": skipped,
        "removed": [],
        "bytes_freed": 0,
    }
    _write_report(Path(report_out), report)  # before: what WILL go
    if not dry_run:
        for item in remove:
            path = Path(item["path"])
            if item["kind"] == "run" and active_holders(path):
                continue  # it came into use since the plan: leave it
            if item["kind"] == "run":
                _remove_tree(path, os.lstat(root).st_dev)
            else:
                _clear_dump(path, keep_marker=item["kind"] == "dump_pieces")
            report["removed"].append(item)
            report["bytes_freed"] += item["bytes"]
    report["status"] = "dry_run" if dry_run else "done"
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_report(Path(report_out), report)  # after: what went
    return report


def preview(
    output_root: Path,
    current_run: Path,
    *,
    dump_root: Path | None,
    keep_runs: int,
    delete_finished: bool,
) -> list[str]:
    """What ``delete_stale`` would remove and keep now, as lines for the terminal."""
    from hsextract.budget import human

    try:
        root, droot = _roots(output_root, dump_root)
    except StaleDeletionError as exc:
        return [f"stale deletion will refuse: {exc}"]
    current = root / Path(current_run).name
    remove, kept, skipped = _plan(
        root, current, droot, keep_runs=keep_runs, delete_finished=delete_finished, owner_pid=None
    )
    lines = [f"  remove {i['path']}  {human(i['bytes'])}  ({i['kind']})" for i in remove]
    lines += [f"  keep   {i['path']}  {human(i['bytes'])}  ({i['why']})" for i in kept]
    return lines
