"""``hsextract status``: where a run stands, from its files alone; reads, never acts.

A multi-day extraction is watched from another terminal, by a person or a script, so the
answer comes only from what the run writes anyway (the index, sidecars, state and logs)
plus one small progress file per chunk in flight.  Nothing here starts, stops or
relaunches anything, takes a lock a workflow could wait on, or removes a file.

- chunks and tokens: done when the chunk file and its sidecar exist and the sidecar holds
  the records ``chunks/index.json`` assigns (``plan.chunk_states``, the planner's own
  test); totals from the index, or ``n_chunks`` before the split has run;
- rates: tokens over busy time (the union of the chunks' extraction intervals), in a
  recent window and overall, so idle days between sessions and ``-j N`` both count right;
- ETA: tokens left over the recent rate, only while a workflow holds the run;
- server: this host's live state file, its pid and one short ``/health`` probe;
- last error: the newest ``ERROR``/traceback line in the rules' logs.  Snakemake removes
  a job's log before running it again, so an error there is its latest attempt's; one
  above the line a job writes when it succeeds (``smk.JOB_DONE``) was recovered from,
  and a done chunk's is history.  A chunk whose job was killed (SIGKILL: no error
  logged) is the error then: its progress file names a dead writer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hsextract.commands import snakemake_command
from hsextract.config import Config
from hsextract.procs import pid_alive
from hsextract.server import read_json
from hsextract.sizing import chunk_count
from hsextract.smk import JOB_DONE

log = logging.getLogger("hsextract")

#: Seconds between rewrites of a chunk's progress file: cheap, yet fresh for a status.
PROGRESS_INTERVAL_S = 2.0
#: The recent-rate window (``--window``).
DEFAULT_WINDOW_S = 300.0
#: Bytes read from the end of each log when looking for its last error.
_LOG_TAIL_BYTES = 256 << 10
_CHUNK_LOG_RE = re.compile(r"extract_chunk_(\d{5})\.log")
_TRACEBACK = "Traceback (most recent call last):"
#: logging's format in the rules' logs (``hsextract.smk``): "<date> <time> ERROR message".
_LOGGED_ERROR = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ (ERROR|CRITICAL) ")


def progress_path(chunk_file: Path) -> Path:
    """``hidden/.chunk_<i>.progress.json`` beside ``hidden/chunk_<i>.safetensors``.

    A dot file, and no ``chunk_<i>.*`` name: nothing that lists chunk files sees it.
    """
    chunk_file = Path(chunk_file)
    return chunk_file.with_name(f".{chunk_file.stem}.progress.json")


class ProgressFile:
    """Tokens done so far by the chunk job in flight, for ``status``.

    A sidecar appears only when a chunk is finished; a chunk of a production run takes
    tens of minutes, so without this a status could say nothing about the one running.
    Rewritten atomically at most every ``interval_s`` seconds, and never more than that
    behind: a record done within the interval is written by a timer once it is up (else a
    slow next record would leave the file stale until it ends).  Removed when the chunk
    ends either way.  A failure to write it is logged once and never fails the chunk.
    """

    def __init__(self, chunk_file: Path, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.path = progress_path(chunk_file)
        self.interval_s = interval_s
        now = time.time()
        self.data: dict[str, Any] = {
            "chunk": Path(chunk_file).stem,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": now,
            "updated_at": now,
            "tokens_done": 0,
            "tokens_total": None,
            "records_done": 0,
            "records_total": None,
            # server (waiting for it to answer /health: it may still be loading) |
            # waiting (for a turn to send: client.sending_jobs) | sending | finishing
            "phase": "sending",
        }
        self._lock = threading.Lock()
        self._written = 0.0
        self._broken = False
        self._timer: threading.Timer | None = None
        self._write()

    def set_total(self, tokens: int, records: int) -> None:
        with self._lock:
            self.data.update(tokens_total=tokens, records_total=records)
            self._write()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.data["phase"] = phase
            self._write()

    def add(self, tokens: int) -> None:
        """One more record done (called from the request threads)."""
        with self._lock:
            self.data["tokens_done"] += tokens
            self.data["records_done"] += 1
            wait = self.interval_s - (time.monotonic() - self._written)
            if wait <= 0:
                self._write()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._write_late)
                self._timer.daemon = True
                self._timer.start()

    def _write_late(self) -> None:
        with self._lock:
            self._timer = None
            self._write()

    def remove(self) -> None:
        with self._lock:
            self._broken = True  # no write after this
            if self._timer is not None:
                self._timer.cancel()
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        if self._broken:
            return
        self.data["updated_at"] = time.time()
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)  # as the chunk writer will
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._broken = True
            log.warning("progress file %s not written (%s); status will not see it", tmp, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        self._written = time.monotonic()


# --------------------------------------------------------------------------- the report


@dataclass
class InFlight:
    chunk: str
    pid: int | None
    started_at: float
    updated_at: float
    tokens_done: int
    tokens_total: int | None
    phase: str = "sending"
    host: str | None = None


@dataclass
class ServerStatus:
    """This host's extraction server as its live state file and one probe see it."""

    recorded: bool
    alive: bool = False
    healthy: bool | None = None
    url: str | None = None
    pid: int | None = None
    started_at: float | None = None
    state_file: str | None = None
    other_hosts: list[str] = field(default_factory=list)
    #: Alive and never healthy yet: loading its model (chunk jobs wait for it).
    starting: bool = False
    healthy_at: float | None = None
    #: Its start failed (died or timed out before /health answered): why, with log lines.
    failed: str | None = None


