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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsextract.errors import HsextractError

STREAM_DIR = "stream"
JOURNAL = "journal.jsonl"
ACKS = "acks.jsonl"
LOCK = "journal.lock"


class StreamError(HsextractError):
    """The stream's files are inconsistent, or a chunk does not match its announcement."""


def stream_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / STREAM_DIR


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every complete, parseable line of a JSON-lines file (none if it does not exist).

    A torn last line -- a writer killed mid-append -- has no newline and is skipped: a
    reader never acts on half an announcement.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for n, raw in enumerate(data.split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            out.append(json.loads(raw))
        except ValueError as exc:
            raise StreamError(
                f"{path} line {n} is not JSON ({exc}); the file was edited or damaged: "
                "restore it or start a new run"
            ) from exc
    return out


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

    def unacked(self, final_pass: int = 1) -> list[dict[str, Any]]:
        return [c for s, c in sorted(self.chunks.items()) if not self.is_acked(s, final_pass)]


def read_state(sdir: Path) -> StreamState:
    st = StreamState()
    for line in read_lines(sdir / JOURNAL):
        if line.get("type") == "chunk":
            st.chunks[int(line["seq"])] = line
        elif line.get("type") == "end_pass":
            st.ends[int(line["pass"])] = line
    for line in read_lines(sdir / ACKS):
        if line.get("type") == "ack":
            for s in line["seqs"]:
                prev = st.acked.get(int(s))
                if prev is None or prev[0] < int(line.get("pass", 1)):
                    st.acked[int(s)] = (int(line.get("pass", 1)), float(line.get("at", 0)))
        elif line.get("type") == "nack":
            st.nacked[int(line["seq"])] = line
    return st


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
    size = (run_dir / path).stat().st_size
    with locked(sdir):
        st = read_state(sdir)
        old = st.find(chunk, pass_)
        redo = old is not None and st.nack_open(int(old["seq"]))
        if (
            old is not None
            and not redo
            and (old["sha256"] == sha256 or st.is_acked(old["seq"], final_pass))
        ):
            _maybe_end_pass(sdir, st, pass_, n_chunks)
            return int(old["seq"]), False
        # A chunk redone with other bytes (Snakemake removed the announced file of a
        # killed job, and the engine is not bit-deterministic), or redone because the
        # trainer nacked it (same bytes or not: the new line answers the nack): a new
        # revision of the same seq, the same records.  Readers open the latest revision.
        seq = st.next_seq if old is None else int(old["seq"])
        line = {
            "type": "chunk",
            "seq": seq,
            "chunk": chunk,
            "path": path,
            "bytes": size,
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
