"""The extraction client: drive one chunk through the server and assemble its file.

Several requests in flight (the server batches them); after each response the client
waits until the request's dump pieces cover ``[0, len)`` exactly once (an async writer may
land them after the response), checks token parity with what it sent and that every value
is finite, writes the rows into the chunk file at their final offsets, and deletes the
pieces.  Bytes in flight in the dump dir stay under ``dump.shm_budget_gb``.

Transient failures (connection refused/reset, HTTP 5xx, timeouts, a restarting server) are
retried with backoff, re-ensuring the server each time.  Permanent ones (a coverage gap
after the request completed, a parity mismatch, a corrupt piece, a 4xx) fail the chunk at
once with the evidence: chunk, record id, rid, ranges, file.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import itertools
import json
import logging
import math
import os
import queue
import select
import shutil
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from hsextract.capture import ABANDONED_DIR, PIECE_SUFFIX
from hsextract.errors import HsextractError
from hsextract.stats import SAMPLE_EVERY, LayerStats, layer_names

if TYPE_CHECKING:
    from hsextract.config import Config
    from hsextract.status import ProgressFile

log = logging.getLogger("hsextract")


class ExtractionError(HsextractError):
    """A chunk could not be extracted; the message names the chunk, record and cause."""


class TransientError(Exception):
    """Worth retrying: the server may come back."""


@dataclass(frozen=True)
class Geometry:
    """What the model produces per token; read from the model's config.json."""

    hidden_size: int
    num_layers: int
    aux_layers: list[int]
    dtype: torch.dtype

    @property
    def dump_bytes_per_token(self) -> int:
        from hsextract.budget import dump_bytes_per_token

        return dump_bytes_per_token(self.hidden_size, len(self.aux_layers), self.dtype)

    def dump_bytes(self, n_tokens: int, chunked_prefill_size: int) -> int:
        """What one request of n tokens may hold in the dump dir (pieces with headers)."""
        from hsextract.budget import dump_bytes_for_request

        return dump_bytes_for_request(
            n_tokens, self.hidden_size, len(self.aux_layers), self.dtype, chunked_prefill_size
        )


def model_geometry(cfg: Config) -> Geometry:
    from hsextract.config import captured_layers, read_model_config
    from hsextract.engine import DTYPES

    try:
        mcfg = read_model_config(cfg)
    except (OSError, ValueError) as exc:
        raise ExtractionError(
            f"cannot read the model config in {cfg.model.path}: {exc} (model.path)"
        ) from exc
    layers = int(mcfg["num_hidden_layers"])
    return Geometry(
        hidden_size=int(mcfg["hidden_size"]),
        num_layers=layers,
        aux_layers=captured_layers(cfg, layers),
        dtype=DTYPES[cfg.model.dtype],
    )


def read_pieces(rid_dir: Path, length: int, timeout_s: float) -> list[dict]:
    """Wait until the pieces of a request cover [0, length) exactly once; open them.

    Each piece is opened and its header parsed once, when it first appears (the writer
    renames a piece into place whole, so what is visible is complete); polls only look
    for new names.  The piece stays open (its fd keeps the bytes even once the file is
    unlinked) and only its small ids tensor is read: the hidden and aux rows never enter
    Python memory whole.  ``assemble`` checks them a slice at a time in a reused buffer
    and, uncompressed, writes each checked slice into the chunk file from there
    (``ChunkWriter.row_sink``; bench/pack.py: copies into fresh memory and their page
    faults cost more than the copy itself).
    A poll is one ``listdir`` (no pathlib glob: its Python held the job's GIL).
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    opened: dict[str, dict] = {}
    try:
        while True:
            try:
                names = sorted(
                    n for n in os.listdir(rid_dir) if n.endswith(PIECE_SUFFIX) and n[0] != "."
                )
            except (FileNotFoundError, NotADirectoryError):
                names = []
            for name in names:
                if name not in opened:
                    try:
                        start = int(name.removesuffix(PIECE_SUFFIX))
                    except ValueError:
                        raise ExtractionError(
                            f"unexpected file {rid_dir / name} in the dump dir"
                        ) from None
                    opened[name] = _open_piece(rid_dir / name, start, opened)
            pieces = sorted(opened.values(), key=lambda p: p["start"])
            covered, problem = _coverage(rid_dir.name, pieces, length)
            if problem:
                raise ExtractionError(problem)
            if covered:
                return pieces
            if time.monotonic() > deadline:
                have = [(p["start"], p["start"] + p["n"]) for p in pieces]
                raise ExtractionError(
                    f"dump pieces of {rid_dir.name} cover {have} after the request completed, "
                    f"not [0, {length}) (waited {timeout_s:.0f}s, client.piece_timeout_s): "
                    "the server dropped part of the prefill"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    except BaseException:
        close_pieces(list(opened.values()))
        raise


def _open_piece(path: Path, start: int, opened: dict[str, dict]) -> dict:
    """Open one piece, check its header against the file, read its ids."""
    piece: dict = {"start": start, "path": path, "fd": -1}
    opened[path.name] = piece  # registered first, so a failure below still closes its fd
    try:
        fd = piece["fd"] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        meta, lay = _piece_layout(fd)
        dtype, shape, offset, _ = lay["input_ids"]
        ids = torch.empty(shape, dtype=dtype)
        _pread_into(fd, ids, offset)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise ExtractionError(f"corrupt dump piece {path}: {exc}") from exc
        raise ExtractionError(
            f"cannot open dump piece {path}: {exc} (a request's pieces stay open until "
            "its rows are copied: raise the open-files limit, ulimit -n)"
        ) from exc
    except Exception as exc:
        raise ExtractionError(
            f"corrupt dump piece {path}: unreadable ({type(exc).__name__}: {str(exc)[:200]}; "
            f"{_size(path)})"
        ) from exc
    piece.update(meta=meta, layout=lay, input_ids=ids, n=int(ids.shape[0]))
    return piece


def close_pieces(pieces: list[dict]) -> None:
    for p in pieces:
        fd = p.pop("fd", -1)
        if fd >= 0:
            os.close(fd)


_PIECE_KEYS = ("input_ids", "hidden_states", "aux_hidden_states")
_PIECE_DTYPES = {
    "I64": torch.int64,
    "I32": torch.int32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}


def _piece_layout(fd: int) -> tuple[dict, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """A piece's metadata and, per tensor, (dtype, shape, file offset, nbytes), all checked
    against the file's size (the safetensors layout that ``hsextract.capture`` writes)."""
    size = os.fstat(fd).st_size
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    if size < 8 or not 2 <= n <= size - 8:
        raise ValueError(f"header length {n} does not fit the file's {size} bytes")
    header = json.loads(os.pread(fd, n, 8))
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for key in _PIECE_KEYS:
        spec = header[key]
        dtype = _PIECE_DTYPES[spec["dtype"]]
        shape = [int(d) for d in spec["shape"]]
        a, b = (int(x) for x in spec["data_offsets"])
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if len(shape) != (1 if key == "input_ids" else 2) or b - a != nbytes or a < 0:
            raise ValueError(f"{key}: shape {shape} {spec['dtype']} vs data_offsets {[a, b]}")
        if 8 + n + b > size:
            raise ValueError(f"{key} runs past the end of the file ({size} bytes)")
        out[key] = (dtype, shape, 8 + n + a, nbytes)
    return meta, out


