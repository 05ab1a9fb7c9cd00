"""The manifest behind ``extract_all``, and ``hsextract verify``: no stale chunk passes as good.

Three things must agree for a chunk to be listed: its file (the tensors and the content
digest in its metadata), ``chunks/index.json`` (the records split_chunks assigned it, by
content digest) and ``merged/train.jsonl`` (the data those records came from, by sha256).
The manifest checks the cheap links on every run; ``verify`` re-derives everything from
the bytes: each chunk file's sha256, the digest of the records it really holds, and the
digest of the lines of train.jsonl the index points at.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import orjson

# The structural half only: building the manifest, once after the last chunk of every run,
# reads no states, and importing torch (hsextract.chunks) was most of its time.
from hsextract.chunkfile import ChunkFileError, check_chunk, digest_mismatch, sha256_file
from hsextract.commands import snakemake_command
from hsextract.config import Config, fingerprint, public_config, run_base, storage_codec, typed
from hsextract.errors import HsextractError
from hsextract.records import content_digest, read_index, record_digest
from hsextract.server import write_json


class ManifestError(HsextractError):
    """A chunk does not match the data it claims to hold."""


def _redo(path: Path) -> str:
    run = Path(path).parent.parent
    if (run / "stream").is_dir():
        # Under a disk budget the rule's output is the sidecar (the receipt): the target.
        redo = snakemake_command(Path(path).with_suffix(".json"), run_dir=run)
        return f"delete it and its sidecar and rerun `{redo}` (or extract_all)"
    redo = snakemake_command(Path(path), run_dir=run)
    return f"delete it and rerun `{redo}` (or extract_all)"


def build_manifest(
    sidecars: list[Path], *, stats: Path, index: Path, out: Path, cfg: Config
) -> dict:
    """Cross-check each chunk against its sidecar, the index and train.jsonl; list them.

    Hashes of the chunk files are taken from the sidecars, which the extractor computed
    from the bytes it fsynced; re-hashing terabytes here would double the I/O.
    ``hsextract verify`` re-hashes.
    """
    root = out.parent
    idx = read_index(index)
    entries = {Path(e["path"]).stem: e for e in idx["chunks"]}
    train = Path(index).parent.parent / "merged" / idx["source"]
    if sha256_file(train) != idx["source_sha256"]:
        raise ManifestError(
            f"{train} changed after split_chunks ({index} was made from another version); "
            f"rerun `{snakemake_command('extract_all', run_dir=root)}` (the split reruns, "
            "changed chunks re-extract)"
        )
    fp = fingerprint(cfg)
    codec = storage_codec(cfg)
    freed = _freed(root)
    chunks = [_chunk_entry(Path(sc), entries, index, fp, codec, root, freed) for sc in sidecars]
    first = json.loads(Path(sidecars[0]).read_text()) if sidecars else {}
    manifest = {
        "format_version": "1",
        "fingerprint": fp,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine": cfg.engine,
        "model": cfg.model.path,
        "aux_layers": first.get("aux_layers"),
        "max_seq_len": cfg.max_seq_len,
        "codec": codec,
        "totals": _sums(chunks),
        "merge_stats": str(Path(stats).relative_to(root))
        if Path(stats).is_relative_to(root)
        else str(stats),
        "data": {
            "index": str(Path(index).relative_to(root))
            if Path(index).is_relative_to(root)
            else str(index),
            "train_sha256": idx["source_sha256"],
            "records": idx["source_records"],
        },
        "config": public_config(cfg),
        "chunks": chunks,
    }
    with manifest_lock(out):
        write_json(out, manifest)
    return manifest


def _freed(root: Path) -> dict[str, dict]:
    """Chunks whose payload the stream deleted after the trainer's ack (their sidecar is
    the receipt, hsextract.stream.receipts); none for an offline run (nothing imported)."""
    if not (root / "stream").is_dir():
        return {}
    from hsextract.stream.receipts import deleted_after_ack

    return deleted_after_ack(root)


def _chunk_entry(
    sc: Path,
    entries: dict[str, dict],
    index: Path,
    fp: str,
    codec: str,
    root: Path,
    freed: dict[str, dict] | None = None,
) -> dict:
    """A chunk's manifest entry, from its sidecar and file header, once both agree with
    each other, the index and the config (:class:`ManifestError` naming what does not).
    A payload the stream deleted after its ack: from its sidecar (the receipt) alone,
    once that is the deleted payload's (same sha256 and bytes)."""
    meta = json.loads(Path(sc).read_text())
    path = Path(sc).with_name(meta["path"])
    name = meta["chunk"]
    gone = (freed or {}).get(name)
    if gone is not None and not path.exists():
        return _receipt_entry(meta, gone, entries.get(name), index, fp, codec, root, path)
    if not path.exists():
        raise ManifestError(f"{path} is missing though its sidecar {sc} exists: {_redo(path)}")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise ManifestError(
            f"chunk {name}: {path} is {size} bytes on disk, its sidecar says "
            f"{meta['bytes']}: the file changed after extraction; {_redo(path)}"
        )
    try:
        info = check_chunk(path, expect_records=meta["records"])
    except ChunkFileError as exc:
        raise ManifestError(f"chunk {name}: {exc}; {_redo(path)}") from exc
    entry = entries.get(name)
    file_meta = info["metadata"]
    file_digest = file_meta.get("content_digest")
    problem = None
    if entry is None:
        problem = f"{index} lists no chunk {name}"
    elif meta.get("fingerprint") != fp or file_meta.get("fingerprint") != fp:
        problem = f"it was extracted for fingerprint {file_meta.get('fingerprint')}, not {fp}"
    elif not (meta.get("content_digest") == file_digest == entry["content_digest"]):
        problem = (
            f"it holds records with content digest {str(file_digest)[:12]}... (sidecar "
            f"{str(meta.get('content_digest'))[:12]}...), but {index} assigns it "
            f"{entry['content_digest'][:12]}...: stale hidden states of other data"
        )
    elif meta["records"] != entry["records"]:
        problem = f"{meta['records']} records, the index says {entry['records']}"
    elif info["codec"] != codec:  # never mix fp8 (lossy) with exact chunks silently
        problem = f"it is stored with codec {info['codec']}, storage.codec is {codec}"
    if problem:
        raise ManifestError(f"chunk {name}: {problem}; {_redo(path)}")
    return _entry(meta, entry, root, path, size, info["codec"], info["raw_bytes"])


