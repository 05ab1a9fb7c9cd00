"""The disk budget: a chunk job waits before sending while the trainer is too far behind.

Unacknowledged bytes are measured on disk (``stat`` of every announced, unacked chunk file;
a deleted one counts nothing) plus the reservations of chunk jobs between their gate and
their announcement: bookkeeping alone would miss a file a user copied in, and would count
one already gone.  Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from hsextract.budget import human
from hsextract.commands import hsextract_command, snakemake_command
from hsextract.config_types import StreamConfig
from hsextract.stream.checkpoints import late_checkpoint_text
from hsextract.stream.journal import (
    ACKS,
    DELETED,
    StreamError,
    StreamState,
    append_line,
    file_identity,
    locked,
    read_lines,
    read_state,
    stream_dir,
)

log = logging.getLogger("hsextract")

GB = 1e9
INFLIGHT = "inflight"
GATE = "gate.json"
#: Samples of disk in use through the run (the report's figure): one line per change.
USAGE = "usage.jsonl"
#: A chunk file's bytes beyond its rows (safetensors header, metadata), before one is seen.
HEADER_SLACK = 1 << 16
#: How often a waiting chunk job writes its progress line to the chunk's log.
REPORT_EVERY_S = 60.0


class BudgetRefused(StreamError):
    """The budget cannot hold the trainer's window: the run would deadlock, so it never starts."""


class StreamSettings(StreamConfig):
    """``stream.*`` as the gate uses it: the typed config's own fields and defaults (each
    declared once, with its help, in :mod:`hsextract.settings`), plus what the gate derives
    from them.  No field of its own, so no second list of defaults can drift from the
    declarations.  Built from a config by :func:`settings_of`; tests construct it directly
    with ``budget_gb``."""

    @property
    def budget_bytes(self) -> int:
        if self.budget_gb is None:
            raise StreamError("stream.budget_gb is null: the stream is off, there is no budget")
        return round(self.budget_gb * GB)

    @property
    def final_pass(self) -> int:
        """The pass whose ack frees a chunk: keep re-reads pass 1's files every pass."""
        return self.passes if self.epochs_mode == "keep" else 1

    def window_chunks(self) -> int:
        """Chunks the trainer needs on disk to reach the checkpoint that acks any: its open
        chunks (every rank and loader worker reads the same ones, each its share of their
        records, so neither multiplies them), those consumed since the last checkpoint, and
        the one being written."""
        return self.prefetch_chunks + self.checkpoint_chunks + 1


def settings_of(cfg: Any) -> StreamSettings | None:
    """The stream's settings, or None when ``stream.budget_gb`` is null (an offline run)."""
    s = getattr(cfg, "stream", None)
    if s is None or s.budget_gb is None:
        return None
    return StreamSettings(**{f.name: getattr(s, f.name) for f in fields(StreamConfig)})


def check_window(
    ss: StreamSettings, largest_chunk_bytes: int, run_bytes: int, basis: str = ""
) -> None:
    """Refuse a budget the trainer cannot make progress in, in one sentence with the numbers.

    The trainer needs its whole window on disk before it can reach the checkpoint that
    acks any of it; a smaller budget waits forever on both sides.  ``basis``: how the
    chunk bytes were estimated (measured, or the codec's), said in the sentence.
    """
    w = ss.window_chunks()
    # A trainer stalled for its next chunk still holds up to w - 1 chunks unacked (all
    # but the one being written); the shut gate reopens only below low_mark x budget, so
    # that must hold them too.
    chunks = max(w, (w - 1) / ss.low_mark)
    need = int(chunks * largest_chunk_bytes)
    if ss.budget_bytes < need:
        raise BudgetRefused(
            f"stream.budget_gb {ss.budget_gb:.6g} ({human(ss.budget_bytes)}) is smaller "
            f"than the trainer's window: ({ss.prefetch_chunks} chunks held (all ranks and "
            f"loader workers share them) + {ss.checkpoint_chunks} chunks between checkpoints "
            f"+ 1) = {w} chunks, or {w - 1} chunks / stream.low_mark "
            f"{ss.low_mark:g} = {(w - 1) / ss.low_mark:.3g} (the gate reopens below the low "
            f"mark), x {human(largest_chunk_bytes)} (the largest chunk's estimate) = "
            f"{human(need)}{basis}; raise stream.budget_gb or shrink the window (stream.* "
            "keys, or smaller chunks: n_chunks)"
        )
    if ss.epochs_mode == "keep" and ss.passes > 1 and ss.budget_bytes < run_bytes:
        raise BudgetRefused(
            f"stream.epochs_mode keep with {ss.passes} passes keeps every chunk until the "
            f"last pass, ~{human(run_bytes)}, more than stream.budget_gb "
            f"{ss.budget_gb:.6g} ({human(ss.budget_bytes)}): use epochs_mode "
            "regenerate, one pass, or a budget of the whole run"
        )


