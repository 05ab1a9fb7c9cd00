"""The manifest behind ``extract_all``, and ``hsextract verify``: no stale chunk passes as good.

Three things must agree for a chunk to be listed: its file (the tensors and the content
digest in its metadata), ``chunks/index.json`` (the records split_chunks assigned it, by
content digest) and ``merged/train.jsonl`` (the data those records came from, by sha256).
The manifest checks the cheap links on every run; ``verify`` re-derives everything from
the bytes: each chunk file's sha256, the digest of the records it really holds, and the
digest of the lines of train.jsonl the index points at.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import orjson

# The structural half only: building the manifest, once after the last chunk of every run,
# reads no states, and importing torch (hsextract.chunks) was most of its time.
from hsextract.chunkfile import ChunkFileError, check_chunk, sha256_file
from hsextract.config import AnyConfig, fingerprint, public_config, storage_codec, typed
from hsextract.errors import HsextractError
from hsextract.records import content_digest, read_index, record_digest
from hsextract.server import write_json


class ManifestError(HsextractError):
    """A chunk does not match the data it claims to hold."""


def _redo(path: Path) -> str:
    return f"delete it and rerun `snakemake -j1 {path}` (or extract_all)"


def build_manifest(
    sidecars: list[Path], *, stats: Path, index: Path, out: Path, cfg: AnyConfig
) -> dict:
    """Cross-check each chunk against its sidecar, the index and train.jsonl; list them.

    Hashes of the chunk files are taken from the sidecars, which the extractor computed
    from the bytes it fsynced; re-hashing terabytes here would double the I/O.
    ``hsextract verify`` re-hashes.
    """
    cfg = typed(cfg)
    root = out.parent
    idx = read_index(index)
    entries = {Path(e["path"]).stem: e for e in idx["chunks"]}
    train = Path(index).parent.parent / "merged" / idx["source"]
    if sha256_file(train) != idx["source_sha256"]:
        raise ManifestError(
            f"{train} changed after split_chunks ({index} was made from another version); "
            "rerun `snakemake -j1 extract_all` (the split reruns, changed chunks re-extract)"
        )
    fp = fingerprint(cfg)
    codec = storage_codec(cfg)
    chunks = []
    for sc in sidecars:
        meta = json.loads(Path(sc).read_text())
        path = Path(sc).with_name(meta["path"])
        name = meta["chunk"]
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
        chunks.append(
            {
                "chunk": name,
                "path": str(path.relative_to(root)),
                "sha256": meta["sha256"],
                "content_digest": entry["content_digest"],
                "records": meta["records"],
                "tokens": meta["tokens"],
                "bytes": size,
                "codec": info["codec"],
                "states_raw_bytes": info["raw_bytes"],
            }
        )
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
        "totals": {
            "chunks": len(chunks),
            "records": sum(c["records"] for c in chunks),
            "tokens": sum(c["tokens"] for c in chunks),
            "bytes": sum(c["bytes"] for c in chunks),
            "states_raw_bytes": sum(c["states_raw_bytes"] for c in chunks),
        },
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
    write_json(out, manifest)
    return manifest


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
    listed = {c["chunk"] for c in data["chunks"]}
    for name in sorted(set(entries) - listed):
        problems.append(f"chunk {name}: in {index_path} but not in the manifest")
    for c in data["chunks"]:
        f = root / c["path"]
        name = c["chunk"]
        if not f.exists():
            problems.append(f"chunk {name}: {f} missing")
            continue
        digest = sha256_file(f)
        if digest != c["sha256"]:
            problems.append(f"chunk {name}: {f}: sha256 {digest} != manifest {c['sha256']}")
            continue
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
    return problems


def _workflow_dir(run_dir: Path, output_root: str | None) -> Path:
    """The directory the workflow ran in (relative inputs are relative to it): the run
    dir is ``<output_root>/<fingerprint>`` under it; the working directory when that
    cannot be told (an absolute output_root)."""
    run_dir = run_dir.resolve()
    parts = Path(output_root or "").parts
    if parts and not Path(output_root).is_absolute() and len(parts) < len(run_dir.parents):
        wd = run_dir.parents[len(parts)]
        if (wd / output_root).resolve() == run_dir.parent:
            return wd
    return Path.cwd()


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
            cfg, stats, base=_workflow_dir(root, cfg.get("output_root")), content=True
        )
    except HsextractError as exc:
        changed = [str(exc)]
    return [
        f"input {line}: the chunks are of what the merge read; rerun `snakemake -j1 "
        "extract_all --forcerun merge_and_shuffle` (chunks whose records changed re-extract)"
        for line in changed
    ]


def _decode_problems(f: Path, name: str) -> list[str]:
    """A compressed chunk's frames all decode (the sha256 proves the bytes, not that the
    writer framed them right); an uncompressed one has nothing to decode."""
    from hsextract.chunks import ChunkReader

    try:
        reader = ChunkReader(f)
        if reader.codec == "none":
            return []
        check_chunk(f)
        for j in range(len(reader)):
            reader[j]
    except (ChunkFileError, OSError, ValueError) as exc:
        return [f"chunk {name}: {f}: does not decode ({exc}); {_redo(f)}"]
    return []