@dataclass
class LastError:
    rule: str
    chunk: str | None
    message: str
    log: str
    at: float


@dataclass
class Status:
    run_dir: str
    fingerprint: str
    now: float
    split_done: bool
    chunks_total: int
    chunks_done: int
    tokens_total: int | None
    tokens_done: int
    in_flight: list[InFlight]
    #: Chunks whose job died mid-chunk without a word (SIGKILL): see :func:`_progress`.
    interrupted: list[InFlight]
    workflow_pids: list[str]
    recent_tok_s: float | None
    overall_tok_s: float | None
    window_s: float
    eta_s: float | None
    manifest: bool
    server: ServerStatus
    last_error: LastError | None
    #: hsextract.audit.status_line: passed, FAILED (the run is unaudited), off, not run.
    audit: str | None = None

    #: Dump dirs (/dev/shm) of runs under the output root that nothing holds:
    #: stale.unclaimed_dumps.
    unclaimed_dumps: list[dict[str, Any]] = field(default_factory=list)

    #: Snakemake's own lock on this run, left by a workflow that died (kill -9) in the
    #: directory the run was made in: the next snakemake there fails until --unlock.
    snakemake_lock: str | None = None

    @property
    def finished(self) -> bool:
        return self.split_done and self.chunks_done == self.chunks_total

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["finished"] = self.finished
        return out