def _pread_into(fd: int, t: torch.Tensor, offset: int) -> None:
    view = memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
    _pread_full(fd, view, offset)


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset``: one ``preadv`` unless the read comes short."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise ValueError(f"file ends at {offset}")
        view, offset = view[n:], offset + n


def _size(path: Path) -> str:
    try:
        return f"{path.stat().st_size} bytes"
    except OSError as exc:
        return f"size unknown: {exc}"


def _coverage(rid: str, pieces: list[dict], length: int) -> tuple[bool, str | None]:
    """(complete?, problem) over the pieces present, by start; overlap is a problem, a gap
    is 'wait'."""
    pos = 0
    for p in pieces:
        if p["start"] < pos:
            return False, f"dump pieces of {rid} overlap at token {p['start']} (< {pos})"
        if p["start"] > pos:
            return False, None
        pos = p["start"] + p["n"]
    if pos > length:
        return False, f"dump pieces of {rid} run to token {pos}, past the request's {length}"
    return pos == length, None


@dataclass
class Dump:
    """A request's checked dump: ids in memory, hidden and aux rows still in the piece files.

    ``hidden`` and ``aux`` are ``(fd, offset, nbytes, path)`` byte ranges, in row order,
    read by ``ChunkWriter.put_files`` (unless the rows went to the chunk file already, as
    they were checked: ``assemble``'s ``rows_to``).  The fds stay valid after the files
    are unlinked; ``close`` (or ``with``) releases them, and with them the /dev/shm pages.
    """

    ids: torch.Tensor
    hidden: list[tuple[int, int, int, str]]
    aux: list[tuple[int, int, int, str]]
    dtype: torch.dtype
    hidden_shape: tuple[int, int]
    aux_shape: tuple[int, int]
    pieces: list[dict]
    stats: LayerStats | None = None
    #: Where the values are checked: ``assemble`` (True), or the chunk writer's encoder,
    #: which reads every row anyway (False: ``check_rows``, given to ``put_files``).
    checked: bool = True
    n_aux: int = 0
    where: str = ""

    def check_rows(self, tensor: int, r0: int, rows: torch.Tensor) -> None:
        """The finiteness check and statistics of ``rows`` [n, cols], rows ``r0..`` of the
        record's hidden (``tensor`` 0) or aux (1) rows, as an encoder reads them
        (``ChunkWriter.put_files``'s ``check``).

        Why here and not in ``assemble``: with a codec the encoder reads each row into its
        frame buffer, so checking that buffer saves reading the record once more (issue
        40: ~1.5 ms of CPU a 5.5 MB request).  A failure raises, and fails the chunk as a
        failed check in ``assemble`` does (a non-finite value is never retried).  The
        sampled rows are the record's every ``SAMPLE_EVERY``-th, whatever the framing."""
        if not _values_ok(rows, tensor, self.stats, self.n_aux, skip=-r0 % SAMPLE_EVERY):
            raise ExtractionError(
                f"{self.where}: non-finite values in the dumped hidden states "
                f"({'aux' if tensor else 'hidden'} rows {r0}-{r0 + rows.shape[0] - 1}; "
                "permanent, not retried)"
            )

    def close(self) -> None:
        close_pieces(self.pieces)

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, hidden, aux) read into memory (for callers that want the values)."""
        out = []
        for ranges, shape in ((self.hidden, self.hidden_shape), (self.aux, self.aux_shape)):
            t = torch.empty(shape, dtype=self.dtype)
            flat, pos = t.view(-1).view(torch.uint8), 0
            for fd, offset, nbytes, _ in ranges:
                _pread_into(fd, flat[pos : pos + nbytes], offset)
                pos += nbytes
            out.append(t)
        return self.ids, out[0], out[1]


#: Where checked rows go as they are read: ``(tensor, at, data)`` with tensor 0 the hidden
#: rows and 1 the aux rows, ``at`` the byte offset of ``data`` in the record's rows of that
#: tensor (``ChunkWriter.row_sink``).
RowSink = Callable[[int, int, memoryview], None]


def assemble(
    pieces: list[dict],
    sent: list[int],
    geo: Geometry,
    where: str,
    rows_to: RowSink | None = None,
    check_values: bool = True,
) -> Dump:
    """Check parity with the sent ids, shapes, dtype, aux layers and finiteness of a
    request's pieces (from ``read_pieces``); on failure the pieces are closed.

    With ``rows_to``, each slice of rows goes there once it is checked, from the buffer
    the check read it into: the rows are read once, not once to check and once more to
    copy them into the chunk file (issue 40: the second read was ~0.5 ms of CPU and a
    dozen GIL round trips a 4 MB request).  A check that fails after some slices went
    there fails the whole chunk (its file is a temporary one, removed).

    With ``check_values`` False the values (finiteness, statistics) are left to the
    encoder that reads the rows next: the Dump's ``check_rows``, for ``put_files``."""
    if rows_to is not None and not check_values:
        raise ValueError("rows go to rows_to as they are checked: check_values must be True")
    try:
        return _assemble(pieces, sent, geo, where, rows_to, check_values)
    except BaseException:
        close_pieces(pieces)
        raise


