"""The chunk file (a contract others read): write it streaming, read it without copying.

One safetensors file per chunk, ragged records packed row-wise::

    input_ids int32 [T] | loss_mask uint8 [T] | offsets int64 [N+1]
    hidden_states <dtype> [T, H] | aux_hidden_states <dtype> [T, k*H]

A production chunk can be tens of GB, more than RAM, so the writer never holds it: the
header is computed up front from the record lengths (all known before extraction starts),
the file is preallocated under a temporary name, and each record's rows are written at
their final offsets as soon as the record arrives, in any order.  Then fsync, hash, rename.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hsextract import faults
from hsextract.errors import HsextractError

FORMAT_VERSION = "1"
_WRITE_SLICE = 1 << 20  # bytes per pwrite
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


class ChunkFileError(HsextractError):
    """A chunk file is not what the contract says."""


def sha256_file(path: str | os.PathLike[str], bufsize: int = 16 << 20) -> str:
    """Hashed straight from a read-only mapping of the file (no copy into a buffer)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for a in range(0, size, bufsize):
                        h.update(view[a : a + bufsize])
                finally:
                    view.release()
    return h.hexdigest()


def _splice(
    src: int, at: int, nbytes: int, dst: int, pos: int, r: int, w: int, step: int, name: str
) -> None:
    """Copy ``nbytes`` from ``src`` at ``at`` to ``dst`` at ``pos`` through the pipe (r, w);
    a source that cannot splice is copied with pread/pwrite."""
    end = at + nbytes
    while at < end:
        try:
            n = os.splice(src, w, min(step, end - at), offset_src=at)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            return _copy(src, at, end - at, dst, pos, name)
        if n <= 0:
            raise ChunkFileError(f"{name}: file ends at byte {at}, expected {end}")
        at += n
        while n:
            m = os.splice(r, dst, n, offset_dst=pos)
            n, pos = n - m, pos + m


def _copy(src: int, at: int, nbytes: int, dst: int, pos: int, name: str) -> None:
    buf = memoryview(bytearray(min(nbytes, _WRITE_SLICE)))
    end = at + nbytes
    while at < end:
        n = os.preadv(src, [buf[: end - at]], at)
        if n <= 0:
            raise ChunkFileError(f"{name}: file ends at byte {at}, expected {end}")
        data = buf[:n]
        while len(data):
            m = os.pwrite(dst, data, pos)
            data, pos = data[m:], pos + m
        at += n


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def remove_stale_temps(path: Path) -> list[str]:
    """Remove temporary files an earlier, killed writer of this chunk left next to it.

    A SIGKILLed job cannot clean up, and each leftover is as large as the chunk.  Only
    one job writes a given chunk at a time (Snakemake locks the outputs), so any
    ``.<name>.<pid>.tmp`` found when a writer starts is stale.  Links are unlinked, never
    followed.
    """
    removed = []
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        if stale.is_symlink() or stale.is_file():
            stale.unlink(missing_ok=True)
            removed.append(stale.name)
    return removed