def collect(
    cfg: Config,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    probe_timeout_s: float = 2.0,
    base: str | None = None,
) -> Status:
    """The status of the config's run dir (which need not exist yet); relative paths
    against ``base``, the directory the run was made in (config.locate_run), if given."""
    from hsextract.config import fingerprint, run_dir
    from hsextract.plan import chunk_states

    rd = run_dir(cfg, base)
    fp = fingerprint(cfg, base)
    now = time.time()
    hidden = rd / "hidden"
    index_path = rd / "chunks" / "index.json"
    index = read_json(index_path)
    intervals: list[tuple[float, float, float]] = []  # (start, end, tokens)
    tokens_done = 0
    done: set[str] = set()
    if index is not None:
        tokens_total: int | None = sum(int(e.get("tokens", 0)) for e in index["chunks"])
        names = [Path(e["path"]).stem for e in index["chunks"]]
        tokens_of = {Path(e["path"]).stem: int(e.get("tokens", 0)) for e in index["chunks"]}
        for state in chunk_states(rd, index_path, fp, rehash=False):  # a status never hashes
            if not state.current:
                continue
            done.add(state.chunk)
            tokens_done += tokens_of[state.chunk]
            span = _chunk_interval(hidden, state.chunk)
            if span is not None:
                intervals.append((*span, tokens_of[state.chunk]))
    else:
        tokens_total = None
        # Read only: an auto count not yet cached is counted, not written.
        names = [f"chunk_{i:05d}" for i in range(chunk_count(cfg, write_cache=False))]
    in_flight, interrupted = _progress(hidden, set(names) - done)
    for f in in_flight:
        tokens_done += f.tokens_done
        # Busy until now; its tokens were done by its last update.
        intervals.append((f.started_at, now, 0.0))
        intervals.append((f.started_at, max(f.updated_at, f.started_at), float(f.tokens_done)))
    recent = _rate(intervals, now - window_s, now)
    overall = _rate(intervals, -math.inf, now)
    pids = _workflow_holders(rd)
    eta: float | None
    if index is not None and len(done) == len(names):
        eta = 0.0
    elif pids and recent and tokens_total is not None:
        eta = max(tokens_total - tokens_done, 0) / recent
    else:
        eta = None
    return Status(
        run_dir=str(rd),
        fingerprint=fp,
        now=now,
        split_done=index is not None,
        chunks_total=len(names),
        chunks_done=len(done),
        tokens_total=tokens_total,
        tokens_done=tokens_done,
        in_flight=in_flight,
        interrupted=interrupted,
        workflow_pids=pids,
        recent_tok_s=recent,
        overall_tok_s=overall,
        window_s=window_s,
        eta_s=eta,
        manifest=(rd / "manifest.json").exists(),
        server=server_status(cfg, rd, timeout_s=probe_timeout_s),
        last_error=_newest(
            last_error(rd / "logs", done, history=_merge_is_history(cfg, rd, base)),
            interrupted,
            hidden,
        ),
        snakemake_lock=None if pids else dead_snakemake_lock(rd),
        unclaimed_dumps=_unclaimed_dumps(cfg, rd),
        audit=audit_status_line(cfg, rd),
    )


def _newest(
    logged: LastError | None, interrupted: list[InFlight], hidden: Path
) -> LastError | None:
    """The latest of a logged error and a chunk interrupted without one (its job killed):
    a killed job is the current state of its chunk, not "error none"."""
    best = logged
    for f in interrupted:
        if best is not None and best.at >= f.updated_at:
            continue
        total = f"{f.tokens_total:,}" if f.tokens_total is not None else "?"
        best = LastError(
            rule="extract_chunk",
            chunk=f.chunk,
            message=(
                f"interrupted: its job (pid {f.pid} on {f.host}) ended after {f.tokens_done:,} "
                f"of {total} tokens without finishing or logging an error (killed: kill -9, "
                "the OOM killer, a preemption?); the next "
                f"`{snakemake_command('extract_all', run_dir=hidden.parent)}` redoes it"
            ),
            log=str(progress_path(hidden / f"{f.chunk}.safetensors")),
            at=f.updated_at,
        )
    return best


def _chunk_interval(hidden: Path, chunk: str) -> tuple[float, float] | None:
    """When a finished chunk was extracted: the sidecar's times, else its mtime."""
    sidecar = hidden / f"{chunk}.json"
    meta = read_json(sidecar) or {}
    try:
        end = float(meta.get("finished_at") or sidecar.stat().st_mtime)
        start = float(meta.get("started_at") or end - float(meta.get("seconds", 0.0)))
    except (OSError, TypeError, ValueError):
        return None
    return start, end


def _in_flight(hidden: Path, pending: set[str]) -> list[InFlight]:
    """Chunks whose job is running now: a progress file whose writer is alive."""
    return _progress(hidden, pending)[0]


def _progress(hidden: Path, pending: set[str]) -> tuple[list[InFlight], list[InFlight]]:
    """(running, interrupted): the chunks with a progress file, by whether its writer runs.

    A job ends either way by removing its file (a failure also logs why); one killed
    with SIGKILL (the OOM killer, a preemption, ``kill -9``) can do neither, and its dead
    pid tells: its chunk was interrupted, with no error anywhere else to say so.  Another
    host's writer cannot be checked from here: its file counts as running while it keeps
    being updated, as interrupted once it stops.  A later attempt of the chunk rewrites
    the file (running again) and removes it when done.
    """

    running, interrupted = [], []
    host = socket.gethostname()
    for name in sorted(pending):
        data = read_json(progress_path(hidden / f"{name}.safetensors"))
        if not isinstance(data, dict):
            continue
        try:
            started, updated = float(data["started_at"]), float(data["updated_at"])
        except (KeyError, TypeError, ValueError):
            continue
        if data.get("host", host) == host:
            alive = pid_alive(data.get("pid"))
        else:
            alive = time.time() - updated <= 10 * PROGRESS_INTERVAL_S + 60
        (running if alive else interrupted).append(
            InFlight(
                chunk=name,
                pid=data.get("pid"),
                started_at=started,
                updated_at=updated,
                tokens_done=int(data.get("tokens_done") or 0),
                tokens_total=data.get("tokens_total"),
                phase=str(data.get("phase") or "sending"),
                host=str(data.get("host") or host),
            )
        )
    return running, interrupted


