"""SpecForge's offline EAGLE-3 format, written so that SpecForge's own readers take it.

SpecForge 0.2.0 trains offline from a directory of ``torch.save`` files, one dict per
record, as its ``scripts/prepare_hidden_states.py`` writes them and
``OfflineManifestReader`` / ``load_feature_file`` / ``build_offline_eagle3_dataset`` read
them (every ``*.ckpt`` / ``*.ckpt.gz`` under the directory, sorted by path)::

    rows_{g}-{g+2000}/data_{idx}.ckpt[.gz]     g = idx // 2000 * 2000 (its file_group_size)
      input_ids        int64 [T]
      loss_mask        int64 [T]
      aux_hidden_state <captured dtype> [1, T, k*H]   the EAGLE-3 aux layers, in layer order
      hidden_state     <captured dtype> [1, T, H]     the final post-norm state

``idx`` is the record's 0-based line in ``merged/train.jsonl`` (:func:`record_indices`).
Beside the data, none of it a ``.ckpt`` (so SpecForge never reads it):

    hsextract_export.json      which run owns the directory (nothing else is ever deleted)
    settings-<digest>.json     compression: a change is a missing file, so every chunk redoes
    journal/chunk_<i>.jsonl    each file of a chunk as it is renamed into place: the resume
                               ledger (key, size, mtime, sha256); it outlives Snakemake's
                               removal of a rerun job's outputs
    done/chunk_<i>.json        the chunk's files, written last: the chunk is exported
    export.json                the whole export, checked against the manifest (last)

Every file goes in under a temporary ``.data_{idx}.ckpt.<pid>.tmp`` (no ``.ckpt`` suffix:
invisible to SpecForge) and is renamed when complete, so a killed export never leaves a
file that looks finished.  A rerun keeps a file only when the journal says it holds the
same record of the same chunk bytes (its key) and the file is still what was written
(size and mtime, else its sha256); everything else is rewritten.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip as gzip_module
import hashlib
import json
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hsextract.commands import hsextract_command
from hsextract.export.common import (
    ExportError,
    check_chunks,
    claim_dir,
    extract_all,
    open_chunk,
    read_json,
    read_record,
    refuse_deleted_after_ack,
    start_hash,
    verify_source,
)

log = logging.getLogger("hsextract")

#: SpecForge's ``--file-group-size`` default: files per ``rows_*`` folder.
GROUP = 2000
#: SpecForge's ``--compression-level`` default for ``--compress``.
GZIP_LEVEL = 6
#: Bumped when what a file holds for a record changes: every file is rewritten then.
LAYOUT_VERSION = 1
FORMAT = "specforge-offline-eagle3"
#: Why a directory holding anything else is refused (:func:`claim_dir`).
READS = "SpecForge reads every .ckpt under the directory it is given"
SUMMARY_FILE = "export.json"
_DATA_RE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
_TEMP_RE = re.compile(r"^\.data_(\d+)\.ckpt(?:\.gz)?\.\d+\.tmp$")
_SETTINGS_RE = re.compile(r"^settings-[0-9a-f]{12}\.json$")
_CHUNK_FILE_RE = re.compile(r"^\.?(chunk_\d+)\.(?:json|jsonl|lock)(?:\.\d+\.tmp)?$")


def folder_of(idx: int) -> str:
    """SpecForge's folder for a record: ``rows_{g}-{g+2000}``, as its
    ``_get_file_path`` names it."""
    g = idx // GROUP * GROUP
    return f"rows_{g}-{g + GROUP}"


def relpath(idx: int, gzip: bool) -> str:
    return f"{folder_of(idx)}/data_{idx}.ckpt{'.gz' if gzip else ''}"


def settings(gzip: bool) -> dict[str, Any]:
    """What the bytes of every exported file depend on beyond the chunk they come from."""
    return {
        "format": FORMAT,
        "layout_version": LAYOUT_VERSION,
        "group": GROUP,
        "gzip": bool(gzip),
        "gzip_level": GZIP_LEVEL if gzip else None,
    }


def _settings_key(gzip: bool) -> str:
    blob = json.dumps(settings(gzip), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def settings_file(out: str | os.PathLike[str], gzip: bool) -> Path:
    """``settings-<digest>.json``: named by the settings, like every stage's (common.smk)."""
    return Path(out) / f"settings-{_settings_key(gzip)}.json"


