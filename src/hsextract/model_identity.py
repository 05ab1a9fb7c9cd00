"""Which weights a model directory holds, cheaply: the model's part of the run fingerprint.

Why not the path as written: ``model.path: models/llama`` names a different model from
each directory a command runs in, yet hashed the same, so one run dir could mix the states
of two models.  Why not a hash of every byte: a 70B checkpoint is 140 GB, and the
fingerprint is taken at every ``snakemake`` parse (each chunk job's too).  So the identity
is the resolved path plus what distinguishes checkpoints without reading them: config.json
whole, and per weight file its name, size, and the first and last ``SAMPLE`` bytes (the
safetensors header -- names, shapes, dtypes, offsets -- and a slice of the values at both
ends).  Weights rewritten in place with the same shapes and sizes can escape the sampled
bytes: ``model.revision`` is the knob for that, as the README says.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

#: Bytes read from each end of a weight file.
SAMPLE = 1 << 16
#: Files whose bytes are the weights (HF's formats); tokenizer files do not change states.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Files that say how the weights are read.
CONFIG_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def resolved(path: str | os.PathLike[str]) -> str:
    """The model directory as the filesystem names it (symlinks and ``..`` resolved,
    relative to the working directory): the same string wherever a command runs."""
    return os.path.realpath(os.fspath(path))


def contents_digest(path: str | os.PathLike[str]) -> str | None:
    """A digest of the checkpoint at ``path`` (see the module doc), or None when there is
    no config.json there: the planning stage that reads it then stops, naming it, so a run
    without its model never gets to extract under that identity."""
    root = Path(path)
    if not (root / "config.json").is_file():
        return None
    files = [root / n for n in CONFIG_FILES if (root / n).is_file()]
    files += sorted(
        Path(e.path) for e in os.scandir(root) if e.name.endswith(WEIGHT_SUFFIXES) and e.is_file()
    )
    # One parse asks several times (run dir, dump dir, settings): read once per version.
    stats = tuple((str(f), *_stat_key(f)) for f in files)
    return _digest(stats)


def _stat_key(f: Path) -> tuple[int, int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=16)
def _digest(stats: tuple[tuple[str, int, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, size, _mtime, _ino in stats:
        f = Path(name)
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.name in CONFIG_FILES or size <= 2 * SAMPLE:
                h.update(fh.read())
                continue
            h.update(fh.read(SAMPLE))
            fh.seek(size - SAMPLE)
            h.update(fh.read(SAMPLE))
    return h.hexdigest()[:16]