def _entry(
    meta: dict, entry: dict, root: Path, path: Path, size: int, codec: str, raw: int
) -> dict:
    """A manifest entry: the sidecar's figures, checked by the caller, whichever way."""
    return {
        "chunk": meta["chunk"],
        "path": str(path.relative_to(root)),
        "sha256": meta["sha256"],
        "content_digest": entry["content_digest"],
        "records": meta["records"],
        "tokens": meta["tokens"],
        "bytes": size,
        "codec": codec,
        "states_raw_bytes": raw,
    }


def _receipt_entry(
    meta: dict,
    gone: dict,
    entry: dict | None,
    index: Path,
    fp: str,
    codec: str,
    root: Path,
    path: Path,
) -> dict:
    """The entry of a chunk deleted after the trainer's ack: its sidecar's figures, checked
    against the deletion's record, the index and the config as a file's would be."""
    from hsextract.stream.receipts import receipt_matches

    name = meta["chunk"]
    problem = None
    if not receipt_matches(meta, gone):
        problem = (
            f"its payload was deleted after the trainer's ack (sha256 "
            f"{str(gone.get('sha256'))[:12]}...), its sidecar is of other bytes "
            f"({str(meta.get('sha256'))[:12]}...)"
        )
    elif entry is None:
        problem = f"{index} lists no chunk {name}"
    elif meta.get("fingerprint") != fp:
        problem = f"it was extracted for fingerprint {meta.get('fingerprint')}, not {fp}"
    elif meta.get("content_digest") != entry["content_digest"]:
        problem = f"its sidecar's records are not the ones {index} assigns it: stale"
    elif meta["records"] != entry["records"]:
        problem = f"{meta['records']} records, the index says {entry['records']}"
    elif meta.get("codec", codec) != codec:
        problem = f"it was stored with codec {meta.get('codec')}, storage.codec is {codec}"
    if problem:
        raise ManifestError(f"chunk {name}: {problem}; {_redo(path)}")
    assert entry is not None
    raw = meta.get("states_raw_bytes", meta["bytes"])
    return {
        **_entry(meta, entry, root, path, meta["bytes"], meta.get("codec", codec), raw),
        # Not on disk: the trainer acknowledged it and the stream freed it (deleted.jsonl).
        "deleted_after_ack": True,
    }


