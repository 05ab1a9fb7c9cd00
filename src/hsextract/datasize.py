"""How many records and tokens the inputs hold, for ``n_chunks: auto`` (hsextract.sizing):
counted once per version of the inputs, then read from a small cache.

Why from the shards at planning, not from the merge's stats.json: the chunk count names the
chunk files Snakemake plans (``snakemake -n`` lists every one before anything has run), and
it must not move once the merge has run -- records go to chunks by hash mod the count, so
a new count re-extracts every chunk.  So it is a function of the inputs alone: their
identity (path, size, mtime: records.input_identity, the merge's own trigger) names the
cache entry, and each record counts min(tokens, max_seq_len) (``overlength: drop``: a record
over it counts nothing).  A line the merge will reject counts nothing either; a few of them
move a chunk's size, not the count the next plan computes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson

from hsextract.config import settings_digest
from hsextract.config_types import Config


def cache_dir() -> Path:
    """Per user, outside output_root: ``snakemake -n`` writes nothing where runs live."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "hsextract" / "input-size"


def count_tokens(files: list[str], max_seq_len: int, overlength: str) -> tuple[int, int]:
    """(records, tokens) the merge would keep, from one pass over the shards."""
    records = tokens = 0
    for f in files:
        with open(f, "rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    ids = orjson.loads(line).get("input_ids")
                except (orjson.JSONDecodeError, AttributeError):
                    continue
                if not isinstance(ids, list) or not ids:
                    continue
                n = len(ids)
                if n > max_seq_len:
                    if overlength == "drop":
                        continue
                    n = max_seq_len
                records += 1
                tokens += n
    return records, tokens


def input_size(cfg: Config, files: list[str], *, write_cache: bool = True) -> tuple[int, int]:
    """(records, tokens) of ``files`` under ``cfg``'s length policy, cached by identity."""
    from hsextract.records import input_identity

    key = settings_digest(
        {
            "inputs": [{**i, "path": os.path.abspath(i["path"])} for i in input_identity(files)],
            "max_seq_len": cfg.max_seq_len,
            "overlength": cfg.merge.overlength,
        }
    )
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return int(data["records"]), int(data["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    records, tokens = count_tokens(files, cfg.max_seq_len, cfg.merge.overlength)
    if write_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"records": records, "tokens": tokens, "files": len(files)}))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: counted again next time, the same count
    return records, tokens
