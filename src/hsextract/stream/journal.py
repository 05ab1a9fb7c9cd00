"""The journal (producer -> trainer) and the ack file (trainer -> producer): JSON lines.

Both are append-only and fsynced line by line.  Why files and not a database: a plain
file on a shared filesystem is all a SLURM extractor and a trainer on another node share,
and an appended line is atomic enough when a reader takes only complete lines.  Stdlib
only: a chunk job's gate must not pay for a torch import.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsextract.errors import HsextractError

STREAM_DIR = "stream"
JOURNAL = "journal.jsonl"
ACKS = "acks.jsonl"
#: Each payload the producer deleted, once acknowledged (stream.gate.delete_acked).
DELETED = "deleted.jsonl"
LOCK = "journal.lock"


class StreamError(HsextractError):
    """The stream's files are inconsistent, or a chunk does not match its announcement."""


def stream_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / STREAM_DIR


#: How much of a file a follower reads at once (its first look at a long journal).
READ_BLOCK = 1 << 22


@dataclass
class LineFollower:
    """A JSON-lines file read incrementally: each look reads only what was appended since
    the last, and returns the complete lines among it.

    Why: readers look at the journal and the ack file every poll while a run goes on, and
    re-reading both whole made each look cost the run's length (a million-chunk journal
    is ~400 MB).  A look reads the bytes appended since the last one, plus, when there are
    any, the last line it took (to see the file rewritten in place); an idle look reads
    nothing.

    - A torn last line (no newline yet: a writer mid-append, or killed) is not taken; it
      is read again at the next look, and taken once complete.
    - The next writer's repair cuts a torn tail only, which was never taken, so the file
      never shrinks below what was taken; if it does, or the file was replaced (another
      inode) or rewritten where it was taken, the next look starts over from the top and
      says so (``reset``): the caller drops what it built from the old file.
    """

    path: Path
    offset: int = 0  # bytes taken: the end of the last complete line
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file taken from
    line_no: int = 0  # lines taken (for a damaged line's number)
    last: bytes = b""  # the last line taken, newline included
    #: Bytes this follower has read, in all: what a look costs (tests assert on it).
    bytes_read: int = 0

    def read_new(self) -> tuple[bool, list[dict[str, Any]]]:
        """(reset, lines): the complete lines appended since the last look; with ``reset``
        the file was replaced, cut back or rewritten, and ``lines`` are all of it."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            reset = self.ident is not None
            self._restart(None)
            return reset, []
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            if ident == self.ident and st.st_size == self.offset:
                return False, []  # an idle look (the poll's usual one) reads nothing
            start = self.offset - len(self.last)
            reset = False
            if ident != self.ident or st.st_size < self.offset or not self._same_last(fd, start):
                reset = self.ident is not None
                self._restart(ident)
            return reset, self._take(fd, st.st_size)
        finally:
            os.close(fd)

    def _restart(self, ident: tuple[int, int] | None) -> None:
        self.offset, self.ident, self.line_no, self.last = 0, ident, 0, b""

    def _same_last(self, fd: int, start: int) -> bool:
        if not self.last:
            return True
        seen = os.pread(fd, len(self.last), start)
        self.bytes_read += len(seen)
        return seen == self.last

    def _take(self, fd: int, size: int) -> list[dict[str, Any]]:
        """Parse every complete line in [offset, size); commit the offset only once all of
        them parsed, so a damaged line fails every look alike."""
        out: list[dict[str, Any]] = []
        pos, n, last, rest = self.offset, self.line_no, self.last, b""
        while pos < size:
            block = os.pread(fd, min(READ_BLOCK, size - pos), pos)
            if not block:
                break  # cut back while read: the rest is the next look's
            self.bytes_read += len(block)
            pos += len(block)
            data = rest + block
            end = data.rfind(b"\n") + 1
            rest = data[end:]
            for raw in data[:end].split(b"\n")[:-1]:
                n += 1
                last = raw + b"\n"
                if not raw.strip():
                    continue
                try:
                    out.append(json.loads(raw))
                except ValueError as exc:
                    raise StreamError(
                        f"{self.path} line {n} is not JSON ({exc}); the file was edited or "
                        "damaged: restore it or start a new run"
                    ) from exc
        self.offset, self.line_no, self.last = pos - len(rest), n, last
        return out


def file_identity(p: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns): what says a file is unwritten since it was last looked at,
    without reading it (None: gone).  No st_dev: NFS numbers a mount per client, so another
    node would see another device."""
    try:
        s = p.stat()
    except FileNotFoundError:
        return None
    return (s.st_ino, s.st_size, s.st_mtime_ns)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every complete, parseable line of a JSON-lines file (none if it does not exist).

    A torn last line -- a writer killed mid-append -- has no newline and is skipped: a
    reader never acts on half an announcement.
    """
    return LineFollower(Path(path)).read_new()[1]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: Path, obj: dict[str, Any]) -> None:
    """Append one line durably.  The caller holds the lock where order matters.

    A torn tail left by a crash is cut first, so the new line starts a line of its own.
    """
    line = (json.dumps(obj, sort_keys=True) + "\n").encode()
    new = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            last = os.pread(fd, 1, size - 1)
            if last != b"\n":
                tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
                os.ftruncate(fd, size - (len(tail) - tail.rfind(b"\n") - 1))
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        _fsync_dir(path.parent)


@contextlib.contextmanager
def locked(sdir: Path) -> Iterator[None]:
    """The stream's one lock: announcing, the gate's decision and deletion take it."""
    sdir.mkdir(parents=True, exist_ok=True)
    with open(sdir / LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@dataclass
class StreamState:
    """The journal and acks as of one read: what each side decides from."""

    chunks: dict[int, dict[str, Any]] = field(default_factory=dict)  # seq -> chunk line
    ends: dict[int, dict[str, Any]] = field(default_factory=dict)  # pass -> end_pass line
    #: seq -> the highest pass an ack covered it in, and when.
    acked: dict[int, tuple[int, float]] = field(default_factory=dict)
    nacked: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: seq -> its last line in deleted.jsonl (the payload removed after its ack).
    deleted: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def next_seq(self) -> int:
        return max(self.chunks, default=-1) + 1

    def find(self, chunk: str, pass_: int) -> dict[str, Any] | None:
        for line in self.chunks.values():
            if line["chunk"] == chunk and line["pass"] == pass_:
                return line
        return None

    def is_acked(self, seq: int, final_pass: int = 1) -> bool:
        """Acked for good: covered by a checkpoint of the last pass that reads it."""
        return seq in self.acked and self.acked[seq][0] >= final_pass

    def nack_open(self, seq: int) -> bool:
        """The trainer nacked this seq's latest revision: no newer one answers it yet."""
        nack, line = self.nacked.get(seq), self.chunks.get(seq)
        if nack is None or line is None:
            return False
        if "rev" in nack:
            return int(line.get("rev", 0)) <= int(nack["rev"])
        return float(line.get("at", 0)) <= float(nack.get("at", 0))  # a nack without its rev

    def freed(self, seq: int) -> bool:
        """The deletion log covers this seq's latest revision: its payload was removed.  A
        revision announced after the deletion (an acked chunk redone on request) is a new
        payload, freed after its ack like any other.  A line without ``rev`` (written before
        deletions carried it) covers the seq whatever its revision."""
        d, line = self.deleted.get(seq), self.chunks.get(seq)
        if d is None:
            return False
        if line is None or "rev" not in d:
            return True
        return int(d["rev"]) >= int(line.get("rev", 0))

    def unacked(self, final_pass: int = 1) -> list[dict[str, Any]]:
        return [c for s, c in sorted(self.chunks.items()) if not self.is_acked(s, final_pass)]