def _assemble(
    pieces: list[dict],
    sent: list[int],
    geo: Geometry,
    where: str,
    rows_to: RowSink | None,
    check_values: bool,
) -> Dump:
    parts = [p["input_ids"] for p in pieces]
    ids = parts[0] if len(parts) == 1 else torch.cat(parts)
    sent_t = torch.tensor(sent, dtype=ids.dtype)
    if ids.shape != sent_t.shape or not torch.equal(ids, sent_t):
        bad = (ids != sent_t).nonzero()[:5].flatten().tolist() if ids.shape == sent_t.shape else []
        raise ExtractionError(
            f"{where}: token parity broken: dumped ids differ from the ids sent "
            f"(len {ids.shape[0]} vs {len(sent)}, first differing positions {bad})"
        )
    k = len(geo.aux_layers)
    want = {"hidden_states": geo.hidden_size, "aux_hidden_states": k * geo.hidden_size}
    shapes = {}
    for key in want:
        cols = {p["layout"][key][1][1] for p in pieces}
        rows = sum(p["layout"][key][1][0] for p in pieces)
        shapes[key] = (rows, cols.pop() if len(cols) == 1 else sorted(cols))
    rows_ok = all(p["layout"][key][1][0] == p["input_ids"].shape[0] for p in pieces for key in want)
    if not rows_ok or any(shapes[key] != (len(sent), want[key]) for key in want):
        raise ExtractionError(
            f"{where}: dumped shapes hidden {shapes['hidden_states']} aux "
            f"{shapes['aux_hidden_states']}, expected [{len(sent)}, {geo.hidden_size}] and "
            f"[{len(sent)}, {k * geo.hidden_size}]"
        )
    layers = {p["meta"].get("aux_layers") for p in pieces}
    if layers != {json.dumps(geo.aux_layers)}:
        raise ExtractionError(
            f"{where}: server captured aux layers {layers}, expected {geo.aux_layers}"
        )
    dtypes = {p["layout"][key][0] for p in pieces for key in want}
    if dtypes != {geo.dtype}:
        raise ExtractionError(
            f"{where}: dumped dtype {', '.join(sorted(map(str, dtypes)))}, expected "
            f"{geo.dtype} (model.dtype)"
        )
    stats = LayerStats(layer_names(geo.aux_layers, geo.num_layers))
    at = [0, 0]  # bytes of hidden and aux rows of the pieces before this one
    for p in pieces if check_values else ():
        if not _piece_finite(p, want, stats, k, rows_to, (at[0], at[1])):
            raise ExtractionError(f"{where}: non-finite values in the dumped hidden states")
        at[0] += p["layout"]["hidden_states"][3]
        at[1] += p["layout"]["aux_hidden_states"][3]
    ranges = {
        key: [(p["fd"], *p["layout"][key][2:], str(p["path"])) for p in pieces] for key in want
    }
    return Dump(
        ids=ids,
        hidden=ranges["hidden_states"],
        aux=ranges["aux_hidden_states"],
        dtype=geo.dtype,
        hidden_shape=shapes["hidden_states"],
        aux_shape=shapes["aux_hidden_states"],
        pieces=pieces,
        stats=stats,
        checked=check_values,
        n_aux=k,
        where=where,
    )


#: Bytes of rows a finiteness check reads at a time (``_piece_finite``).
CHECK_SLICE_BYTES = 4 << 20
#: Check buffers not in use, reused from request to request (allocated as needed).
_CHECK_BUFFERS: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
#: At most this many checks at once per process: each holds a buffer, and they are
#: CPU-bound, so more than the cores would only hold more memory.
_CHECK_SLOTS = threading.BoundedSemaphore(max(2, os.cpu_count() or 2))


def _piece_finite(
    piece: dict,
    keys: Iterable[str],
    stats: LayerStats | None = None,
    k: int = 0,
    rows_to: RowSink | None = None,
    at: tuple[int, int] = (0, 0),
) -> bool:
    """Are the piece's float tensors all finite?  On the way, the sampled activation
    statistics (:mod:`hsextract.stats`) of its layers.

    Read ``CHECK_SLICE_BYTES`` of rows at a time into a buffer reused across requests,
    not mapped: unmapping a mapping holds the GIL (CPython's ``mmap.close``), and a
    mapping's page faults and its teardown's TLB shootdowns in a process of many threads
    cost more than the copy (issue 40: ~0.6 ms a 4 MB request, the sender threads of the
    job stalled meanwhile).  ``preadv`` and the torch reductions release the GIL.  Slices
    start at a multiple of the statistics' sampling step, so they sample the same rows.

    A checked slice goes to ``rows_to`` (``assemble``), ``at`` the byte offsets of this
    piece's hidden and aux rows in the record's."""
    fd = piece["fd"]
    with _CHECK_SLOTS:
        try:
            buf = _CHECK_BUFFERS.get_nowait()
        except queue.Empty:
            buf = torch.empty(CHECK_SLICE_BYTES, dtype=torch.uint8)
        try:
            for key in keys:
                dtype, shape, offset, nbytes = piece["layout"][key]
                if not nbytes:
                    continue
                rows, cols = shape
                row_bytes = nbytes // rows
                step = max(1, CHECK_SLICE_BYTES // row_bytes // SAMPLE_EVERY) * SAMPLE_EVERY
                if step * row_bytes > buf.numel():  # rows wider than a slice
                    buf = torch.empty(step * row_bytes, dtype=torch.uint8)
                mem = memoryview(buf.numpy())
                aux = key == "aux_hidden_states"
                tensor = 1 if aux else 0
                for r0 in range(0, rows, step):
                    n = min(step, rows - r0)
                    view = mem[: n * row_bytes]
                    _pread_full(fd, view, offset + r0 * row_bytes)
                    t = buf[: n * row_bytes].view(dtype).view(n, cols)
                    if not _values_ok(t, tensor, stats, k):
                        return False
                    if rows_to is not None:
                        rows_to(tensor, at[tensor] + r0 * row_bytes, view)
        finally:
            _CHECK_BUFFERS.put(buf)
    return True


def one_thread_per_op() -> None:
    """Run this process's torch ops on one thread each: the chunk job's parallelism is its
    sender threads (``requests_in_flight`` x dp of them).  Each thread that runs a parallel
    torch op gets an OpenMP team of its own, ``torch.get_num_threads()`` (the cores) wide,
    kept while the thread lives: at dp 8 on a 16-core node the client ceiling bench died
    of it ("libgomp: Thread creation failed"), and a 128-core node would ask for ~16k
    threads a job."""
    torch.set_num_threads(1)


def _values_ok(
    rows: torch.Tensor, tensor: int, stats: LayerStats | None, k: int, skip: int = 0
) -> bool:
    """Are ``rows`` (of the hidden rows, ``tensor`` 0, or the aux rows, 1) all finite?  If
    so, their sampled statistics go to ``stats``, sampling from row ``skip`` on (so that
    the record's every ``SAMPLE_EVERY``-th row is taken whatever slice these rows are)."""
    if not _all_finite(rows):
        return False
    if stats is not None:
        stats.add_rows(k if tensor == 0 else 0, rows[skip:], 1 if tensor == 0 else k)
    return True


def _all_finite(t: torch.Tensor) -> bool:
    """Exact, and fast: an inf or nan makes the sum inf or nan, so a finite sum proves every
    element finite (bf16 ``sum`` runs ~50x faster than ``isfinite().all()`` on CPU); only an
    overflowing sum of finite values takes the elementwise check."""
    if math.isfinite(t.sum().item()):
        return True
    return bool(torch.isfinite(t).all())


def _remove_request_dir(rid_dir: Path) -> None:
    """Unlink a request's pieces and remove its dir.  The usual case, a dir of pieces, is
    a listdir, an unlink each and a rmdir (``shutil.rmtree``'s Python walk held the job's
    GIL); anything else in it (a subdir, a piece landing meanwhile) goes to rmtree."""
    try:
        names = os.listdir(rid_dir)
    except FileNotFoundError:
        return
    except OSError:
        shutil.rmtree(rid_dir, ignore_errors=True)
        return
    try:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(rid_dir, name))
        os.rmdir(rid_dir)
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(rid_dir, ignore_errors=True)