def _rate(intervals: list[tuple[float, float, float]], lo: float, hi: float) -> float | None:
    """Tokens per second of busy time within [lo, hi].

    Each interval's tokens count in proportion to its overlap with the window (a chunk
    is assumed to progress evenly); busy time is the union of the overlaps, so chunks
    extracted side by side (``-j N``) add their tokens over shared seconds.  None when
    nothing was busy in the window.
    """
    tokens, spans = 0.0, []
    for start, end, n in intervals:
        a, b = max(start, lo), min(end, hi)
        if b < a:
            continue
        if end > start:
            tokens += n * (b - a) / (end - start)
        else:
            tokens += n
        spans.append((a, b))
    busy, reach = 0.0, -math.inf
    for a, b in sorted(spans):
        if a > reach:
            busy += b - a
            reach = b
        elif b > reach:
            busy += b - reach
            reach = b
    if busy <= 0.0:
        return None
    return tokens / busy


def _workflow_holders(rd: Path) -> list[str]:
    """Workflows holding the run (``state/active/<host>-<pid>.lock``, flock'ed while alive).

    Probed by :func:`hsextract.stale.lock_held`: never blocks, never creates
    or removes a lock file (``stale.claim_run`` tidies dead ones; a status must not).
    """
    from hsextract.stale import lock_held

    out = []
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(rd / "state" / "active"), key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.name.endswith(".lock"):
                continue  # the claim lock, a lock file being created
            lhost, _, pid = entry.name.removesuffix(".lock").rpartition("-")
            if lhost != host:
                out.append(f"{lhost}:{pid}")  # cannot be checked from here
            elif lock_held(entry.path):
                out.append(pid)
    return out


def dead_snakemake_lock(rd: Path) -> str | None:
    """Snakemake's lock directory when it holds a lock on this run's files though no
    workflow holds the run (called only then): its workflow died without removing it
    (``kill -9``), and every snakemake in that directory ends in a LockException until
    ``snakemake --unlock``.  Only a lock naming a file of this run: another run's workflow
    in the same directory may hold its own lock, alive."""
    from hsextract.commands import sources_for

    src = sources_for(rd)
    locks = Path(src.workdir if src else os.getcwd()) / ".snakemake" / "locks"
    run = os.path.realpath(rd)
    try:
        entries = [e for e in os.scandir(locks) if e.name.endswith(".lock")]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(entry.path) as f:
                names = f.read().splitlines()
        except OSError:
            continue
        base = Path(src.workdir) if src else Path.cwd()
        for name in names:
            path = os.path.realpath(base / name)
            if path == run or path.startswith(run + os.sep):
                return str(locks)
    return None


def server_status(cfg: Config, rd: Path, *, timeout_s: float = 2.0) -> ServerStatus:
    """This host's live server: recorded?  pid alive?  ``/health`` within ``timeout_s``?"""
    from hsextract.server import API_KEY_ENV, health, live_path

    state_dir = rd / "state"
    path = live_path(state_dir)
    others = sorted(
        p.name[len("server.") : -len(".live.json")]
        for p in state_dir.glob("server.*.live.json")
        if p != path
    )
    state = read_json(path)
    if not isinstance(state, dict):
        return ServerStatus(recorded=False, other_hosts=others)
    out = ServerStatus(
        recorded=True,
        url=state.get("url"),
        pid=state.get("pid"),
        started_at=state.get("started_at"),
        state_file=str(path),
        other_hosts=others,
        healthy_at=state.get("healthy_at"),
        failed=state.get("failed"),
    )
    out.alive = pid_alive(out.pid)
    if out.alive and out.url and not out.failed:
        key = cfg.server.api_key or os.environ.get(API_KEY_ENV)
        out.healthy = health(out.url, timeout=timeout_s, api_key=key)
        # Not healthy yet and never was: loading (a chunk job records healthy_at first).
        out.starting = not out.healthy and not out.healthy_at
    return out


