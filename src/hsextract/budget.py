"""Disk and /dev/shm budgets, checked before anything touches a GPU.

At hidden size 7168 with 3 aux layers + the final state in bf16 a token costs ~57 KB, so
the seed's 88 M tokens are ~5 TB: a wrong guess about space costs hours of GPU time.
Every failure names the numbers and the config key that changes them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import itertools
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hsextract.errors import HsextractError
from hsextract.procs import start_time

log = logging.getLogger(__name__)

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
#: Chunk files store input_ids as int32 and loss_mask as uint8.
ID_BYTES, MASK_BYTES = 4, 1
#: Dump pieces store input_ids as int64 and no mask (see hsextract.capture).
DUMP_ID_BYTES = 8


class BudgetError(HsextractError):
    """The run will not fit: disk at the output root or the /dev/shm dump budget."""


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name ('bfloat16', 'torch.float16', ...), no torch import."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise BudgetError(f"unknown dtype {dtype!r} (config key: model.dtype)")
    return DTYPE_BYTES[name]


def bytes_per_token(hidden_size: int, n_aux: int, dtype: Any) -> int:
    """Output bytes per token: final + aux hidden states, plus int32 id and uint8 mask."""
    return dtype_bytes(dtype) * hidden_size * (n_aux + 1) + ID_BYTES + MASK_BYTES


def stored_bytes_per_token(
    codec: str, hidden_size: int, n_aux: int, dtype: Any
) -> tuple[int, bool]:
    """A chunk file's bytes per token under ``storage.codec`` before any is measured, and
    whether that is exact: ``none`` stores the raw rows, ``fp8`` one byte per element
    plus a float32 scale per token per layer (chunkfile's layout), both exact; ``lossless``
    depends on the states (zstd on their byte planes), so only the raw size bounds it."""
    if codec == "fp8":
        return (hidden_size + 4) * (n_aux + 1) + ID_BYTES + MASK_BYTES, True
    return bytes_per_token(hidden_size, n_aux, dtype), codec != "lossless"


def dump_bytes_per_token(hidden_size: int, n_aux: int, dtype: Any) -> int:
    """Bytes per token of a dump piece in /dev/shm (int64 ids, no mask)."""
    return dtype_bytes(dtype) * hidden_size * (n_aux + 1) + DUMP_ID_BYTES


#: Bytes allowed per dump piece beyond its tensors (the safetensors header is ~400 B).
PIECE_OVERHEAD = 1024
#: Where the shared budget's reservations live, inside the dump dir.
LEDGER_DIR = ".budget"


def dump_bytes_for_request(
    n_tokens: int, hidden_size: int, n_aux: int, dtype: Any, chunked_prefill_size: int
) -> int:
    """What one request's pieces may occupy in the dump dir, headers included.

    A request is cut into about n / chunked_prefill_size extend passes, one piece each; a
    batch boundary can cut it once more per pass, hence the factor two.
    """
    passes = -(-n_tokens // chunked_prefill_size) if chunked_prefill_size > 0 else 1
    pieces = 2 * passes + 2
    return n_tokens * dump_bytes_per_token(hidden_size, n_aux, dtype) + pieces * PIECE_OVERHEAD


#: One sequence per process, not per budget: two chunks extracted at once in one process
#: (two budgets on one dump dir) must never name a reservation alike.
_SEQ = itertools.count()
#: Which budget of this process granted each reservation: any of them may release it, as
#: when a reservation was a file anyone could unlink.
_GRANTED: dict[str, SharedByteBudget] = {}


def _marks_in(names: list[str]) -> list[tuple[int, int]]:
    """(ticket, bytes waited for) of the waiting marks among ledger entry names,
    ``<pid>-<start>-<ticket>x<bytes>-0`` (a lease of 0 bytes)."""
    marks = []
    for name in names:
        parts = name.split("-")
        if len(parts) == 4 and parts[3] == "0":
            ticket, _, need = parts[2].partition("x")
            if ticket.isdigit():
                marks.append((int(ticket), int(need) if need.isdigit() else 0))
    return marks


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A request waiting for bytes: its size, its ticket (the host's monotonic clock when
    it queued, comparable across processes), and the event that wakes it."""

    nbytes: int
    ticket: int
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: Its reservation, once granted (by whichever thread served it).
    token: str | None = None


class _Closed(RuntimeError):
    """A ledger visit after :meth:`SharedByteBudget.close` (a late release's give-back)."""


#: How long another process's request waits before the bytes it waits for are kept for it
#: (``SharedByteBudget._grant_at_ledger``): long beside a wait for room in a budget that
#: binds evenly (tens of ms), short beside the seconds a long record starved before.
PATIENCE_S = 0.25
#: How long a ledger visit trusts that a lease's owner it found alive still runs.
ALIVE_TTL_S = 1.0


class SharedByteBudget:
    """A byte semaphore shared by every process that extracts into one dump dir.

    Each process holds a lease, a file ``<pid>-<start time>-<seq>-<bytes>`` in ``<dump
    dir>/.budget``, taken, grown and given back under an ``flock``: so ``-j N`` chunk jobs
    on one host share ``dump.shm_budget_gb`` instead of each having all of it.  Its
    threads' acquires are served from the lease in memory; only a request that does not fit
    what the lease has free goes to the ledger, to grow it.

    Why leases (issue 40): with a reservation file per request every acquire took the
    lock and scanned a ledger of every request in flight on the host (512 files at dp 8),
    ~260 ms a request at a simulated dp 8.  A lease stays at the most its process had in
    use (its high-water mark), so a job in its steady state, each request's bytes freed
    and taken again, never touches the ledger.  It is given back whole when the process
    has nothing in use, and down to what is in use while another process waits: a waiting
    process marks itself with a lease of 0 bytes (its oldest waiter's ticket and bytes,
    :meth:`acquire`), which a holder's watcher thread sees within ``watch_s``.  A lease of
    a process that died (a killed chunk job) no longer counts; it is removed by the next
    reader.  One request alone may exceed the budget when nothing else is reserved (the
    preflight refuses a budget smaller than the longest request).

    Two locks: ``_llock`` takes this process's threads to the ledger one at a time (an
    ``flock`` is shared by the threads of the process that holds it), ``_tlock`` guards
    the counts and is never held while waiting for the ``flock``.  Why (issue 40): with
    one lock for both, a thread releasing its bytes waited behind another's ledger visit,
    itself waiting for other jobs' visits: at 16 chunk jobs on a contended budget, 0.64 s
    of every request's thread time went there, its window slot held meanwhile
    (bench/client_ceiling.py, -j16 at dp 8).  So a release never visits the ledger while
    others wait: it wakes the watcher, which gives the bytes back within ``watch_s``.
    """

    def __init__(
        self,
        dump_dir: Path,
        capacity: int,
        *,
        poll_s: float = 0.005,
        watch_s: float = 0.01,
        patience_s: float = PATIENCE_S,
    ) -> None:
        self.dir = Path(dump_dir) / LEDGER_DIR
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.capacity = capacity
        self.poll_s = poll_s
        self.watch_s = watch_s
        self.patience_s = patience_s
        self.peak = 0
        #: How many times this budget took the ledger's lock (bench/client_ceiling.py).
        self.ledger_visits = 0
        self._me = f"{os.getpid()}-{start_time(os.getpid())}"
        self._llock = threading.Lock()  # this process's turn at the ledger (before _tlock)
        self._tlock = threading.Lock()  # the counts below; never held waiting for the flock
        self._wake = threading.Event()  # a release asks the watcher to give bytes back
        #: Lease owners seen alive (``pid-start``), and when: a visit re-reads /proc for an
        #: owner only after ``ALIVE_TTL_S``.  A dead owner's lease may count that much longer
        #: (the safe side: a wait, never an overcommit); a dead one is never alive again.
        self._seen_alive: dict[str, float] = {}
        self._fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._lease = 0  # bytes of this budget's lease in the ledger
        self._lease_name: str | None = None
        self._in_use = 0  # of the lease, handed to this process's threads
        self._held: dict[str, int] = {}
        self._others = 0  # other processes' bytes at the last visit (for ``peak``)
        #: This process's waiting requests, served oldest first (from the lease, or by the
        #: head at the ledger), so the process asks the ledger as one waiter, under one
        #: mark named by the head's ticket.
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._mark: str | None = None  # this process's waiting mark in the ledger
        #: Other processes' waiting marks at the last look, (ticket, bytes waited for).
        self._marks: list[tuple[int, int]] = []
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    def _scan(self, fresh: bool = False) -> tuple[int, list[tuple[int, int]]]:
        """(bytes other processes' leases hold, their waiting marks as (ticket, bytes it
        waits for)), under the lock; entries of dead processes are removed on the way."""
        with self._tlock:
            mine = self._mine()
        used = 0
        names: list[str] = []
        alive: dict[str, bool] = {}
        for entry in os.scandir(self.dir):
            parts = entry.name.split("-")
            if len(parts) != 4 or not parts[3].isdigit():
                continue
            owner = f"{parts[0]}-{parts[1]}"
            if owner not in alive:
                alive[owner] = owner == self._me or self._alive(owner, parts, fresh)
            if not alive[owner]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            if entry.name in mine:
                continue
            used += int(parts[3])
            names.append(entry.name)
        return used, _marks_in(names)

    def _alive(self, owner: str, parts: list[str], fresh: bool) -> bool:
        """Does the lease's owner run?  ``fresh``: read /proc whatever was seen."""
        now = time.monotonic()
        if not fresh and now - self._seen_alive.get(owner, -math.inf) < ALIVE_TTL_S:
            return True
        if start_time(int(parts[0])) != parts[1]:
            self._seen_alive.pop(owner, None)
            return False
        self._seen_alive[owner] = now
        return True

    def _mine(self) -> set[str]:
        """This budget's own entries: its lease and its waiting mark."""
        return {n for n in (self._lease_name, self._mark) if n is not None}

    def _used(self) -> int:
        """Bytes every live lease holds, this budget's own included (under the lock)."""
        return self._scan(fresh=True)[0] + self._lease

    def _set_lease(self, nbytes: int) -> None:
        """Make the lease ``nbytes`` (under the lock): one rename, or a create or unlink."""
        old = self._lease_name
        if nbytes == self._lease and (old is not None or not nbytes):
            return
        new = f"{self._me}-{next(_SEQ)}-{nbytes}" if nbytes else None
        if new is not None:
            if old is None:
                with open(self.dir / new, "x"):
                    pass
            else:
                os.rename(self.dir / old, self.dir / new)
        elif old is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / old)
        self._lease, self._lease_name = nbytes, new
        if nbytes > 0 and self._watcher is None and not self._closed.is_set():
            self._watcher = threading.Thread(
                target=self._watch, name="shm-budget-watch", daemon=True
            )
            self._watcher.start()

    @contextlib.contextmanager
    def _ledger(self, wait: bool = True) -> Iterator[bool]:
        """This process's turn at the ledger, then its ``flock`` (take ``_tlock`` inside).
        Yields whether both are held: without ``wait``, False where either is busy."""
        if not self._llock.acquire(blocking=wait):
            yield False
            return
        try:
            if self._fd < 0:
                raise _Closed(f"{self.dir}: this budget is closed")
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                held = True
            except BlockingIOError:
                held = False
            self.ledger_visits += held
            try:
                yield held
            finally:
                if held and self._fd >= 0:  # close() closes the fd, and its flock with it
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._llock.release()

    def _grant(self, nbytes: int) -> str:
        token = f"{self._me}-{next(_SEQ)}-{nbytes}"
        self._held[token] = nbytes
        _GRANTED[token] = self
        self._in_use += nbytes
        self.peak = max(self.peak, self._others + self._in_use)
        return token

    def acquire(self, nbytes: int) -> str:
        """Wait until ``nbytes`` fit; returns the reservation to hand to :meth:`release`.

        In order, with a bound on how long another process's request waits: in the
        process, waiters queue in memory and are served oldest first, by the release that
        frees their bytes or by the head's ledger visit (it polls every ``poll_s`` for room
        other processes free).
        Across processes, the queue's head marks the process as waiting with its ticket
        (the host's monotonic clock when it queued) and the bytes it waits for; once a
        mark is ``patience_s`` old, those bytes are its claim: no younger request anywhere
        is granted bytes the claim needs, and leases give back what they do not use.

        Why: without an order, a large request (a long record) waiting for room lost every
        race to the small ones behind it, for as long as they kept coming (8 s in a
        synthetic run).  Why a patience, not a strict turn: bytes then pass from process
        to process at the ledger's polling pace, and a budget that binds evenly across
        jobs (every job with waiters, waits of tens of ms) got ~4,400 grants a second
        instead of ~7,000; with a mark and a backing-off ledger poll per waiting thread,
        as first built, ~4 (issue 40).
        """
        with self._tlock:
            if not self._queue and self._lease_fits(nbytes, time.monotonic_ns()):
                return self._grant(nbytes)
            w = _Waiter(nbytes, time.monotonic_ns())
            self._queue.append(w)
        try:
            while True:
                w.event.clear()  # before looking: a release after the look wakes the wait
                with self._tlock:
                    if w.token is None and self._queue[0] is w:
                        self._serve()
                    if w.token is not None:
                        return w.token
                    head = self._queue[0] is w
                if head and self._grant_at_ledger(w):
                    return w.token  # type: ignore[return-value]  # granted at the ledger
                # The head polls for what other processes free; the rest are served in
                # turn by whoever frees or gets bytes (the timeout is only a safety net).
                w.event.wait(self.poll_s if head else 1.0)
        except BaseException:
            with self._tlock:
                token, w.token = w.token, None  # granted meanwhile: given back below
                was_head = bool(self._queue) and self._queue[0] is w
                with contextlib.suppress(ValueError):
                    self._queue.remove(w)
                if was_head:
                    self._next_head()
            if token is not None:
                self.release(token)
            raise

    @property
    def _contended(self) -> bool:
        """Another process waits (its mark seen at the last look)."""
        return bool(self._marks)

    def _lease_fits(self, nbytes: int, ticket: int) -> bool:
        """Can a request of ``ticket`` take ``nbytes`` from the lease alone (under
        ``_tlock``)?  Never past the capacity (a lone request's lease may be larger), nor
        into a due claim of another process's older waiter."""
        room = min(self._lease, self.capacity)
        return self._in_use + nbytes <= room and not self._claims(ticket)

    def _claims(self, ticket: int) -> int:
        """Bytes other processes' waiting marks older than ``ticket`` and ``patience_s``
        old claim (their last seen marks; under ``_tlock``)."""
        if not self._marks:
            return 0
        due = min(ticket, time.monotonic_ns() - int(self.patience_s * 1e9))
        return sum(need for t, need in self._marks if t < due)

    def _grant_at_ledger(self, w: _Waiter) -> bool:
        """The queue's head at the ledger: grow the lease and grant if the bytes fit beside
        what every other process holds and what each older waiter of theirs waits for
        (its claim); else mark the process as waiting, with its ticket and claim (seen by
        the holders' watchers, which give back what they do not use).  Whether ``w`` was
        granted.

        Why claims rather than a strict turn: a younger request still goes first where
        it leaves an older one all the room it waits for (nothing is held idle waiting
        for a turn to pass from process to process at polling pace), and none takes
        bytes an older one waits for, so a large request is not starved by small ones.

        Why the lease grows by every waiter queued here, not by the head's bytes alone:
        while the head visits, every new request of the process queues behind it, and each
        would then visit in turn, a thread wake-up apart; a job ramping up 64 requests
        waited ~45 ms a request (bench/client_ceiling.py, a budget that never binds) and
        the server's queue ran dry with the client's window full (issue 40)."""
        with self._ledger():
            others, marks = self._scan()
            with self._tlock:
                self._others, self._marks = others, marks
                if w.token is not None:  # by a release while this thread came to the ledger
                    return True
                claims = self._claims(w.ticket)
                need = self._in_use + w.nbytes
                fits = others + claims + need <= self.capacity or (
                    others == 0 and not self._in_use and not claims
                )
                if not fits:
                    self._set_mark(w.ticket, w.nbytes)
                    return False
                if marks:  # while another waits, no more than is in use
                    self._set_lease(need)
                else:
                    room = self.capacity - others - claims
                    queued = self._in_use + sum(q.nbytes for q in self._queue)
                    self._set_lease(max(need, self._lease, min(queued, room)))
                self._serve(head=True)  # ``w``: a lone request may be past the capacity
                return True

    def _serve(self, head: bool = False) -> bool:
        """Grant queued waiters from the lease, oldest first, while the head fits (under
        ``_tlock``); ``head``: the first whatever it finds (granted at the ledger).
        Whether any was.  Why here, by the thread that freed or got the bytes: a waiter
        woken to serve itself runs only once it gets the GIL, milliseconds behind its
        predecessor with hundreds of sender threads."""
        served = False
        while self._queue and (
            head or self._lease_fits(self._queue[0].nbytes, self._queue[0].ticket)
        ):
            head = False
            w = self._queue.popleft()
            w.token = self._grant(w.nbytes)
            w.event.set()
            served = True
        if served:
            self._next_head()
        return served

    def _next_head(self) -> None:
        """The queue's head left (under ``_tlock``): its mark goes (the next head marks the
        process again with its own ticket and bytes if it must wait), and the next head
        looks now."""
        self._set_mark(None)
        if self._queue:
            self._queue[0].event.set()

    def _set_mark(self, ticket: int | None, nbytes: int = 0) -> None:
        """This process's waiting mark, ``<pid>-<start>-<ticket>x<bytes>-0``: its head's
        ticket and the bytes it waits for; or none (under ``_tlock``)."""
        name = None if ticket is None else f"{self._me}-{ticket}x{nbytes}-0"
        if name == self._mark:
            return
        if self._mark is not None:
            try:
                os.unlink(self.dir / self._mark)
            except FileNotFoundError:
                pass
            except OSError as exc:  # other jobs see a waiter that is gone: they wait less
                log.warning("%s: removing waiting mark %s failed (%s)", self.dir, self._mark, exc)
        if name is not None:
            with open(self.dir / name, "x"):
                pass
        self._mark = name

    def release(self, token: str) -> None:
        owner = _GRANTED.pop(token, None)
        if owner is None:
            return  # released already
        if owner is not self:
            owner.release_own(token)
            return
        self.release_own(token)

    def release_own(self, token: str) -> None:
        with self._tlock:
            nbytes = self._held.pop(token, None)
            if nbytes is None:
                return
            self._in_use -= nbytes
            # The oldest waiters, if the freed bytes fit them; else the head looks at the
            # ledger now (other processes may have freed room), not at its next poll.
            if not self._serve() and self._queue:
                self._queue[0].event.set()
            idle, waiter = not self._in_use, bool(self._queue)
            # Bytes another process waits for, and no waiter here may take them: given back.
            give = self._contended and (not waiter or self._claims(self._queue[0].ticket))
        if give:
            self._wake.set()  # the watcher gives it back: no wait here for the ledger
        elif idle and (not waiter or self._lease > self.capacity):
            self._shrink(wait=False)  # a lone request's lease past the capacity included

    def _shrink(self, wait: bool = True) -> None:
        """Give back what the lease holds beyond what is in use.  Without ``wait`` (a
        release): now if the ledger is free, else the watcher does it."""
        with self._tlock:
            if self._fd < 0 or self._lease <= self._in_use:
                return
        with contextlib.suppress(_Closed), self._ledger(wait) as held:
            if not held:
                self._wake.set()
                return
            with self._tlock:
                self._set_lease(self._in_use)

    def _watch(self) -> None:
        """While there is a lease, look for other processes' waiting marks every
        ``watch_s``; give back what is not in use where another process waits and no
        waiter here may use it (none waits, or an older mark's claim is due), or where
        nothing is in use.  Why a thread: every sender thread of the job may be waiting
        on the server, none acquiring or releasing, while another job waits for bytes this
        lease holds idle.  It looks even with the whole lease in use: a job whose threads
        take their bytes back as soon as they release them never visits the ledger, and
        without this a waiter behind it was never seen."""
        failing = False
        while True:
            self._wake.wait(self.watch_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            if not self._lease:
                continue  # nothing to give back
            with self._tlock:
                mine = self._mine()
            names: list[str] = []
            with contextlib.suppress(OSError):
                names = [e.name for e in os.scandir(self.dir) if e.name.endswith("-0")]
            with self._tlock:
                mine |= self._mine()  # a mark this process made during the scan is its own
                marks = _marks_in([n for n in names if n not in mine])
                self._marks = marks
                ticket = self._queue[0].ticket if self._queue else time.monotonic_ns()
                give = (
                    (marks and not self._queue)
                    or self._claims(ticket)
                    or not (self._in_use or self._queue)
                    or self._lease > max(self.capacity, self._in_use)  # a lone request's, gone
                )
            if give:
                try:
                    self._shrink()
                    failing = False
                except OSError as exc:  # retried next round: a dead watcher strands bytes
                    if not failing:
                        log.warning("%s: giving back budget failed (%s); retrying", self.dir, exc)
                    failing = True

    def reserved(self) -> int:
        """Bytes reserved now by live processes."""
        with self._ledger():
            return self._used()

    @contextlib.contextmanager
    def unused(self) -> Iterator[bool]:
        """Hold the ledger's lock; yield whether no live process holds a lease or waits
        for one.

        Why: a chunk job takes its lease before it sends a request and keeps it until
        that request's pieces are read, so no live lease means no live job needs any piece
        in the dump dir; and while the lock is held no job can take one (:meth:`acquire`
        takes the same lock), so none starts a request whose pieces a cleanup would then
        remove.
        """
        with self._ledger():
            others, marks = self._scan(fresh=True)
            with self._tlock:
                mine = self._lease or self._mark is not None
            yield not (others or marks or mine)

    def close(self) -> None:
        """Give the lease back (nothing is in use by then) and stop the watcher."""
        self._closed.set()
        self._wake.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        with contextlib.suppress(_Closed), self._ledger(), self._tlock:
            try:
                self._set_lease(0)
                self._set_mark(None)
            finally:
                os.close(self._fd)  # the flock goes with it
                self._fd = -1


#: Where the sending turns live, inside the dump dir.
TURNS_DIR = ".turns"


class SendingTurn:
    """One of ``n`` turns to send requests, shared by every chunk job on one dump dir.

    Why: a chunk job's last step -- fsync and the sha256 of its whole file, ~1 GB/s on
    one core -- sends the server nothing, and chunk jobs sharing a server progress at one
    rate, so they reach that step together and the GPU idles (measured on the live
    SGLang: 0.78 of capture-off throughput at ``-j4``).  With more jobs than turns
    (``-j8``, 4 turns) a job hands its turn on as soon as its last record is sent, so a
    waiting job's requests queue behind that record and the server never runs dry while
    jobs write, fsync and hash.  A turn is an ``flock`` on a file, so the kernel frees it
    when its job dies, SIGKILL included.  ``taken_at`` / ``released_at``: wall clock.
    """

    def __init__(self, dump_dir: Path, n: int, *, poll_s: float = 0.02) -> None:
        if n < 1:
            raise ValueError(f"n={n} turns: at least 1")
        self.dir = Path(dump_dir) / TURNS_DIR
        self.n, self.poll_s = n, poll_s
        self.fd = -1
        self.index = -1
        self.taken_at: float | None = None
        self.released_at: float | None = None
        self._lock = threading.Lock()  # released from whichever thread sends the last record

    def acquire(self) -> float:
        """Block until a turn is free and take it; returns the seconds waited."""
        if self.fd >= 0:
            raise RuntimeError("this job already holds a turn")
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        t0 = time.monotonic()
        while True:
            for i in range(self.n):
                fd = os.open(self.dir / f"turn-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.fd, self.index = fd, i
                self.taken_at, self.released_at = time.time(), None
                return time.monotonic() - t0
            time.sleep(self.poll_s)

    def release(self) -> None:
        """Give the turn back (idempotent, any thread): closing the file drops the lock."""
        with self._lock:
            if self.fd >= 0:
                self.released_at = time.time()
                os.close(self.fd)
                self.fd, self.index = -1, -1

    def held_count(self) -> int:
        """How many of the ``n`` turns live jobs hold now, this job's own included.

        A probe takes a free turn for an instant (a shared lock, dropped at once): a job
        waiting in :meth:`acquire` then tries the next turn or polls again.  Why: the
        sending jobs share the server's window (``client.requests_in_flight`` x turns), so
        a turn nobody holds -- no job was ready when it was handed on -- is window the
        jobs that are sending may use (``client._Window``)."""
        count = 0
        for i in range(self.n):
            path = self.dir / f"turn-{i}"
            if i == self.index:
                count += 1
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # never taken
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                count += 1
            finally:
                os.close(fd)
        return count

    @staticmethod
    def held(dump_dir: Path) -> bool:
        """Whether a live job holds a turn on this dump dir now."""
        d = Path(dump_dir) / TURNS_DIR
        if not d.is_dir():
            return False
        for entry in d.glob("turn-*"):
            fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            finally:
                os.close(fd)
        return False


def max_in_flight(shm_budget_bytes: int, per_request_bytes: int) -> int:
    """How many requests may have dump pieces at once; at least 1 so work can proceed.

    The preflight has already refused a budget below one request, so 1 is never a lie.
    """
    if per_request_bytes <= 0:
        raise ValueError(f"per_request_bytes must be > 0, got {per_request_bytes}")
    return max(1, int(shm_budget_bytes // per_request_bytes))


def probe_free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the filesystem that holds ``path`` or would hold it.

    The nearest existing ancestor is probed, since the output dir may not exist yet.
    Tests patch this function at module level.
    """
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def probe_mem_available() -> int:
    """Bytes of memory available now (``MemAvailable``); 0 where unknown (no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


def preflight(
    *,
    total_tokens: int,
    max_len: int,
    hidden_size: int,
    n_aux: int,
    dtype: Any,
    output_root: Path,
    dump_dir: Path,
    requests_in_flight: int,
    shm_budget_bytes: int,
    chunked_prefill_size: int = -1,
    free_bytes: Callable[[Path], int] | None = None,
    headroom: float = 0.02,
    stream_budget_bytes: int | None = None,
    largest_chunk_tokens: int = 0,
) -> dict[str, Any]:
    """Check both budgets; return the figures or raise BudgetError naming the key to change.

    ``headroom`` is the fraction of the estimate kept free on top (safetensors headers,
    sidecars, filesystem slack).  ``free_bytes`` defaults to :func:`probe_free_bytes`,
    looked up at call time so tests can patch the module attribute.
    ``stream_budget_bytes`` (stream.budget_gb): the stream deletes what the trainer acked,
    so the output disk holds at most the budget plus the chunk a job writes past it (the
    largest, ``largest_chunk_tokens``), or the tokens left if fewer: the run's bytes would
    refuse exactly the runs a budget is for.
    """
    probe = free_bytes or (lambda p: probe_free_bytes(p))
    bpt = bytes_per_token(hidden_size, n_aux, dtype)
    written = total_tokens * bpt
    if stream_budget_bytes is not None:
        written = min(written, stream_budget_bytes + largest_chunk_tokens * bpt)
    out_need = int(written * (1 + headroom))
    out_free = probe(Path(output_root))
    per_request = (
        dump_bytes_for_request(max_len, hidden_size, n_aux, dtype, chunked_prefill_size)
        if max_len
        else 0
    )
    fit = shm_budget_bytes // per_request if per_request else 0
    in_flight_bytes = per_request * requests_in_flight
    dump_free = probe(Path(dump_dir))
    report = {
        "bytes_per_token": bpt,
        "total_tokens": total_tokens,
        "output_bytes_needed": out_need,
        "stream_budget_bytes": stream_budget_bytes,
        "largest_chunk_tokens": largest_chunk_tokens,
        "output_root": str(output_root),
        "output_free_bytes": out_free,
        "max_len": max_len,
        "dump_bytes_per_request": per_request,
        "requests_in_flight": requests_in_flight,
        "dump_bytes_in_flight": in_flight_bytes,
        "shm_budget_bytes": shm_budget_bytes,
        "dump_dir": str(dump_dir),
        "dump_free_bytes": dump_free,
        "requests_that_fit_budget": int(fit),
        # A chunk job holds each in-flight request's states once more while it packs
        # them (read from the pieces, compressed, written): RAM beside /dev/shm's own.
        "mem_available_bytes": probe_mem_available(),
    }
    problems = _problems(report, hidden_size, n_aux, dtype)
    if problems:
        raise BudgetError("budget preflight failed:\n  " + "\n  ".join(problems))
    return report


def _problems(r: dict[str, Any], hidden_size: int, n_aux: int, dtype: Any) -> list[str]:
    """Each failed budget as one sentence: the numbers, then what to change."""
    out = []
    capped = r.get("stream_budget_bytes") is not None and (
        r["stream_budget_bytes"] + r["largest_chunk_tokens"] * r["bytes_per_token"]
        < r["total_tokens"] * r["bytes_per_token"]
    )
    if r["output_bytes_needed"] > r["output_free_bytes"] and capped:
        out.append(
            f"output: the stream holds at most stream.budget_gb "
            f"({human(r['stream_budget_bytes'])}) + the largest chunk "
            f"({r['largest_chunk_tokens']:,} tokens x {r['bytes_per_token']:,} B/token) = "
            f"{human(r['output_bytes_needed'])} with headroom, but {r['output_root']} has "
            f"{human(r['output_free_bytes'])} free; free space there, lower stream.budget_gb "
            "or change output_root"
        )
    elif r["output_bytes_needed"] > r["output_free_bytes"]:
        out.append(
            f"output: {r['total_tokens']:,} tokens x {r['bytes_per_token']:,} B/token "
            f"(H={hidden_size}, {n_aux} aux + final, {dtype}) = "
            f"{human(r['output_bytes_needed'])} with headroom, but {r['output_root']} has "
            f"{human(r['output_free_bytes'])} free; free space there or change output_root "
            "(or fewer tokens: inputs / max_seq_len, fewer layers: aux_layers)"
        )
    if r["dump_bytes_in_flight"] > r["shm_budget_bytes"]:
        out.append(
            f"dump: {r['requests_in_flight']} requests in flight x "
            f"{human(r['dump_bytes_per_request'])} (max_len {r['max_len']}) = "
            f"{human(r['dump_bytes_in_flight'])} > shm budget "
            f"{human(r['shm_budget_bytes'])}; lower client.requests_in_flight to "
            f"{max(r['requests_that_fit_budget'], 1)} or raise dump.shm_budget_gb"
            + (" (one request alone exceeds it)" if r["requests_that_fit_budget"] < 1 else "")
        )
    if r["dump_bytes_in_flight"] > r["dump_free_bytes"]:
        out.append(
            f"dump: {human(r['dump_bytes_in_flight'])} in flight but {r['dump_dir']} has "
            f"{human(r['dump_free_bytes'])} free; lower client.requests_in_flight, free "
            "/dev/shm, or point dump.dir at a larger filesystem"
        )
    need = 2 * r["dump_bytes_in_flight"]
    if r["mem_available_bytes"] and need > r["mem_available_bytes"]:
        out.append(
            f"memory: {r['requests_in_flight']} requests in flight hold "
            f"{human(r['dump_bytes_in_flight'])} of pieces in /dev/shm (RAM) and as much again "
            f"in the chunk job while it packs them, {human(need)}, but "
            f"{human(r['mem_available_bytes'])} is available; lower client.requests_in_flight "
            "(per DP replica: x sglang.dp_size)"
        )
    return out