def _on_disk(run_dir: Path, line: dict[str, Any]) -> int:
    try:
        return (run_dir / line["path"]).stat().st_size
    except FileNotFoundError:
        return 0


#: This process's reservations: chunk -> the descriptor holding its file's flock.
_held: dict[str, int] = {}


def _reserve(sdir: Path, chunk: str, entry: dict[str, Any]) -> None:
    """Write a chunk's reservation, flock'ed by this process until :func:`release`.

    The lock is the liveness: the kernel drops it when the job dies (a SIGKILL, a SLURM
    cancel), on whichever node the job ran, so the next gate on any node frees a dead
    job's bytes.  A pid names a process on one host only: across nodes a cancelled job's
    reservation would hold its bytes until that chunk was redone, and a budget sized at
    the trainer's window would deadlock.  The file is locked before it is renamed into
    place, so no gate ever sees it unheld.
    """
    d = sdir / INFLIGHT
    d.mkdir(exist_ok=True)
    tmp = d / f".{chunk}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(entry, sort_keys=True).encode())
        os.replace(tmp, d / f"{chunk}.json")
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    old = _held.pop(chunk, None)
    if old is not None:
        os.close(old)
    _held[chunk] = fd


def _alive(path: Path) -> bool:
    """A reservation's job still runs: its flock is held (see :func:`_reserve`).  The
    probe opens the file for writing: NFS emulates flock with POSIX locks, whose
    exclusive lock needs it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _live(sdir: Path, *, exclude: str | None = None) -> dict[str, dict[str, Any]]:
    """The entries of live chunk jobs' reservation files (a dead job's are removed)."""
    out = {}
    d = sdir / INFLIGHT
    if not d.is_dir():
        return out
    for p in d.glob("*.json"):
        if p.stem == exclude:
            continue
        if not _alive(p):
            p.unlink(missing_ok=True)  # a dead job's: ours, and it will not announce
            continue
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # removed by its job right now
    return out


def reservations(sdir: Path, *, exclude: str | None = None) -> dict[str, int]:
    """Bytes reserved by live chunk jobs between their gate and their announcement (a
    redo's marker reserves nothing: its bytes count already, see :func:`wait_for_room`)."""
    return {k: int(e["bytes"]) for k, e in _live(sdir, exclude=exclude).items()
            if "bytes" in e and "redo_of" not in e}  # fmt: skip


#: A chunk writer's temporary names (chunks.ChunkWriter): the partial chunk file and the
#: spill of records encoded ahead of their turn, ``.<chunk>.safetensors.<pid>[.spill].tmp``.
_TEMP = re.compile(r"\.(chunk_\d{5})\.safetensors\.\d+(?:\.spill)?\.tmp")
_PASS_DIR = re.compile(r"pass([2-9]|[1-9]\d+)")


def temp_files(run_dir: Path) -> dict[str, list[tuple[Path, int]]]:
    """Gate key (the chunk, ``<chunk>.pass<p>`` for a later pass) -> the chunk writers'
    temporary files of that chunk in ``hidden/[pass<p>/]``, with their bytes: only names
    of ours, regular files (a link is never followed, nor counted)."""
    hidden = Path(run_dir) / "hidden"
    out: dict[str, list[tuple[Path, int]]] = {}
    dirs = [(hidden, "")]
    with os.scandir(hidden) if hidden.is_dir() else contextlib.nullcontext([]) as it:
        dirs += [(Path(e.path), f".{e.name}") for e in it
                 if _PASS_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]  # fmt: skip
    for d, suffix in dirs:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(d) as it:
            for e in it:
                m = _TEMP.fullmatch(e.name)
                if m is None:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out.setdefault(m.group(1) + suffix, []).append((Path(e.path), st.st_size))
    return out


def _payload_of(run_dir: Path, key: str) -> Path:
    chunk, _, p = key.partition(".pass")
    return Path(run_dir) / "hidden" / (f"pass{p}" if p else "") / f"{chunk}.safetensors"


def jobs_bytes(
    run_dir: Path, st: StreamState, *, exclude: str | None = None, remove_dead: bool = False
) -> dict[str, int]:
    """What chunk jobs hold on disk beyond the journal's payloads, by gate key: a live
    job's reservation, or its files if they are larger (the partial file and spill, and
    its payload once renamed, until announced: a reservation is an estimate, and a
    stored chunk can outgrow it); a dead job's temporary files in full.  A redo's marker
    reserves nothing, and its files count beyond the announced bytes its missing payload
    holds already (:func:`unacked_bytes`).  ``remove_dead`` (the caller holds the lock):
    a dead job's temporary files are removed instead (no job will finish them: a rerun
    writes its own), so they count nothing."""
    run_dir = Path(run_dir)
    live = _live(stream_dir(run_dir), exclude=exclude)
    temps = temp_files(run_dir)
    out: dict[str, int] = {}
    for key, files in temps.items():
        if key in live:  # ``exclude``'s own are a dead attempt's: one job per chunk at a time
            continue
        if remove_dead:
            for f, _ in files:
                f.unlink(missing_ok=True)  # a dead job's: it will never rename it
                log.info("removed %s, a dead chunk job's temporary file", f)
        else:
            out[key] = sum(n for _, n in files)
    for key, e in live.items():
        on_disk = sum(n for _, n in temps.get(key, []))
        chunk, _, p = key.partition(".pass")
        line = st.find(chunk, int(p or 1))
        if line is None:
            on_disk += _on_disk(run_dir, {"path": _payload_of(run_dir, key)})
        if isinstance(e.get("redo_of"), list):
            held = 0 if line is None or _on_disk(run_dir, line) else int(line["bytes"])
            out[key] = max(0, on_disk - held)
        else:
            out[key] = max(int(e.get("bytes", 0)), on_disk)
    return out


def _redos_running(sdir: Path) -> set[tuple[str, int]]:
    """(chunk, pass) of each redo of an announced, unacked chunk whose job runs now."""
    return {(str(e["redo_of"][0]), int(e["redo_of"][1])) for e in _live(sdir).values()
            if isinstance(e.get("redo_of"), list)}  # fmt: skip


def open_nacks(st: StreamState, final_pass: int) -> list[dict[str, Any]]:
    """The chunks the trainer nacked and waits for (no newer revision answers the nack, not
    acked since): it trains on nothing past them, so no ack comes until each is redone.
    ``taken_up``: a plan deleted it for its redo (a ``why: nack`` line for that revision)."""
    out = []
    for seq in sorted(st.nacked):
        line = st.chunks.get(seq)
        if line is None or not st.nack_open(seq) or st.is_acked(seq, final_pass):
            continue
        rev = int(line.get("rev", 0))
        d = st.deleted.get(seq) or {}
        taken_up = d.get("why") == "nack" and int(d.get("rev", -1)) == rev
        out.append({"seq": seq, "chunk": line["chunk"], "pass": int(line["pass"]), "rev": rev,
                    "path": line["path"], "taken_up": taken_up})  # fmt: skip
    return out


def _stuck_on_nack(run_dir: Path, waiting: str, nack: dict[str, Any]) -> StreamError:
    """The sentence a chunk job fails with when its gate is shut while the trainer waits
    for the redo of a nacked chunk no job of this run is making: both would wait forever."""
    receipt = (run_dir / nack["path"]).with_suffix(".json")
    redo = snakemake_command("-f", receipt, run_dir=run_dir)
    rest = snakemake_command("extract_all", run_dir=run_dir)
    return StreamError(
        f"{waiting}: the gate is shut and the trainer nacked {nack['chunk']} (seq "
        f"{nack['seq']}, pass {nack['pass']}: its bytes are not the announced sha256), so it "
        "waits for that chunk's redo and acks nothing, and no job of this run is redoing it: "
        f"a new run redoes it as a new revision the trainer reads: `{redo}` (its receipt, "
        f"forced), then `{rest}` for the rest"
    )


def unacked_bytes(run_dir: Path, st: StreamState, final_pass: int) -> int:
    """What announced, unacked chunks hold on disk; one whose payload is gone (lost
    before its ack, or nacked and deleted) counts its announced bytes: it will be redone
    past the gate (see wait_for_room), so its room stays held."""
    return sum(_on_disk(run_dir, c) or int(c["bytes"]) for c in st.unacked(final_pass))


#: Why an acked payload waits for ``hsextract stream gc``: only its sha256 can tell it is ours.
UNPROVEN = (
    "written to since it was announced (not the inode and mtime announced): only its sha256 "
    "can tell it is the file we wrote, which a gate does not read (the stream's gc does)"
)
#: gc's verdicts on payloads it hashed and left (status counts them no more): JSON lines.
GC_LEFT = "gc_left.jsonl"


def _announced(line: dict[str, Any]) -> tuple[int, int, int] | None:
    """The payload's identity recorded when it was announced (None: a line of an older
    hsextract, which recorded none)."""
    if "ino" not in line or "mtime_ns" not in line:
        return None
    return (int(line["ino"]), int(line["bytes"]), int(line["mtime_ns"]))


def _not_ours(run_dir: Path, line: dict[str, Any], sha256: str | None = None) -> str | None:
    """The producer's one deletion rule: why the payload an announcement names may not be
    deleted ("gone": nothing there; :data:`UNPROVEN`: its sha256 must tell), or None: it
    is the file we announced.

    Ours: the path the journal names, inside the run dir, not a symlink, of the size
    announced, and either unwritten since its announcement (its inode and mtime are the
    ones recorded then: a stat) or, only where it was written to, hashing to the announced
    sha256 (``sha256``: its hash, which ``hsextract stream gc`` takes outside the lock).
    Why the identity and not the sha256 at every gate: a gate would read every payload it
    frees, under the stream's lock; a file replaced (another inode) or written in place
    (another mtime) fails the stat, and one whose bytes changed without either (a disk
    fault) is still the file we wrote, acked: freeing it loses nothing.
    """
    p = run_dir / line["path"]
    if p.is_symlink():
        return "a symlink, not the file we wrote"
    if run_dir.resolve() not in p.resolve().parents:
        return "outside the run dir"
    ident = file_identity(p)
    if ident is None:
        return "gone"
    if ident[1] != line["bytes"]:
        return f"{ident[1]} bytes, announced {line['bytes']}: not the file we wrote"
    if ident == _announced(line):
        return None
    if sha256 is None:
        return UNPROVEN
    if sha256 != line["sha256"]:
        return f"its bytes are not the announced sha256 {line['sha256'][:12]}...: changed"
    return None


def _unlink_acked(run_dir: Path, seq: int, c: dict[str, Any]) -> None:
    """Delete an acked payload found ours, and log it (the caller holds the lock)."""
    (run_dir / c["path"]).unlink()
    append_line(
        stream_dir(run_dir) / DELETED,
        {
            "seq": seq,
            "chunk": c["chunk"],
            "path": c["path"],
            "bytes": c["bytes"],
            "sha256": c["sha256"],
            "rev": int(c.get("rev", 0)),
            "why": "ack",
            "at": round(time.time(), 3),
        },
    )


def _freeable(
    run_dir: Path, st: StreamState, final_pass: int, keep: str | None = None
) -> list[tuple[int, dict[str, Any], str | None]]:
    """(seq, line, why not ours) of every payload acked for good and on disk, not yet
    logged deleted: what the deletion rule looks at."""
    out = []
    for seq, c in sorted(st.chunks.items()):
        if not st.is_acked(seq, final_pass) or st.freed(seq) or c["path"] == keep:
            continue
        why = _not_ours(run_dir, c)
        if why != "gone":
            out.append((seq, c, why))
    return out


def delete_acked(
    run_dir: Path, st: StreamState, final_pass: int, *, keep: str | None = None
) -> list[str]:
    """A gate's and an announcement's deletion: remove the payload of every chunk acked for
    good that :func:`_not_ours` proves ours by a stat (one written to since its
    announcement waits for ``hsextract stream gc``, which hashes it).  The caller holds
    the lock.  The sidecar stays (the receipt, stream.receipts); the line says which bytes
    it stands for.  ``keep``: the path the calling job just wrote (an acked chunk redone
    on request, its receipt forced): Snakemake has yet to see it."""
    gone = []
    for seq, c, why in _freeable(run_dir, st, final_pass, keep):
        if why is None:
            _unlink_acked(run_dir, seq, c)
            gone.append(c["path"])
    return gone


def gc(run_dir: Path, ss: StreamSettings) -> dict[str, Any]:
    """``hsextract stream gc``: free the payloads acked after the last chunk job's look
    (deletion otherwise happens at a gate or an announcement only, and the last chunk's
    job may have ended before the trainer's last acks), by the producer's one rule
    (:func:`_not_ours`), and those a gate leaves to it: written to since announced, freed
    if their bytes are still the announced sha256.  Logged in ``deleted.jsonl``, a usage
    sample after.  What it freed and what it left, and why.

    The hashes are taken outside the stream's lock (acks and every gate take it; tens of
    GB to hash would hold them all): the candidates and their identity are picked under
    it, then, under it again, only those still acked and unlogged, with the same journal
    line and identity, are deleted."""
    from hsextract.chunkfile import sha256_file

    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    left: list[tuple[str, str]] = []
    with locked(sdir):
        jobs_bytes(run_dir, read_state(sdir), remove_dead=True)  # a dead job's temp files
        picked = [
            (seq, c, why, file_identity(run_dir / c["path"]))
            for seq, c, why in _freeable(run_dir, read_state(sdir), ss.final_pass)
        ]
    hashed: dict[int, str] = {}
    for seq, c, why, _ in picked:
        if why == UNPROVEN:
            try:
                hashed[seq] = sha256_file(run_dir / c["path"])
            except FileNotFoundError:
                continue
    gone: list[str] = []
    with locked(sdir):
        st = read_state(sdir)
        for seq, c, _, ident in picked:
            now = st.chunks.get(seq)
            same = now is not None and all(
                now.get(k) == c.get(k) for k in ("path", "sha256", "rev")
            )
            if not same or not st.is_acked(seq, ss.final_pass) or st.freed(seq):
                continue  # redone, or freed by a gate meanwhile: not what was picked
            if file_identity(run_dir / c["path"]) != ident:
                continue  # written to while hashed: the next gc looks again
            verdict = _not_ours(run_dir, c, hashed.get(seq))
            if verdict is None:
                _unlink_acked(run_dir, seq, c)
                gone.append(c["path"])
                continue
            left.append((c["path"], verdict))
            if seq in hashed:  # a verdict on these very bytes: status counts them no more
                append_line(sdir / GC_LEFT, {"seq": seq, "path": c["path"],
                                             "identity": list(ident or ()), "why": verdict,
                                             "at": round(time.time(), 3)})  # fmt: skip
        record_usage(run_dir, read_state(sdir), ss, "gc", "")
    return {"deleted": gone, "freed_bytes": sum(int(c["bytes"]) for _, c, _, _ in picked
                                                if c["path"] in gone), "left": left}  # fmt: skip


def acked_on_disk(run_dir: Path, st: StreamState, final_pass: int) -> list[dict[str, Any]]:
    """Announced payloads acked for good, still on disk, that the next gate or ``hsextract
    stream gc`` frees: ours by :func:`_not_ours` (a stat: a status reads no payload), or
    written to since announced (gc hashes it) unless gc already hashed these very bytes and
    left them (``gc_left.jsonl``).  Only those the deletion log does not name are looked at."""
    gc_left = {
        (int(v["seq"]), tuple(v["identity"])) for v in read_lines(stream_dir(run_dir) / GC_LEFT)
    }
    return [
        c
        for s, c, why in _freeable(run_dir, st, final_pass)
        if why is None
        or (why == UNPROVEN and (s, file_identity(run_dir / c["path"])) not in gc_left)
    ]


def usage_figures(run_dir: Path, st: StreamState, ss: StreamSettings) -> dict[str, Any]:
    """Disk in use now: the announced chunks not acknowledged for good (what the budget
    bounds), every announced payload still on disk (acked ones wait for the next gate or
    announcement to delete them), the live reservations, and whether the gate is shut.
    Only payloads the deletion log does not name are looked at (``stat``), so a sample
    costs the chunks on disk, not the run's."""
    sdir = stream_dir(run_dir)
    present = {c["path"]: c for s, c in st.chunks.items() if not st.freed(s)}
    return {
        "unacked_bytes": unacked_bytes(run_dir, st, ss.final_pass),
        "payload_bytes": sum(_on_disk(run_dir, c) for c in present.values()),
        "reserved_bytes": sum(reservations(sdir).values()),
        # What chunk jobs hold beyond the journal: max(reservation, files) of each live
        # one, a dead one's temporary files in full (jobs_bytes).
        "jobs_bytes": sum(jobs_bytes(run_dir, st).values()),
        "paused": bool(_gate_state(sdir).get("paused")),
        "budget_bytes": ss.budget_bytes,
    }


def record_usage(
    run_dir: Path, st: StreamState, ss: StreamSettings, event: str, chunk: str,
    last: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Append one durable sample of :func:`usage_figures` to ``usage.jsonl`` (the caller
    holds the lock, so samples are in the order of what they saw), unless the figures are
    ``last``'s: a gate polling while nothing changed adds no line.  The figures."""
    figures = usage_figures(run_dir, st, ss)
    if last is None or figures != {k: last.get(k) for k in figures}:
        at = round(time.time(), 3)
        append_line(stream_dir(run_dir) / USAGE, {"at": at, "event": event, "chunk": chunk,
                                                  **figures})  # fmt: skip
    return figures


def after_announce(
    run_dir: Path, ss: StreamSettings, chunk: str, *, keep: str | None = None
) -> list[str]:
    """A chunk job's last look, after announcing ``chunk``: a usage sample with it on
    disk, then free what was acked while the chunk was made -- now, not at the next
    chunk's gate, which the last chunks never reach -- and a sample after that.  ``keep``
    (this chunk's own payload, redone after its ack on request) is left to the next gate:
    Snakemake has yet to see it.  The payloads deleted."""
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    with locked(sdir):
        st = read_state(sdir)
        last = record_usage(run_dir, st, ss, "announce", chunk)
        jobs_bytes(run_dir, st, remove_dead=True)
        gone = delete_acked(run_dir, st, ss.final_pass, keep=keep)
        if gone:
            record_usage(run_dir, read_state(sdir), ss, "delete", chunk, last)
    return gone


def _gate_state(sdir: Path) -> dict[str, Any]:
    try:
        return json.loads((sdir / GATE).read_text())
    except (OSError, ValueError):
        return {"paused": False}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def measured_bytes_per_token(st: StreamState) -> float | None:
    """The largest bytes/token of the chunks announced so far (the codec's real ratio,
    the header's share included), or None before the first."""
    return max((c["bytes"] / c["tokens"] for c in st.chunks.values() if c.get("tokens")),
               default=None)  # fmt: skip


def estimate_bytes(st: StreamState, tokens: int, raw_bytes_per_token: int) -> int:
    """A chunk's size before it exists: its tokens at the largest bytes/token announced so
    far (the codec's real ratio), or at ``raw_bytes_per_token`` (the codec's size before
    any is measured: stream.producer) while nothing is."""
    seen = measured_bytes_per_token(st)
    if seen is not None:
        return int(tokens * seen) + 1
    return tokens * raw_bytes_per_token + HEADER_SLACK


def check_room(
    ss: StreamSettings, st: StreamState, *, raw_bytes_per_token: int, ratio_known: bool,
    largest_tokens: int, run_tokens: int,
) -> None:  # fmt: skip
    """:func:`check_window` at the bytes/token the gate knows: measured on the chunks
    announced so far, else the codec's (``raw_bytes_per_token``, exact for ``none`` and
    ``fp8``).  A lossless codec's ratio depends on the states: before its first chunk is
    measured only the uncompressed size bounds it, and sizing the window at that refused
    budgets the stored bytes hold (a 5 % budget of a lossless run needed ~1.5x the chunks).
    So until then only one chunk must fit (one that cannot would wait for acks of nothing),
    and each gate checks the window again, waiting ones too, once a chunk is measured: a
    budget too small is refused before the trainer's window fills it."""
    seen = measured_bytes_per_token(st)
    if seen is not None:
        check_window(ss, math.ceil(largest_tokens * seen), math.ceil(run_tokens * seen),
                     f", at {seen:,.0f} B/token (the largest of the chunks announced)")  # fmt: skip
    elif ratio_known:
        bpt = raw_bytes_per_token
        check_window(ss, largest_tokens * bpt, run_tokens * bpt, f", at {bpt:,} B/token")
    elif largest_tokens * raw_bytes_per_token + HEADER_SLACK > ss.budget_bytes:
        one = largest_tokens * raw_bytes_per_token + HEADER_SLACK
        raise BudgetRefused(
            f"stream.budget_gb {ss.budget_gb:.6g} ({human(ss.budget_bytes)}) cannot hold the "
            f"largest chunk before one is measured: {largest_tokens:,} tokens x "
            f"{raw_bytes_per_token:,} B/token uncompressed = {human(one)} (storage.codec "
            "lossless: its ratio is known once a chunk is written); raise stream.budget_gb "
            "or use smaller chunks (n_chunks)"
        )


def wait_for_room(
    run_dir: Path,
    ss: StreamSettings,
    *,
    chunk: str,
    tokens: int,
    raw_bytes_per_token: int,
    largest_tokens: int,
    run_tokens: int,
    on_wait: Callable[[dict[str, Any]], None] | None = None,
    redo_of: tuple[str, int] | None = None,
    ratio_known: bool = True,
) -> dict[str, Any]:
    """Block until this chunk fits the budget, then reserve its estimate; the figures.

    The gate opens while ``unacked + estimate <= budget``; once it refused it stays shut
    for every chunk job until unacked bytes fall to ``low_mark x budget``.  A waiting job
    watches the ack file (its size and mtime) with a poll of at most ``poll_s``.
    ``redo_of``: (chunk, pass) when ``chunk`` is the gate's key for another pass's job.
    ``raw_bytes_per_token``: a chunk's bytes/token before any is measured, exact unless
    ``ratio_known`` is false (a lossless codec: an upper bound), see :func:`check_room`.
    """
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    t0 = time.monotonic()
    last_report = -REPORT_EVERY_S
    last_seen: tuple[float, int] | None = None
    sampled: dict[str, Any] | None = None
    while True:
        with locked(sdir):
            st = read_state(sdir)
            check_room(ss, st, raw_bytes_per_token=raw_bytes_per_token, ratio_known=ratio_known,
                       largest_tokens=largest_tokens, run_tokens=run_tokens)  # fmt: skip
            if delete_acked(run_dir, st, ss.final_pass):
                st = read_state(sdir)
                record_usage(run_dir, st, ss, "delete", chunk)
            name, pass_ = redo_of or (chunk, 1)
            if any(c["chunk"] == name and c["pass"] == pass_ for c in st.unacked(ss.final_pass)):
                # A redo of a chunk announced and not acked (its payload lost, or nacked):
                # its room is held (unacked_bytes), and the trainer waits for it, so
                # waiting here for acks would deadlock both.  No bytes reserved: its bytes
                # count already; a marker tells the other gates its redo is under way.
                marker = {"redo_of": [name, pass_], "host": socket.gethostname(),
                          "pid": os.getpid(), "at": round(time.time(), 3)}  # fmt: skip
                _reserve(sdir, chunk, marker)
                return {"waited_s": 0.0, "unacked_bytes": unacked_bytes(run_dir, st, ss.final_pass),
                        "reserved_bytes": 0, "estimate_bytes": 0, "redo": True}  # fmt: skip
            est = estimate_bytes(st, tokens, raw_bytes_per_token)
            unacked = unacked_bytes(run_dir, st, ss.final_pass)
            # Live jobs' reservations, or their files where larger; a dead job's
            # temporary files go (they counted until now: status, usage).
            others = sum(jobs_bytes(run_dir, st, exclude=chunk, remove_dead=True).values())
            held = unacked + others
            gate = _gate_state(sdir)
            low = ss.low_mark * ss.budget_bytes
            if gate.get("paused") and held <= low:
                gate = {"paused": False}
            fits = held + est <= ss.budget_bytes and not gate.get("paused")
            if fits:
                _write_json(sdir / GATE, gate)
                _reserve(
                    sdir,
                    chunk,
                    {
                        "bytes": est,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "at": round(time.time(), 3),
                    },
                )
                record_usage(run_dir, st, ss, "pass", chunk)
                return {
                    "waited_s": round(time.monotonic() - t0, 3),
                    "unacked_bytes": unacked,
                    "reserved_bytes": others,
                    "estimate_bytes": est,
                }
            if not gate.get("paused"):
                gate = {"paused": True, "since": round(time.time(), 3), "by": chunk}
                _write_json(sdir / GATE, gate)
            # Shut while the trainer waits for a redo nothing runs: no ack will open it.
            running = _redos_running(sdir)
            for n in open_nacks(st, ss.final_pass):
                if (n["chunk"], n["pass"]) not in running:
                    raise _stuck_on_nack(run_dir, chunk, n)
            # Shut, or still shut after an ack: a sample whenever what it sees changed.
            sampled = record_usage(run_dir, st, ss, "wait", chunk, sampled)
        now = time.monotonic()
        if now - last_report >= REPORT_EVERY_S:
            last_report = now
            info = summary(run_dir, ss.final_pass, budget_bytes=ss.budget_bytes)
            info.update(chunk=chunk, estimate_bytes=est, waited_s=round(now - t0, 1))
            text = waiting_text(info)
            if gate.get("paused"):  # shut for acks: name the deadlock of a late checkpoint
                text += late_checkpoint_text(
                    ss.checkpoint_chunks, ss.prefetch_chunks, info["unacked"]
                )
            log.info("%s", text)
            if on_wait is not None:
                on_wait(info)
        last_seen = _wait_for_acks(sdir, last_seen, ss.poll_s)


def _wait_for_acks(sdir: Path, seen: tuple[float, int] | None, poll_s: float):
    """Sleep until the ack file changes or ``poll_s`` passed; what it looked like."""
    deadline = time.monotonic() + poll_s
    step = min(0.05, poll_s)
    while True:
        try:
            s = (sdir / ACKS).stat()
            now = (s.st_mtime, s.st_size)
        except FileNotFoundError:
            now = (0.0, 0)
        if seen is not None and now != seen:
            return now
        if time.monotonic() >= deadline:
            return now
        time.sleep(step)
        step = min(step * 2, poll_s)


def release(run_dir: Path, chunk: str) -> None:
    """Drop a chunk job's reservation (announced: its file counts now; or failed).
    Unlinked before its lock goes, so no gate finds it unheld and takes it for a dead
    job's."""
    (stream_dir(run_dir) / INFLIGHT / f"{chunk}.json").unlink(missing_ok=True)
    fd = _held.pop(chunk, None)
    if fd is not None:
        os.close(fd)


def summary(run_dir: Path, final_pass: int = 1, *, budget_bytes: int | None = None) -> dict:
    """What ``hsextract status`` and a waiting chunk's log say: GB waiting for the trainer,
    the oldest unacked chunk and since when, whether the gate is paused."""
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    st = read_state(sdir)
    unacked = st.unacked(final_pass)
    oldest = min(unacked, key=lambda c: c["at"], default=None)
    deleted = [d for d in st.deleted.values() if d.get("why", "ack") == "ack"]
    waiting = acked_on_disk(run_dir, st, final_pass)
    running = _redos_running(sdir)
    live = _live(sdir)
    temps = temp_files(run_dir)
    dead = sorted(str(f.relative_to(run_dir)) for k, fs in temps.items() if k not in live
                  for f, _ in fs)  # fmt: skip
    return {
        "announced": len(st.chunks),
        "acked": sum(1 for s in st.chunks if st.is_acked(s, final_pass)),
        "unacked": len(unacked),
        "unacked_bytes": sum(_on_disk(run_dir, c) for c in unacked),
        "budget_bytes": budget_bytes,
        "oldest_unacked": None
        if oldest is None
        else {"seq": oldest["seq"], "chunk": oldest["chunk"], "since": oldest["at"]},
        "paused": bool(_gate_state(sdir).get("paused")),
        "passes_ended": sorted(st.ends),
        "deleted": len(deleted),
        "deleted_bytes": sum(d["bytes"] for d in deleted),
        # Nacks the trainer waits on: the gate's waiting text and status name them.
        "nacked": [
            {**n, "redo_running": (n["chunk"], n["pass"]) in running}
            for n in open_nacks(st, final_pass)
        ],
        "acked_on_disk": len(waiting),
        "acked_on_disk_bytes": sum(int(c["bytes"]) for c in waiting),
        # Every announced payload not freed, as on disk (what hidden/ holds of the stream's).
        "payload_bytes": sum(
            _on_disk(run_dir, c) for s, c in st.chunks.items() if not st.freed(s)
        ),  # fmt: skip
        "temp_files": sum(len(fs) for fs in temps.values()),
        "temp_bytes": sum(n for fs in temps.values() for _, n in fs),
        # A dead chunk job's partial files: counted in full until the next gate, announcement
        # or `hsextract stream gc` removes them.
        "dead_temp_files": dead,
    }


def waiting_text(info: dict[str, Any]) -> str:
    old = info.get("oldest_unacked")
    since = (
        f"; oldest unacked {old['chunk']} (seq {old['seq']}) since "
        f"{time.strftime('%H:%M:%S', time.localtime(old['since']))}"
        if old
        else ""
    )
    budget = info.get("budget_bytes")
    of = f" of a {budget / GB:.3g} GB budget" if budget else ""
    head = f"{info['chunk']}: waiting for the trainer, " if "chunk" in info else ""
    return (
        f"{head}{info['unacked_bytes'] / GB:.3g} GB in {info['unacked']} chunks not yet "
        f"acknowledged{of}{since}{''.join(_nack_text(n) for n in info.get('nacked', []))}"
        f"{_dead_text(info.get('dead_temp_files', []))}"
    )


def _dead_text(dead: list[str]) -> str:
    if not dead:
        return ""
    shown = ", ".join(dead[:3]) + (f" and {len(dead) - 3} more" if len(dead) > 3 else "")
    return (
        f"; {len(dead)} temporary file(s) of chunk jobs that died ({shown}): counted against "
        f"the budget until the next chunk job's gate or `{hsextract_command('stream', 'gc')}` "
        "removes them"
    )


def _nack_text(n: dict[str, Any]) -> str:
    """An open nack, as the waiting text and ``hsextract status`` say it."""
    if n.get("redo_running"):
        then = "its redo is running"
    elif n.get("taken_up"):
        then = "a plan took it up: its redo is a job of this run"
    else:
        then = "a new run redoes it (a chunk job at a shut gate stops, saying how)"
    return (
        f"; the trainer nacked {n['chunk']} (seq {n['seq']}, pass {n['pass']}) and waits for "
        f"its redo, acking nothing meanwhile: {then}"
    )