def _merge_is_history(cfg: Config, rd: Path, base: str | None) -> frozenset[str]:
    """``{"merge_and_shuffle.log"}`` when the published merge read exactly the inputs
    there are now: a failed merge's error is then history (its input was restored, e.g.
    from a backup with its old time, and nothing needed to rerun, so its log stays)."""
    from hsextract.errors import HsextractError
    from hsextract.plan import changed_inputs

    stats = read_json(rd / "merged" / "stats.json")
    if not isinstance(stats, dict) or "inputs" not in stats:
        return frozenset()
    try:
        changed = changed_inputs(cfg, stats, base=Path(base) if base else None)
    except (HsextractError, OSError):
        return frozenset()
    return frozenset() if changed else frozenset({"merge_and_shuffle.log"})


def last_error(
    logs: Path, done: AbstractSet[str] = frozenset(), history: AbstractSet[str] = frozenset()
) -> LastError | None:
    """The newest error line of the rules' logs (the server's own log excluded).

    A chunk's log is skipped once the chunk is done: its error is history; so is the log
    of each name in ``history``.
    """
    best: LastError | None = None
    with contextlib.suppress(OSError):
        for entry in os.scandir(logs):
            if not entry.name.endswith(".log") or entry.name == "server.log":
                continue
            if entry.name in history:
                continue
            m = _CHUNK_LOG_RE.fullmatch(entry.name)
            chunk = f"chunk_{m.group(1)}" if m else None
            if chunk in done:
                continue
            try:
                mtime = entry.stat().st_mtime
            except OSError:
                continue
            if best is not None and mtime <= best.at:
                continue
            message = _error_in(Path(entry.path))
            if message is None:
                continue
            rule = "extract_chunk" if m else entry.name.removesuffix(".log")
            best = LastError(rule=rule, chunk=chunk, message=message, log=entry.path, at=mtime)
    return best


