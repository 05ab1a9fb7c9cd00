"""The server-side half of the dump protocol: one piece per (rid, start) of an extend pass.

Imported inside the SGLang server process (through the patch or the forward hooks) and by
the reference engine, so the protocol exists once.  It may use only what SGLang's process
already has: the standard library, torch and safetensors.

A piece is ``<dump_dir>/<rid>/<start:09d>.safetensors`` holding the tokens
``[start, start+n)`` of request ``rid``: ``input_ids`` [n] int64, ``hidden_states`` [n, H]
(final, post-norm) and ``aux_hidden_states`` [n, k*H] (the residual stream entering each
aux layer, concatenated in ``aux_layers`` order).  It is written under a dot-prefixed
temporary name and renamed, so a reader never sees half a piece.

Why it is asynchronous.  On TP rank 0 this code sits on the critical path of the whole TP
group: an 8,192-token pass at H=7168 captures ~470 MB, which takes ~2.4 s to ``torch.save``
from the GPU and ~160 ms to write to /dev/shm even from pinned memory, against a ~200 ms
forward.  So ``write_batch`` only *hands over* the batch and returns:

1. on the caller's (forward) stream it snapshots the captured tensors into fresh device
   memory (a device-to-device copy, ~0.2 ms for 470 MB), so the caller may overwrite or
   free its own buffers as soon as we return, without waiting for anything;
2. a copier thread makes a side stream wait on an event recorded after that snapshot and
   copies it into a pinned host buffer taken from a bounded pool (~8.5 ms at ~55 GB/s,
   overlapped with the next forward), a few 16 MiB chunks at a time so that the forward's
   own small device-to-host copies never queue behind a whole pass (``_copier``);
3. writer threads take each completed pass and write each request's rows straight from
   the pinned buffer to a temporary file (the safetensors layout is serialised here, so
   the rows are written without another host copy), then rename it.

When all pool buffers are in flight, ``write_batch`` blocks until one is free: memory stays
bounded and the forward slows down only if the disk path cannot keep up.  A failure in a
writer thread is re-raised by the next ``write_batch``, ``flush`` or ``close``; it is never
dropped.  CPU tensors take the same path, with the device copy replaced by a synchronous
copy into the (unpinned) pool buffer.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import json
import os
import queue
import struct
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

DUMP_DIR_ENV = "SGLANG_HS_DUMP_DIR"
AUX_LAYERS_ENV = "HSEXTRACT_AUX_LAYERS"
#: Number of staging buffers (each sized for the largest batch seen); bounds host memory.
SLOTS_ENV = "HSEXTRACT_CAPTURE_SLOTS"
#: Number of writer threads; pieces of different requests and passes are written in parallel.
THREADS_ENV = "HSEXTRACT_CAPTURE_THREADS"
#: Size of each device-to-host copy, in MiB (0: one copy per tensor); see ``_copier``.
D2H_CHUNK_ENV = "HSEXTRACT_CAPTURE_D2H_CHUNK_MB"
#: Most D2H chunks queued on the GPU at once (0: all of a pass at once); see ``_copier``.
D2H_INFLIGHT_ENV = "HSEXTRACT_CAPTURE_D2H_INFLIGHT"
PIECE_SUFFIX = ".safetensors"
#: ``<dump_dir>/.abandoned/<rid>``: the client gave up on rid; write none of its pieces.
ABANDONED_DIR = ".abandoned"

DEFAULT_SLOTS = 4
DEFAULT_THREADS = 4
DEFAULT_D2H_CHUNK_MB = 16
DEFAULT_D2H_INFLIGHT = 2

_ALIGN = 64  # region alignment inside a staging buffer (dtype views need element alignment)
_MIN_CAPACITY = 1 << 20

# safetensors dtype names (the format's spec; safe_open checks them).
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class CaptureWriteError(RuntimeError):
    """A piece could not be written in a writer thread; raised on the caller's next call."""


def piece_name(start: int) -> str:
    return f"{start:09d}{PIECE_SUFFIX}"


