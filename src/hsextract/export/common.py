"""What every export shares: a record's stable index, its error, reading its inputs."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from hsextract.errors import HsextractError
from hsextract.records import read_index


class ExportError(HsextractError):
    """An export cannot be written or does not match the run it claims to export."""


def read_json(path: Path, what: str, fix: str) -> dict:
    """A JSON input of an export, or an :class:`ExportError` naming it and what to do."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ExportError(f"{what}: {path} does not exist; {fix}") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{what}: {path} is unreadable ({exc}); {fix}") from exc


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
