"""The trainer's side: a torch ``IterableDataset`` that follows a run in progress.

Split (deterministic, whatever the timing): the records of a pass are taken in journal
order, each chunk's in its order shuffled by (seed, pass, seq), and numbered ``k`` over the
whole pass; record ``k`` goes to DDP rank ``k % world``, and inside a rank its ``t``-th
record (``t = k // world``) to loader worker ``t % workers`` (:func:`share`).  Why records
and not chunks to ranks: every rank then reads the *same* chunk at the same time, so the
trainer's disk window does not grow with its ranks -- ``prefetch + checkpoint + 1``
chunks (stream.gate.check_window) for any number of ranks and workers -- and ranks are
always within one record of each other (the end-of-pass padding is at most one sample a
rank).  Dealt by chunks (each to one rank, as before), every rank held chunks of its own
open, the window was ``ranks x prefetch + checkpoint + 1`` chunks, and ranks drifted up to a
chunk apart.  Why the worker split counts over the pass, not restarts at each chunk: a
``StatefulDataLoader`` takes one record from each worker in turn, so rank ``r``'s ``t``-th
sample is then exactly record ``t * world + r``; restarted per chunk, worker 0 would take
the odd record of every chunk and fall a record behind per such chunk, chunks apart over a
pass.

Resume: each worker's position is its ``state_dict`` (pass, chunk slot in the pass,
position in its share of that chunk, padding yielded); :class:`hsextract.stream.loader.
StreamLoader` (torchdata's ``StatefulDataLoader``, one end-of-pass behaviour changed)
gathers them from the worker processes and replays exactly what it had prefetched but not
handed out.  A chunk is consumed once every worker of every rank has passed it
(:func:`consumed_seqs` over all ranks' loader states); :func:`checkpoint_due` says when a
trainer must checkpoint for the budget's window to hold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hsextract.chunkfile import (
    ChunkDigestError,
    ChunkFileError,
    VerifiedDir,
    sha256_file,
    shared_verdict_path,
    verify_chunk_file,
)
from hsextract.chunks import ChunkReader
from hsextract.commands import hsextract_command, snakemake_command
from hsextract.config_types import StreamConfig
from hsextract.stream.checkpoints import LATE_CHECKPOINT
from hsextract.stream.journal import (
    ACKS,
    JOURNAL,
    AckWriter,
    StreamError,
    file_identity,
    read_lines,
    read_state,
    stream_dir,
)

LAYOUTS = ("raw", "specforge", "speculators")

log = logging.getLogger("hsextract")


def offsets(lines: list[dict]) -> list[int]:
    """Records of the pass before each chunk of ``lines`` (and, last, after all of them):
    chunk i's records are numbered ``offsets[i] ..`` over the pass.  Chunk i's depends on
    ``lines[:i]`` only, so every rank, and every resume, computes the same deal from
    whatever prefix of the journal it has read."""
    out = [0]
    for c in lines:
        out.append(out[-1] + int(c["records"]))
    return out


def share(offset: int, records: int, *, rank: int, world: int, worker: int = 0,
          workers: int = 1) -> range:  # fmt: skip
    """The positions, in a chunk's shuffled order, of the records that ``worker`` of
    ``rank`` reads: the chunk's records are numbered ``offset ..`` over the pass; record
    ``k`` is rank ``k % world``'s, and that rank's ``t``-th (``t = k // world``) its worker
    ``t % workers``'s, i.e. ``k % (world x workers) == worker x world + rank``."""
    n = world * workers
    return range((worker * world + rank - offset) % n, records, n)


def rank_records(total: int, rank: int, world: int) -> int:
    """Records of a pass of ``total`` that ``rank`` reads (ranks differ by one at most)."""
    return len(range(rank, total, world))


def verdict_dir(run_dir: Path) -> VerifiedDir:
    """Where a reader's processes leave their verdicts on the chunks they hashed.

    Every rank reads every chunk (:func:`share`), so with a dir per rank a node of 8 ranks
    would read each chunk's bytes 8 times just to hash them.  Under torchrun the ranks of
    a job on one node share one dir, named from the job's rendezvous id and the run dir
    (in the temp dir, ours alone: :meth:`VerifiedDir.shared`); a verdict is for one file
    identity and sha256, so a job restarted under the same id can keep them.  Elsewhere
    (no torchrun, one local rank) a private dir.  Either kind left by a killed reader is
    removed by the next one made once no process that used it runs
    (:func:`~hsextract.chunkfile.sweep_verdict_dirs`)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if not job or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < 2:
        return VerifiedDir()
    key = hashlib.sha256(f"{job}\0{Path(run_dir).resolve()}".encode()).hexdigest()[:16]
    return VerifiedDir.shared(shared_verdict_path(key))


def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


class StreamDataset(IterableDataset):
    """Every record of every announced chunk exactly once per pass, for one DDP rank.

    ``pass_`` counts from 1; ``set_pass`` moves to the next one (call it in the main
    process before iterating again: workers get a fresh copy each epoch).  ``epochs_mode``
    ``keep`` re-reads pass 1's chunks in every pass; ``regenerate`` reads pass p's.

    Padding: once the pass has ended every rank knows every rank's record count; a rank
    one short of the others (ranks differ by one record at most) yields one padding sample
    (``pad`` True, one token, loss mask 0), so all ranks take the same number of steps and
    DDP never waits on a rank that ran out.  Real records are never dropped or repeated.

    A sample is the layout's tensors plus ``id`` (the record's id, ``"<pad>"`` for
    padding), ``seq`` (the journal's sequence number of its chunk, -1 for padding),
    ``pass`` and ``pad`` (True for the padding sample: train on it, its loss mask is 0,
    so that every rank steps; count only the others as trained).

    Waiting: the reader waits for the journal (a chunk not announced yet, a nacked
    chunk's redo) as long as it takes by default, since a trainer legitimately waits for
    a workflow that is starting, queued or held by the budget; it logs a warning after
    ``REPORT_S`` seconds of waiting and each ``REPORT_S`` after, saying what it waits for,
    whether the workflow's gate is shut waiting for this trainer's acks (then a
    checkpoint is overdue: :func:`checkpoint_due`) and whether any chunk job is in
    flight.  ``timeout_s`` set: after that many seconds without the chunk it raises
    :class:`StreamError` in one sentence instead.

    Resume through :class:`hsextract.stream.loader.StreamLoader`; a state of an earlier
    pass than :meth:`set_pass` chose (a checkpoint taken after that pass ended) starts the
    chosen pass at its beginning.
    """

    #: Seconds between the warnings of a reader that waits for the journal.
    REPORT_S = 60.0

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        layout: str = "raw",
        epochs_mode: str = StreamConfig.epochs_mode,
        poll_s: float = 0.05,
        timeout_s: float | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world {world})")
        self.run_dir = Path(run_dir)
        self.sdir = stream_dir(self.run_dir)
        self.rank, self.world, self.seed = rank, world, seed
        self.layout, self.epochs_mode = layout, epochs_mode
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.pass_ = 1
        self._pos = {"pass": 1, "slot": 0, "pos": 0, "pad": 0}
        #: (pass, slot) of the state this reader was resumed from, if any: whether a chunk
        #: found deleted was covered by that checkpoint (open_checked's message).
        self._resumed: tuple[int, int] | None = None
        #: Where this dataset's loader workers leave the chunks they hashed: each chunk is
        #: hashed once per loader, not once per worker reading a share of its records --
        #: and once per node under torchrun (:func:`verdict_dir`).
        self.verified = verdict_dir(self.run_dir)

    # -- resumable state (torchdata's Stateful protocol, per worker) --------------------
    def state_dict(self) -> dict[str, int]:
        return dict(self._pos)

    def load_state_dict(self, state: dict[str, int]) -> None:
        pos = {k: int(state[k]) for k in ("pass", "slot", "pos", "pad")}
        if pos["pass"] < self.pass_:
            # set_pass chose a later pass than the state's (a trainer resuming from the
            # checkpoint it took after that pass ended, at its next epoch): taking the
            # state's pass would read nothing of the chosen one, i.e. skip it.
            return
        self._pos = pos
        self.pass_ = pos["pass"]
        self._resumed = (pos["pass"], pos["slot"])

    def set_pass(self, pass_: int) -> None:
        self.pass_ = pass_
        if self._pos["pass"] != pass_:
            self._pos = {"pass": pass_, "slot": 0, "pos": 0, "pad": 0}

    # -- following the journal ----------------------------------------------------------
    def _chunks_of_pass(self, st: Any) -> tuple[list[dict], bool]:
        src = 1 if self.epochs_mode == "keep" else self.pass_
        lines = [c for _, c in sorted(st.chunks.items()) if c["pass"] == src]
        return lines, src in st.ends

    def _wait(self, slot: int) -> tuple[list[dict], bool]:
        """The pass's chunks once its ``slot``-th is announced or the pass has ended."""
        t0 = time.monotonic()
        deadline = None if self.timeout_s is None else t0 + self.timeout_s
        report = t0 + self.REPORT_S
        seen = None
        while True:
            st = read_state(self.sdir)
            lines, ended = self._chunks_of_pass(st)
            if len(lines) > slot or ended:
                return lines, ended
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise StreamError(
                    f"rank {self.rank}: no chunk {slot} of pass {self.pass_} in "
                    f"{self.sdir / JOURNAL} after {self.timeout_s} s"
                    f"{waiting_why(self.run_dir, st, lines, self.pass_)}"
                )
            if now >= report:
                report = now + self.REPORT_S
                log.warning(
                    "rank %d: waiting %.0f s for chunk %d of pass %d in %s%s (StreamDataset's "
                    "timeout_s stops it instead)", self.rank, now - t0, slot, self.pass_,
                    self.sdir / JOURNAL, waiting_why(self.run_dir, st, lines, self.pass_),
                )  # fmt: skip
            seen = _wait_change(self.sdir / JOURNAL, seen, self.poll_s)

    def _open(self, line: dict, resume: str | None = None) -> tuple[ChunkReader, dict]:
        return open_checked(self.run_dir, line, who=f"rank {self.rank}", poll_s=self.poll_s,
                            timeout_s=self.timeout_s, verified=self.verified,
                            resume=resume)  # fmt: skip

    def _resume_relation(self, slot: int) -> str:
        """Where the state this reader resumed from stands to chunk ``slot`` of its pass:
        ``past`` it (that checkpoint covers it), ``before`` it, or ``fresh`` (the pass was
        started at its beginning, not from a state)."""
        if self._resumed is None or self._resumed[0] != self.pass_:
            return "fresh"
        return "past" if self._resumed[1] > slot else "before"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if self._pos["pass"] != self.pass_:
            self._pos = {"pass": self.pass_, "slot": 0, "pos": 0, "pad": 0}
        at_slot = at = 0  # records of the pass before chunk at_slot, kept as slots advance
        while True:
            slot = self._pos["slot"]
            lines, _ = self._wait(slot)
            if slot >= len(lines):
                break  # the pass ended
            line = lines[slot]
            order = list(range(int(line["records"])))
            random.Random(_seed_of(self.seed, self.pass_, line["seq"])).shuffle(order)
            at += sum(int(c["records"]) for c in lines[at_slot:slot])  # O(1) a chunk
            at_slot = slot
            mine = [order[j] for j in share(at, len(order), rank=self.rank, world=self.world,
                                            worker=wid, workers=nw)]  # fmt: skip
            reader = None
            if self._pos["pos"] < len(mine):
                # The revision whose bytes were checked.
                reader, line = self._open(line, self._resume_relation(slot))
            while self._pos["pos"] < len(mine):
                j = mine[self._pos["pos"]]
                self._pos["pos"] += 1
                if self._pos["pos"] == len(mine):  # done with this chunk: say so at once
                    self._pos["slot"] += 1
                    self._pos["pos"] = 0
                assert reader is not None
                if info is None:
                    yield self._sample(reader[j], line)
                else:  # its tensors go through shared memory: written there at once
                    yield shared_compact(self._sample(worker_record(reader, j), line))
                if self._pos["pos"] == 0:
                    break
            else:  # nothing (left) of this chunk for this worker
                self._pos["slot"] += 1
                self._pos["pos"] = 0
            del reader
        yield from self._padding(lines, wid, nw)

    def _padding(self, lines: list[dict], wid: int, nw: int) -> Iterator[dict[str, Any]]:
        """The rank's padding samples (at most one: ranks differ by one record), each at
        the worker whose turn it is, so the loader's round robin goes on in order."""
        total = offsets(lines)[-1]
        mine = rank_records(total, self.rank, self.world)
        deficit = rank_records(total, 0, self.world) - mine
        todo = len(range((wid - mine) % nw, deficit, nw))
        while self._pos["pad"] < todo:
            self._pos["pad"] += 1
            yield self._pad_sample(lines)

    # -- layouts ----------------------------------------------------------------------
    def _sample(self, rec: dict[str, Any], line: dict) -> dict[str, Any]:
        meta = {"seq": int(line["seq"]), "pass": self.pass_, "id": rec["id"], "pad": False}
        if self.layout == "raw":
            return {**rec, **meta}
        if self.layout == "specforge":
            from hsextract.export.specforge import _tensors

            return {**_tensors(rec), **meta}
        return {**speculators_sample(rec, line["chunk"]), **meta}

    def _pad_sample(self, lines: list[dict]) -> dict[str, Any]:
        """One token, loss mask 0, shaped like the real samples (from the journal's
        ``shapes``: the chunk files may be deleted by now)."""
        shapes = next((c["shapes"] for c in lines if c.get("shapes")), None)
        if shapes is None:
            raise StreamError(f"pass {self.pass_}: no chunk's shapes to pad rank {self.rank} with")
        dtype = getattr(torch, shapes["dtype"])
        rec: dict[str, Any] = {
            "input_ids": torch.zeros(1, dtype=torch.int32),
            "loss_mask": torch.zeros(1, dtype=torch.uint8),
            "hidden_states": torch.zeros(1, shapes["hidden"], dtype=dtype),
            "aux_hidden_states": torch.zeros(1, shapes["aux"], dtype=dtype),
            "id": "<pad>",
        }
        if shapes.get("prenorm"):
            rec["prenorm_hidden_states"] = torch.zeros(1, shapes["hidden"], dtype=dtype)
        out = self._sample(rec, lines[0])
        return {**out, "seq": -1, "pad": True}


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory of exactly its size.  Why not
    ``torch.empty(...).share_memory_()``: that faults in private pages, then copies them
    into shared ones (2 copies' page faults, which dominate on a VM: 0.4 GB/s against
    0.55 allocated shared at once, bench/stream_reader.py's machine)."""
    n = math.prod(shape) * dtype.itemsize
    if not n:
        return torch.empty(shape, dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(n), 0, shape)


def _byte_span(v: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a (non-empty) tensor spans: [first, past its last)."""
    last = v.storage_offset() + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True))
    return v.storage_offset() * v.element_size(), (last + 1) * v.element_size()


def shared_compact(sample: dict[str, Any]) -> dict[str, Any]:
    """``sample`` as a loader worker hands it to the trainer process: the tensors that are
    views of a larger storage not yet shared moved into shared memory holding just the
    bytes they span (views of one storage together, once), each with its shape, strides
    and values as they were; the others as they are.

    Why: a worker's tensors reach the trainer through shared memory, and torch shares a
    tensor's *whole storage*, copying it there unless it is already shared.  An
    uncompressed chunk's rows (and every codec's ids and masks) are slices of the chunk's
    mapping, so each record shipped its whole chunk's tensors: with 7 records a chunk, 7x
    the bytes (bench/stream_reader.py: 0.09 GB/s a worker, against 0.9 in the process).
    Copied here, once, into shared memory, torch sends the record's bytes and no more.
    """
    # Views of one storage whose bytes overlap go together (aux and the pre-norm state
    # of one decoded block); apart ones apart, so that tensors of one file-wide mapping
    # never copy what lies between them.
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for k, v in sample.items():
        if isinstance(v, torch.Tensor) and v.numel() and not v.is_shared():
            spans.setdefault(v.untyped_storage().data_ptr(), []).append((*_byte_span(v), k))
    groups: list[list[tuple[int, int, str]]] = []
    for views in spans.values():
        views.sort()
        groups.append([views[0]])
        for view in views[1:]:
            if view[0] < max(b for _, b, _ in groups[-1]):
                groups[-1].append(view)
            else:
                groups.append([view])
    out = dict(sample)
    u8 = torch.uint8
    for group in groups:
        lo, hi = group[0][0], max(b for _, b, _ in group)
        src = sample[group[0][2]].untyped_storage()
        if src.nbytes() <= hi - lo:
            continue  # its own bytes only: torch's one copy is all it costs
        dst = torch.UntypedStorage._new_shared(hi - lo)
        torch.empty(0, dtype=u8).set_(dst, 0, (hi - lo,)).copy_(
            torch.empty(0, dtype=u8).set_(src, lo, (hi - lo,))
        )
        for a, _, k in group:
            v = sample[k]
            off, rem = divmod(a - lo, v.element_size())
            if rem:  # at an odd offset for its dtype (never from a chunk): left as it is
                continue
            out[k] = torch.empty(0, dtype=v.dtype).set_(dst, off, v.shape, v.stride())
    return out


def worker_record(reader: ChunkReader, j: int) -> dict[str, Any]:
    """Record ``j`` of ``reader`` as a loader worker sends it: the same tensors as
    ``reader[j]`` (values, dtypes, shapes, the ``id``), each in shared memory of its own.

    Why not ``reader[j]``, then shared: a lossless record decodes into fresh buffers, which
    torch then copies into shared memory to send -- a second copy of every byte, ~40 % of
    a worker's time (bench/stream_reader.py, ``loader1`` against ``dataset``).  Here its
    frames decode straight into shared memory (``ChunkReader.record``'s ``alloc``, its
    checks and errors); the other codecs' rows are slices of the file's mapping, copied
    once (:func:`shared_compact`)."""
    alloc = _shared_empty if reader.codec == "lossless" else None
    return shared_compact(reader.record(j, alloc))


def waiting_why(run_dir: Path, st: Any, lines: list[dict], pass_: int, *,
                epochs_mode: str = StreamConfig.epochs_mode) -> str:  # fmt: skip
    """What a reader waiting for the pass's next chunk (``lines``: its chunks so far) can
    tell about why, for its warning or its timeout's sentence: the workflow's gate shut
    for acks of chunks this trainer read (it checkpoints too rarely: both sides wait for
    good), or no chunk job in flight (no workflow running, or between jobs)."""
    from hsextract.stream import gate  # stdlib only, like the journal

    sdir = stream_dir(run_dir)
    final = pass_ if epochs_mode == "keep" else 1
    unacked = [int(c["seq"]) for c in lines if not st.is_acked(int(c["seq"]), final)]
    try:
        shut = json.loads((sdir / gate.GATE).read_text())
    except (OSError, ValueError):
        shut = {}
    if shut.get("paused"):
        since = time.strftime("%H:%M:%S", time.localtime(float(shut.get("since", 0))))
        if not unacked:
            return (
                f"; the workflow's gate has been shut since {since} waiting for acks, though "
                f"every chunk this pass read so far is acknowledged "
                f"(`{hsextract_command('status', run_dir=run_dir)}` names what it waits for)"
            )
        seqs = str(unacked[0]) if len(unacked) == 1 else f"{unacked[0]}..{unacked[-1]}"
        return (
            f"; the workflow's gate has been shut since {since} waiting for acks, and "
            f"{len(unacked)} chunk(s) this pass read (seqs {seqs}) are not acknowledged: "
            f"{LATE_CHECKPOINT}"
        )
    jobs = len(gate.reservations(sdir))
    if jobs:
        return f"; {jobs} chunk job(s) in flight"
    status = hsextract_command("status", run_dir=run_dir)
    return f"; no chunk job is in flight: is the workflow running? (`{status}` says)"


def speculators_sample(rec: dict[str, Any], chunk: str) -> dict[str, torch.Tensor]:
    """One record as speculators' ``BaseDataset.__getitem__`` returns it (speculators
    0.9.0): aux layers concatenated, the pre-norm final state apart."""
    if "prenorm_hidden_states" not in rec:
        raise StreamError(
            f"{chunk}: speculators' layout needs the pre-norm final state, which this run "
            "did not capture; set prenorm_final: true (a new run dir)"
        )
    t = rec["input_ids"].shape[0]
    return {
        "input_ids": rec["input_ids"].to(torch.int64),
        "hidden_states": rec["aux_hidden_states"],
        "verifier_last_hidden_states": rec["prenorm_hidden_states"],
        "loss_mask": rec["loss_mask"].to(torch.int64),
        "lengths": torch.tensor([t], dtype=torch.long),
        "position_ids": torch.arange(t, dtype=torch.long),
    }


def open_checked(
    run_dir: str | os.PathLike[str],
    line: dict,
    *,
    who: str = "rank 0",
    poll_s: float = 0.05,
    timeout_s: float | None = None,
    verified: VerifiedDir | None = None,
    resume: str | None = None,
) -> tuple[ChunkReader, dict]:
    """The chunk ``line`` announces, opened once its bytes hash to the journal's sha256,
    and the journal line of the revision read (the latest of its seq).

    A mismatch appends a ``nack`` and waits, following the journal as the reader waits for
    new chunks (``poll_s``, ``timeout_s``), for the newer revision that answers it, and
    checks that.  Why wait rather than stop: the redo comes from the next ``extract_all``
    (its plan removes the nacked payload and redoes the chunk) and holds the same records,
    so a trainer that waits loses nothing, and need not be restarted.  But nothing redoes
    it once its pass has ended (no chunk job of it is left) unless a plan has taken the
    nack up (``deleted.jsonl``: ``why: nack`` of that revision): then it stops at once, in
    one sentence saying what to run.  ``who`` names the waiter in the timeout's sentence;
    ``verified``: the reader's processes hash each chunk once between them.  A payload
    gone with no nack open stops the reader in one sentence (:func:`gone_text`; ``resume``
    says where the reader's resumed state stands to this chunk, for it).
    """
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    seq = int(line["seq"])
    dealt = line
    while True:
        line = read_state(sdir).chunks.get(seq, line)  # a redo announced meanwhile: its line
        path = run_dir / line["path"]
        hashed = file_identity(path)
        try:
            verify_chunk_file(path, line["sha256"], shared=verified)
            seen: str | None = line["sha256"]
        except ChunkDigestError as exc:
            seen = exc.actual
        except ChunkFileError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise StreamError(f"{line['chunk']} (seq {seq}): {exc}") from exc
            st = read_state(sdir)
            if not st.nack_open(seq):
                raise StreamError(gone_text(run_dir, st, line, resume)) from None
            seen = None  # nacked, and removed for its redo by the plan
        if seen == line["sha256"]:
            try:  # its bytes were just hashed against the journal: no second hash
                reader = ChunkReader(path, verify=False)
            except ChunkFileError as exc:
                raise StreamError(f"{line['chunk']} (seq {seq}): {exc}") from exc
            if file_identity(path) != hashed:  # replaced (a redo renamed in) since: again
                continue
            _same_records(dealt, line)
            return reader, line
        if seen is not None:
            AckWriter(run_dir).nack(seq, line["sha256"], seen, int(line.get("rev", 0)))
        line = _await_redo(run_dir, line, seen, who=who, poll_s=poll_s, timeout_s=timeout_s)


def gone_text(run_dir: Path, st: Any, line: dict, resume: str | None) -> str:
    """Why the payload of an announced chunk is gone, for a reader that needs it: acked
    (by which step's checkpoint) and freed, or removed with no ack; and what to do, by
    where the reader's resumed state stands to the chunk (``resume``: ``past`` -- that
    checkpoint covers it --, ``before``, ``fresh`` -- the pass started at its beginning
    --, or None: not known).  Why it matters: a trainer whose own checkpoint acked the
    chunk is reading its pass again (its loader started it over), not racing another."""
    seq = int(line["seq"])
    head = f"{line['chunk']} (seq {seq}) is announced but {run_dir / line['path']} is gone"
    freed = (st.deleted.get(seq) or {}).get("why") == "ack"
    if seq not in st.acked and not freed:
        return (
            f"{head} and no checkpoint acknowledged it (a user or another tool removed "
            f"it): run `{snakemake_command('extract_all', run_dir=run_dir)}` (it redoes "
            "the chunk), then resume from your checkpoint"
        )
    steps = [a.get("step") for a in read_lines(stream_dir(run_dir) / ACKS)
             if a.get("type") == "ack" and seq in a.get("seqs", ())]  # fmt: skip
    by = f" at step {steps[0]}" if steps and steps[0] is not None else ""
    acked = f"{head}: a checkpoint acknowledged it{by} and the workflow freed it"
    if resume == "before":
        return (
            f"{acked}, a later one than the checkpoint this trainer resumed from; resume "
            "from the latest checkpoint (the one that acknowledged it)"
        )
    if resume in ("past", "fresh"):
        why = (
            "this reader's resumed state is past it, yet reads it again"
            if resume == "past"
            else "this reader started its pass at the beginning instead of from that "
            "checkpoint's loader state"
        )
        return (
            f"{acked}, and {why}: resume with hsextract.stream.StreamLoader and load the "
            "checkpoint's loader state into it (torchdata's StatefulDataLoader starts a "
            "pass over from a state taken after the pass ended); a second trainer cannot "
            "read what the first acknowledged"
        )
    return f"{acked}; resume from the latest checkpoint, which covers it"


def _same_records(dealt: dict, read: dict) -> None:
    """A revision holds its seq's records (a redo of the same data); the reader dealt and
    shuffled the chunk's records from ``dealt``, so a revision of other records (the
    run's data changed under the stream: announce makes a revision of a re-extraction)
    would be read short or with records lost: stop, in one sentence."""
    if (int(read["records"]), read.get("content_digest")) != (
        int(dealt["records"]),
        dealt.get("content_digest"),
    ):
        raise StreamError(
            f"{read['chunk']} (seq {read['seq']}): revision {read.get('rev', 0)} holds other "
            f"records ({read['records']}, digest {str(read.get('content_digest'))[:12]}) than "
            f"the one this pass was dealt from ({dealt['records']}, digest "
            f"{str(dealt.get('content_digest'))[:12]}): the run's data changed while it was "
            "streamed; a data change is a new stream: train from the start of this run's "
            "pass, not from a checkpoint of the old data"
        )


def _await_redo(
    run_dir: Path,
    line: dict,
    seen: str | None,
    *,
    who: str,
    poll_s: float,
    timeout_s: float | None,
) -> dict:
    """The journal line that answers the nack of ``line`` (a newer revision of its seq),
    or ``line`` itself once its file hashes to the announced sha256 again (a payload
    restored: the plan keeps it and redoes nothing).  Raises when nothing will redo it."""
    sdir = stream_dir(run_dir)
    seq, rev, pass_ = int(line["seq"]), int(line.get("rev", 0)), int(line["pass"])
    path = run_dir / line["path"]
    mark = file_identity(path)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    said = None
    told = False
    while True:
        st = read_state(sdir)
        now = st.chunks.get(seq, line)
        if int(now.get("rev", 0)) > rev:
            return now
        if file_identity(path) != mark:  # rewritten: restored, or a redo not announced yet
            mark = file_identity(path)
            try:
                if sha256_file(path) == line["sha256"]:
                    return line
            except FileNotFoundError:
                pass
        bytes_were = "is gone" if seen is None else f"has sha256 {seen[:12]}..."
        deleted = st.deleted.get(seq) or {}
        taken_up = deleted.get("why") == "nack" and int(deleted.get("rev", -1)) == rev
        if pass_ in st.ends and not taken_up:
            raise StreamError(
                f"{line['chunk']} (seq {seq}): {path} {bytes_were}, the journal announced "
                f"{line['sha256'][:12]}...: nacked, not trained on, and nothing will redo it "
                f"(pass {pass_} has ended and no plan has taken the nack up): run "
                f"`{snakemake_command('extract_all', run_dir=run_dir)}` (it redoes the chunk "
                "as a new revision), then resume from your checkpoint"
            )
        if deadline is not None and time.monotonic() > deadline:
            raise StreamError(
                f"{who}: no redo of {line['chunk']} (seq {seq}, revision {rev} nacked: {path} "
                f"{bytes_were}) in {sdir / JOURNAL} after {timeout_s} s; is the workflow "
                "running? the next extract_all redoes it"
            )
        if not told:
            told = True
            log.warning(
                "%s: %s (seq %d) %s, the journal announced %s...: nacked; waiting for its "
                "redo, which the next extract_all makes (stop a run whose chunk jobs wait "
                "at the gate for this trainer, and rerun it)",
                who, line["chunk"], seq, bytes_were, line["sha256"][:12],
            )  # fmt: skip
        said = _wait_change(sdir / JOURNAL, said, poll_s)


def _wait_change(path: Path, seen: Any, poll_s: float) -> Any:
    """Sleep until ``path`` changes (size, mtime) or ``poll_s`` passed."""
    deadline = time.monotonic() + poll_s
    step = min(0.01, poll_s)
    while True:
        try:
            s = path.stat()
            now = (s.st_mtime_ns, s.st_size)
        except FileNotFoundError:
            now = None
        if (seen is not None and now != seen) or time.monotonic() >= deadline:
            return now
        time.sleep(step)
        step = min(step * 2, poll_s)


def worker_states(loader_state: dict[str, Any]) -> list[dict[str, int] | None]:
    """Each loader worker's dataset state inside a ``StatefulDataLoader.state_dict()``,
    indexed by worker id (None: a worker that has not reported one), or the dataset's own
    state with no workers."""
    snap = loader_state.get("_snapshot", loader_state)
    workers = snap.get("_worker_snapshots")
    if workers:
        out: list[dict[str, int] | None] = [None] * len(workers)
        for key, w in workers.items():
            out[int(w.get("worker_id", key.rsplit("_", 1)[-1]))] = w.get("dataset_state") or None
        return out
    ds = loader_state.get("dataset_state") or snap.get("_main_snapshot", {}).get("dataset_state")
    return [ds or None]


def consumed_seqs(
    run_dir: str | os.PathLike[str],
    loader_states: list[dict[str, Any]],
    *,
    epochs_mode: str = StreamConfig.epochs_mode,
) -> list[int]:
    """The seqs that every loader worker of every rank has read to the end, given each
    rank's loader state (``loader_states[r]`` is rank ``r``'s, all-gathered at the
    checkpoint): what a checkpoint holding those states covers, so what rank 0 may ack
    once it commits.

    Why every rank's: all ranks read each chunk (:func:`share`), so a chunk one rank has
    finished may still be read by another.  Each worker's state says which record of the
    pass it takes next (it takes every ``world x workers``-th); a chunk is covered once
    every worker's next record is past it, so a worker with nothing to read in a chunk
    does not hold it.  A worker that has not reported a state covers nothing; one in a
    later pass has finished this one.
    """
    world = len(loader_states)
    per_rank = [worker_states(s) for s in loader_states]
    if not per_rank or any(w is None for ws in per_rank for w in ws):
        return []  # a worker that has not reported yet covers nothing
    pass_ = min(int(w["pass"]) for ws in per_rank for w in ws)
    st = read_state(stream_dir(run_dir))
    src = 1 if epochs_mode == "keep" else pass_
    lines = [c for _, c in sorted(st.chunks.items()) if c["pass"] == src]
    off = offsets(lines)
    upto = off[-1]  # the first record of the pass some worker has not taken yet
    for rank, ws in enumerate(per_rank):
        n = world * len(ws)
        for wid, w in enumerate(ws):
            assert w is not None
            if int(w["pass"]) == pass_:
                at = off[min(int(w["slot"]), len(lines))]
                upto = min(upto, at + (wid * world + rank - at) % n + int(w["pos"]) * n)
    return [int(c["seq"]) for c, end in zip(lines, off[1:], strict=True) if end <= upto]


def _pass_of(states: list[dict[str, int] | None]) -> int | None:
    """The pass a rank's loader is in: its workers' lowest (None: none reported yet)."""
    passes = [int(w["pass"]) for w in states if w is not None]
    return min(passes) if passes else None


def _steps(states: list[dict[str, int] | None], lines: list[dict], pass_: int, *, rank: int,
           world: int) -> int:  # fmt: skip
    """Samples one rank's loader has handed out in ``pass_`` (padding included), from its
    workers' states: its next record of the pass (as :func:`consumed_seqs` finds it) says
    how many of its records it took.  ``lines`` must hold every chunk the rank read."""
    off = offsets(lines)
    n = world * len(states)
    nxt, pad = off[-1], 0
    for wid, w in enumerate(states):
        if w is None:
            return 0  # a worker that has not reported: nothing handed out yet
        if int(w["pass"]) != pass_:
            continue  # in a later pass: done with this one
        at = off[min(int(w["slot"]), len(lines))]
        nxt = min(nxt, at + (wid * world + rank - at) % n + int(w["pos"]) * n)
        pad += int(w["pad"])
    return len(range(rank, nxt, world)) + pad


def _covered(
    run_dir: Path,
    loader_state: dict[str, Any] | None,
    *,
    rank: int,
    world: int,
    epochs_mode: str,
    poll_s: float,
    timeout_s: float | None,
    pass_: int | None = None,
) -> tuple[int | None, list[int]]:
    """The pass of ``loader_state`` (or ``pass_`` for none) and the seqs a checkpoint taken
    with every rank at its step covers: the chunks ending at or before record ``steps x
    world`` of the pass (ranks step in lockstep, rank r's t-th sample is record
    ``t x world + r``).  Every rank computes the same from its own state; a rank waits
    here for the journal lines of records the other ranks took at this step."""
    sdir = stream_dir(run_dir)
    states = worker_states(loader_state) if loader_state else []
    pass_ = _pass_of(states) or pass_
    if pass_ is None:
        return None, []
    src = 1 if epochs_mode == "keep" else pass_
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    seen = None
    while True:
        st = read_state(sdir)
        lines = [c for _, c in sorted(st.chunks.items()) if c["pass"] == src]
        off = offsets(lines)
        upto = _steps(states, lines, pass_, rank=rank, world=world) * world if states else 0
        if src in st.ends:
            upto = min(upto, off[-1])
        if off[-1] >= upto:
            return pass_, [int(c["seq"]) for c, end in zip(lines, off[1:], strict=True)
                           if end <= upto]  # fmt: skip
        if deadline is not None and time.monotonic() > deadline:
            raise StreamError(
                f"rank {rank}: the journal {sdir / JOURNAL} has no chunk for record {upto - 1} "
                f"of pass {pass_}, which the other ranks have read at this step, after "
                f"{timeout_s} s"
            )
        seen = _wait_change(sdir / JOURNAL, seen, poll_s)


def checkpoint_due(
    run_dir: str | os.PathLike[str],
    loader_state: dict[str, Any],
    since: dict[str, Any] | None = None,
    *,
    checkpoint_chunks: int,
    rank: int = 0,
    world: int = 1,
    epochs_mode: str = StreamConfig.epochs_mode,
    poll_s: float = 0.05,
    timeout_s: float | None = None,
) -> bool:
    """Whether a trainer must checkpoint (then ack) now: ``checkpoint_chunks`` (the run's
    ``stream.checkpoint_chunks``) or more chunks are covered since the checkpoint whose
    loader state is ``since`` (None: the start), with every rank at the step of this
    rank's ``loader_state``.  Call it on every rank after each step (every rank gets the
    same answer from its own state: no collective) and checkpoint when it says so.

    Why not a step count: chunks hold different numbers of records, so N steps may cover
    no chunk or several; a trainer that covers more chunks than declared between
    checkpoints needs more of them on disk than the budget holds for it, and then waits
    for a chunk the workflow only writes after an ack that trainer has not written
    (:data:`hsextract.stream.checkpoints.LATE_CHECKPOINT`).  Chunks of earlier passes
    count too (a pass that ended since ``since``).  A rank ahead of the others waits here
    for the journal lines of what they read at this step (``timeout_s``).
    """
    if checkpoint_chunks < 1:
        raise ValueError(f"checkpoint_chunks {checkpoint_chunks} must be >= 1")
    run_dir = Path(run_dir)
    kw = {"rank": rank, "world": world, "epochs_mode": epochs_mode, "poll_s": poll_s,
          "timeout_s": timeout_s}  # fmt: skip
    now_pass, now = _covered(run_dir, loader_state, **kw)
    if now_pass is None:
        return False
    then_pass, then = _covered(run_dir, since, pass_=now_pass, **kw)
    assert then_pass is not None
    if then_pass > now_pass:
        raise ValueError(f"since is of pass {then_pass}, after the loader's pass {now_pass}")
    if then_pass == now_pass:
        return len(set(now) - set(then)) >= checkpoint_chunks
    st = read_state(stream_dir(run_dir))
    srcs = [1 if epochs_mode == "keep" else p for p in range(then_pass, now_pass)]
    ended = sum(sum(1 for c in st.chunks.values() if c["pass"] == src) for src in srcs)
    return ended - len(then) + len(now) >= checkpoint_chunks