class StreamFollower:
    """The journal, the ack file and the deletion log followed incrementally into one
    :class:`StreamState`: each look applies only the lines appended since the last (see
    :class:`LineFollower`).
    Applying a line is idempotent (a chunk line sets its seq, an ack raises a pass), so a
    caller that added a line it just appended to the state loses nothing."""

    def __init__(self, sdir: Path) -> None:
        self.journal = LineFollower(Path(sdir) / JOURNAL)
        self.acks = LineFollower(Path(sdir) / ACKS)
        self.deleted = LineFollower(Path(sdir) / DELETED)
        self.st = StreamState()

    def state(self) -> StreamState:
        reset, lines = self.journal.read_new()
        if reset:
            self.st.chunks.clear()
            self.st.ends.clear()
        for line in lines:
            if line.get("type") == "chunk":
                self.st.chunks[int(line["seq"])] = line
            elif line.get("type") == "end_pass":
                self.st.ends[int(line["pass"])] = line
        reset, lines = self.acks.read_new()
        if reset:
            self.st.acked.clear()
            self.st.nacked.clear()
        for line in lines:
            if line.get("type") == "ack":
                p = int(line.get("pass", 1))
                for s in line["seqs"]:
                    prev = self.st.acked.get(int(s))
                    if prev is None or prev[0] < p:
                        self.st.acked[int(s)] = (p, float(line.get("at", 0)))
            elif line.get("type") == "nack":
                self.st.nacked[int(line["seq"])] = line
        reset, lines = self.deleted.read_new()
        if reset:
            self.st.deleted.clear()
        for line in lines:
            self.st.deleted[int(line["seq"])] = line
        return self.st


#: Each thread's followers, by stream dir: a thread's state is changed by its own looks
#: only, so a caller may read it without a lock while another thread looks too.
_LOCAL = threading.local()


def follower(sdir: Path) -> StreamFollower:
    """This thread's follower of ``sdir`` (made at its first look)."""
    mine: dict[Path, StreamFollower] = _LOCAL.__dict__.setdefault("followers", {})
    key = Path(sdir).absolute()
    if key not in mine:
        mine[key] = StreamFollower(key)
    return mine[key]


def read_state(sdir: Path) -> StreamState:
    """The stream as of now, read incrementally: this thread's follower of ``sdir`` takes
    the lines appended since its last look.  The state is the follower's own: valid until
    this thread's next ``read_state`` of the same dir, which updates it in place."""
    return follower(sdir).state()