class ChunkWriter:
    """Preallocated, position-addressed writer: records may arrive in any order."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        lengths: Sequence[int],
        *,
        hidden_size: int,
        n_aux: int,
        dtype: torch.dtype,
        metadata: dict[str, str],
    ) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.lengths = [int(n) for n in lengths]
        self.offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        t = int(self.offsets[-1])
        self.h, self.k, self.dtype = hidden_size, n_aux, dtype
        esize = torch.empty((), dtype=dtype).element_size()
        layout = [
            ("input_ids", "I32", [t], 4 * t),
            ("loss_mask", "U8", [t], t),
            ("offsets", "I64", [len(self.offsets)], 8 * len(self.offsets)),
            ("hidden_states", _ST_DTYPES[dtype], [t, self.h], esize * t * self.h),
            (
                "aux_hidden_states",
                _ST_DTYPES[dtype],
                [t, self.k * self.h],
                esize * t * self.k * self.h,
            ),
        ]
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        self.base: dict[str, int] = {}
        pos = 0
        for name, st, shape, nbytes in layout:
            header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            self.base[name] = pos
            pos += nbytes
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(hjson)
        self.size = self.data_start + pos
        self.esize = esize
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.removed_stale = remove_stale_temps(self.path)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, self.size)
            os.pwrite(self.fd, len(hjson).to_bytes(8, "little") + hjson, 0)
            self._pwrite("offsets", 0, memoryview(self.offsets).cast("B"))
        except BaseException:
            self.abort()
            raise
        self.written = [False] * len(self.lengths)

    def _pwrite(self, name: str, at: int, data: memoryview) -> None:
        # In slices: one pwrite of a whole record (hundreds of MB) runs at a fraction of the
        # page-cache speed that a few-MB pwrite gets (measured: bench/pack.py).
        pos = self.data_start + self.base[name] + at
        while len(data):
            n = os.pwrite(self.fd, data[:_WRITE_SLICE], pos)
            data, pos = data[n:], pos + n

    def put(
        self,
        j: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
    ) -> None:
        n, start = self.lengths[j], int(self.offsets[j])
        if (
            input_ids.shape != (n,)
            or hidden.shape != (n, self.h)
            or aux.shape != (n, self.k * self.h)
        ):
            raise ChunkFileError(
                f"record {j}: shapes ids {tuple(input_ids.shape)} hidden {tuple(hidden.shape)} "
                f"aux {tuple(aux.shape)} do not match length {n}, H={self.h}, k={self.k}"
            )
        if hidden.dtype != self.dtype or aux.dtype != self.dtype:
            raise ChunkFileError(f"record {j}: dtype {hidden.dtype}/{aux.dtype} != {self.dtype}")
        if faults.ACTIVE:  # tests only: a disk that fills up mid-chunk
            faults.on_chunk_put(self.path)
        self._pwrite("input_ids", 4 * start, _as_bytes(input_ids.to(torch.int32)))
        self._pwrite("loss_mask", start, _as_bytes(loss_mask.to(torch.uint8)))
        row = self.esize * self.h
        self._pwrite("hidden_states", row * start, _as_bytes(hidden))
        self._pwrite("aux_hidden_states", row * self.k * start, _as_bytes(aux))
        self.written[j] = True

    def put_files(
        self,
        j: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: Sequence[tuple[int, int, int, str]],
        aux: Sequence[tuple[int, int, int, str]],
        dtype: torch.dtype,
    ) -> None:
        """Like ``put``, but the hidden and aux rows are ``(fd, offset, nbytes, name)`` byte
        ranges of open files, in row order, copied file to file in the kernel (``splice``
        through a pipe: no user-space copy, no fresh memory).  ``name`` is for errors."""
        n, start = self.lengths[j], int(self.offsets[j])
        row = self.esize * self.h
        got = (sum(r[2] for r in hidden), sum(r[2] for r in aux))
        if input_ids.shape != (n,) or got != (n * row, n * row * self.k):
            raise ChunkFileError(
                f"record {j}: ids {tuple(input_ids.shape)}, hidden {got[0]} bytes, aux "
                f"{got[1]} bytes do not match length {n}, H={self.h}, k={self.k}, {self.dtype}"
            )
        if dtype != self.dtype:
            raise ChunkFileError(f"record {j}: dtype {dtype} != {self.dtype}")
        if faults.ACTIVE:  # tests only: a disk that fills up mid-chunk
            faults.on_chunk_put(self.path)
        self._pwrite("input_ids", 4 * start, _as_bytes(input_ids.to(torch.int32)))
        self._pwrite("loss_mask", start, _as_bytes(loss_mask.to(torch.uint8)))
        r, w = os.pipe() if hasattr(os, "splice") else (-1, -1)
        try:
            step = 1 << 16  # a pipe's default capacity
            if r >= 0:
                try:
                    fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _WRITE_SLICE)
                    step = _WRITE_SLICE
                except OSError:  # pipe-max-size below 1 MiB, or the user's pipe quota is full
                    pass
            for name, at, ranges in (
                ("hidden_states", row * start, hidden),
                ("aux_hidden_states", row * self.k * start, aux),
            ):
                pos = self.data_start + self.base[name] + at
                for fd, offset, nbytes, src in ranges:
                    if r >= 0:
                        _splice(fd, offset, nbytes, self.fd, pos, r, w, step, src)
                    else:
                        _copy(fd, offset, nbytes, self.fd, pos, src)
                    pos += nbytes
        finally:
            if r >= 0:
                os.close(r)
                os.close(w)
        self.written[j] = True

    def finish(self) -> str:
        """fsync, hash and rename into place; returns the sha256. Refuses if a record is missing."""
        missing = [j for j, w in enumerate(self.written) if not w]
        if missing:
            self.abort()
            raise ChunkFileError(f"{self.path}: records {missing[:10]} never written")
        # Hash (CPU, from the page cache) while fsync (disk) runs; both release the GIL.
        with ThreadPoolExecutor(max_workers=1) as pool:
            hashing = pool.submit(sha256_file, self.tmp)
            os.fsync(self.fd)
            digest = hashing.result()
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return digest

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


class ChunkReader:
    """Records of one chunk file, sliced lazily from an mmap (no whole-file copy)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except Exception as exc:
            raise ChunkFileError(f"{self.path}: not a readable safetensors file: {exc}") from exc
        self.metadata: dict[str, str] = self._f.metadata() or {}
        keys = set(self._f.keys())
        need = {"input_ids", "loss_mask", "offsets", "hidden_states", "aux_hidden_states"}
        if not need <= keys:
            raise ChunkFileError(f"{self.path}: missing tensors {sorted(need - keys)}")
        self.offsets = self._f.get_tensor("offsets")
        self.record_ids: list[str] = json.loads(self.metadata.get("record_ids", "[]"))
        self.aux_layers: list[int] = json.loads(self.metadata.get("aux_layers", "[]"))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> dict[str, torch.Tensor | str]:
        if not 0 <= j < len(self):
            raise IndexError(j)
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        out: dict[str, torch.Tensor | str] = {
            name: self._f.get_slice(name)[a:b]
            for name in ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states")
        }
        out["id"] = self.record_ids[j] if j < len(self.record_ids) else str(j)
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor | str]]:
        for j in range(len(self)):
            yield self[j]

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        out = {}
        for name in self._f.keys():
            sl = self._f.get_slice(name)
            out[name] = (list(sl.get_shape()), str(sl.get_dtype()))
        return out