def _sums(chunks: list[dict]) -> dict:
    return {
        "chunks": len(chunks),
        "records": sum(c["records"] for c in chunks),
        "tokens": sum(c["tokens"] for c in chunks),
        "bytes": sum(c["bytes"] for c in chunks),
        "states_raw_bytes": sum(c["states_raw_bytes"] for c in chunks),
    }


@contextmanager
def manifest_lock(manifest: Path) -> Iterator[None]:
    """Held while a run's manifest.json is written, or read and rewritten: the manifest job
    and chunk jobs updating their entries (:func:`update_manifest_entry`, several at once
    under ``-j N``) never lose each other's write.  An ``flock``: the kernel drops it with
    a killed holder."""
    lock = Path(manifest).parent / "state" / "manifest.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def update_manifest_entry(manifest: Path, sidecar: Path, *, index: Path, cfg: Config) -> str:
    """After a chunk was (re-)extracted: its entry in an existing manifest follows it.

    Why: ``snakemake -j1 <chunk file>`` redoes one chunk and not the manifest (nothing it
    was asked for needs it), and a redo with other bytes (another
    ``server.chunked_prefill_size``, an engine without deterministic inference) left the
    manifest's sha256 stale: every reader then refused the good chunk, advising the very
    redo that made the state.  So the chunk job rewrites its own entry (and the totals),
    checked as :func:`build_manifest` checks it, atomically and under
    :func:`manifest_lock`, so the run is consistent again at once.

    Only where the manifest describes this run's data as it is now (same fingerprint,
    codec and train.jsonl, an entry for this chunk with the same records): a manifest of
    other data is the manifest job's to rebuild (``extract_all``), and it is left alone.
    Returns what was done, one sentence for the job's log.
    """
    manifest = Path(manifest)
    run_all = snakemake_command("extract_all", run_dir=manifest.parent)
    if not manifest.exists():
        return f"no {manifest} yet: `{run_all}` writes it"
    rebuild = f"left for `{run_all}` to rebuild {manifest}"
    with manifest_lock(manifest):
        data = json.loads(manifest.read_text())
        idx = read_index(index)
        entries = {Path(e["path"]).stem: e for e in idx["chunks"]}
        fp, codec = fingerprint(cfg), storage_codec(cfg)
        new = _chunk_entry(Path(sidecar), entries, index, fp, codec, manifest.parent)
        chunks = data.get("chunks") or []
        pos = next((i for i, c in enumerate(chunks) if c.get("chunk") == new["chunk"]), None)
        same_run = (
            data.get("fingerprint") == fp
            and data.get("codec") == codec
            and (data.get("data") or {}).get("train_sha256") == idx["source_sha256"]
        )
        if not same_run or pos is None:
            return f"{manifest} is of other data or settings than this chunk: {rebuild}"
        old = chunks[pos]
        if old.get("content_digest") != new["content_digest"]:
            return f"{manifest} lists other records for {new['chunk']}: {rebuild}"
        if old == new:
            return f"{new['chunk']}'s entry in {manifest} is unchanged"
        chunks[pos] = new
        data["totals"] = _sums(chunks)
        write_json(manifest, data)
    return (
        f"{new['chunk']}'s entry in {manifest} updated: sha256 {str(old.get('sha256'))[:12]}... "
        f"-> {new['sha256'][:12]}..."
    )


