"""Guarded deletion of stale hidden states (the seed deleted 924 GB by hand).

Only directories this pipeline created are ever removed: a run dir
``<output_root>/<fingerprint>/`` or a dump dir, each carrying ``RUN_MARKER``.  The root
is resolved first and must not be ``/``, ``$HOME`` or a mount point; candidates are
direct children of the root, never reached through a symlink; the removal walk never
follows a symlink and never crosses into another filesystem.  The report is written
before anything is removed (what will go) and again after (what went).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path
from typing import Any

import orjson

from hsextract.config import RUN_MARKER
from hsextract.errors import HsextractError

__all__ = ["RUN_MARKER", "StaleDeletionError", "delete_stale"]


class StaleDeletionError(HsextractError):
    """The configured root is unsafe to clean, or a removal failed."""


def _safe_root(root: Path, what: str, *, allow_mount: bool = False) -> Path:
    """Resolve ``..`` and symlinks, then refuse roots that could hold other people's data.

    ``allow_mount`` is for the dump root only: /dev/shm is a mount point by design, and
    only marked children of it are ever touched.
    """
    if not str(root):
        raise StaleDeletionError(f"{what} is empty")
    resolved = Path(os.path.realpath(os.path.abspath(root)))
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if resolved == Path(resolved.anchor):
        raise StaleDeletionError(f"refusing to clean {what}={root!s}: it resolves to '/'")
    if resolved == home:
        raise StaleDeletionError(f"refusing to clean {what}={root!s}: it is $HOME ({home})")
    if not allow_mount and resolved.exists() and os.path.ismount(resolved):
        raise StaleDeletionError(
            f"refusing to clean {what}={root!s}: {resolved} is a filesystem root (mount "
            "point); use a subdirectory as output_root / dump.dir"
        )
    return resolved


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


def _candidates(root: Path, keep_name: str | None) -> list[Path]:
    """Marked real directories directly under root, except the current run's."""
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        if entry.name == keep_name or not entry.is_dir(follow_symlinks=False):
            continue  # symlinks (to anywhere) and files are never candidates
        marker = os.path.join(entry.path, RUN_MARKER)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(marker).st_mode):
                found.append(Path(entry.path))
    return found


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


def _clear_pieces(path: Path, dev: int) -> None:
    """Empty a dump dir but keep it and its marker (the current run still owns it)."""
    with os.scandir(path) as it:
        entries = [Path(e.path) for e in it if e.name != RUN_MARKER]
    for child in entries:
        _remove_tree(child, dev)


def _plan(
    output_root: Path, fingerprint: str, dump_root: Path | None, keep_runs: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(to remove, kept) entries; runs are ordered newest first by their marker's mtime.

    A marked dump dir goes when its name carries the fingerprint of a run being removed;
    the current run's dump dir loses its leftover pieces; any other marked dump dir may
    belong to a live run elsewhere and is only reported.
    """
    runs = _candidates(output_root, fingerprint)
    runs.sort(key=lambda p: (-os.lstat(p / RUN_MARKER).st_mtime_ns, p.name))
    kept = [{"path": str(p), "kind": "run", "why": "keep_runs"} for p in runs[:keep_runs]]
    remove = [{"path": str(p), "kind": "run"} for p in runs[keep_runs:]]
    stale_fps = {Path(i["path"]).name for i in remove}
    if dump_root is not None:
        for p in _candidates(dump_root, None):
            if fingerprint in p.name:
                if any(e.name != RUN_MARKER for e in os.scandir(p)):
                    remove.append({"path": str(p), "kind": "dump_pieces"})
            elif any(fp in p.name for fp in stale_fps):
                remove.append({"path": str(p), "kind": "dump"})
            else:
                kept.append({"path": str(p), "kind": "dump", "why": "not a run removed here"})
    for item in remove:
        item["bytes"] = _tree_bytes(Path(item["path"]))
    return remove, kept


def _write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(tmp, path)


def delete_stale(
    output_root: Path,
    current_fingerprint: str,
    *,
    dump_root: Path | None,
    keep_runs: int,
    dry_run: bool,
    report_out: Path,
) -> dict[str, Any]:
    """Remove marked run dirs of other fingerprints and leftover marked dump dirs.

    ``dump_root`` is the directory that holds dump dirs (e.g. ``/dev/shm`` or the parent
    of ``dump.dir``); only its marked children are touched.  Returns the report.
    """
    if keep_runs < 0:
        raise StaleDeletionError(f"stale.keep_runs must be >= 0, got {keep_runs}")
    if not current_fingerprint or "/" in current_fingerprint or current_fingerprint in (".", ".."):
        raise StaleDeletionError(f"bad fingerprint {current_fingerprint!r}")
    root = _safe_root(Path(output_root), "output_root")
    droot = (
        _safe_root(Path(dump_root), "dump root", allow_mount=True)
        if dump_root is not None
        else None
    )
    remove, kept = _plan(root, current_fingerprint, droot, keep_runs)
    report: dict[str, Any] = {
        "output_root": str(root),
        "dump_root": str(droot) if droot else None,
        "fingerprint": current_fingerprint,
        "dry_run": dry_run,
        "keep_runs": keep_runs,
        "status": "planned",
        "will_remove": remove,
        "will_remove_bytes": sum(i["bytes"] for i in remove),
        "kept": kept,
        "removed": [],
        "bytes_freed": 0,
    }
    _write_report(Path(report_out), report)  # before: what WILL go
    if not dry_run:
        for item in remove:
            path = Path(item["path"])
            dev = os.lstat(root if item["kind"] == "run" else droot).st_dev  # type: ignore[arg-type]
            if item["kind"] == "dump_pieces":
                _clear_pieces(path, dev)
            else:
                _remove_tree(path, dev)
            report["removed"].append(item)
            report["bytes_freed"] += item["bytes"]
    report["status"] = "dry_run" if dry_run else "done"
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_report(Path(report_out), report)  # after: what went
    return report