class ManifestDataset(torch.utils.data.Dataset):
    """A torch Dataset over every record of every chunk in a manifest (lazy, mmap-backed)."""

    def __init__(self, manifest: str | os.PathLike[str]) -> None:
        self.manifest_path = Path(manifest)
        data = json.loads(self.manifest_path.read_text())
        root = self.manifest_path.parent
        self.readers = [ChunkReader(root / c["path"]) for c in data["chunks"]]
        self.index = [(ci, j) for ci, r in enumerate(self.readers) for j in range(len(r))]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | str]:
        ci, j = self.index[i]
        return self.readers[ci][j]


def check_chunk(path: str | os.PathLike[str], expect_records: int | None = None) -> dict:
    """Structural check of a finished chunk file: tensors, shapes, offsets, metadata."""
    r = ChunkReader(path)
    shapes = r.shapes()
    t = int(r.offsets[-1])
    h = int(r.metadata.get("hidden_size", -1))
    k = len(r.aux_layers)
    problems = []
    if shapes["input_ids"][0] != [t] or shapes["loss_mask"][0] != [t]:
        problems.append(f"ids/mask length != offsets[-1]={t}")
    if shapes["hidden_states"][0] != [t, h]:
        problems.append(f"hidden_states {shapes['hidden_states'][0]} != [{t}, {h}]")
    if shapes["aux_hidden_states"][0] != [t, k * h]:
        problems.append(f"aux_hidden_states {shapes['aux_hidden_states'][0]} != [{t}, {k * h}]")
    if len(r.record_ids) != len(r):
        problems.append(f"{len(r.record_ids)} record_ids for {len(r)} records")
    if expect_records is not None and len(r) != expect_records:
        problems.append(f"{len(r)} records, expected {expect_records}")
    if bool((r.offsets[1:] < r.offsets[:-1]).any()) or int(r.offsets[0]) != 0:
        problems.append("offsets not monotone from 0")
    for key in ("record_ids", "aux_layers", "hidden_size", "model", "fingerprint", "engine"):
        if key not in r.metadata:
            problems.append(f"metadata {key!r} missing")
    if problems:
        raise ChunkFileError(f"{path}: " + "; ".join(problems))
    return {"records": len(r), "tokens": t, "hidden_size": h, "aux_layers": r.aux_layers}


def content_digest_of(path: str | os.PathLike[str]) -> str:
    """The content digest of the records a chunk file holds, from its own tensors.

    The same function of (id, input_ids, loss_mask) that split_chunks computes from JSON
    (:func:`hsextract.records.record_digest`), so a file can be checked against the index
    and train.jsonl without trusting its metadata.
    """
    from hsextract.records import content_digest, record_digest

    r = ChunkReader(path)
    ids = r._f.get_tensor("input_ids").numpy()
    mask = r._f.get_tensor("loss_mask").numpy()
    off = r.offsets.tolist()
    if len(r.record_ids) != len(off) - 1:
        raise ChunkFileError(f"{path}: {len(r.record_ids)} record_ids for {len(off) - 1} records")
    return content_digest(
        [
            record_digest(rid, ids[off[j] : off[j + 1]], mask[off[j] : off[j + 1]])
            for j, rid in enumerate(r.record_ids)
        ]
    )


def inspect_text(path: str | os.PathLike[str]) -> str:
    r = ChunkReader(path)
    lines = [f"{path}", f"  records: {len(r)}  tokens: {int(r.offsets[-1])}"]
    for name, (shape, dtype) in sorted(r.shapes().items()):
        lines.append(f"  {name:<18} {dtype:<5} {shape}")
    for key, value in sorted(r.metadata.items()):
        if key == "record_ids":
            ids = json.loads(value)
            value = json.dumps(ids[:5])[:-1] + (
                f", ... ({len(ids)} total)]" if len(ids) > 5 else "]"
            )
        lines.append(f"  {key}: {value}")
    return "\n".join(lines)