def default_out(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "export" / "specforge"


def _write_json_if_changed(path: Path, data: dict) -> bool:
    """Atomically (temp + rename), and only if the content differs: an unchanged file
    keeps its mtime, so a rerun that changes nothing makes nothing look newer."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


@contextlib.contextmanager
def _lock(path: Path, shared: bool, busy: str) -> Iterator[None]:
    """A non-blocking flock: two writers of one chunk, or a cleanup during a chunk's
    export, fail at once with ``busy`` instead of racing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(busy) from None
        yield
    finally:
        os.close(fd)


def prepare(
    out: str | os.PathLike[str], run_dir: str | os.PathLike[str], fingerprint: str, gzip: bool
) -> Path:
    """Claim the directory and record the settings (earlier settings files go)."""
    out, run_dir = Path(out), Path(run_dir)
    claim_dir(out, FORMAT, fingerprint, run_dir, READS)
    path = settings_file(out, gzip)
    for old in out.glob("settings-*.json"):
        if old != path and _SETTINGS_RE.match(old.name) and not old.is_symlink():
            old.unlink(missing_ok=True)
    _write_json_if_changed(path, settings(gzip))
    return path


def _prior_entries(marker: Path, journal: Path) -> dict[int, dict]:
    """What earlier exports of this chunk wrote, by idx: the marker's list, then the
    journal's lines (a torn last line, from a kill mid-append, is ignored)."""
    entries: dict[int, dict] = {}
    with contextlib.suppress(OSError, ValueError):
        for e in json.loads(marker.read_text()).get("files", []):
            entries[int(e["idx"])] = e
    with contextlib.suppress(OSError):
        for line in journal.read_text().splitlines():
            try:
                e = json.loads(line)
                entries[int(e["idx"])] = e
            except (ValueError, KeyError, TypeError):
                continue
    return entries


def _marker_source(marker: Path) -> str | None:
    """The sha256 of the chunk bytes a finished export of the chunk was written from."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        return str(json.loads(marker.read_text())["source"]["sha256"])
    return None


def _still_written(path: Path, entry: dict) -> int | None:
    """The file is the one the entry recorded: same size, and same mtime or same sha256
    (a copied or touched file is re-hashed, a truncated one never passes).  Returns its
    mtime_ns then, else None."""
    from hsextract.chunks import sha256_file

    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_size != entry.get("bytes"):
        return None
    if st.st_mtime_ns == entry.get("mtime_ns") or sha256_file(path) == entry.get("sha256"):
        return st.st_mtime_ns
    return None


def _remove_stale_temps(out: Path, idxs: set[int]) -> list[str]:
    """Temporary files a killed export of these records left (only ours: another chunk's
    job may be writing its own next to them)."""
    removed = []
    for folder in sorted({folder_of(i) for i in idxs}):
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(out / folder):
                m = _TEMP_RE.match(name)
                if m and int(m.group(1)) in idxs:
                    (out / folder / name).unlink(missing_ok=True)
                    removed.append(f"{folder}/{name}")
    return removed


def _own_storage(t: Any) -> Any:
    """torch.save writes a tensor's whole storage: a view of a larger buffer is copied."""
    import torch

    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and whole:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _write_file(path: Path, tensors: dict, gzip: bool, chunk: str) -> tuple[int, int, str]:
    """Temp name, fsync, hash, rename; returns (size, mtime_ns, sha256).  Gzip streams are
    written with mtime 0, so the same record gives the same bytes on every rerun."""
    import torch

    from hsextract.chunks import sha256_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            if gzip:
                with gzip_module.GzipFile(
                    filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=raw, mtime=0
                ) as f:
                    torch.save(tensors, f)
            else:
                torch.save(tensors, raw)
            raw.flush()
            os.fsync(raw.fileno())
        sha = sha256_file(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        cause = "disk full" if getattr(exc, "errno", None) == 28 else "cannot write"
        raise ExportError(
            f"{chunk}: {cause} writing {path} ({exc}): the partial file was removed; "
            "fix that (free space there) and rerun: finished files are kept"
        ) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    st = path.stat()
    return st.st_size, st.st_mtime_ns, sha


def export_chunk(
    run_dir: str | os.PathLike[str],
    chunk: str,
    out: str | os.PathLike[str] | None = None,
    *,
    gzip: bool = False,
    expect_sha256: str | None = None,
    progress: Callable[[int], object] | None = None,
) -> dict:
    """Write one chunk's records as SpecForge files; returns (and writes) its marker.

    The chunk must hold exactly the records ``chunks/index.json`` assigns it (checked
    from its own tensors), since each file is named by the record's train.jsonl line.
    ``expect_sha256`` (the manifest's) refuses a chunk re-extracted since the manifest.
    ``progress`` is called with 1 per record.
    """
    t0 = time.monotonic()
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else default_out(run_dir)
    src = open_chunk(run_dir, chunk, expect_sha256)
    hidden, sidecar, reader, idxs = src.path, src.sidecar, src.reader, src.indices
    source_sha, digest = src.sha256, src.content_digest
    claim_dir(out, FORMAT, str(sidecar.get("fingerprint")), run_dir, READS)

    # The EAGLE-3 aux layers only: the reader hands a prenorm_final capture (aux index L)
    # out on its own, and SpecForge has no slot for it.
    h = reader.hidden_size
    if reader.codec == "fp8":
        log.warning("%s: fp8 chunk: the export holds its dequantized (lossy) states", chunk)

    key_base = f"{source_sha}:{_settings_key(gzip)}"
    marker_path = out / "done" / f"{chunk}.json"
    journal = out / "journal" / f"{chunk}.jsonl"
    busy = f"{out}: another export of {chunk} is running; wait for it"
    files: list[dict] = []
    written = kept = 0
    hasher = None  # started at the first record read: a rerun that keeps all reads none
    ledger = (journal, marker_path)  # removed with the files on a mismatch
    with (
        _lock(out / "journal" / ".export.lock", True, f"{out}: an export cleanup is running"),
        _lock(journal.with_suffix(".lock"), False, busy),
        contextlib.ExitStack() as hashing,
    ):
        # A marker is written only once the chunk's bytes were checked: one naming these
        # bytes (their sha256) vouches for the files a rerun keeps, when it reads none;
        # journal lines alone may be a killed pass's, written before the check.
        vouched = _marker_source(marker_path) == source_sha
        prior = _prior_entries(marker_path, journal)
        removed = _remove_stale_temps(out, set(idxs))
        if removed:
            log.info("%s: removed temporary files of a killed export: %s", chunk, removed)
        journal.parent.mkdir(parents=True, exist_ok=True)
        with open(journal, "a", buffering=1) as jf:
            for j, idx in enumerate(idxs):
                rid = reader.record_ids[j]
                rel = relpath(idx, gzip)
                path = out / rel
                key = f"{key_base}:{j}:{rid}"
                e = prior.get(idx)
                same = e is not None and e.get("key") == key and e.get("path") == rel
                mtime_ns = _still_written(path, e) if same and e is not None else None
                if e is not None and mtime_ns is not None:
                    kept += 1
                    e = {**e, "mtime_ns": mtime_ns}
                else:
                    if hasher is None:
                        hasher = hashing.enter_context(start_hash(src))
                    rec = read_record(
                        src, hasher, j, lambda: [out / f["path"] for f in files], ledger
                    )
                    tensors = _tensors(rec)
                    nbytes, mtime_ns, sha = _write_file(path, tensors, gzip, chunk)
                    e = {
                        "idx": idx,
                        "id": rid,
                        "path": rel,
                        "tokens": int(tensors["input_ids"].numel()),
                        "bytes": nbytes,
                        "mtime_ns": mtime_ns,
                        "sha256": sha,
                        "key": key,
                    }
                    jf.write(json.dumps(e, sort_keys=True) + "\n")
                    written += 1
                # The other compression's twin would be read too: SpecForge reads both.
                (out / relpath(idx, not gzip)).unlink(missing_ok=True)
                files.append(e)
                if progress is not None:
                    progress(1)
        if hasher is None and not vouched:
            hasher = hashing.enter_context(start_hash(src))
        if hasher is not None:
            # On a mismatch nothing of this pass may be kept by the next: the ledger goes.
            verify_source(src, hasher, [out / f["path"] for f in files], ledger)
        marker = {
            "format": FORMAT,
            "chunk": chunk,
            "fingerprint": sidecar.get("fingerprint"),
            "source": {
                "path": f"hidden/{hidden.name}",
                "sha256": source_sha,
                "content_digest": digest,
                "codec": reader.codec,
            },
            "settings": settings(gzip),
            "dtype": str(reader.dtype).replace("torch.", ""),
            "hidden_size": h,
            "aux_layers": reader.aux_layers,
            "prenorm_left_out": reader.prenorm,
            "records": len(files),
            "tokens": sum(f["tokens"] for f in files),
            "bytes": sum(f["bytes"] for f in files),
            "files": files,
        }
        # The journal now says exactly what the marker says: entries of records this
        # chunk no longer holds go (another chunk may own those files now).
        text = "".join(json.dumps(f, sort_keys=True) + "\n" for f in files)
        if journal.read_text() != text:
            tmp = journal.with_name(f".{journal.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, journal)
        _write_json_if_changed(marker_path, marker)
    marker["written"], marker["kept"] = written, kept
    marker["seconds"] = round(time.monotonic() - t0, 3)
    return marker


def _tensors(rec: dict) -> dict:
    """One record as SpecForge's prepare_hidden_states persists it (same keys, order,
    ranks; ids and mask as int64, the states in the captured dtype)."""
    import torch

    return {
        "input_ids": rec["input_ids"].to(torch.int64),
        "loss_mask": rec["loss_mask"].to(torch.int64),
        "aux_hidden_state": _own_storage(rec["aux_hidden_states"]).unsqueeze(0),
        "hidden_state": _own_storage(rec["hidden_states"]).unsqueeze(0),
    }


def finish_export(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    manifest: str | os.PathLike[str] | None = None,
) -> dict:
    """Check the exported chunks against the manifest, remove what no chunk lists, write
    ``export.json``.

    Orphans appear when the data changes (train.jsonl has fewer lines, ``n_chunks`` went
    down) or when the compression changed; SpecForge would train on them, so they go.
    Leftover temporary files go too.  A ``.ckpt`` of any other name is refused, not
    deleted: it is someone's, and SpecForge would read it.
    """
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else default_out(run_dir)
    mpath = Path(manifest) if manifest is not None else run_dir / "manifest.json"
    man = read_json(mpath, "export", f"run `{extract_all(mpath)}` first")
    chunks = {Path(c["path"]).stem: c for c in man["chunks"]}
    busy = f"{out}: a chunk export is still running; rerun when it has finished"
    with _lock(out / "journal" / ".export.lock", False, busy):
        listed: dict[str, str] = {}
        markers = []
        for name, c in sorted(chunks.items()):
            again = ("export", "specforge", "--manifest", mpath)
            redo = f"export it: `{hsextract_command(*again, with_config=False)}`"
            m = read_json(out / "done" / f"{name}.json", name, redo)
            if m["source"]["sha256"] != c["sha256"]:
                raise ExportError(
                    f"{name}: exported from other bytes than the manifest lists (re-extracted "
                    f"since its export); {redo}"
                )
            for f in m["files"]:
                if f["path"] in listed:
                    raise ExportError(f"{f['path']} is listed by {listed[f['path']]} and {name}")
                listed[f["path"]] = name
                try:
                    size = (out / f["path"]).stat().st_size
                except FileNotFoundError:
                    size = None
                if size != f["bytes"]:
                    raise ExportError(
                        f"{name}: {out / f['path']} is missing or changed since it was written; "
                        f"delete {out / 'done' / (name + '.json')} and {redo}"
                    )
            markers.append(m)
        gz = {m["settings"]["gzip"] for m in markers}
        if len(gz) > 1:
            raise ExportError(f"{out}: chunks exported with and without gzip; export again")
        idxs = sorted(f["idx"] for m in markers for f in m["files"])
        total = int(man["totals"]["records"])
        if idxs != list(range(total)):
            raise ExportError(
                f"{out}: the chunks hold {len(idxs)} records, not the lines 0..{total - 1} of "
                f"train.jsonl the manifest counts; export again"
            )
        removed = _remove_unlisted(out, set(listed), set(chunks))
        first = markers[0] if markers else {}
        summary = {
            "format": FORMAT,
            "fingerprint": man.get("fingerprint"),
            "manifest_created": man.get("created"),
            "records": len(idxs),
            "tokens": sum(m["tokens"] for m in markers),
            "bytes": sum(m["bytes"] for m in markers),
            "chunks": len(markers),
            "settings": first.get("settings", settings(False)),
            "layout": "rows_{g}-{g+2000}/data_{idx}.ckpt" + (".gz" if gz == {True} else ""),
            "idx": "the record's 0-based line in merged/train.jsonl",
            "dtype": first.get("dtype"),
            "hidden_size": first.get("hidden_size"),
            "aux_layers": first.get("aux_layers"),
            "prenorm_left_out": first.get("prenorm_left_out"),
            "keys": {
                "input_ids": "int64 [T]",
                "loss_mask": "int64 [T]",
                "aux_hidden_state": "[1, T, k*H]",
                "hidden_state": "[1, T, H] (final post-norm)",
            },
            # Pasted into a shell: a path with a space or a `$` must stay one argument.
            "train": "specforge train --config <run.yaml> "
            + shlex.quote(f"data.hidden_states_path={out.resolve()}"),
        }
        # Newer than every marker even when its content is the same (a CLI rerun that
        # rewrote one damaged file), so Snakemake's mtimes see the export as finished.
        path = out / SUMMARY_FILE
        if not _write_json_if_changed(path, summary) and path.stat().st_mtime_ns < max(
            (out / "done" / f"{name}.json").stat().st_mtime_ns for name in chunks
        ):
            os.utime(path)
    summary["removed"] = removed
    return summary


def _remove_unlisted(out: Path, listed: set[str], chunks: set[str]) -> list[str]:
    """Data files no chunk lists, leftover temporary files, markers and journals of chunks
    the run no longer has; empty ``rows_*`` folders.  Returns what went."""
    removed: list[str] = []
    for root, dirs, names in os.walk(out, topdown=False):  # folders emptied first
        rel_root = Path(root).relative_to(out)
        depth, top = len(rel_root.parts), (rel_root.parts or ("",))[0]
        for name in names:
            rel = (rel_root / name).as_posix()
            m = _CHUNK_FILE_RE.match(name)
            if depth == 1 and top in ("done", "journal") and m:
                if m.group(1) not in chunks:
                    (Path(root) / name).unlink(missing_ok=True)
                    removed.append(rel)
                continue
            ours = _TEMP_RE.match(name) or (_DATA_RE.match(name) and rel not in listed)
            if depth == 1 and top.startswith("rows_") and ours:
                (Path(root) / name).unlink(missing_ok=True)
                removed.append(rel)
            elif name.endswith((".ckpt", ".ckpt.gz")) and rel not in listed:
                raise ExportError(
                    f"{out / rel} is not part of this export, and SpecForge would train on it: "
                    "move it out of the directory"
                )
        if depth == 0:
            for d in dirs:
                if d.startswith("rows_") and not any((out / d).iterdir()):
                    (out / d).rmdir()
                    removed.append(d + "/")
    return removed


def export_run(
    manifest: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    gzip: bool = False,
    show_progress: bool = True,
) -> dict:
    """Every chunk of a manifest, then :func:`finish_export` (the CLI)."""
    from tqdm import tqdm

    mpath = Path(manifest)
    man = read_json(mpath, "export", f"run `{extract_all(mpath)}` first")
    run_dir = mpath.parent
    refuse_deleted_after_ack(run_dir)
    out = Path(out) if out is not None else default_out(run_dir)
    check_chunks(run_dir, man)
    prepare(out, run_dir, str(man.get("fingerprint")), gzip)
    written = kept = 0
    with tqdm(
        total=int(man["totals"]["records"]),
        unit="rec",
        desc="export specforge",
        disable=not show_progress,
    ) as bar:
        for c in man["chunks"]:
            bar.set_postfix_str(c["chunk"])
            m = export_chunk(
                run_dir,
                c["chunk"],
                out,
                gzip=gzip,
                expect_sha256=c["sha256"],
                progress=bar.update,
            )
            written, kept = written + m["written"], kept + m["kept"]
    summary = finish_export(run_dir, out, manifest=mpath)
    summary["written"], summary["kept"], summary["out"] = written, kept, str(out)
    return summary


def register_cli(sub: Any) -> None:
    """``hsextract export specforge --manifest M [--out DIR] [--gzip]``."""
    p = sub.add_parser(
        "specforge",
        help="SpecForge's offline format (data.hidden_states_path)",
        description="Write a finished run as SpecForge offline .ckpt files; resumable.",
    )
    p.add_argument("--manifest", required=True, help="the run's manifest.json")
    p.add_argument("--out", help="export directory (default: <run dir>/export/specforge)")
    p.add_argument("--gzip", action="store_true", help="write .ckpt.gz (SpecForge --compress)")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    s = export_run(args.manifest, args.out, gzip=args.gzip, show_progress=sys.stderr.isatty())
    print(
        f"{s['records']} records ({s['tokens']} tokens, {s['bytes'] / 2**20:.1f} MiB) in "
        f"{s['out']}: {s['written']} written, {s['kept']} kept, {len(s['removed'])} removed"
    )
    print(f"train: {s['train']}")
    return 0


# Snakemake jobs (rules/export.smk): scripts/export_specforge_*.py hand them `snakemake`.


def step_settings(sm: Any) -> None:
    from hsextract.config import fingerprint, run_dir, typed

    cfg = typed(sm.config)
    prepare(Path(sm.output.settings).parent, run_dir(cfg), fingerprint(cfg), sm.params.gzip)


def step_chunk(sm: Any) -> None:
    hidden = Path(sm.input.hidden)
    m = export_chunk(
        hidden.parent.parent,
        hidden.stem,
        Path(sm.output.done).parent.parent,
        gzip=json.loads(Path(sm.input.settings).read_text())["gzip"],
    )
    log.info("%s exported: %d written, %d kept", hidden.stem, m["written"], m["kept"])
    sys.__stderr__.write(
        f"hsextract [export {hidden.stem}]: {m['records']} records, {m['written']} written, "
        f"{m['kept']} kept, {m['bytes'] / 2**20:.1f} MiB in {m['seconds']:.1f}s\n"
    )


def step_summary(sm: Any) -> None:
    s = finish_export(
        Path(sm.input.manifest).parent,
        Path(sm.output.summary).parent,
        manifest=Path(sm.input.manifest),
    )
    log.info("export: %s", json.dumps(s))
    sys.__stderr__.write(
        f"hsextract [export]: {s['records']} records in {Path(sm.output.summary).parent}, "
        f"{len(s['removed'])} stale file(s) removed; train: {s['train']}\n"
    )