def announce(
    run_dir: Path,
    *,
    chunk: str,
    path: str,
    sha256: str,
    records: int,
    tokens: int,
    content_digest: str,
    n_chunks: int,
    shapes: dict[str, Any] | None = None,
    pass_: int = 1,
    final_pass: int = 1,
) -> tuple[int, bool]:
    """Announce a finished chunk once: (its seq, whether this call appended it).

    Idempotent: a line for the same chunk and pass already there (a job announced, then
    was killed before Snakemake saw it finish, and was rerun) returns that seq, and so
    does one already acknowledged (the caller removes the redundant file).
    The pass's last chunk also appends its ``end_pass`` line.  ``shapes`` (hidden and
    aux widths, dtype, prenorm) lets a reader shape padding without opening a chunk.
    """
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    # The payload's identity as announced: the producer's deletion rule (stream.gate) frees
    # only this file, unwritten since (a stat, where a sha256 would read it).
    fs = (run_dir / path).stat()
    with locked(sdir):
        st = read_state(sdir)
        old = st.find(chunk, pass_)
        redo = old is not None and st.nack_open(int(old["seq"]))
        acked = old is not None and st.is_acked(old["seq"], final_pass)
        # An acked chunk redone on request (its receipt forced) wrote a new file: a new
        # revision records that file's identity, so the deletion rule frees it (it is
        # acked already) by a stat, as it freed the first.  The trainer read this seq.
        replaced = acked and (fs.st_ino, fs.st_size, fs.st_mtime_ns) != (
            old.get("ino"),
            old.get("bytes"),
            old.get("mtime_ns"),
        )
        if old is not None and not redo and not replaced and (old["sha256"] == sha256 or acked):
            _maybe_end_pass(sdir, st, pass_, n_chunks)
            return int(old["seq"]), False
        # A chunk redone with other bytes (Snakemake removed the announced file of a
        # killed job, and the engine is not bit-deterministic), or redone because the
        # trainer nacked it (same bytes or not: the new line answers the nack), or an acked
        # chunk redone on request (above): a new revision of the same seq, the same
        # records.  Readers open the latest revision.
        seq = st.next_seq if old is None else int(old["seq"])
        line = {
            "type": "chunk",
            "seq": seq,
            "chunk": chunk,
            "path": path,
            "bytes": fs.st_size,
            "ino": fs.st_ino,
            "mtime_ns": fs.st_mtime_ns,
            "sha256": sha256,
            "records": records,
            "tokens": tokens,
            "content_digest": content_digest,
            "pass": pass_,
            "shapes": shapes,
            "rev": 0 if old is None else int(old.get("rev", 0)) + 1,
            "at": round(time.time(), 3),
        }
        append_line(sdir / JOURNAL, line)
        st.chunks[seq] = line
        _maybe_end_pass(sdir, st, pass_, n_chunks)
        return seq, True


def _maybe_end_pass(sdir: Path, st: StreamState, pass_: int, n_chunks: int) -> None:
    if pass_ in st.ends:
        return
    mine = [c for c in st.chunks.values() if c["pass"] == pass_]
    if len({c["chunk"] for c in mine}) < n_chunks:
        return
    line = {
        "type": "end_pass",
        "pass": pass_,
        "chunks": len(mine),
        "seqs": sorted(c["seq"] for c in mine),
        "records": sum(c["records"] for c in mine),
        "at": round(time.time(), 3),
    }
    append_line(sdir / JOURNAL, line)
    st.ends[pass_] = line


class AckWriter:
    """The trainer's side of the ack file: one rank writes, after a checkpoint committed.

    Why after: an ack lets the producer delete the chunk, so a chunk acked before its
    checkpoint is durable could be gone when the trainer resumes from the previous one.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.sdir = stream_dir(run_dir)
        self.sdir.mkdir(parents=True, exist_ok=True)

    def ack(self, seqs: list[int] | set[int], *, pass_: int = 1, step: int | None = None) -> None:
        from hsextract import faults

        if faults.ACTIVE:  # a test's kill between a checkpoint's commit and its ack
            faults.around_ack("before")
        if not seqs:
            return
        line = {
            "type": "ack",
            "seqs": sorted(int(s) for s in seqs),
            "pass": pass_,
            "step": step,
            "at": round(time.time(), 3),
        }
        with locked(self.sdir):
            append_line(self.sdir / ACKS, line)
        if faults.ACTIVE:  # ... or right after it, "after_last" once the pass is all acked
            st = read_state(self.sdir)
            end = st.ends.get(pass_)
            done = end is not None and all(st.is_acked(int(s), pass_) for s in end["seqs"])
            faults.around_ack("after_last" if done else "after")

    def nack(self, seq: int, expected: str, seen: str, rev: int = 0) -> None:
        """``rev``: the revision read; a newer one (the producer's redo) answers the nack."""
        line = {
            "type": "nack",
            "seq": int(seq),
            "rev": int(rev),
            "sha256_expected": expected,
            "sha256_seen": seen,
            "at": round(time.time(), 3),
        }
        with locked(self.sdir):
            append_line(self.sdir / ACKS, line)