def _error_in(path: Path) -> str | None:
    """The last error of one log: ``ERROR [rule]: ...`` (an HsextractError: its message
    says what to do), a logged ERROR, or the exception line that ends a traceback."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found: str | None = None
    in_traceback = False
    for raw in re.split(r"[\r\n]+", text):  # \r: the progress bar's redraws
        line = raw.rstrip()
        if line.startswith(JOB_DONE):  # the job succeeded after it: fixed, not current
            found, in_traceback = None, False
            continue
        k = line.find("ERROR [")
        if k >= 0:
            found = re.sub(r"^ERROR \[[^\]]*\]:\s*", "", line[k:])
            in_traceback = False
        elif _LOGGED_ERROR.match(line):
            found = _LOGGED_ERROR.sub("", line)
        elif line.startswith(_TRACEBACK):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            # Frames and code are indented; the first line at column 0 is the exception
            # (or the text that chains to the next traceback).
            if not line.startswith(("During handling", "The above exception")):
                found = line
                in_traceback = False
    return found[:2000] if found else None


# --------------------------------------------------------------------------- text


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _rate_text(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f} tok/s"


def audit_status_line(cfg: Config, rd: Path) -> str:
    from hsextract.audit import status_line

    return status_line(cfg, rd)


def render(st: Status) -> str:
    """The status as a few aligned lines for a person."""
    lines = [f"run       {st.run_dir} (fingerprint {st.fingerprint})"]
    if st.workflow_pids:
        lines.append(f"workflow  running (pid {', '.join(st.workflow_pids)})")
    else:
        lines.append("workflow  not running")
    if not st.split_done:
        lines.append(
            f"chunks    0 of {st.chunks_total} done (the data stage has not run yet: "
            "no chunks/index.json)"
        )
    else:
        pct = 100.0 * st.chunks_done / st.chunks_total if st.chunks_total else 100.0
        lines.append(f"chunks    {st.chunks_done} of {st.chunks_total} done ({pct:.0f}%)")
    for f in st.in_flight:
        total = f"{f.tokens_total:,}" if f.tokens_total is not None else "?"
        phase = "waiting for the server" if f.phase == "server" else f.phase
        lines.append(
            f"          {f.chunk} in flight ({phase}): {f.tokens_done:,} of {total} tokens, "
            f"for {_duration(st.now - f.started_at)} (pid {f.pid})"
        )
    for f in st.interrupted:
        lines.append(
            f"          {f.chunk} interrupted: its job (pid {f.pid}) is gone, "
            f"{_duration(max(0.0, st.now - f.updated_at))} ago; the next run redoes it"
        )
    if st.tokens_total is not None:
        pct = 100.0 * st.tokens_done / st.tokens_total if st.tokens_total else 100.0
        lines.append(f"tokens    {st.tokens_done:,} of {st.tokens_total:,} ({pct:.1f}%)")
    lines.append(
        f"rate      {_rate_text(st.recent_tok_s)} over the last {_duration(st.window_s)}, "
        f"{_rate_text(st.overall_tok_s)} overall (busy time)"
    )
    if st.eta_s == 0.0:
        extra = "manifest.json written" if st.manifest else "manifest.json not written yet"
        lines.append(f"eta       0s: every chunk is extracted ({extra})")
    elif st.eta_s is not None:
        at = time.strftime("%Y-%m-%d %H:%M", time.localtime(st.now + st.eta_s))
        lines.append(f"eta       {_duration(st.eta_s)} (about {at}, at the recent rate)")
    elif not st.workflow_pids:
        run = snakemake_command("extract_all", run_dir=st.run_dir)
        if st.snakemake_lock:
            unlock = snakemake_command("--unlock", run_dir=st.run_dir)
            lines.append(
                f"eta       - (no workflow is running; the last one died holding Snakemake's "
                f"lock in {st.snakemake_lock}: first `{unlock}`, then `{run}`)"
            )
        else:
            lines.append(f"eta       - (no workflow is running: `{run}`)")
    else:
        lines.append("eta       - (no progress measured yet)")
    srv = st.server
    if not srv.recorded:
        lines.append("server    not running (no live server recorded on this host)")
    elif srv.failed:
        msg = srv.failed.splitlines()
        lines.append(f"server    failed: {msg[0]} (pid {srv.pid}, {srv.state_file})")
        lines += [f"          {line}" for line in msg[1:][-10:]]
    elif srv.starting:
        up = f", loading for {_duration(st.now - srv.started_at)}" if srv.started_at else ""
        lines.append(
            f"server    starting: {srv.url} (pid {srv.pid}{up}; chunk jobs wait for /health)"
        )
    elif not srv.alive:
        lines.append(f"server    gone: pid {srv.pid} is not running ({srv.state_file})")
    else:
        up = f", up {_duration(st.now - srv.started_at)}" if srv.started_at else ""
        health = "healthy" if srv.healthy else "NOT healthy (/health did not answer 200)"
        lines.append(f"server    alive and {health}: {srv.url} (pid {srv.pid}{up})")
    if srv.other_hosts:
        lines.append(f"          also recorded on host(s): {', '.join(srv.other_hosts)}")
    if st.audit is not None:
        lines.append(f"audit     {st.audit}")
    for d in st.unclaimed_dumps:
        theirs = f" (its {d['foreign']} file(s) not ours stay)" if d["foreign"] else ""
        lines.append(
            f"dump dir  {d['path']} ({d['bytes']:,} bytes of pieces) of run {d['run_dir']}, "
            "which no workflow or server holds: the next workflow under this output root "
            f"removes it{theirs}"
        )
    err = st.last_error
    if err is None:
        lines.append("error     none")
    else:
        where = err.chunk or err.rule
        ago = _duration(max(0.0, st.now - err.at))
        lines.append(f"error     {where} ({ago} ago, {err.log}):")
        lines.append(f"          {err.message}")
    return "\n".join(lines)


def _unclaimed_dumps(cfg: Config, rd: Path) -> list[dict[str, Any]]:
    """Dump dirs a workflow killed and not rerun left in RAM, of any run under this
    output root (stale.unclaimed_dumps); the stale stage of the next workflow removes them."""
    from hsextract.config import dump_dir
    from hsextract.stale import unclaimed_dumps

    with contextlib.suppress(OSError):
        return unclaimed_dumps(rd.parent, dump_dir(cfg).parent)
    return []