def _train_digests(train: Path, entries: list[dict]) -> tuple[dict[str, str], list[str]]:
    """Per chunk, the content digest of the train.jsonl lines the index points at; and
    what is wrong with the coverage (every line in exactly one chunk)."""
    data = train.read_bytes()
    ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 10)
    starts = {0, *(ends[ends + 1 < len(data)] + 1).tolist()} if data else set()
    seen: dict[int, str] = {}
    problems, out = [], {}
    for e in entries:
        name = Path(e["path"]).stem
        digests = []
        for off, length in e["lines"]:
            if off in seen:
                problems.append(f"{train} byte {off}: in both {seen[off]} and {name}")
            seen[off] = name
            obj = orjson.loads(data[off : off + length])
            digests.append(record_digest(str(obj["id"]), obj["input_ids"], obj["loss_mask"]))
        out[name] = content_digest(digests)
    missing = sorted(starts - set(seen))
    if missing:
        problems.append(f"{train}: {len(missing)} line(s) in no chunk (first at byte {missing[0]})")
    return out, problems


def verify_manifest(path: Path) -> list[str]:
    """Re-derive everything a manifest claims; return the problems (empty when all hold).

    Each chunk file: present, its sha256 the manifest's, the records it really holds
    (digest of its own ids, masks and record ids) the ones the index assigns it, and the
    index's digest that of the train.jsonl lines it points at, each line in one chunk.
    And every field of the manifest against its source (:class:`_Fields`): a per-chunk
    field against the file's header and its sidecar, a run-level one against the run
    dir, the config, the merge stats, the index and the chunks, one line per mismatch.
    """
    from hsextract.chunks import content_digest_of  # reads the tensors: torch

    path = Path(path)
    root = path.parent
    data = json.loads(path.read_text())
    problems: list[str] = []
    index_path = root / data.get("data", {}).get("index", "chunks/index.json")
    try:
        idx = read_index(index_path)
    except HsextractError as exc:
        return [f"{index_path}: {exc}"]
    entries = {Path(e["path"]).stem: e for e in idx["chunks"]}
    train = index_path.parent.parent / "merged" / idx["source"]
    if not train.exists():
        problems.append(f"{train}: missing")
        want: dict[str, str] = {}
    elif sha256_file(train) != idx["source_sha256"]:
        problems.append(f"{train}: changed after split_chunks ({index_path} is of another)")
        want = {}
    else:
        want, coverage = _train_digests(train, idx["chunks"])
        problems += coverage
        for name, digest in want.items():
            if digest != entries[name]["content_digest"]:
                problems.append(f"{index_path}: {name}'s digest is not its train.jsonl lines'")
    problems += _input_problems(root, data)
    chunks = [c for c in data.get("chunks") or [] if isinstance(c, dict)]
    listed = {c.get("chunk") for c in chunks}
    for name in sorted(set(entries) - listed):
        problems.append(f"chunk {name}: in {index_path} but not in the manifest")
    fields = _Fields(path)
    truths: list[dict] = []
    freed = _freed(root)
    for c in chunks:
        name = str(c.get("chunk"))
        f = root / str(c.get("path"))
        if not f.is_file() and name in freed:
            problems += _receipt_problems(f, c, freed[name], entries.get(name), index_path)
            continue
        if not f.is_file():
            redo = snakemake_command(f, run_dir=root)
            problems.append(f"chunk {name}: {f} missing; redo it: `{redo}` (or extract_all)")
            continue
        truth = _chunk_truth(f, fields, name)
        if truth is None:
            continue
        truths.append(truth)
        fields.chunk(name, c, truth, entries.get(name), index_path)
        digest = sha256_file(f)
        recorded = truth["sidecar"].get("sha256", c.get("sha256"))
        if digest != recorded:  # the bytes changed after extraction: the chunk is damaged
            problems.append(
                f"chunk {name}: {digest_mismatch(f, str(recorded), digest)} (manifest "
                f"{str(c.get('sha256'))[:12]}...)"
            )
            continue
        fields.chunk_field(name, "sha256", c.get("sha256"), digest, f"the bytes of {f}")
        entry = entries.get(name)
        if entry is None:
            problems.append(f"chunk {name}: {f} is not a chunk of {index_path}")
            continue
        try:
            held = content_digest_of(f)
        except (ChunkFileError, OSError, ValueError) as exc:
            problems.append(f"chunk {name}: {f}: unreadable ({exc})")
            continue
        if held != entry["content_digest"]:
            problems.append(
                f"chunk {name}: {f} holds records (digest {held[:12]}...) other than the "
                f"ones {index_path} assigns it ({entry['content_digest'][:12]}...): stale; "
                f"{_redo(f)}"
            )
            continue
        problems += _decode_problems(f, name)
    fields.run(data, root, idx, truths, chunks)
    return problems + fields.problems


