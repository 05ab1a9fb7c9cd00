"""The chunk file (a contract others read): write it streaming, read it without copying.

One safetensors file per chunk, ragged records packed row-wise::

    input_ids int32 [T] | loss_mask uint8 [T] | offsets int64 [N+1]
    hidden_states <dtype> [T, H] | aux_hidden_states <dtype> [T, k*H]

A production chunk can be tens of GB, more than RAM, so the writer never holds it: the
header is computed up front from the record lengths (all known before extraction starts),
the file is preallocated under a temporary name, and each record's rows are written at
their final offsets as soon as the record arrives, in any order.  Then fsync, hash, rename.
While it streams, a background fdatasync every :data:`SYNC_EVERY_BYTES` keeps the dirty
pages few, so that final fsync, in the tail of the run, has little left to write.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hsextract import faults, storage
from hsextract.chunkfile import (  # noqa: F401 - re-exported: the structural half
    _STORED,
    ChunkDigestError,
    ChunkFileError,
    check_chunk,
    sha256_file,
    stored_bytes,
    verify_chunk_file,
)

FORMAT_VERSION = "1"  # the uncompressed layout
FORMAT_VERSION_CODED = "2"  # lossless or fp8: other tensors (storage.py)
_WRITE_SLICE = 1 << 20  # bytes per pwrite
#: Compressed frames of records ahead of their turn held in memory before they spill.
PENDING_BYTES = 1 << 30
#: Bytes written to a chunk between background fdatasyncs.  Why: the kernel starts
#: writeback of a page only ~30 s after it is dirtied, so without them a chunk written in
#: less than that reaches its final fsync with all of it dirty (a 1.7 GB chunk: seconds at
#: the end of the run, on the H200 box).
SYNC_EVERY_BYTES = 256 << 20
#: What an encoder shows each frame's rows before encoding them: ``(tensor, r0, rows)``,
#: tensor 0 the hidden rows and 1 the aux rows, ``rows`` [n, cols] from record row ``r0``;
#: it refuses them by raising (the client's ``Dump.check_rows``).
RowCheck = Callable[[int, int, torch.Tensor], None]
#: Makes an uninitialised tensor of (shape, dtype): where a lossless record decodes into.
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


def _pwrite_all(fd: int, data, pos: int) -> int:
    """All of ``data`` (any buffer) at ``pos``, in slices; its size in bytes.  Slices: one
    pwrite of a whole record (hundreds of MB) runs at a fraction of the page-cache speed
    that a few-MB pwrite gets (bench/pack.py)."""
    data = memoryview(data).cast("B")
    nbytes = len(data)
    while len(data):
        n = os.pwrite(fd, data[:_WRITE_SLICE], pos)
        data, pos = data[n:], pos + n
    return nbytes


def _copy(src: int, at: int, nbytes: int, dst: int, pos: int, name: str) -> None:
    buf = memoryview(bytearray(min(nbytes, _WRITE_SLICE)))
    end = at + nbytes
    while at < end:
        n = os.preadv(src, [buf[: end - at]], at)
        if n <= 0:
            raise ChunkFileError(f"{name}: file ends at byte {at}, expected {end}")
        _pwrite_all(dst, buf[:n], pos)
        at, pos = at + n, pos + n


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
        t = t.view(torch.int16)
    if not t.numel():
        return memoryview(b"")
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


#: Buffers pieces are read into for an encoder (``_Rows.read``), kept from record to
#: record.  Why kept: a fresh 4 MB array a frame is fresh pages, and their faults cost
#: more than the read (issue 40, codec lossless on chat-length records: ``preadv`` 0.36 ms
#: a MB into new arrays, ~0.1 into a kept one, and the planes' copy ~2x faster after it).
_READ_BUFFERS: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
#: At most this many records encoded at once per process, each holding a buffer: the
#: encoding is CPU-bound, so more than the cores would only keep more buffers.
_ENCODE_SLOTS = threading.BoundedSemaphore(max(2, os.cpu_count() or 2))


@contextlib.contextmanager
def _read_buffer() -> Iterator[list[np.ndarray]]:
    """A read buffer for one record's encoding, in a one-element list (``_Rows.read``
    grows it for a frame wider than it), given back after."""
    with _ENCODE_SLOTS:
        try:
            held = [_READ_BUFFERS.get_nowait()]
        except queue.Empty:
            held = [np.empty(storage.FRAME_BYTES, dtype=np.uint8)]
        try:
            yield held
        finally:
            _READ_BUFFERS.put(held[0])


class _Rows:
    """Consecutive row bytes of one tensor of a record, read a frame at a time: from memory
    (``put``) or from byte ranges of open dump pieces (``put_files``) into ``buf``.  What
    ``read`` returns from pieces lives in that buffer until the next ``read``: the encoders
    copy out of it (planes, fp8 values) before they read again."""

    def __init__(
        self,
        mem: memoryview | None = None,
        ranges: Sequence[tuple[int, int, int, str]] = (),
        buf: list[np.ndarray] | None = None,
    ) -> None:
        self.mem, self.pos = mem, 0
        self.ranges = [list(r) for r in ranges]
        self.buf = buf if buf is not None else [np.empty(0, dtype=np.uint8)]

    def read(self, n: int) -> memoryview | np.ndarray:
        if self.mem is not None:
            out = self.mem[self.pos : self.pos + n]
            self.pos += n
            return out
        if self.buf[0].size < n:
            self.buf[0] = np.empty(n, dtype=np.uint8)
        buf = self.buf[0][:n]
        view, got = memoryview(buf), 0
        while got < n:
            fd, at, left, name = self.ranges[0]
            m = os.preadv(fd, [view[got : got + min(left, n - got)]], at)
            if m <= 0:
                raise ChunkFileError(f"{name}: file ends at byte {at}")
            got += m
            self.ranges[0][1:3] = [at + m, left - m]
            if left == m:
                self.ranges.pop(0)
        return buf


class ChunkWriter:
    """Position-addressed writer: records may arrive in any order, from any thread.

    With ``codec="none"`` the file is preallocated and rows go to their final offsets.
    With ``lossless`` the frames' sizes are unknown until they are compressed, so they are
    appended after the fixed-size part (ids, mask, offsets, frame table) as they come; the
    header is rewritten at ``finish`` with the blob's final size, in space reserved for it.
    ``fp8`` is fixed-size like ``none``, plus a per-layer error report in the header.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        lengths: Sequence[int],
        *,
        hidden_size: int,
        n_aux: int,
        dtype: torch.dtype,
        metadata: dict[str, str],
        codec: str = "none",
    ) -> None:
        if codec not in storage.CODECS:
            raise ChunkFileError(f"unknown storage codec {codec!r}; known: {storage.CODECS}")
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.codec = codec
        self.lengths = [int(n) for n in lengths]
        self.offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        t = int(self.offsets[-1])
        self.h, self.k, self.dtype = hidden_size, n_aux, dtype
        self.esize = esize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = (esize * self.h, esize * self.k * self.h)  # hidden, aux
        self.metadata = dict(metadata)
        self.metadata.update(
            codec=codec,
            codec_params=json.dumps(storage.codec_params(codec), sort_keys=True),
            format_version=FORMAT_VERSION if codec == "none" else FORMAT_VERSION_CODED,
        )
        layout = [
            ("input_ids", "I32", [t], 4 * t),
            ("loss_mask", "U8", [t], t),
            ("offsets", "I64", [len(self.offsets)], 8 * len(self.offsets)),
        ]
        if codec == "none":
            st = _ST_DTYPES[dtype]
            layout += [
                ("hidden_states", st, [t, self.h], self.row_bytes[0] * t),
                ("aux_hidden_states", st, [t, self.k * self.h], self.row_bytes[1] * t),
            ]
        elif codec == "fp8":
            layout += [
                ("hidden_states", "F8_E4M3", [t, self.h], t * self.h),
                ("aux_hidden_states", "F8_E4M3", [t, self.k * self.h], t * self.k * self.h),
                ("hidden_scales", "F32", [t, 1], 4 * t),
                ("aux_scales", "F32", [t, self.k], 4 * t * self.k),
            ]
            self.fp8_error = storage.Fp8Error(self.k + 1)
        else:
            self.rows_per_frame = [max(1, storage.FRAME_BYTES // max(1, b)) for b in self.row_bytes]
            per_record = [
                [-(-n // self.rows_per_frame[i]) if self.row_bytes[i] else 0 for i in (0, 1)]
                for n in self.lengths
            ]
            self.frame_start = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum([a + b for a, b in per_record], out=self.frame_start[1:])
            self.first_aux_frame = [
                int(self.frame_start[j]) + per_record[j][0] for j in range(len(self.lengths))
            ]
            n_frames = int(self.frame_start[-1])
            self.frame_width = len(storage.FRAME_COLUMNS) + esize
            layout += [
                ("frame_start", "I64", [len(self.frame_start)], 8 * len(self.frame_start)),
                ("frames", "I64", [n_frames, self.frame_width], 8 * n_frames * self.frame_width),
                ("blob", "U8", [0], 0),
            ]
            self.blob = _OrderedBlob(self, n_frames)
        self.layout = layout
        self.base: dict[str, int] = {}
        pos = 0
        for name, _, _, nbytes in layout:
            self.base[name] = pos
            pos += nbytes
        self.fixed_bytes = pos
        # Room for what only finish() knows: the blob's size, the fp8 error report.
        slack = {"none": 0, "lossless": 64, "fp8": 256 + 160 * (self.k + 1)}[codec]
        hjson = self._header(blob_bytes=0)
        self.header_len = len(hjson) + slack + (-(len(hjson) + slack) % 8)
        self.data_start = 8 + self.header_len
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.removed_stale = remove_stale_temps(self.path)
        self._sync_lock = threading.Lock()  # records are written from several threads
        self._write_lock = threading.Lock()  # see _pwrite_at
        self._unsynced = 0  # bytes written since the last background sync started
        self._sync_closed = False
        self._sync_pool: ThreadPoolExecutor | None = None
        self._sync_future: Future[None] | None = None
        self._sync_error: BaseException | None = None
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, self.data_start + self.fixed_bytes)
            self._write_header(hjson)
            self._pwrite("offsets", 0, memoryview(self.offsets).cast("B"))
            if codec == "lossless":
                self._pwrite("frame_start", 0, memoryview(self.frame_start).cast("B"))
        except BaseException:
            self.abort()
            raise
        self.written = [False] * len(self.lengths)
        self.ids = np.zeros(t, dtype=np.int32)
        self.mask = np.zeros(t, dtype=np.uint8)
        #: Per record given a ``row_sink``: bytes of its hidden and aux rows written so far.
        self._sunk: dict[int, list[int]] = {}

    def _header(self, blob_bytes: int) -> bytes:
        header: dict[str, object] = {"__metadata__": self.metadata}
        pos = 0
        for name, st, shape, nbytes in self.layout:
            if name == "blob":
                shape, nbytes = [blob_bytes], blob_bytes
            header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        return json.dumps(header, separators=(",", ":")).encode()

    def _write_header(self, hjson: bytes) -> None:
        if len(hjson) > self.header_len:  # the slack above is generous: a bug if reached
            raise ChunkFileError(f"{self.path}: header of {len(hjson)} bytes overflows its room")
        hjson += b" " * (self.header_len - len(hjson))  # safetensors allows space padding
        self._pwrite_at(0, memoryview(self.header_len.to_bytes(8, "little") + hjson))

    def _pwrite(self, name: str, at: int, data: memoryview) -> None:
        self._pwrite_at(self.data_start + self.base[name] + at, data)

    def _pwrite_at(self, pos: int, data: memoryview) -> None:
        # One pwrite at a time per file: a buffered write holds the file's inode lock, and
        # a second writer spins on it (the kernel's optimistic rwsem spinning) rather than
        # sleep, so sender threads writing into one chunk burned ~2x the CPU a byte for no
        # more throughput (issue 40; bench/piece_path.py).  This lock's waiters sleep.
        with self._write_lock:
            nbytes = _pwrite_all(self.fd, data, pos)
        self._wrote(nbytes)

    def _wrote(self, nbytes: int) -> None:
        """Count bytes written to the file (every write of the writer comes here); past
        :data:`SYNC_EVERY_BYTES` since the last background fdatasync started, start one.

        Why: writeback then runs while the chunk streams, and the fsync at ``finish``, in
        the tail of the run, has little left.  One at a time: a sync still running means
        the disk is behind, a second would only queue; the next write tries again.
        """
        with self._sync_lock:
            self._unsynced += nbytes
            if self._unsynced < SYNC_EVERY_BYTES or self._sync_closed:
                return
            if self._sync_future is not None:
                if not self._sync_future.done():
                    return
                self._sync_error = self._sync_error or self._sync_future.exception()
                self._sync_future = None
            if self._sync_error is not None:
                return  # the chunk is lost already; finish() raises the error
            self._unsynced = 0
            if self._sync_pool is None:  # lazily: most small chunks never get here
                self._sync_pool = ThreadPoolExecutor(1, thread_name_prefix="chunk-sync")
            self._sync_future = self._sync_pool.submit(os.fdatasync, self.fd)

    def _end_syncs(self) -> BaseException | None:
        """Start no more background syncs, wait for the one in flight (the fd must stay open
        until it returns: closed, its number could be another file's) and stop the thread.
        Returns the error of any background sync."""
        with self._sync_lock:
            self._sync_closed = True
            future, pool = self._sync_future, self._sync_pool
            self._sync_future = self._sync_pool = None
        error = self._sync_error
        if future is not None:
            error = error or future.exception()
        if pool is not None:
            pool.shutdown(wait=True)
        return error

    def _check(self, j: int, input_ids: torch.Tensor, nbytes: tuple[int, int], dtype) -> None:
        n = self.lengths[j]
        want = (n * self.row_bytes[0], n * self.row_bytes[1])
        if input_ids.shape != (n,) or nbytes != want:
            raise ChunkFileError(
                f"record {j}: ids {tuple(input_ids.shape)}, hidden {nbytes[0]} bytes, aux "
                f"{nbytes[1]} bytes do not match length {n}, H={self.h}, k={self.k}, {self.dtype}"
            )
        if dtype != self.dtype:
            raise ChunkFileError(f"record {j}: dtype {dtype} != {self.dtype}")
        if faults.ACTIVE:  # tests only: a disk that fills up mid-chunk
            faults.on_chunk_put(self.path)

    def _put_small(self, j: int, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        # Kept in memory, written once by finish: two small pwrites a record took the
        # file's write lock, which a blob or row write may hold for long (issue 40).
        start, n = int(self.offsets[j]), self.lengths[j]
        self.ids[start : start + n] = input_ids.detach().to("cpu", torch.int32).numpy()
        self.mask[start : start + n] = loss_mask.detach().to("cpu", torch.uint8).numpy()

    def put(
        self,
        j: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
    ) -> None:
        n = self.lengths[j]
        if hidden.shape != (n, self.h) or aux.shape != (n, self.k * self.h):
            raise ChunkFileError(
                f"record {j}: shapes ids {tuple(input_ids.shape)} hidden {tuple(hidden.shape)} "
                f"aux {tuple(aux.shape)} do not match length {n}, H={self.h}, k={self.k}"
            )
        if hidden.dtype != aux.dtype:
            raise ChunkFileError(f"record {j}: dtype {hidden.dtype}/{aux.dtype} != {self.dtype}")
        hb, ab = _as_bytes(hidden), _as_bytes(aux)
        self._check(j, input_ids, (hb.nbytes, ab.nbytes), hidden.dtype)
        self._put_small(j, input_ids, loss_mask)
        self._put_rows(j, _Rows(mem=hb), _Rows(mem=ab))
        self.written[j] = True

    def row_sink(self, j: int) -> Callable[[int, int, memoryview], None] | None:
        """Uncompressed: a callable ``(tensor, at, data)`` writing bytes of record ``j``'s
        hidden (tensor 0) or aux (1) rows, ``at`` bytes into the record's rows of that
        tensor, straight to their place in the file; then ``put_files(..., rows_sunk=True)``
        writes the rest of the record.  ``None`` with a codec (it encodes whole frames).

        Why: the client reads every row once to check it (``client.assemble``); writing
        the rows from that buffer saves reading them once more to copy them (issue 40)."""
        if self.codec != "none":
            return None
        start, n = int(self.offsets[j]), self.lengths[j]
        where = [
            (self.data_start + self.base[name] + rb * start, n * rb)
            for name, rb in zip(("hidden_states", "aux_hidden_states"), self.row_bytes, strict=True)
        ]
        got = self._sunk[j] = [0, 0]

        def sink(tensor: int, at: int, data: memoryview) -> None:
            base, room = where[tensor]
            if at < 0 or at + len(data) > room:
                raise ChunkFileError(
                    f"record {j}: rows at byte {at}+{len(data)} past its {room} bytes"
                )
            self._pwrite_at(base + at, data)
            got[tensor] += len(data)

        return sink

    def put_files(
        self,
        j: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: Sequence[tuple[int, int, int, str]],
        aux: Sequence[tuple[int, int, int, str]],
        dtype: torch.dtype,
        *,
        rows_sunk: bool = False,
        check: RowCheck | None = None,
    ) -> None:
        """Like ``put``, but the hidden and aux rows are ``(fd, offset, nbytes, name)`` byte
        ranges of open files, in row order (``name`` is for errors).

        With a codec the ranges are read a frame at a time and encoded; ``check`` (the
        client's ``Dump.check_rows``) sees each frame's rows before they are encoded and
        may refuse them by raising: the client checks the values in the encoder's buffer
        instead of reading every row once more to check it (a refused record is never
        counted as written; the chunk fails).  Uncompressed, the
        rows must have come through ``row_sink(j)`` already (``rows_sunk=True``): the ranges
        only give the record's size, and the call is refused unless the sink took exactly
        its bytes.  Why no second way: the client reads every row once to check it anyway,
        and writing from that read is the one path (copying the ranges again cost a read
        more, issue 40; bench/piece_path.py keeps that copy as its baseline)."""
        if self.codec == "none" and not rows_sunk:
            raise ChunkFileError(
                f"{self.path}: record {j}: uncompressed rows are written through "
                f"row_sink({j}) as they are checked, then put_files(..., rows_sunk=True)"
            )
        nbytes = (sum(r[2] for r in hidden), sum(r[2] for r in aux))
        self._check(j, input_ids, nbytes, dtype)
        if rows_sunk:
            got = self._sunk.pop(j, None)
            if got is None or tuple(got) != nbytes:
                raise ChunkFileError(
                    f"record {j}: its row sink took {got} bytes of hidden and aux rows, "
                    f"not {list(nbytes)}"
                )
        if check is not None and rows_sunk:
            raise ChunkFileError(
                f"record {j}: check= is for rows the encoder reads; rows that went through "
                f"row_sink({j}) were checked as they were read"
            )
        self._put_small(j, input_ids, loss_mask)
        if not rows_sunk:
            with _read_buffer() as buf:  # one: hidden's frames are encoded before aux's
                self._put_rows(j, _Rows(ranges=hidden, buf=buf), _Rows(ranges=aux, buf=buf), check)
        self.written[j] = True

    def _put_rows(self, j: int, hidden: _Rows, aux: _Rows, check: RowCheck | None = None) -> None:
        n, start = self.lengths[j], int(self.offsets[j])
        if self.codec == "none":
            for name, rows, rb in (
                ("hidden_states", hidden, self.row_bytes[0]),
                ("aux_hidden_states", aux, self.row_bytes[1]),
            ):
                self._pwrite(name, rb * start, rows.read(n * rb))
        elif self.codec == "fp8":
            self._put_fp8(start, n, hidden, aux, check)
        else:
            self._put_lossless(j, n, hidden, aux, check)

    def _put_fp8(
        self, start: int, n: int, hidden: _Rows, aux: _Rows, check: RowCheck | None
    ) -> None:
        for tensor, (rows, layers) in enumerate(((hidden, 1), (aux, self.k))):
            if not layers:
                continue
            rb = self.row_bytes[tensor]
            step = max(1, storage.FRAME_BYTES // rb)
            name = ("hidden_states", "aux_hidden_states")[tensor]
            scales = ("hidden_scales", "aux_scales")[tensor]
            for r0 in range(0, n, step):
                nr = min(step, n - r0)
                x = torch.frombuffer(rows.read(nr * rb), dtype=self.dtype).view(nr, layers, self.h)
                if check is not None:
                    check(tensor, r0, x.view(nr, -1))
                q, scale = storage.fp8_quantize(x, self.fp8_error, layer0=0 if tensor else self.k)
                self._pwrite(name, (start + r0) * layers * self.h, _as_bytes(q.view(torch.uint8)))
                self._pwrite(scales, 4 * (start + r0) * layers, _as_bytes(scale))

    def _put_lossless(
        self, j: int, n: int, hidden: _Rows, aux: _Rows, check: RowCheck | None
    ) -> None:
        frame = int(self.frame_start[j])
        for tensor, rows in enumerate((hidden, aux)):
            rb, step = self.row_bytes[tensor], self.rows_per_frame[tensor]
            if not rb:
                continue
            for r0 in range(0, n, step):
                nr = min(step, n - r0)
                data = rows.read(nr * rb)
                if check is not None:
                    check(tensor, r0, torch.frombuffer(data, dtype=self.dtype).view(nr, -1))
                parts, lengths = storage.compress_frame(data, self.esize)
                self.blob.add(j, [frame, j, tensor, r0, nr], parts, lengths)
                frame += 1
        self.blob.record_done(j)

    def finish(self) -> str:
        """fsync, hash and rename into place; returns the sha256. Refuses if a record is missing.
        On any failure (a background sync's included) the temp file is removed, nothing renamed."""
        missing = [j for j, w in enumerate(self.written) if not w]
        if missing:
            self.abort()
            raise ChunkFileError(f"{self.path}: records {missing[:10]} never written")
        try:
            digest = self._finish()
        except BaseException:
            self.abort()  # as for a missing record: no temp file left behind
            raise
        os.replace(self.tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return digest

    def _finish(self) -> str:
        self._pwrite("input_ids", 0, memoryview(self.ids).cast("B"))
        self._pwrite("loss_mask", 0, memoryview(self.mask).cast("B"))
        if self.codec == "lossless":
            end = self.blob.close()
            os.ftruncate(self.fd, self.data_start + self.fixed_bytes + end)
            self._write_header(self._header(blob_bytes=end))
        elif self.codec == "fp8":
            prenorm = self.metadata.get("num_layers")
            names = [
                "prenorm" if str(layer) == prenorm else f"aux_{layer}"
                for layer in json.loads(self.metadata.get("aux_layers", "[]"))
            ]
            names = (names + [f"aux_{i}" for i in range(len(names), self.k)])[: self.k]
            report = self.fp8_error.report([*names, "final"])
            self.metadata["fp8_error"] = json.dumps(report, separators=(",", ":"))
            self._write_header(self._header(blob_bytes=0))
        # Hash (CPU, from the page cache) while fsync (disk) runs; both release the GIL.
        with ThreadPoolExecutor(max_workers=1) as pool:
            hashing = pool.submit(sha256_file, self.tmp)
            # A background sync's error is the chunk's: Linux reports a writeback error
            # once per open file, so the fsync below may well succeed after an EIO.
            error = self._end_syncs()
            if error is not None:
                raise error
            os.fsync(self.fd)
            digest = hashing.result()
        os.close(self.fd)
        self.fd = -1
        return digest

    def abort(self) -> None:
        if self.codec == "lossless":
            self.blob.close(drop=True)
        self._end_syncs()  # before the close; its error is moot, the chunk is dropped
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


class _OrderedBlob:
    """A lossless chunk's compressed frames, laid out in record order whatever order the
    records arrive in, written by a thread of its own.

    Why in order: a chunk file must be the same bytes however its requests were scheduled,
    so a rerun reproduces its sha256.  Why a thread of its own (issue 40): the request
    threads hold the server's window until their record is handed over, and a record's
    frames can only be written once every record before it is.  When the request thread
    that completed the head wrote the records waiting behind it, under a lock every other
    encoder needed, one slow write (writeback throttling, a spill file to copy back)
    stalled every encoder of the job with their requests counted in flight: on the chat
    cell (H100 host) the chunk jobs held 404 of the 615 requests in flight after their
    answers, SGLang's queue empty in 196 of 271 passes, 0.813 of the bare server.  Now a
    request thread only queues its frames (in memory up to :data:`PENDING_BYTES`, past it
    in a spill file next to the chunk, written by that thread) and marks its record done;
    the writer thread alone writes the blob, in record order.  Its frame-table rows are
    kept in memory (``table``) and written once, at ``close``.
    """

    def __init__(self, writer: ChunkWriter, n_frames: int) -> None:
        self.w = writer
        self.end = 0  # bytes of blob written
        self.next = 0  # the head: every record before it is written or being written
        self.pending: dict[int, list] = {}
        self.done: set[int] = set()
        self.mem = 0
        self.cv = threading.Condition()
        self.table = np.zeros((n_frames, writer.frame_width), dtype=np.int64)
        self.spill_path = writer.tmp.with_name(writer.tmp.name[: -len(".tmp")] + ".spill.tmp")
        self.spill_fd, self.spill_end = -1, 0
        self.error: BaseException | None = None
        self.stopping = self.dropping = False
        self.thread: threading.Thread | None = None

    def _raise_if_failed(self) -> None:
        err = self.error
        if err is None:
            return
        if isinstance(err, OSError):  # a disk's error stays one: the client names the file
            raise OSError(err.errno, err.strerror, err.filename) from err
        raise ChunkFileError(f"{self.w.path}: writing the blob failed: {err!r}") from err

    def add(self, j: int, entry: list[int], parts: list, lengths: list[int]) -> None:
        size = sum(abs(x) for x in lengths)
        with self.cv:
            self._raise_if_failed()
            spill = self.mem + size > PENDING_BYTES
            if spill:
                if self.spill_fd < 0:
                    self.spill_fd = os.open(self.spill_path, os.O_RDWR | os.O_CREAT, 0o600)
                off = self.spill_end
                self.spill_end += size
            else:
                self.mem += size
            self.pending.setdefault(j, []).append(
                (entry, [("spill", off)] if spill else parts, lengths, size)
            )
        if spill:  # the range is this thread's; the writer reads it after record_done(j)
            for part in parts:
                off += _pwrite_all(self.spill_fd, part, off)

    def record_done(self, j: int) -> None:
        with self.cv:
            self._raise_if_failed()
            self.done.add(j)
            if self.thread is None:  # lazily: a writer dropped unused leaves no thread
                self.thread = threading.Thread(
                    target=self._run, name=f"blob-{self.w.path.name}", daemon=True
                )
                self.thread.start()
            if j == self.next:
                self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while self.next not in self.done and not self.stopping and not self.dropping:
                    self.cv.wait()
                if self.dropping or self.next not in self.done:
                    return
                j = self.next
                self.done.discard(j)
                self.next += 1
                items = self.pending.pop(j, [])
            try:
                for entry, parts, lengths, size in items:
                    self._write(entry, parts, lengths, size)
            except BaseException as exc:  # handed to the request threads and to close
                with self.cv:
                    self.error = exc
                    self.cv.notify_all()
                return
            freed = sum(size for _, parts, _, size in items if not isinstance(parts[0], tuple))
            with self.cv:
                self.mem -= freed

    def _write(self, entry: list[int], parts: list, lengths: list[int], size: int) -> None:
        w = self.w
        pos = w.data_start + w.base["blob"] + self.end
        if isinstance(parts[0], tuple):  # from the spill file
            _copy(self.spill_fd, parts[0][1], size, w.fd, pos, str(self.spill_path))
            w._wrote(size)  # not through _pwrite_at: counted here
        else:
            for part in parts:
                view = memoryview(part).cast("B")
                w._pwrite_at(pos, view)
                pos += len(view)
        self.table[entry[0]] = [*entry[1:], self.end, *lengths]
        self.end += size

    def close(self, drop: bool = False) -> int:
        """Stop the writer thread: after it has written every record marked done, or, with
        ``drop`` (abort), after the record it is writing.  Writes the frame table (unless
        dropped); returns the blob's size.  Raises the writer's error."""
        with self.cv:
            self.stopping, self.dropping = True, drop
            self.cv.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join()
        if self.spill_fd >= 0:
            os.close(self.spill_fd)
            self.spill_fd = -1
        self.spill_path.unlink(missing_ok=True)
        if not drop:
            self._raise_if_failed()
            self.w._pwrite("frames", 0, memoryview(self.table).cast("B"))
        return self.end


def _sidecar_sha256(path: Path) -> str | None:
    """The sha256 the chunk's sidecar recorded at extraction, or None when there is no
    sidecar of this file: a ``.json`` that is not one (not a JSON object naming this file
    with a ``sha256``) is some other file, never an error."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("path") != path.name:
        return None
    sha = meta.get("sha256")
    return sha if isinstance(sha, str) and sha else None


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_TO_TORCH = {v: k for k, v in _ST_DTYPES.items()}


class ChunkReader:
    """Records of one chunk file, any codec, decoded per record (no whole-file read).

    Uncompressed rows are sliced lazily from safetensors' mmap; lossless frames are
    decoded from this reader's own read-only mapping; fp8 rows are dequantized to the
    captured dtype.  Every codec gives the same tensors, dtypes and shapes.

    Its bytes are checked when the reader opens, whenever their sha256 is known:
    ``expected_sha256`` if given, else the ``sha256`` of the chunk's sidecar (the
    ``.json`` of the same name next to it, which names this file) -- the digest taken when
    it was extracted.  Why at open: a flipped byte in the states still decodes (other
    numbers, no error), and one in the header changes record ids or shapes, so nothing
    read from a file is trusted before its hash is.  The whole file is hashed once, read
    1 MiB at a time into one buffer (:func:`~hsextract.chunkfile.verify_chunk_file`: once
    per file and process while it is unchanged, so reopening costs nothing), and a
    mismatch raises :class:`~hsextract.chunkfile.ChunkDigestError` naming the file and how
    to redo it.  A file with no sidecar and no ``expected_sha256`` is not checked;
    ``verify=False`` skips the check (for callers that hash alongside their own reads,
    like the exports).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        expected_sha256: str | None = None,
        *,
        verify: bool = True,
    ) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        #: The sha256 the file was checked against at open (None: not checked).
        self.sha256: str | None = None
        if verify:
            self.sha256 = expected_sha256 or _sidecar_sha256(self.path)
            if self.sha256 is not None:
                verify_chunk_file(self.path, self.sha256)
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except Exception as exc:
            raise ChunkFileError(f"{self.path}: not a readable safetensors file: {exc}") from exc
        self.metadata: dict[str, str] = self._f.metadata() or {}
        self.codec = self.metadata.get("codec", "none")
        if self.codec not in storage.CODECS:
            raise ChunkFileError(
                f"{self.path}: codec {self.codec!r} is not one this hsextract reads "
                f"({', '.join(storage.CODECS)}); upgrade hsextract"
            )
        keys = set(self._f.keys())
        need = set(_STORED[self.codec])
        if not need <= keys:
            raise ChunkFileError(f"{self.path}: missing tensors {sorted(need - keys)}")
        self.offsets = self._f.get_tensor("offsets")
        self.record_ids: list[str] = json.loads(self.metadata.get("record_ids", "[]"))
        #: Every layer stored in ``aux_hidden_states``, in order (what the dump captured).
        self.stored_layers: list[int] = json.loads(self.metadata.get("aux_layers", "[]"))
        n_layers = self.metadata.get("num_layers")
        #: With ``prenorm_final`` the last stored block is index L, the stream before the
        #: final norm: records hand it out on its own, as ``prenorm_hidden_states``.
        self.prenorm = n_layers is not None and int(n_layers) in self.stored_layers
        self.aux_layers: list[int] = self.stored_layers[:-1] if self.prenorm else self.stored_layers
        self.hidden_size = int(self.metadata.get("hidden_size", -1))
        if self.codec == "none":
            self.dtype = _ST_TO_TORCH[self._f.get_slice("hidden_states").get_dtype()]
        else:
            self.dtype = _TORCH_DTYPES.get(self.metadata.get("dtype", ""), torch.bfloat16)
        if self.codec == "lossless":
            self.frame_start = self._f.get_tensor("frame_start").numpy()
            self.frames = self._f.get_tensor("frames").numpy()
            self._blob = self._map_blob()

    def _map_blob(self) -> memoryview:
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
            self._mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""
        a, b = header["blob"]["data_offsets"]
        return memoryview(self._mm)[8 + n + a : 8 + n + b]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> dict[str, torch.Tensor | str]:
        return self.record(j)

    def record(self, j: int, alloc: Alloc | None = None) -> dict[str, torch.Tensor | str]:
        """Record ``j``; ``alloc(shape, dtype)`` gives the tensors a lossless record decodes
        into (a loader worker's: shared memory, which its tensors are sent through, so they
        are written once, not decoded and then copied there; stream.reader.worker_record)."""
        if not 0 <= j < len(self):
            raise IndexError(j)
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        out: dict[str, torch.Tensor | str] = {
            name: self._f.get_slice(name)[a:b] for name in ("input_ids", "loss_mask")
        }
        out["hidden_states"], aux = self._rows(j, a, b, alloc)
        if self.prenorm:
            k = len(self.aux_layers) * self.hidden_size
            out["aux_hidden_states"], out["prenorm_hidden_states"] = aux[:, :k], aux[:, k:]
        else:
            out["aux_hidden_states"] = aux
        out["id"] = self.record_ids[j] if j < len(self.record_ids) else str(j)
        return out

    def _rows(
        self, j: int, a: int, b: int, alloc: Alloc | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, k = self.hidden_size, len(self.stored_layers)
        if self.codec == "none":
            return (
                self._f.get_slice("hidden_states")[a:b],
                self._f.get_slice("aux_hidden_states")[a:b],
            )
        if self.codec == "fp8":
            hid = self._f.get_slice("hidden_states")[a:b].view(b - a, 1, h)
            aux = self._f.get_slice("aux_hidden_states")[a:b].view(b - a, k, h)
            return (
                storage.fp8_dequantize(
                    hid, self._f.get_slice("hidden_scales")[a:b], self.dtype
                ).view(b - a, h),
                storage.fp8_dequantize(aux, self._f.get_slice("aux_scales")[a:b], self.dtype).view(
                    b - a, k * h
                ),
            )
        esize = torch.empty((), dtype=self.dtype).element_size()
        widths = (h, k * h)
        make = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        outs = [make((b - a, w), self.dtype) for w in widths]
        bufs = [t.view(-1).view(torch.uint8).numpy() for t in outs]
        ncol = len(storage.FRAME_COLUMNS)
        for row in self.frames[self.frame_start[j] : self.frame_start[j + 1]]:
            rec, tensor, r0, nr, at = (int(x) for x in row[:ncol])
            rb = widths[tensor] * esize
            if rec != j or r0 + nr > b - a or not outs[tensor].numel():
                raise ChunkFileError(f"{self.path}: frame table entry {row.tolist()} is corrupt")
            try:
                storage.decompress_frame(
                    self._blob,
                    at,
                    [int(x) for x in row[ncol:]],
                    nr * rb,
                    bufs[tensor][r0 * rb : (r0 + nr) * rb],
                )
            except Exception as exc:
                raise ChunkFileError(f"{self.path}: record {j} does not decode: {exc}") from exc
        return outs[0], outs[1]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor | str]]:
        for j in range(len(self)):
            yield self[j]

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        """The tensors as stored (a compressed file has no ``hidden_states`` tensor)."""
        out = {}
        for name in self._f.keys():
            sl = self._f.get_slice(name)
            out[name] = (list(sl.get_shape()), str(sl.get_dtype()))
        return out

    def raw_bytes(self) -> int:
        """What the hidden and aux rows take uncompressed, in the captured dtype."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        return int(self.offsets[-1]) * self.hidden_size * (len(self.stored_layers) + 1) * esize

    def stored_bytes(self) -> int:
        return stored_bytes(self.codec, self.shapes())


class ManifestDataset(torch.utils.data.Dataset):
    """A torch Dataset over every record of every chunk in a manifest (lazy, mmap-backed).

    Each chunk file is opened, and its bytes checked against the manifest's sha256, when a
    record of it is first read (a :class:`ChunkReader` given ``expected_sha256``: one hash
    per file and process), so a damaged chunk fails naming itself instead of training on
    bad states; not at construction, which would read a multi-TB run before the first
    step.  A chunk re-extracted after the manifest was written (its sidecar's sha256 is its
    bytes', the manifest's is not) is told apart: the manifest is stale, not the chunk.
    """

    def __init__(self, manifest: str | os.PathLike[str]) -> None:
        self.manifest_path = Path(manifest)
        data = json.loads(self.manifest_path.read_text())
        root = self.manifest_path.parent
        self.paths = [root / c["path"] for c in data["chunks"]]
        self.sha256: list[str] = [str(c["sha256"]) for c in data["chunks"]]
        self.records: list[int] = [int(c["records"]) for c in data["chunks"]]
        self.readers: list[ChunkReader | None] = [None] * len(self.paths)
        self.index = [(ci, j) for ci, n in enumerate(self.records) for j in range(n)]

    def __len__(self) -> int:
        return len(self.index)

    def reader(self, ci: int) -> ChunkReader:
        """Chunk ``ci``'s reader, opened (and its bytes checked) on first use."""
        r = self.readers[ci]
        if r is None:
            path = self.paths[ci]
            try:
                r = ChunkReader(path, self.sha256[ci])
            except ChunkDigestError as exc:
                if _sidecar_sha256(path) != exc.actual:
                    raise
                raise ChunkDigestError(
                    f"{self.manifest_path} lists {path} with sha256 {exc.expected[:12]}..., "
                    f"but the chunk was re-extracted since (its sidecar's sha256 "
                    f"{exc.actual[:12]}... is its bytes'): the manifest is stale, not the "
                    f"chunk; rebuild it with `{_run_all(self.manifest_path)}`",
                    path=path,
                    expected=exc.expected,
                    actual=exc.actual,
                ) from None
            if len(r) != self.records[ci]:
                raise ChunkFileError(
                    f"{path} holds {len(r)} records, {self.manifest_path} lists "
                    f"{self.records[ci]}: rebuild the manifest with "
                    f"`{_run_all(self.manifest_path)}`"
                )
            self.readers[ci] = r
        return r

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | str]:
        ci, j = self.index[i]
        return self.reader(ci)[j]


def content_digest_of(path: str | os.PathLike[str]) -> str:
    """The content digest of the records a chunk file holds, from its own tensors.

    The same function of (id, input_ids, loss_mask) that split_chunks computes from JSON
    (:func:`hsextract.records.record_digest`), so a file can be checked against the index
    and train.jsonl without trusting its metadata.
    """
    from hsextract.records import content_digest, record_digest

    r = ChunkReader(path, verify=False)  # its callers check the bytes (once, their way)
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
    r = ChunkReader(path, verify=False)  # shows a damaged file too: `verify` judges it
    lines = [f"{path}", f"  records: {len(r)}  tokens: {int(r.offsets[-1])}"]
    raw, stored = r.raw_bytes(), r.stored_bytes()
    ratio = f"{raw / stored:.3f}x smaller" if stored else "empty"
    lines.append(
        f"  codec: {r.codec}  states {raw / 2**20:.2f} MiB as {r.dtype}, stored "
        f"{stored / 2**20:.2f} MiB ({ratio})"
    )
    t, h, k = int(r.offsets[-1]), r.hidden_size, len(r.aux_layers)
    lines.append(
        f"  records read as: hidden_states {r.dtype} [{t}, {h}], "
        f"aux_hidden_states {r.dtype} [{t}, {k * h}]"
        + (f", prenorm_hidden_states {r.dtype} [{t}, {h}]" if r.prenorm else "")
    )
    lines.append("  stored tensors:")
    for name, (shape, dtype) in sorted(r.shapes().items()):
        lines.append(f"    {name:<18} {dtype:<7} {shape}")
    if r.codec == "fp8" and "fp8_error" in r.metadata:
        lines.append(f"  fp8 error against the captured {r.dtype} states, per layer:")
        lines.append(f"    {'layer':<10} {'rel_rms':>10} {'max_abs':>10}")
        for layer, e in json.loads(r.metadata["fp8_error"]).items():
            lines.append(f"    {layer:<10} {e['rel_rms']:>10.5f} {e['max_abs']:>10.4g}")
    for key, value in sorted(r.metadata.items()):
        if key == "record_ids":
            ids = json.loads(value)
            value = json.dumps(ids[:5])[:-1] + (
                f", ... ({len(ids)} total)]" if len(ids) > 5 else "]"
            )
        if key == "fp8_error":
            continue
        lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def _run_all(manifest: Path) -> str:
    """The command that rebuilds ``manifest``, as it works pasted here (hsextract.commands)."""
    from hsextract.commands import snakemake_command

    return snakemake_command("extract_all", run_dir=Path(manifest).parent)
