"""What every export shares: a record's stable index, its error, reading its inputs, the
checked chunk it exports from, and the ownership of its directory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hsextract.commands import snakemake_command
from hsextract.errors import HsextractError
from hsextract.records import read_index

if TYPE_CHECKING:  # chunks imports torch: the Snakefile imports this module to plan
    from hsextract.chunkfile import ChunkHasher
    from hsextract.chunks import ChunkReader


class ExportError(HsextractError):
    """An export cannot be written or does not match the run it claims to export."""


def extract_all(manifest: str | os.PathLike[str]) -> str:
    """The command that makes (or rebuilds) a manifest, with its run's config."""
    return snakemake_command("extract_all", run_dir=Path(manifest).parent)


def read_json(path: Path, what: str, fix: str) -> dict:
    """A JSON input of an export, or an :class:`ExportError` naming it and what to do."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ExportError(f"{what}: {path} does not exist; {fix}") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{what}: {path} is unreadable ({exc}); {fix}") from exc


def refuse_deleted_after_ack(run_dir: str | os.PathLike[str]) -> None:
    """Refuse, before anything is written, to export a run whose chunk files the stream
    deleted after the trainer's ack (``stream.budget_gb``; their sidecars are receipts).

    An export reads every chunk file: it could only re-extract those, which nobody asked
    for and which the budget was set to keep off the disk.  The CLI and the export rules'
    inputs (``export_chunk_files`` in rules/common.smk: ``snakemake -n`` ends with it)
    call this; a run whose chunk files are all still on disk exports as any run does.
    """
    from hsextract.stream.receipts import deleted_after_ack

    gone = sorted(deleted_after_ack(run_dir))
    if gone:
        named = ", ".join(gone[:3]) + (", ..." if len(gone) > 3 else "")
        raise ExportError(
            f"{run_dir}: {len(gone)} chunk file(s) ({named}) were deleted after the "
            "trainer's ack (the run was streamed under stream.budget_gb), so an export "
            "would have to re-extract them: read the run as a stream instead "
            "(hsextract.stream: StreamDataset, SpecForgeStreamDataset, speculators_loader), "
            "or set stream.budget_gb: null and rerun "
            f"`{snakemake_command('extract_all', run_dir=run_dir)}` (it re-extracts them; the "
            "disk must then hold the whole run) before exporting"
        )


@lru_cache(maxsize=4)
def _line_starts(train: Path, size: int, mtime_ns: int) -> np.ndarray:
    data = np.fromfile(train, dtype=np.uint8)
    ends = np.flatnonzero(data == 10)
    return np.concatenate([[0], ends[ends + 1 < len(data)] + 1]).astype(np.int64)


def record_indices(run_dir: Path, chunk: str) -> list[int]:
    """Each record of ``chunk`` (in the chunk file's order): its 0-based line number in
    ``merged/train.jsonl``.

    The export's file names use it (``data_{idx}``, ``hs_{idx}``): stable across reruns
    of other chunks and across ``n_chunks``, unique in the run, and it points a reader at
    the record's text and token ids.  It changes only when train.jsonl does, and then
    every chunk is re-exported (the export rules depend on the index).
    """
    run_dir = Path(run_dir)
    idx = read_index(run_dir / "chunks" / "index.json")
    train = run_dir / "merged" / idx["source"]
    st = train.stat()
    starts = _line_starts(train, st.st_size, st.st_mtime_ns)
    for entry in idx["chunks"]:
        if Path(entry["path"]).stem == chunk:
            offsets = np.array([off for off, _ in entry["lines"]], dtype=np.int64)
            lines = np.searchsorted(starts, offsets)
            if len(offsets) and not np.array_equal(starts[lines], offsets):
                raise ValueError(f"{chunk}: index lines do not start lines of {train}")
            return lines.tolist()
    raise KeyError(f"{chunk} is not a chunk of {run_dir / 'chunks' / 'index.json'}")


OWNER_FILE = "hsextract_export.json"


def claim_dir(out: Path, fmt: str, fingerprint: str, run_dir: Path, reads: str) -> None:
    """Make ``out`` this run's ``fmt`` export directory, or refuse naming it.

    An export replaces and removes files in its directory, and the trainer reads what is
    there (``reads`` says what), so a directory holding anything else (another tool's,
    another run's or another format's files) is never used.  The owner file is created
    (atomically, exclusively) before anything else is written: an entry seen without it,
    after a second look, is not ours.  Empty folders are not entries: Snakemake creates
    the folders of a job's outputs (``done/``) before the job runs.
    """
    owner = out / OWNER_FILE
    want = {"format": fmt, "fingerprint": fingerprint, "run_dir": str(run_dir.resolve())}

    def check() -> bool:
        try:
            have = json.loads(owner.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            raise ExportError(f"{owner} is unreadable ({exc}); delete {out}, export again") from exc
        if have.get("format") != fmt or have.get("fingerprint") != fingerprint:
            raise ExportError(
                f"{out} holds the export of run {have.get('fingerprint')!r} "
                f"({have.get('run_dir')}, {have.get('format')}), not the {fmt} export of "
                f"{fingerprint} ({run_dir}): the trainer would mix both; export to another "
                "directory or delete it"
            )
        return True

    def foreign(entry: os.DirEntry) -> bool:
        if entry.name.startswith(f".{OWNER_FILE}."):
            return False
        if entry.is_dir(follow_symlinks=False):
            return any(True for _ in os.scandir(entry.path))
        return True

    if check():
        return
    out.mkdir(parents=True, exist_ok=True)
    with os.scandir(out) as entries:
        taken = any(foreign(e) for e in entries)
    if taken and not check():
        raise ExportError(
            f"{out} is not empty and holds no hsextract export; {reads}: export to a new or "
            "empty directory (nothing in it was changed)"
        )
    tmp = out / f".{OWNER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(want, indent=2, sort_keys=True) + "\n")
    try:
        os.link(tmp, owner)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    check()


@dataclass(frozen=True)
class CheckedChunk:
    """A chunk file an export may read: the one its sidecar (and the manifest) describe,
    holding exactly the records ``chunks/index.json`` assigns it."""

    name: str
    path: Path
    sidecar: dict
    sha256: str
    content_digest: str
    reader: ChunkReader
    indices: list[int]


def open_chunk(run_dir: Path, chunk: str, expect_sha256: str | None = None) -> CheckedChunk:
    """``chunk`` of ``run_dir``, checked before any export writes a file from it.

    Every exported file is named by its record's train.jsonl line and holds the chunk's
    states, so a chunk extracted from other records than the index now assigns it (the
    data changed and the chunk was not re-extracted) would pair new tokens with old
    states: its content digest, computed from its own tensors, must equal the index's.
    ``expect_sha256`` (the manifest's) refuses a chunk re-extracted since the manifest.
    Its bytes are checked against its sha256 as the export reads them (:func:`start_hash`,
    :func:`verify_source`), not here: that would read the whole file twice.
    """
    from hsextract.chunks import ChunkFileError, content_digest_of
    from hsextract.records import ChunkInputError

    run_dir = Path(run_dir)
    hidden = run_dir / "hidden" / f"{chunk}.safetensors"
    redo = f"re-extract it: delete it and rerun `{snakemake_command(hidden, run_dir=run_dir)}`"
    sidecar = read_json(hidden.with_suffix(".json"), chunk, f"extract it first ({redo})")
    try:
        size = hidden.stat().st_size
    except FileNotFoundError:
        raise ExportError(f"{chunk}: {hidden} does not exist; {redo}") from None
    if size != sidecar.get("bytes"):
        raise ExportError(
            f"{chunk}: {hidden} is {size} bytes, its sidecar says {sidecar.get('bytes')}; {redo}"
        )
    source_sha = str(sidecar["sha256"])
    if expect_sha256 is not None and expect_sha256 != source_sha:
        raise ExportError(
            f"{chunk}: {hidden} (sha256 {source_sha[:12]}) is not the file the manifest "
            f"lists ({expect_sha256[:12]}): rerun "
            f"`{snakemake_command('extract_all', run_dir=run_dir)}`, then export"
        )
    try:
        index = read_index(run_dir / "chunks" / "index.json")
        entry = next(e for e in index["chunks"] if Path(e["path"]).stem == chunk)
        indices = record_indices(run_dir, chunk)
        digest = content_digest_of(hidden)
        from hsextract.chunks import ChunkReader

        reader = ChunkReader(hidden, verify=False)  # hashed as it is read: start_hash
    except StopIteration:
        raise ExportError(f"{chunk} is not a chunk of {run_dir}/chunks/index.json") from None
    except (ChunkFileError, ChunkInputError, OSError, KeyError, ValueError) as exc:
        raise ExportError(f"{chunk}: {exc}; {redo}") from exc
    if digest != entry["content_digest"] or len(reader) != len(indices):
        raise ExportError(
            f"{chunk}: {hidden} holds other records than chunks/index.json assigns it "
            f"(extracted before the data changed, or replaced since); nothing was exported "
            f"from it: {redo}"
        )
    return CheckedChunk(chunk, hidden, sidecar, source_sha, digest, reader, indices)


def start_hash(src: CheckedChunk) -> ChunkHasher:
    """The chunk file's sha256, taken while the export reads it (:class:`ChunkHasher`):
    :func:`open_chunk` checks what is cheap, this the bytes, with no second read."""
    from hsextract.chunkfile import ChunkHasher

    return ChunkHasher(src.path, src.sha256)


def verify_source(
    src: CheckedChunk, hasher: ChunkHasher, made: Sequence[Path], ledger: Sequence[Path] = ()
) -> None:
    """Refuse what was exported from a chunk whose bytes are not its sidecar's sha256.

    Called before the export commits (its marker), with every file it holds of the
    chunk's records (``made``) and its own records of them (``ledger``: a rerun must keep
    none): on a mismatch all are removed (states of damaged bytes; a trainer reads every
    file of the directory) and the export fails naming the chunk file, the two digests
    and what to do.  The chunk file itself is never touched.
    """
    from hsextract.chunkfile import ChunkFileError

    try:
        hasher.check()
    except ChunkFileError as exc:
        for path in [*made, *ledger]:
            path.unlink(missing_ok=True)
        raise ExportError(
            f"{src.name}: {exc}, then export again (the {len(made)} file(s) exported from "
            "it were removed)"
        ) from None


def read_record(
    src: CheckedChunk,
    hasher: ChunkHasher,
    j: int,
    made: Callable[[], Sequence[Path]],
    ledger: Sequence[Path] = (),
) -> dict:
    """Record ``j`` of the chunk; one that does not decode (a damaged compressed frame)
    is blamed on the bytes when their hash says so (:func:`verify_source`), since that
    names the cause and the fix; otherwise the decoder's error, with what to do.
    ``made`` lists the files written so far, called only then (not once per record)."""
    from hsextract.chunkfile import ChunkFileError, redo_chunk

    try:
        return src.reader[j]
    except ChunkFileError as exc:
        verify_source(src, hasher, made(), ledger)
        raise ExportError(f"{src.name}: {exc}; {redo_chunk(src.path)}") from None


def check_chunks(
    run_dir: Path, man: dict, require: Callable[[CheckedChunk], None] | None = None
) -> None:
    """Every chunk of a manifest through :func:`open_chunk` (then ``require``) before an
    export writes anything: a stale chunk found halfway would leave files of the new data
    beside files of the old.  Costs a second read of each chunk's ids and masks, small
    beside its states."""
    for c in man["chunks"]:
        src = open_chunk(run_dir, c["chunk"], c["sha256"])
        if require is not None:
            require(src)