def _receipt_problems(
    f: Path, c: dict, gone: dict, entry: dict | None, index_path: Path
) -> list[str]:
    """A chunk the stream deleted after the trainer's ack is done, not missing: its bytes
    cannot be re-hashed, so its manifest entry, its sidecar (the receipt), the deletion's
    record and the index must agree."""
    name = str(c.get("chunk"))
    sidecar_path = f.with_suffix(".json")
    try:
        side = json.loads(sidecar_path.read_text())
    except (OSError, ValueError) as exc:
        return [f"chunk {name}: deleted after the trainer's ack, and its receipt "
                f"{sidecar_path} is unreadable ({exc})"]  # fmt: skip
    out = []
    for field, want, source in (
        ("sha256", gone.get("sha256"), "the stream's deletion record"),
        ("bytes", gone.get("bytes"), "the stream's deletion record"),
        ("sha256", side.get("sha256"), str(sidecar_path)),
        ("records", side.get("records"), str(sidecar_path)),
        ("tokens", side.get("tokens"), str(sidecar_path)),
        ("content_digest", side.get("content_digest"), str(sidecar_path)),
        ("records", (entry or {}).get("records"), str(index_path)),
        ("content_digest", (entry or {}).get("content_digest"), str(index_path)),
    ):
        if c.get(field) != want:
            out.append(
                f"chunk {name} (deleted after the trainer's ack): {field} is {c.get(field)!r} "
                f"in the manifest but {want!r} in {source}"
            )
    return out


def _chunk_truth(f: Path, fields: _Fields, name: str) -> dict | None:
    """What a chunk's file header and its sidecar say (no states read): the values every
    per-chunk field of the manifest must equal; None (reported) when unreadable."""
    try:
        info = check_chunk(f)
    except ChunkFileError as exc:
        fields.problems.append(f"chunk {name}: {exc}; {_redo(f)}")
        return None
    sidecar_path = f.with_suffix(".json")
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except (OSError, ValueError) as exc:
        fields.problems.append(f"chunk {name}: its sidecar {sidecar_path} is unreadable ({exc})")
        sidecar = {}
    return {**info, "name": name, "file": f, "bytes": f.stat().st_size, "sidecar": sidecar}


