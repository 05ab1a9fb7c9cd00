"""What every export shares: a record's stable index, and the chunks of a run."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from hsextract.records import read_index


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
