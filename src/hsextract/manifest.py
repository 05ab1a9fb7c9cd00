"""The manifest behind ``extract_all``: every chunk with sha256, records, tokens, bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hsextract.chunks import ChunkFileError, check_chunk, sha256_file
from hsextract.config import fingerprint, public_config
from hsextract.errors import HsextractError
from hsextract.server import write_json


def build_manifest(sidecars: list[Path], *, stats: Path, out: Path, cfg: dict) -> dict:
    """Cross-check each chunk file against its sidecar (size, structure) and list them.

    Hashes are taken from the sidecars, which the extractor computed from the bytes it
    fsynced; re-hashing terabytes here would double the I/O.  ``hsextract verify`` re-hashes.
    """
    root = out.parent
    chunks = []
    for sc in sidecars:
        meta = json.loads(Path(sc).read_text())
        path = Path(sc).with_name(meta["path"])
        if not path.exists():
            raise HsextractError(
                f"{path} is missing though its sidecar {sc} exists: rerun that chunk"
            )
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise HsextractError(
                f"{path}: {size} bytes on disk, sidecar says {meta['bytes']}: the file changed "
                f"after extraction; delete it and rerun `snakemake -j1 {path}`"
            )
        try:
            check_chunk(path, expect_records=meta["records"])
        except ChunkFileError as exc:
            raise HsextractError(f"{exc}; delete it and rerun `snakemake -j1 {path}`") from exc
        chunks.append(
            {
                "chunk": meta["chunk"],
                "path": str(path.relative_to(root)),
                "sha256": meta["sha256"],
                "records": meta["records"],
                "tokens": meta["tokens"],
                "bytes": size,
            }
        )
    first = json.loads(Path(sidecars[0]).read_text()) if sidecars else {}
    manifest = {
        "format_version": "1",
        "fingerprint": fingerprint(cfg),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine": cfg["engine"],
        "model": cfg["model"]["path"],
        "aux_layers": first.get("aux_layers"),
        "max_seq_len": cfg["max_seq_len"],
        "totals": {
            "chunks": len(chunks),
            "records": sum(c["records"] for c in chunks),
            "tokens": sum(c["tokens"] for c in chunks),
            "bytes": sum(c["bytes"] for c in chunks),
        },
        "merge_stats": str(Path(stats).relative_to(root))
        if Path(stats).is_relative_to(root)
        else str(stats),
        "config": public_config(cfg),
        "chunks": chunks,
    }
    write_json(out, manifest)
    return manifest


def verify_manifest(path: Path) -> list[str]:
    """Re-hash every chunk listed; return the problems (empty when all match)."""
    data = json.loads(Path(path).read_text())
    problems = []
    for c in data["chunks"]:
        f = Path(path).parent / c["path"]
        if not f.exists():
            problems.append(f"{f}: missing")
            continue
        digest = sha256_file(f)
        if digest != c["sha256"]:
            problems.append(f"{f}: sha256 {digest} != manifest {c['sha256']}")
    return problems