class _Fields:
    """Every field of a manifest against what it was made from, one line per mismatch.

    A manifest field is only ever written from a chunk file (its header, its bytes), its
    sidecar, the index or the config: each is compared with its source, so an edit of
    any of them (by hand, or a tool's) cannot pass as ok.  The file is the truth; the fix
    named is a rebuilt manifest, or a re-extraction where the sidecar disagrees too.
    """

    def __init__(self, manifest: Path) -> None:
        self.manifest = manifest
        self.rebuild = (
            f"rebuild it: delete {manifest} and rerun "
            f"`{snakemake_command('extract_all', run_dir=Path(manifest).parent)}`"
        )
        self.problems: list[str] = []

    def chunk_field(self, name: str, field: str, have: object, want: object, source: str) -> None:
        if have != want:
            self.problems.append(
                f"chunk {name}: {field} is {have!r} in the manifest but {want!r} in "
                f"{source}; {self.rebuild}"
            )

    def run_field(self, field: str, have: object, want: object, source: str) -> None:
        if have != want:
            self.problems.append(
                f"{field} is {have!r} in the manifest but {want!r} in {source}; {self.rebuild}"
            )

    def chunk(self, name: str, c: dict, truth: dict, entry: dict | None, index_path: Path) -> None:
        """The per-chunk fields, against the file's header (and size), its sidecar and
        the index; a sidecar that disagrees with its own file is reported too."""
        f, sidecar, meta = truth["file"], truth["sidecar"], truth["metadata"]
        rel = f"hidden/{f.name}"
        self.chunk_field(name, "path", c.get("path"), rel, f"the chunk's name ({name})")
        self.chunk_field(name, "chunk", name, meta.get("chunk", name), f"the header of {f}")
        for field, want in (
            ("records", truth["records"]),
            ("tokens", truth["tokens"]),
            ("bytes", truth["bytes"]),
            ("codec", truth["codec"]),
            ("states_raw_bytes", truth["raw_bytes"]),
            ("content_digest", meta.get("content_digest")),
        ):
            self.chunk_field(name, field, c.get(field), want, f"{f}")
            if field in sidecar and sidecar[field] != want:
                self.problems.append(
                    f"chunk {name}: {field} is {sidecar[field]!r} in its sidecar but "
                    f"{want!r} in {f}; {_redo(f)}"
                )
        if entry is not None:
            for field in ("records", "content_digest"):
                self.chunk_field(name, field, c.get(field), entry.get(field), str(index_path))

    def run(
        self, data: dict, root: Path, idx: dict, truths: list[dict], chunks: list[dict]
    ) -> None:
        """The run-level fields, against the run dir, the config the manifest records,
        the merge stats, the index and every chunk's header and sidecar."""
        cfg = data.get("config") or {}
        fp = data.get("fingerprint")
        self.run_field("format_version", data.get("format_version"), "1", "this hsextract")
        made_under = None
        try:
            recorded = typed(cfg)  # as written then: typed() takes an older release's keys
            # Relative paths (model.path) as the run resolved them, not from wherever
            # verify is called: else a whole run reads as made under another fingerprint.
            made_under = fingerprint(recorded, run_base(root, cfg.get("output_root")))
            self.run_field("fingerprint", fp, made_under, "the config it records")
            self.run_field("codec", data.get("codec"), storage_codec(recorded), "the config")
        except (KeyError, TypeError, AttributeError, HsextractError) as exc:
            self.problems.append(f"its config is incomplete ({exc!r}); {self.rebuild}")
        if fp != root.name and fp == made_under:
            # The manifest agrees with its config (and, below, its chunks): the dir was
            # renamed or moved.  Deleting the manifest would not help: the name is how
            # the workflow and `hsextract` find the run.
            self.problems.append(
                f"run dir {root} was renamed or moved: its name is not the fingerprint {fp} "
                f"its manifest, config and chunks were made under; rename it back to "
                f"{root.parent / str(fp)} (the workflow and `hsextract` find a run by that "
                "name) -- nothing in it needs deleting or redoing"
            )
        else:
            self.run_field("fingerprint", fp, root.name, f"the run dir's name ({root})")
        model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
        self.run_field("engine", data.get("engine"), cfg.get("engine"), "the config")
        self.run_field("model", data.get("model"), model.get("path"), "the config")
        self.run_field("max_seq_len", data.get("max_seq_len"), cfg.get("max_seq_len"), "the config")
        self._max_seq_len(data.get("max_seq_len"), root / str(data.get("merge_stats")), truths)
        self._aux_layers(data.get("aux_layers"), cfg.get("aux_layers"), truths)
        for t in truths:
            meta, side, f = t["metadata"], t["sidecar"], t["file"]
            for field in ("fingerprint", "engine", "model", "codec"):
                want = t["codec"] if field == "codec" else meta.get(field)
                self.chunk_field(t["name"], field, data.get(field), want, f"the header of {f}")
            if "fingerprint" in side:
                self.chunk_field(
                    t["name"], "fingerprint", fp, side["fingerprint"], f"{f.stem}'s sidecar"
                )
        self._totals(data, idx, truths, chunks)

    def _max_seq_len(self, have: object, stats: Path, truths: list[dict]) -> None:
        try:
            merged = json.loads(stats.read_text()).get("params", {}).get("max_seq_len")
        except (OSError, ValueError, AttributeError):
            merged = have  # unreadable stats: reported by _input_problems
        self.run_field("max_seq_len", have, merged, f"{stats} (what the merge cut records to)")
        for t in truths:
            if isinstance(have, int) and t["longest"] > have:
                self.problems.append(
                    f"chunk {t['name']}: max_seq_len is {have} in the manifest but {t['file']} "
                    f"holds a record of {t['longest']} tokens; {self.rebuild}"
                )

    def _aux_layers(self, have: object, configured: object, truths: list[dict]) -> None:
        for t in truths:
            self.chunk_field(
                t["name"], "aux_layers", have, t["stored_layers"], f"the header of {t['file']}"
            )
            side = t["sidecar"].get("aux_layers", t["stored_layers"])
            if side != t["stored_layers"]:
                self.problems.append(
                    f"chunk {t['name']}: aux_layers is {side!r} in its sidecar but "
                    f"{t['stored_layers']!r} in {t['file']}; {_redo(t['file'])}"
                )
        if configured is not None and truths:
            # Stored = the configured layers, plus the final layer's index with prenorm_final.
            self.run_field(
                "aux_layers (without prenorm_final's)",
                truths[0]["aux_layers"],
                configured,
                "the config",
            )

    def _totals(self, data: dict, idx: dict, truths: list[dict], chunks: list[dict]) -> None:
        """Sums of what the chunk files hold (not of the manifest's per-chunk fields: an
        edit of one and its total together must not pass)."""
        totals = data.get("totals") or {}
        complete = len(truths) == len(chunks)  # else the missing chunks are reported
        self.run_field("totals.chunks", totals.get("chunks"), len(chunks), "its chunk list")
        for field, key in (
            ("records", "records"),
            ("tokens", "tokens"),
            ("bytes", "bytes"),
            ("states_raw_bytes", "raw_bytes"),
        ):
            want = (
                sum(t[key] for t in truths)
                if complete
                else sum(int(c.get(field) or 0) for c in chunks)
            )
            self.run_field(f"totals.{field}", totals.get(field), want, "the chunk files (summed)")
        d = data.get("data") or {}
        self.run_field("data.records", d.get("records"), idx.get("source_records"), "the index")
        self.run_field(
            "data.train_sha256", d.get("train_sha256"), idx.get("source_sha256"), "the index"
        )
        self.run_field(
            "totals.records", totals.get("records"), idx.get("source_records"), "the index"
        )