def _safe_rid(rid: str) -> str:
    # rids come from our client (hex/uuid-like); refuse anything that could escape the dir.
    if not rid or "/" in rid or rid.startswith(".") or "\x00" in rid:
        raise ValueError(f"refusing unsafe request id for a dump path: {rid!r}")
    return rid


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


class _Slot:
    """One reusable staging buffer: raw bytes plus a zero-copy memoryview for ``os.writev``.

    Sized to a power of two of the largest batch it has held, so a steady stream of
    similar passes never reallocates (pinned allocation costs ~0.1 s per 500 MB), and the
    memory retired by growth is at most the final size again.
    """

    __slots__ = ("buf", "view", "pinned")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.view: memoryview | None = None
        self.pinned = False

    def ensure(self, nbytes: int, pinned: bool) -> None:
        if self.buf is not None and self.buf.numel() >= nbytes and self.pinned == pinned:
            return
        cap = max(_MIN_CAPACITY, 1 << max(0, nbytes - 1).bit_length())
        self.buf = None
        self.view = None
        # A normal tensor even when the first caller runs under inference_mode, so later
        # callers outside it may still write into it.
        with torch.inference_mode(False):
            buf = torch.empty(cap, dtype=torch.uint8, pin_memory=pinned)
        # ctypes keeps this stdlib-only (no numpy); ``buf`` outlives the view in this slot.
        raw = (ctypes.c_ubyte * cap).from_address(buf.data_ptr())
        self.buf = buf
        self.view = memoryview(raw).cast("B")
        self.pinned = pinned

    def region(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]):
        assert self.buf is not None
        return self.buf[offset : offset + nbytes].view(dtype).view(shape)


class _Batch:
    """One handed-over extend pass: its staging slot, layout and the copy's completion."""

    __slots__ = (
        "slot",
        "failed",
        "remaining",
        "dtype_name",
        "hidden_size",
        "aux_width",
        "elem",
        "off_ids",
        "off_hidden",
        "off_aux",
        "layers_json",
    )

    def __init__(self, slot: _Slot, remaining: int) -> None:
        self.slot = slot
        self.failed = False  # the D2H copy failed: pieces are only accounted for, not written
        self.remaining = remaining
        self.dtype_name = ""
        self.hidden_size = 0
        self.aux_width = 0
        self.elem = 0
        self.off_ids = 0
        self.off_hidden = 0
        self.off_aux = 0
        self.layers_json = "[]"