def _text(data: bytes, n: int) -> str:
    return data[: 4 * n].decode("utf-8", "replace")[:n]


def _direct_ok(url: str, trust_env: bool) -> bool:
    """Whether POSTs to ``url`` may skip requests: plain http, and nothing requests would
    take from the environment applies (a proxy for that host, .netrc credentials; read
    once per server, where requests reads them on every request)."""
    if not url.startswith("http://"):
        return False
    if not trust_env:
        return True
    from requests.utils import get_environ_proxies, get_netrc_auth

    return not get_environ_proxies(url) and get_netrc_auth(url) is None


class _DirectHttp:
    """POSTs over one kept-alive ``http.client`` connection per sender thread.

    Why: a chunk job's sender threads share one GIL, so the Python a request costs bounds
    the job's request rate; requests and urllib3 (request preparation, hooks, adapters,
    the pool's bookkeeping, header objects) were the largest share of it (issue 40,
    bench/client_ceiling.py).  Request line, headers and body go out in one send.  A
    connection the server closed while idle (a restart, its keep-alive timeout) is
    noticed before reuse and reopened; any failure to get a whole answer drops the
    connection and is a ``TransientError``, as requests' connection errors were.
    """

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = {"Content-Type": "application/json", **headers}
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _conn(self, url: str, timeout: float) -> http.client.HTTPConnection:
        loc = self._local
        conn = getattr(loc, "conn", None)
        if conn is not None and (loc.url != url or _dropped(conn)):
            conn.close()
            conn = None
        if conn is None:
            parts = urllib.parse.urlsplit(url)
            conn = http.client.HTTPConnection(
                parts.hostname or "", parts.port or 80, timeout=timeout
            )
            loc.conn, loc.url, loc.base = conn, url, parts.path.rstrip("/")
            with self._lock:
                self._all.append(conn)
        # The timeout of this request, not the one the connection was opened with: a
        # retry after ensure() may be given a longer one (a kept-alive socket, a reconnect).
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def post(self, url: str, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        """POST ``body``; ``timeout``: seconds for the connection and for the answer."""
        conn = self._conn(url, timeout)
        reused = conn.sock is not None
        try:
            try:
                conn.request("POST", self._local.base + path, body, self.headers)
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused:
                    raise
                # The server closed the kept-alive connection as the request went out (its
                # idle timeout): it never read it.  Once more on a new connection; a server
                # that died refuses that one, a transient error as before.
                conn.close()
                conn.request("POST", self._local.base + path, body, self.headers)
                resp = conn.getresponse()
            data = resp.read()
        except TimeoutError as exc:
            conn.close()
            raise TransientError(
                f"no answer within {timeout:.0f}s (client.request_timeout_s)"
            ) from exc
        except http.client.IncompleteRead as exc:
            # The headers came and the body did not: the server died mid-answer (another
            # request killed it, an OOM).  As transient as a refused connection.
            conn.close()
            raise TransientError(f"connection failed mid-answer: {exc!r}") from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransientError(f"connection failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            conn.close()  # a half-sent request leaves the connection unusable
            raise
        if resp.will_close:
            conn.close()  # the next request reconnects (http.client does on a closed one)
        return resp.status, data

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection was closed by the server: readable with no
    request under way means EOF (or garbage).  ``poll``, not ``select``: a chunk job holds
    many piece fds, and a socket's number may be past select's 1024."""
    sock = conn.sock
    if sock is None:
        return False
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(p.poll(0))


class Client:
    """One chunk's worth of requests against a server described by its live state."""

    def __init__(self, cfg: Config, geo: Geometry, ensure: Callable[[], dict]) -> None:
        import requests

        self.cfg = cfg
        self.geo = geo
        self.ensure = ensure
        t = time.monotonic()
        self.state = ensure()  # waits for a server still loading (launch_server did not)
        #: Seconds this job waited for a healthy server before its first request.
        self.waited_for_server = time.monotonic() - t
        self.session = requests.Session()
        # A connection per request in flight: requests keeps 10 per host and drops the rest
        # after use, so at 16 in flight (the 8B config) every request past the tenth opened
        # a new one ("Connection pool is full, discarding connection" in the live race).
        from requests.adapters import HTTPAdapter

        from hsextract.dp import requests_in_flight

        pool = HTTPAdapter(pool_connections=1, pool_maxsize=max(10, requests_in_flight(cfg)))
        self.session.mount("http://", pool)
        self.session.mount("https://", pool)
        from hsextract.config import is_loopback

        # requests reads the proxy variables on every request (2.6 ms of a 7.5 ms POST in
        # bench/client_ceiling.py's profile), and with http_proxy set and no no_proxy it
        # would send a loopback request to the proxy: a loopback server never needs one.
        self.session.trust_env = not is_loopback(cfg.server.host)
        if cfg.server.api_key:
            self.session.headers["Authorization"] = f"Bearer {cfg.server.api_key}"
        self.timeout = float(cfg.client.request_timeout_s)
        auth = {"Authorization": f"Bearer {cfg.server.api_key}"} if cfg.server.api_key else {}
        self._http = _DirectHttp(auth)
        #: Per server url: whether its POSTs may take the direct path (``_direct_ok``).
        self._direct: dict[str, bool] = {}
        self.piece_timeout = float(cfg.client.piece_timeout_s)
        self.retries = cfg.client.retries
        self.backoff = float(cfg.client.backoff_s)
        self.dump_dir = Path(self.state["spec"]["dump_dir"])
        self._lock = threading.Lock()
        #: Set when the chunk has failed: no new attempts, no retries.
        self.stop = threading.Event()
        #: rids given up on (aborted, tombstoned, swept).
        self.abandoned: list[str] = []
        #: Wall clock of the latest response (the server done with a request), or None.
        self.last_response_at: float | None = None
        #: Seconds summed over requests from the POST to its answer, and from the answer
        #: to its pieces all on /dev/shm and opened (the server's writers may lag).
        self.answer_wait, self.pieces_wait = Occupancy(), Occupancy()

    def _post(self, rid: str, ids: list[int]) -> dict:
        body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        status, data = self._post_json(self.state["url"], "/generate", body)
        if status >= 500:
            raise TransientError(f"HTTP {status}: {_text(data, 200)}")
        if status != 200:
            hint = " (server.api_key must match the server's key)" if status in (401, 403) else ""
            raise ExtractionError(
                f"server refused the request: HTTP {status}: {_text(data, 300)}{hint}"
            )
        out = orjson.loads(data)
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            # Someone (an operator, the server under memory pressure) aborted it: its
            # pieces are incomplete; a new attempt starts over under a new rid.
            raise TransientError(f"the server aborted the request: {reason}")
        return out

    def _post_json(self, url: str, path: str, body: dict) -> tuple[int, bytes]:
        """(status, body) of a POST; a failure to get an answer is a ``TransientError``.

        Plain http with nothing from the environment to apply goes over this thread's own
        kept-alive connection (``_DirectHttp``); anything else (https, a proxy, .netrc
        credentials: what requests takes from the environment when ``trust_env``) through
        the requests session, as before."""
        direct = self._direct.get(url)
        if direct is None:
            direct = self._direct[url] = _direct_ok(url, self.session.trust_env)
        if direct:
            return self._http.post(url, path, orjson.dumps(body), self.timeout)
        import requests

        try:
            resp = self.session.post(f"{url}{path}", json=body, timeout=self.timeout)
        except requests.Timeout as exc:
            raise TransientError(
                f"no answer within {self.timeout:.0f}s (client.request_timeout_s)"
            ) from exc
        except requests.ConnectionError as exc:
            raise TransientError(f"connection failed: {exc}") from exc
        except (
            requests.exceptions.ChunkedEncodingError,
            requests.exceptions.ContentDecodingError,
        ) as exc:
            # The headers came and the body did not: the server died mid-answer (another
            # request killed it, an OOM).  As transient as a refused connection.
            raise TransientError(f"connection failed mid-answer: {exc}") from exc
        return resp.status_code, resp.content

    def close(self) -> None:
        """Close the sender threads' connections (once no request is under way)."""
        self._http.close()
        self.session.close()

    def extract(self, rid_prefix: str, record_id: str, ids: list[int]) -> tuple[torch.Tensor, ...]:
        """(ids, hidden, aux) of one request, read into memory."""
        with self.extract_dump(rid_prefix, record_id, ids) as dump:
            return dump.tensors()

    def extract_dump(
        self,
        rid_prefix: str,
        record_id: str,
        ids: list[int],
        rows_to: RowSink | None = None,
        check_values: bool = True,
    ) -> Dump:
        """One request, checked; its pieces are unlinked, their bytes held by the ``Dump``
        until it is closed (the caller closes it, after ``ChunkWriter.put_files``).  With
        ``rows_to`` its rows go there as they are checked; without ``check_values`` the
        values are checked by the encoder that reads them (``assemble``)."""
        where = f"record {record_id!r}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            rid = f"{rid_prefix}-{uuid.uuid4().hex[:8]}"
            rid_dir = self.dump_dir / rid
            try:
                posted = time.monotonic()
                self._post(rid, ids)
                answered = time.monotonic()
                self.answer_wait.add(answered - posted)
                self.last_response_at = max(self.last_response_at or 0.0, time.time())
                pieces = read_pieces(rid_dir, len(ids), self.piece_timeout)
                self.pieces_wait.add(time.monotonic() - answered)
                return assemble(
                    pieces, ids, self.geo, f"{where} (rid {rid})", rows_to, check_values
                )
            except TransientError as exc:
                last = exc
                # The server may still be prefilling it: stop it, and make sure no piece
                # of it outlives this attempt (see abandon).
                self.abandon(rid)
                if attempt == self.retries or self.stop.is_set():
                    break
                delay = self.backoff * 2**attempt
                log.warning(
                    "%s (rid %s): %s; retry %d/%d in %.1fs (client.retries, client.backoff_s)",
                    where, rid, exc, attempt + 1, self.retries, delay,
                )  # fmt: skip
                time.sleep(delay)
                with self._lock:  # one relaunch for all threads, under ensure()'s file lock
                    self.state = self.ensure()
                    self.dump_dir = Path(self.state["spec"]["dump_dir"])
            except ExtractionError as exc:
                msg, prefix = str(exc), f"{where} (rid {rid})"
                msg = msg if msg.startswith(prefix) else f"{prefix}: {msg}"
                raise ExtractionError(
                    f"{msg} (permanent, not retried; server log: {self._server_log()})"
                ) from None
            finally:
                _remove_request_dir(rid_dir)
        raise ExtractionError(
            f"{where}: gave up after {self.retries + 1} attempts (client.retries="
            f"{self.retries}): {last}. Check the server log {self._server_log()}, then rerun "
            "(finished chunks are kept)"
        )

    def abandon(self, rid: str) -> None:
        """Give up on a request: abort it on the server, tombstone it, sweep its pieces.

        A timed-out request keeps running on the server unless aborted (SGLang's
        ``/abort_request``; the reference engine has the same), and a pass already under
        way still hands its pieces to the writer.  So the tombstone: the capture code
        writes no piece for a tombstoned rid and removes one it renamed into place as the
        tombstone appeared (``hsextract.capture``), so after this sweep no byte of the rid
        is left, whatever the server does next.  Tombstones go when the server stops.
        """
        import requests

        try:
            self.session.post(f"{self.state['url']}/abort_request", json={"rid": rid}, timeout=5.0)
        except requests.RequestException as exc:
            log.info("abort of %s not acknowledged (%s); its tombstone stands", rid, exc)
        tombs = self.dump_dir / ABANDONED_DIR
        tombs.mkdir(mode=0o700, exist_ok=True)
        (tombs / rid).touch()
        shutil.rmtree(self.dump_dir / rid, ignore_errors=True)
        self.abandoned.append(rid)

    def remove_stale_pieces(self, chunk: str) -> list[str]:
        """Remove this chunk's request dirs an interrupted earlier attempt left behind.

        A killed job cannot delete its in-flight pieces; left alone they would hold
        /dev/shm.  Request ids start with the chunk's name and one job at a time extracts
        a chunk, so any such dir in the dump dir is stale.  Never follows a link.
        """
        removed = []
        for d in self.dump_dir.glob(f"{chunk}-*"):
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
        return removed

    def _server_log(self) -> str:
        return str(self.state.get("spec", {}).get("log_path", "(server log unknown)"))


def extract_chunk(
    cfg: Config,
    *,
    chunk_path: Path,
    index_path: Path | None,
    merged_path: Path | None = None,
    out_path: Path,
    sidecar_path: Path,
    ensure: Callable[[], dict],
    progress: bool = True,
) -> dict:
    """Extract every record of a chunk into the contract's chunk file plus its sidecar.

    While it runs, ``hidden/.chunk_<i>.progress.json`` says how far it got (for
    ``hsextract status``); it is removed when the chunk ends, whichever way.
    """
    from hsextract.status import ProgressFile

    tracker = ProgressFile(Path(out_path))
    try:
        return _extract_chunk(
            cfg,
            chunk_path=chunk_path,
            index_path=index_path,
            merged_path=merged_path,
            out_path=out_path,
            sidecar_path=sidecar_path,
            ensure=ensure,
            progress=progress,
            tracker=tracker,
        )
    finally:
        tracker.remove()


def _extract_chunk(
    cfg: Config,
    *,
    chunk_path: Path,
    index_path: Path | None,
    merged_path: Path | None,
    out_path: Path,
    sidecar_path: Path,
    ensure: Callable[[], dict],
    progress: bool,
    tracker: ProgressFile,
) -> dict:
    from hsextract import __version__
    from hsextract.budget import SendingTurn, SharedByteBudget
    from hsextract.chunks import ChunkWriter, check_chunk
    from hsextract.config import fingerprint, storage_codec
    from hsextract.dp import budget_keys, dp_size, shm_budget_bytes
    from hsextract.records import Record, index_entry, load_chunk, records_digest
    from hsextract.window import for_run

    one_thread_per_op()
    name = Path(chunk_path).stem
    t0 = time.monotonic()
    index = Path(index_path) if index_path else None
    records = load_chunk(
        Path(chunk_path),
        index,
        max_seq_len=cfg.max_seq_len,
        merged=Path(merged_path) if merged_path else None,
    )
    digest = records_digest(records)
    if index is not None:
        want = index_entry(Path(chunk_path), index).get("content_digest")
        if digest != want:  # the sha256 check passed, so the index itself is inconsistent
            raise ExtractionError(
                f"chunk {name}: its records have content digest {digest[:12]}..., "
                f"{index} says {str(want)[:12]}...; rerun split_chunks"
            )
    geo = model_geometry(cfg)
    budget_bytes = shm_budget_bytes(cfg)  # per DP replica (hsextract.dp)
    cps = cfg.server.chunked_prefill_size

    def need(rec: Record) -> int:
        return geo.dump_bytes(len(rec.input_ids), cps)

    longest_rec = max(records, key=need, default=None)
    if longest_rec is not None and need(longest_rec) > budget_bytes:
        raise ExtractionError(
            f"chunk {name}: the longest record ({longest_rec.id!r}, "
            f"{len(longest_rec.input_ids)} tokens) needs {need(longest_rec) / 2**20:.2f} MiB "
            f"of dump space, more than dump.shm_budget_gb={cfg.dump.shm_budget_gb}"
            f"{budget_keys(cfg)} ({budget_bytes / 2**20:.2f} MiB); raise it"
        )
    tracker.set_phase("server")  # waiting for the server (it may still be loading)
    client = Client(cfg, geo, ensure)
    tracker.set_phase("sending")
    if client.waited_for_server >= 1:
        log.info("%s: waited %.1f s for the server to load", name, client.waited_for_server)
    stale = client.remove_stale_pieces(name)
    if stale:
        log.info("%s: removed dump pieces of an interrupted earlier attempt: %s", name, stale)
    fp = fingerprint(cfg)
    meta = {
        "record_ids": json.dumps([r.id for r in records]),
        "aux_layers": json.dumps(geo.aux_layers),
        "hidden_size": str(geo.hidden_size),
        "num_layers": str(geo.num_layers),
        "model": str(cfg.model.path),
        "fingerprint": fp,
        "engine": cfg.engine,
        "dtype": cfg.model.dtype,
        "chunk": name,
        "content_digest": digest,
    }
    try:
        writer = ChunkWriter(
            out_path,
            [len(r.input_ids) for r in records],
            hidden_size=geo.hidden_size,
            n_aux=len(geo.aux_layers),
            dtype=geo.dtype,
            metadata=meta,
            codec=storage_codec(cfg),
        )
    except OSError as exc:
        raise _write_error(name, out_path, exc) from exc
    if writer.removed_stale:
        log.info(
            "%s: removed temporary files of an interrupted attempt: %s", name, writer.removed_stale
        )
    # One budget for every chunk job using this dump dir (-j N shares it).
    shm = SharedByteBudget(client.dump_dir, budget_bytes)
    total_tokens = sum(len(r.input_ids) for r in records)
    bar = _progress(name, total_tokens, len(records), progress)
    tracker.set_total(total_tokens, len(records))

    # The server's window (requests_in_flight and tokens_in_flight per turn, both per DP
    # worker; ``auto`` from the records' lengths, hsextract.window) is shared by the jobs
    # holding a turn: a turn no job holds -- none was ready when it was handed on -- is theirs.
    # Never more than the server runs at once (server.max_running_requests per DP worker):
    # past it a request only waits in SGLang's queue, its timeout running (seen in CI: the
    # reference engine at 8 running, a job alone at 32 in flight, requests abandoned).
    win = for_run(cfg)
    # A turn to send (client.sending_jobs per dump dir; ``auto`` from the records' cost a
    # token, within the workflow's -j: every job of the run derives the same count), held
    # until the last record is sent: this job's writes, fsync and sha256 then overlap a
    # waiting job's requests.
    turn = SendingTurn(client.dump_dir, win.sending.jobs)
    dp = dp_size(cfg)
    tokens = win.tokens * dp if win.tokens is not None else None
    window = _Window(turn, win.requests * dp, cap=win.max_running * dp, tokens=tokens)
    started = itertools.count(1)
    first_error: list[BaseException] = []
    chunk_stats = LayerStats(layer_names(geo.aux_layers, geo.num_layers))
    in_window, shm_wait = Occupancy(), Occupancy()

    def one(j: int) -> None:
        if client.stop.is_set():
            return  # the chunk has failed already: start nothing new
        rec = records[j]
        n_tokens = len(rec.input_ids)
        try:
            window.acquire(n_tokens)
            admitted = time.monotonic()
            try:
                if client.stop.is_set():
                    return  # failed while this one waited for room in the window
                token = shm.acquire(need(rec))
                shm_wait.add(time.monotonic() - admitted)
                if next(started) == len(records):
                    turn.release()  # the last record goes out now: a waiting job may send
                # Each row is read once: uncompressed, the rows go to the chunk file as
                # they are checked; with a codec, they are checked as the encoder reads them.
                sink = writer.row_sink(j)
                try:  # the budget is held until the pieces' bytes are freed (dump closed)
                    with client.extract_dump(
                        f"{name}-{j:06d}", rec.id, rec.input_ids, rows_to=sink,
                        check_values=sink is not None,
                    ) as dump:  # fmt: skip
                        mask = torch.tensor(rec.loss_mask, dtype=torch.uint8)
                        writer.put_files(
                            j, dump.ids, mask, dump.hidden, dump.aux, dump.dtype,
                            rows_sunk=sink is not None,
                            check=None if dump.checked else dump.check_rows,
                        )  # fmt: skip
                        if dump.stats is not None:
                            chunk_stats.merge(dump.stats)
                finally:
                    shm.release(token)
            finally:
                window.release(n_tokens)
                in_window.add(time.monotonic() - admitted)
        except BaseException as exc:
            first_error.append(exc)  # list.append is atomic
            client.stop.set()  # other threads finish their request, retry nothing
            raise
        bar.update(len(rec.input_ids))
        tracker.add(len(rec.input_ids))

    pool = ThreadPoolExecutor(max_workers=window.most)  # the window gates them
    try:
        tracker.set_phase("waiting")
        waited = turn.acquire()
        tracker.set_phase("sending")
        if waited >= 1:
            log.info("%s: waited %.1f s for a turn to send (client.sending_jobs)", name, waited)
        futures = [pool.submit(one, j) for j in range(len(records))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        # The last response is in and its rows handed to the writer (with a codec, the blob's
        # thread may still be writing them: finish waits for it).
        drained_at = time.time()
        turn.release()  # an empty chunk, or one that failed
        if first_error:
            for g in futures:
                g.cancel()
            exc = first_error[0]  # the cause, not a record that stopped because of it
            if isinstance(exc, HsextractError):
                raise ExtractionError(f"chunk {name}: {exc}") from exc
            # requests' errors are OSErrors too: only a file's error is a write error.
            if isinstance(exc, OSError) and not _is_http_error(exc):
                raise _write_error(name, out_path, exc) from exc
            raise ExtractionError(f"chunk {name}: {type(exc).__name__}: {exc}") from exc
        tracker.set_phase("finishing")
        try:
            sha = writer.finish()
        except OSError as exc:
            raise _write_error(name, out_path, exc) from exc
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        writer.abort()
        client.close()
        raise
    finally:
        turn.release()
        bar.close()
        shm.close()
    pool.shutdown(wait=True)
    client.close()
    check = check_chunk(out_path, expect_records=len(records))
    # The extraction, not the server's load: a chunk job starts while the model loads.
    seconds = time.monotonic() - t0 - client.waited_for_server
    sidecar = {
        "chunk": name,
        "path": Path(out_path).name,
        "records": check["records"],
        "tokens": check["tokens"],
        # A file of another size, or newer than this sidecar (written after it; no mtime is
        # recorded: Snakemake touches a job's outputs once it ends, this sidecar last), is
        # re-hashed by the next plan and redone if its bytes changed (plan.chunk_states).
        "bytes": os.path.getsize(out_path),
        "codec": check["codec"],
        "states_raw_bytes": check["raw_bytes"],
        "states_stored_bytes": check["stored_bytes"],
        "sha256": sha,
        "seconds": round(seconds, 3),
        # Wall clock, for `hsextract status` (its rates; an mtime does not survive a copy).
        # Once the server answered (waited_for_server_s after the job began).
        "started_at": round(tracker.data["started_at"] + client.waited_for_server, 3),
        "finished_at": round(time.time(), 3),
        "tokens_per_s": round(total_tokens / seconds, 1) if seconds > 0 else math.inf,
        "fingerprint": fp,
        "content_digest": digest,
        "aux_layers": geo.aux_layers,
        "engine": cfg.engine,
        "server_url": client.state["url"],
        # Which server produced these numbers: a chunk done before a settings change keeps
        # the record of the settings it was done with.
        "server": _server_record(client.state),
        "hsextract_version": __version__,
        "abandoned_requests": len(client.abandoned),
        "activation_stats": chunk_stats.report(),
        "shm_peak_bytes": shm.peak,
        # Wall clock [took its turn to send, sent its last record].
        "sending": [round(turn.taken_at or 0.0, 3), round(turn.released_at or 0.0, 3)],
        # Of how many turns (client.sending_jobs, auto within the workflow's -j).
        "sending_jobs": turn.n,
        # Wall clock: its last response came, then was in and written (fsync, sha256 next).
        "last_response_at": round(client.last_response_at or drained_at, 3),
        "drained_at": round(drained_at, 3),
        # Its requests in flight: its own share, and the most it had (vacant turns' share);
        # its tokens in flight the same way (hsextract.window).
        "window": [window.base, window.peak],
        "window_tokens": [window.tokens_base, window.tokens_peak],
        "waited_for_turn_s": round(waited, 3),
        "waited_for_server_s": round(client.waited_for_server, 3),
        # Seconds summed over the requests: held in the window, of which waiting for
        # /dev/shm room, from the POST to its answer, and from there to its pieces all
        # written and opened; the rest is this job's own work (checked, encoded, and
        # written, or with a codec queued for the blob's writer thread).
        # Over the sending phase, the requests in flight in each on average: whether the
        # server or the client holds the window (issue 40).
        "request_s": {
            "window": in_window.round(),
            "shm": shm_wait.round(),
            "answer": client.answer_wait.round(),
            "pieces": client.pieces_wait.round(),
        },
        # The niceness it ran at (client.nice, or nicer if started so; steps.extract_chunk).
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        # Wall clock: this job's process began (its start cost: interpreter, imports).
        "process_started_at": _process_started_at(),
    }
    from hsextract.server import write_json

    write_json(Path(sidecar_path), sidecar)
    return sidecar


class Occupancy:
    """Seconds summed over requests, added from any sender thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:  # a float's += is not atomic across threads
            self.seconds += seconds

    def round(self) -> float:
        return round(self.seconds, 3)


class _Window:
    """How many requests, and tokens, a sending job keeps in flight: its own share, ``base``
    requests and ``tokens_base`` tokens (``client.requests_in_flight`` and
    ``client.tokens_in_flight`` x dp), plus the share of every turn no job holds.

    Why (issue 34): the turns only keep the server fed while a job is ready to take each
    one as it is handed on.  A chunk job spends seconds not sending (its process start,
    imports and records before it is ready; its last requests, fsync and sha256 after);
    with small chunks those add up to more than the others' sending, turns stay free, and
    SGLang's queue runs dry (47k-token chunks on the H200: 42 % of the turns' time vacant,
    0.94 of the bare server).  So the jobs holding a turn send for the vacant ones too:
    ``base x n / held`` each, at most ``base x n`` -- the server's window stays full while
    any job sends, and shrinks back as soon as a waiting job takes a turn (requests already
    sent finish; no new one goes out over the limit).  Never more than ``cap``, what the
    server runs at once, unless its own share is more: past it a request only waits in
    the server's queue, its timeout running.  Occupancy is probed at most every
    ``probe_s`` (``SendingTurn.held_count``).

    Why tokens too (issue 40): what keeps the server fed is tokens queued; the token limit
    scales with the request limit (the same share of vacant turns).  A request longer than
    the whole token limit goes out alone, once nothing else is in flight.  Requests go out
    in the order they ask (one waits at a time, ``_gate``): a long record waiting for
    token room is not overtaken forever by short ones that fit.
    """

    def __init__(
        self,
        turn: Any,
        base: int,
        *,
        cap: int,
        tokens: int | None = None,
        probe_s: float = 0.05,
    ) -> None:
        self.turn, self.base, self.probe_s = turn, base, probe_s
        self.most = max(base, min(base * turn.n, cap))
        self.tokens_base = tokens
        self.active = self.peak = 0
        self.active_tokens = self.tokens_peak = 0
        self._limit, self._at = base, -math.inf
        self._cv = threading.Condition()
        self._gate = threading.Lock()

    def limit(self) -> int:
        now = time.monotonic()
        if now - self._at >= self.probe_s:
            held = max(1, self.turn.held_count())
            self._limit, self._at = min(self.most, -(-self.base * self.turn.n // held)), now
        return self._limit

    def token_limit(self) -> float:
        """The tokens allowed in flight now: ``tokens_base`` scaled as the request limit."""
        if self.tokens_base is None:
            return math.inf
        return self.tokens_base * self.limit() / self.base

    def _room(self, n_tokens: int) -> bool:
        if self.active >= self.limit():
            return False
        return self.active_tokens == 0 or self.active_tokens + n_tokens <= self.token_limit()

    def acquire(self, n_tokens: int = 0) -> None:
        with self._gate, self._cv:
            while not self._room(n_tokens):
                self._cv.wait(self.probe_s)
            self.active += 1
            self.active_tokens += n_tokens
            self.peak = max(self.peak, self.active)
            self.tokens_peak = max(self.tokens_peak, self.active_tokens)

    def release(self, n_tokens: int = 0) -> None:
        with self._cv:
            self.active -= 1
            self.active_tokens -= n_tokens
            self._cv.notify()


def _process_started_at() -> float | None:
    """When this process began, wall clock (10 ms; /proc), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return round(time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK")), 3)
    except (OSError, ValueError, IndexError):
        return None


def _server_record(state: dict) -> dict:
    from hsextract.server import ServerSpec
    from hsextract.sglang.launch import redact_argv

    spec = ServerSpec(**state["spec"])
    return {
        "engine": spec.engine,
        "settings_digest": spec.settings_digest,
        "settings": spec.settings,
        "argv": redact_argv(spec.argv),
        "version": state.get("server_version"),
        "pid": state.get("pid"),
        "started_at": state.get("started_at"),
        "healthy_at": state.get("healthy_at"),
    }


def _is_http_error(exc: BaseException) -> bool:
    import requests

    return isinstance(exc, requests.RequestException)


def _write_error(name: str, out_path: Path, exc: OSError) -> ExtractionError:
    """The chunk file could not be written: say where, why, and what to do."""
    where = Path(out_path).parent
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(where).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        return ExtractionError(
            f"chunk {name}: disk full writing {out_path} ({exc.strerror}; {free} on {where}): "
            "the partial file was removed; free space there (or move output_root), then rerun"
        )
    return ExtractionError(f"chunk {name}: cannot write {out_path}: {exc}")


def _progress(name: str, tokens: int, records: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=tokens,
        unit="tok",
        unit_scale=True,
        desc=f"{name} ({records} records)",
        file=sys.stderr,
        disable=not enabled,
        mininterval=1.0,
    )