def _input_problems(root: Path, data: dict) -> list[str]:
    """Each input shard changed since the merge, by its bytes (sha256): the chunks hold
    states of what the merge read, and a changed shard makes them stale though every
    chunk still matches train.jsonl."""
    from hsextract.plan import changed_inputs

    cfg = data.get("config") or {}
    stats_path = root / data.get("merge_stats", "merged/stats.json")
    try:
        stats = json.loads(stats_path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{stats_path}: unreadable ({exc}); cannot check the inputs"]
    if "demo" not in cfg or "inputs" not in stats:
        return []
    try:
        changed = changed_inputs(
            typed(cfg), stats, base=Path(run_base(root, cfg.get("output_root"))), content=True
        )
    except HsextractError as exc:
        changed = [str(exc)]
    return [
        f"input {line}: the chunks are of what the merge read; rerun "
        f"`{snakemake_command('extract_all', '--forcerun', 'merge_and_shuffle', run_dir=root)}` "
        "(chunks whose records changed re-extract)"
        for line in changed
    ]


def _decode_problems(f: Path, name: str) -> list[str]:
    """A compressed chunk's frames all decode (the sha256 proves the bytes, not that the
    writer framed them right); an uncompressed one has nothing to decode."""
    from hsextract.chunks import ChunkReader

    try:
        reader = ChunkReader(f, verify=False)  # verify_manifest hashed it already
        if reader.codec == "none":
            return []
        check_chunk(f)
        for j in range(len(reader)):
            reader[j]
    except (ChunkFileError, OSError, ValueError) as exc:
        return [f"chunk {name}: {f}: does not decode ({exc}); {_redo(f)}"]
    return []