class DumpWriter:
    """Writes the pieces of extend passes without blocking the forward (see module doc).

    ``slots`` (env ``HSEXTRACT_CAPTURE_SLOTS``) bounds the staging buffers, hence the host
    memory and the passes in flight; ``threads`` (env ``HSEXTRACT_CAPTURE_THREADS``) sets
    how many pieces are written at once.
    """

    def __init__(
        self,
        dump_dir: str | os.PathLike[str],
        aux_layers: Sequence[int] | None = None,
        *,
        slots: int | None = None,
        threads: int | None = None,
        d2h_chunk_mb: int | None = None,
        d2h_inflight: int | None = None,
    ):
        self.dump_dir = Path(dump_dir)
        if self.dump_dir.is_symlink() or not self.dump_dir.is_dir():
            raise RuntimeError(
                f"{DUMP_DIR_ENV}={self.dump_dir} is not an existing real directory; "
                "the hsextract client creates it (mode 0700) before the server starts"
            )
        self.aux_layers = list(aux_layers) if aux_layers is not None else None
        self.slots = slots if slots is not None else _env_int(SLOTS_ENV, DEFAULT_SLOTS)
        self.threads = threads if threads is not None else _env_int(THREADS_ENV, DEFAULT_THREADS)
        if d2h_chunk_mb is None:
            raw = os.environ.get(D2H_CHUNK_ENV)
            d2h_chunk_mb = int(raw) if raw else DEFAULT_D2H_CHUNK_MB
        if d2h_chunk_mb < 0:
            raise ValueError(f"d2h_chunk_mb={d2h_chunk_mb} must be >= 0")
        self.d2h_chunk_bytes = d2h_chunk_mb << 20
        if d2h_inflight is None:
            raw = os.environ.get(D2H_INFLIGHT_ENV)
            d2h_inflight = int(raw) if raw else DEFAULT_D2H_INFLIGHT
        if d2h_inflight < 0:
            raise ValueError(f"d2h_inflight={d2h_inflight} must be >= 0")
        self.d2h_inflight = d2h_inflight
        if self.slots < 1 or self.threads < 1:
            raise ValueError(f"slots={self.slots} and threads={self.threads} must be >= 1")
        self._dir = str(self.dump_dir)
        # LIFO: reuse the most recently freed (already sized, already hot) buffer first, so
        # only as many buffers are ever allocated as passes are really in flight.
        self._free: queue.LifoQueue[_Slot] = queue.LifoQueue()
        for _ in range(self.slots):
            self._free.put(_Slot())
        self._tasks: queue.SimpleQueue[tuple[_Batch, str, int, int, int] | None] = (
            queue.SimpleQueue()
        )
        self._copies: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._submit_lock = threading.Lock()
        self._cv = threading.Condition()
        self._pending = 0  # pieces handed over and not yet finished (written or failed)
        self._error: BaseException | None = None
        self._error_where = ""
        self._closed = False
        self._side: dict[int, torch.cuda.Stream] = {}
        self._pid = os.getpid()
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    # -- caller side -------------------------------------------------------------------

    def write_batch(
        self,
        rids: Sequence[str],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        aux_layers: Sequence[int] | None = None,
    ) -> None:
        """Hand a flat [T, ...] extend batch over; its per-request pieces are written later.

        ``input_ids`` is [T], ``hidden`` [T, H], each of ``aux`` [T, H]; request j owns rows
        ``sum(extend_lens[:j])`` to ``sum(extend_lens[:j+1])`` and those rows are its tokens
        ``[prefix_lens[j], prefix_lens[j] + extend_lens[j])``.  On return the inputs have been
        copied (on CUDA: snapshotted on the caller's current stream), so the caller may reuse
        them at once.  Raises a writer thread's earlier failure, if any.
        """
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError("DumpWriter is closed")
        layers = list(aux_layers) if aux_layers is not None else self.aux_layers
        if layers is None:
            raise ValueError("aux_layers unknown: pass them or set HSEXTRACT_AUX_LAYERS")
        if len(aux) != len(layers):
            raise ValueError(f"got {len(aux)} aux tensors for aux_layers {layers}")
        total = int(sum(int(n) for n in extend_lens))
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
        if input_ids.numel() != total or hidden.shape[0] != total:
            raise ValueError(
                f"batch rows {hidden.shape[0]} / ids {input_ids.numel()} "
                f"!= sum(extend_lens) {total}"
            )
        hidden_size = int(hidden.shape[1])
        for i, a in enumerate(aux):
            if a.numel() != total * hidden_size or a.dtype != hidden.dtype:
                raise ValueError(
                    f"aux[{i}] is {tuple(a.shape)} {a.dtype}; expected [{total}, {hidden_size}] "
                    f"{hidden.dtype} like hidden"
                )
            if a.device != hidden.device:
                raise ValueError(f"aux[{i}] is on {a.device}, hidden on {hidden.device}")
        if hidden.dtype not in _ST_DTYPES:
            raise ValueError(f"unsupported dtype {hidden.dtype}")
        pieces: list[tuple[str, int, int, int]] = []
        row = 0
        for rid, start, n in zip(rids, prefix_lens, extend_lens, strict=True):
            n = int(n)
            if n < 0 or int(start) < 0:
                raise ValueError(f"negative length or start for rid {rid!r}")
            if n > 0:
                pieces.append((_safe_rid(str(rid)), int(start), row, n))
            row += n
        if not pieces:
            return

        elem = hidden.element_size()
        aux_width = hidden_size * len(aux)
        off_hidden = _align(total * 8)
        off_aux = _align(off_hidden + total * hidden_size * elem)
        nbytes = off_aux + total * aux_width * elem
        on_cuda = hidden.is_cuda

        with self._submit_lock:
            self._ensure_workers()
            slot = self._acquire_slot()
            batch = _Batch(slot, len(pieces))
            copy_job = None
            try:
                slot.ensure(nbytes, pinned=on_cuda)
                ids_v = slot.region(0, total * 8, torch.int64, (total,))
                hid_nb = total * hidden_size * elem
                hid_v = slot.region(off_hidden, hid_nb, hidden.dtype, (total, hidden_size))
                aux_nb = total * aux_width * elem
                aux_v = slot.region(off_aux, aux_nb, hidden.dtype, (total, aux_width))
                if on_cuda:
                    copy_job = self._stage_cuda(input_ids, hidden, aux, ids_v, hid_v, aux_v)
                else:
                    self._stage_cpu(input_ids, hidden, aux, ids_v, hid_v, aux_v)
            except BaseException:
                self._free.put(slot)
                raise
            batch.dtype_name = _ST_DTYPES[hidden.dtype]
            batch.hidden_size = hidden_size
            batch.aux_width = aux_width
            batch.elem = elem
            batch.off_hidden = off_hidden
            batch.off_aux = off_aux
            batch.layers_json = json.dumps(layers)
            with self._cv:
                self._pending += len(pieces)
            if copy_job is not None:
                self._copies.put((batch, pieces, copy_job))
            else:
                for rid, start, row0, n in pieces:
                    self._tasks.put((batch, rid, start, row0, n))

    def flush(self) -> None:
        """Block until every piece handed over so far is renamed into place, or has failed.

        Raises the first writer failure (and keeps raising it: a writer that lost a piece
        has broken the protocol for that request, so it must not look healthy again).
        """
        with self._cv:
            while self._pending:
                self._cv.wait()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, then stop the writer threads.  Idempotent."""
        try:
            if not self._closed:
                self.flush()
        finally:
            self._closed = True
            self._stop_workers()

    # -- internals ---------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            raise CaptureWriteError(
                f"hidden-state dump of {self._error_where} under {self._dir} failed: {err!r}"
            ) from err

    def _acquire_slot(self) -> _Slot:
        # Backpressure: wait for a buffer, but wake up to surface a writer failure instead of
        # queueing more work behind it.
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                self._raise_if_failed()

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side.get(idx)
        if stream is None:
            stream = torch.cuda.Stream(device=idx)
            self._side[idx] = stream
        return stream

    def _stage_cuda(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        ids_v: torch.Tensor,
        hid_v: torch.Tensor,
        aux_v: torch.Tensor,
    ) -> tuple[torch.device, torch.cuda.Event, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Snapshot on the caller's stream; return the D2H copies for the copier thread."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("hidden-state capture cannot run inside CUDA graph capture")
        device = hidden.device
        total = hid_v.shape[0]
        with torch.cuda.device(device):
            # Fresh device tensors, ordered on the caller's stream before whatever it does
            # next: it may overwrite its buffers once we return; only we touch these.  The
            # copier holds them until their copies are complete, then drops them.
            copies = _chunks(
                hid_v, hidden.detach().clone(memory_format=torch.contiguous_format), self
            )
            if aux:
                snap = torch.cat([a.detach().reshape(total, -1) for a in aux], dim=1)
                copies += _chunks(aux_v, snap, self)
            if input_ids.is_cuda:
                copies.append((ids_v, input_ids.detach().reshape(-1).to(torch.int64, copy=True)))
            else:
                ids_v.copy_(input_ids.detach().reshape(-1))
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return device, ready, copies

    @staticmethod
    def _stage_cpu(
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        ids_v: torch.Tensor,
        hid_v: torch.Tensor,
        aux_v: torch.Tensor,
    ) -> None:
        total = hid_v.shape[0]
        ids_v.copy_(input_ids.detach().reshape(-1))
        hid_v.copy_(hidden.detach())
        h = hid_v.shape[1]
        for i, a in enumerate(aux):
            aux_v[:, i * h : (i + 1) * h].copy_(a.detach().reshape(total, h))

    def _ensure_workers(self) -> None:
        if self._pid != os.getpid():
            raise RuntimeError("DumpWriter used across fork; create it in the child (get_writer)")
        if self._workers:
            return
        t = threading.Thread(target=self._copier, name="hsextract-d2h", daemon=True)
        t.start()
        self._workers.append(t)
        for i in range(self.threads):
            t = threading.Thread(target=self._worker, name=f"hsextract-dump-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def _stop_workers(self) -> None:
        if self._pid != os.getpid():
            return
        self._copies.put(None)
        for _ in self._workers[1:]:
            self._tasks.put(None)
        for t in self._workers:
            t.join()
        self._workers = []

    def _copier(self) -> None:
        """Issue each pass's D2H copies on a side stream, a few chunks at a time.

        Why paced: device-to-host copies from every stream go through the same copy
        engine.  Were a whole pass (~470 MB, ~8.5 ms) queued at once, the forward's own
        small D2H at the end of the next step (sampling's ``.tolist()``) would wait behind
        it, stalling the whole TP group.  With at most ``d2h_inflight`` chunks of
        ``d2h_chunk_mb`` queued, it waits for at most that much (~0.6 ms at the defaults).
        The pass's pieces go to the writer threads once all its copies have completed.
        """
        while True:
            job = self._copies.get()
            if job is None:
                return
            batch, pieces, (device, ready, copies) = job
            side: torch.cuda.Stream | None = None
            try:
                # inference_mode: the staging views may have been made under the caller's
                # inference mode, and grad mode is per thread.
                with torch.cuda.device(device), torch.inference_mode():
                    side = self._side_stream(device)
                    side.wait_event(ready)
                    queued: collections.deque[torch.cuda.Event] = collections.deque()
                    with torch.cuda.stream(side):
                        for dst, src in copies:
                            dst.copy_(src, non_blocking=True)
                            if self.d2h_inflight:
                                ev = torch.cuda.Event(blocking=True)
                                ev.record(side)
                                queued.append(ev)
                                if len(queued) >= self.d2h_inflight:
                                    queued.popleft().synchronize()
                    done = torch.cuda.Event(blocking=True)  # sleep, don't spin, on the rest
                    done.record(side)
                    done.synchronize()
            except BaseException as exc:  # handed to the caller, never dropped
                batch.failed = True
                with self._cv:
                    if self._error is None:
                        self._error = exc
                        self._error_where = f"the D2H copy of {len(pieces)} piece(s)"
                if side is not None:  # don't free snapshots a copy may still read
                    try:
                        side.synchronize()
                    except BaseException:
                        pass
            # Copies complete: the snapshots may go back to the allocator, from this thread.
            dst = src = None
            del copies, job
            for rid, start, row0, n in pieces:
                self._tasks.put((batch, rid, start, row0, n))

    def _worker(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            batch, rid, start, row0, n = task
            try:
                if not batch.failed:
                    self._write_piece(batch, rid, start, row0, n)
            except BaseException as exc:  # handed to the caller, never dropped
                with self._cv:
                    if self._error is None:
                        self._error = exc
                        self._error_where = f"{rid}/{piece_name(start)}"
            finally:
                release = False
                with self._cv:
                    batch.remaining -= 1
                    release = batch.remaining == 0
                    self._pending -= 1
                    if self._pending == 0:
                        self._cv.notify_all()
                if release:
                    self._free.put(batch.slot)

    def _write_piece(self, b: _Batch, rid: str, start: int, row0: int, n: int) -> None:
        # A request the client abandoned (timed out, aborted) may still be in this pass:
        # its pieces would sit in /dev/shm, outside every budget, forever.
        tomb = os.path.join(self._dir, ABANDONED_DIR, rid)
        if os.path.lexists(tomb):
            return
        rdir = os.path.join(self._dir, rid)
        try:
            os.mkdir(rdir, 0o700)
        except FileExistsError:
            if not os.path.isdir(rdir) or os.path.islink(rdir):
                raise
        ids_nb = n * 8
        hid_row = b.hidden_size * b.elem
        aux_row = b.aux_width * b.elem
        hid_nb = n * hid_row
        aux_nb = n * aux_row
        header = {
            "input_ids": {"dtype": "I64", "shape": [n], "data_offsets": [0, ids_nb]},
            "hidden_states": {
                "dtype": b.dtype_name,
                "shape": [n, b.hidden_size],
                "data_offsets": [ids_nb, ids_nb + hid_nb],
            },
            "aux_hidden_states": {
                "dtype": b.dtype_name,
                "shape": [n, b.aux_width],
                "data_offsets": [ids_nb + hid_nb, ids_nb + hid_nb + aux_nb],
            },
            "__metadata__": {
                "rid": rid,
                "start": str(start),
                "n": str(n),
                "aux_layers": b.layers_json,
            },
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-aligned, as safetensors writes it
        view = b.slot.view
        assert view is not None
        bufs = [
            struct.pack("<Q", len(raw)) + raw,
            view[row0 * 8 : row0 * 8 + ids_nb],
            view[b.off_hidden + row0 * hid_row : b.off_hidden + row0 * hid_row + hid_nb],
            view[b.off_aux + row0 * aux_row : b.off_aux + row0 * aux_row + aux_nb],
        ]
        final = os.path.join(rdir, piece_name(start))
        tmp = os.path.join(rdir, f".{start:09d}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                _writev_all(fd, bufs)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            if os.path.lexists(tomb):  # abandoned while we wrote: the client's sweep is done
                os.unlink(final)
                try:
                    os.rmdir(rdir)
                except OSError:
                    pass
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _chunks(
    dst: torch.Tensor, src: torch.Tensor, writer: DumpWriter
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a D2H copy of ``src`` into pinned ``dst`` into row blocks of ~d2h_chunk_mb."""
    rows = src.shape[0]
    row_bytes = max(1, src[0].numel() * src.element_size()) if rows else 1
    chunk = writer.d2h_chunk_bytes
    step = max(rows, 1) if chunk <= 0 else max(1, chunk // row_bytes)
    return [(dst[r0 : r0 + step], src[r0 : r0 + step]) for r0 in range(0, rows, step)]


def _writev_all(fd: int, bufs: list) -> None:
    """``os.writev`` until every byte is out (tmpfs may take large writes in parts)."""
    pending = [memoryview(b).cast("B") for b in bufs if len(b)]
    while pending:
        written = os.writev(fd, pending)
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if pending and written:
            pending[0] = pending[0][written:]


def _close_at_exit(ref: weakref.ref[DumpWriter]) -> None:
    # Daemon writer threads die at exit; finish what was handed over first, and say so if
    # that fails (there is no caller left to raise to).
    writer = ref()
    if writer is None or writer._pid != os.getpid():
        return
    try:
        writer.close()
    except Exception as exc:
        import sys

        print(f"hsextract.capture: {exc!r}", file=sys.stderr)


_WRITER: DumpWriter | None = None
_WRITER_DIR: str | None = None
_WRITER_PID: int | None = None


def get_writer(
    dump_dir: str | None = None, aux_layers: Sequence[int] | None = None
) -> DumpWriter | None:
    """The process-wide writer, or None when capture is off.

    The dump dir is ``dump_dir`` when given (``capture: hooks`` passes it in the hooks'
    config), else ``SGLANG_HS_DUMP_DIR`` (the patch and the reference engine); unset, capture
    is off.  Aux layers likewise: given, else ``HSEXTRACT_AUX_LAYERS``.
    """
    global _WRITER, _WRITER_DIR, _WRITER_PID
    d = dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not d:
        return None
    if _WRITER is None or _WRITER_DIR != d or _WRITER_PID != os.getpid():
        if aux_layers is None:
            layers_env = os.environ.get(AUX_LAYERS_ENV)
            aux_layers = json.loads(layers_env) if layers_env else None
        if _WRITER is not None and _WRITER_PID == os.getpid():
            _WRITER.close()
        _WRITER = DumpWriter(d, aux_layers)
        _WRITER_DIR = d
        _WRITER_PID = os.getpid()
    return _WRITER
