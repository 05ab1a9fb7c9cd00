"""The chunk job's side of the stream: the gate before it sends, the announcement after.

Called from :func:`hsextract.steps.extract_chunk` only when ``stream.budget_gb`` is set;
an offline run never imports this package.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hsextract.stream import gate, journal

log = logging.getLogger("hsextract")


def _chunk_entries(index: Path) -> list[dict[str, Any]]:
    from hsextract.records import read_index

    return list(read_index(index)["chunks"])


def _key(chunk: str, pass_: int) -> str:
    """A chunk job's name in the gate (its reservation): a later pass's is its own."""
    return chunk if pass_ == 1 else f"{chunk}.pass{pass_}"


#: Under ``stream/``: a copy of each announced chunk's sidecar, what its receipt needs.
RECEIPTS = "receipts"


def receipt_copy(run_dir: Path, chunk: str, pass_: int = 1) -> Path:
    """Where the copy of a chunk's sidecar is kept once announced (see :func:`restore`)."""
    sub = Path(RECEIPTS) if pass_ == 1 else Path(RECEIPTS, f"pass{pass_}")
    return journal.stream_dir(run_dir) / sub / f"{chunk}.json"


def _keep_receipt(run_dir: Path, sidecar: dict[str, Any], pass_: int) -> None:
    """Keep the sidecar's copy before the chunk is announced (temp name, fsync, rename):
    an announcement whose copy is missing is redone, never restored from nothing."""
    dest = receipt_copy(run_dir, sidecar["chunk"], pass_)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(sidecar, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)


def restore(
    ss: gate.StreamSettings, *, run_dir: Path, hidden: Path, sidecar_out: Path,
    content_digest: str | None, pass_: int = 1,
) -> dict[str, Any] | None:  # fmt: skip
    """The receipt of a chunk already announced, written back in place of extracting it
    again; None when the chunk must be extracted.

    A workflow killed after a chunk's announcement but before Snakemake recorded its job's
    end reruns that job (``rerun-incomplete``), and Snakemake deletes an incomplete job's
    outputs first: the receipt is gone though the chunk is announced.  Extracting it
    again would cost its GPU time and leave a payload nothing counts (the journal
    announces a chunk once).  So a job whose chunk is announced -- its latest revision not
    nacked, its payload acked for good or still on disk as announced (inode, size,
    mtime), its records unchanged (``content_digest``) -- restores the sidecar kept at
    its announcement and extracts nothing.  Anything else (never announced, lost before
    its ack, nacked, written to since, records changed) is extracted; so is a receipt
    the user forced (``snakemake -f``: the caller does not ask).
    """
    run_dir = Path(run_dir)
    chunk = Path(hidden).stem
    sdir = journal.stream_dir(run_dir)
    if not (sdir / journal.JOURNAL).exists():
        return None
    st = journal.read_state(sdir)
    line = st.find(chunk, pass_)
    if line is None or st.nack_open(int(line["seq"])):
        return None
    try:
        kept = json.loads(receipt_copy(run_dir, chunk, pass_).read_text())
    except (OSError, ValueError):
        return None  # no copy (an older hsextract kept none): extracted, as before
    if kept.get("sha256") != line["sha256"] or kept.get("bytes") != line["bytes"]:
        return None  # the copy of another revision
    if content_digest is not None and kept.get("content_digest", "") != content_digest:
        return None  # its records changed since: extracted anew
    acked = st.is_acked(int(line["seq"]), ss.final_pass)
    payload = run_dir / line["path"]
    as_announced = journal.file_identity(payload) == gate._announced(line)
    if not acked and not as_announced:
        return None  # lost (or written to) before its ack: redone, past the gate
    tmp = sidecar_out.with_name(f".{sidecar_out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(kept, indent=2, sort_keys=True))
    os.replace(tmp, sidecar_out)
    log.info(
        "%s: announced as seq %d (pass %d) before the workflow was interrupted, %s: its "
        "receipt restored, nothing extracted",
        chunk, line["seq"], pass_,
        "acknowledged by the trainer" if acked else "its payload on disk as announced",
    )  # fmt: skip
    # This job's look: what was acked meanwhile is freed, a dead job's temp files go.
    gate.after_announce(run_dir, ss, chunk)
    return kept


def before_send(
    ss: gate.StreamSettings,
    *,
    run_dir: Path,
    chunk: str,
    index: Path,
    raw_bytes_per_token: int,
    pass_: int = 1,
    ratio_known: bool = True,
) -> dict[str, Any]:
    """Wait for room in the budget (logging why), then hold this chunk's reservation.
    ``raw_bytes_per_token``: the codec's bytes/token before any chunk is measured (exact
    unless ``ratio_known`` is false: budget.stored_bytes_per_token)."""
    entries = _chunk_entries(index)
    tokens = {Path(e["path"]).stem: int(e["tokens"]) for e in entries}
    if chunk not in tokens:
        raise journal.StreamError(f"{chunk} is not a chunk of {index}; rerun split_chunks")

    def tell(info: dict[str, Any]) -> None:
        sys.__stderr__.write(f"hsextract [{chunk}]: {gate.waiting_text(info)}\n")

    figures = gate.wait_for_room(
        run_dir,
        ss,
        chunk=_key(chunk, pass_),
        redo_of=(chunk, pass_),
        tokens=tokens[chunk],
        raw_bytes_per_token=raw_bytes_per_token,
        ratio_known=ratio_known,
        largest_tokens=max(tokens.values()),
        run_tokens=sum(tokens.values()),
        on_wait=tell,
    )
    log.info(
        "%s: stream budget: %.3g GB unacked + %.3g GB reserved + this chunk's ~%.3g GB "
        "<= %.3g GB (waited %.1f s)",
        chunk,
        figures["unacked_bytes"] / gate.GB,
        figures["reserved_bytes"] / gate.GB,
        figures["estimate_bytes"] / gate.GB,
        ss.budget_bytes / gate.GB,
        figures["waited_s"],
    )
    return figures


def after_chunk(
    ss: gate.StreamSettings,
    *,
    run_dir: Path,
    sidecar: dict[str, Any],
    hidden: Path,
    index: Path,
    shapes: dict[str, Any],
    pass_: int = 1,
    deterministic: bool = False,
) -> int:
    """Announce the verified, renamed chunk (once), drop the reservation; its seq.

    A later pass's chunk (epochs_mode regenerate) is compared with pass 1's sha256: with a
    bit-deterministic engine a difference is logged as a warning (the report counts both).
    """
    chunk = sidecar["chunk"]
    path = str(Path(hidden).resolve().relative_to(Path(run_dir).resolve()))
    _keep_receipt(run_dir, sidecar, pass_)
    try:
        seq, new = journal.announce(
            run_dir,
            chunk=chunk,
            path=path,
            sha256=sidecar["sha256"],
            records=int(sidecar["records"]),
            tokens=int(sidecar["tokens"]),
            content_digest=str(sidecar.get("content_digest", "")),
            n_chunks=len(_chunk_entries(index)),
            shapes=shapes,
            pass_=pass_,
            final_pass=ss.final_pass,
        )
    finally:
        gate.release(run_dir, _key(chunk, pass_))
    from hsextract import faults

    if faults.ACTIVE:
        faults.after_announce(chunk)
    # A usage sample; what was acked meanwhile freed (not this chunk's own payload).
    gate.after_announce(run_dir, ss, chunk, keep=path)
    if pass_ > 1:
        first = journal.read_state(journal.stream_dir(run_dir)).find(chunk, 1)
        same = first is not None and first["sha256"] == sidecar["sha256"]
        if same:
            log.info("%s: pass %d matches pass 1's sha256", chunk, pass_)
        elif deterministic:
            log.warning(
                "%s: pass %d's sha256 %s... differs from pass 1's %s... though the engine is "
                "bit-deterministic: the server or its settings changed between passes?",
                chunk, pass_, sidecar["sha256"][:12],
                None if first is None else first["sha256"][:12],
            )  # fmt: skip
    if new:
        log.info("%s: announced to the trainer as seq %d (pass %d)", chunk, seq, pass_)
    else:
        log.info("%s: already announced as seq %d (a rerun): not announced again", chunk, seq)
    return seq


class ChunkStream:
    """One chunk job's stream: opened past the gate, announces once, releases always."""

    def __init__(self, ss: gate.StreamSettings, run_dir: Path, hidden: Path, index: Path,
                 shapes: dict[str, Any], pass_: int = 1,
                 deterministic: bool = False) -> None:  # fmt: skip
        self.ss, self.run_dir, self.hidden, self.index, self.shapes = (
            ss, run_dir, hidden, index, shapes
        )  # fmt: skip
        self.pass_, self.deterministic = pass_, deterministic

    @classmethod
    def open(cls, cfg: Any, *, hidden: Path, index: Path, pass_: int = 1) -> ChunkStream:
        from hsextract.budget import stored_bytes_per_token
        from hsextract.client import model_geometry
        from hsextract.config import run_dir

        ss = gate.settings_of(cfg)
        assert ss is not None
        geo = model_geometry(cfg)
        dtype = str(geo.dtype).removeprefix("torch.")
        n_aux = len(geo.aux_layers)
        prenorm = geo.num_layers in geo.aux_layers
        shapes = {
            "hidden": geo.hidden_size,
            "aux": geo.hidden_size * (n_aux - 1 if prenorm else n_aux),
            "prenorm": prenorm,
            "dtype": dtype,
        }
        rd = run_dir(cfg)
        bpt, exact = stored_bytes_per_token(cfg.storage.codec, geo.hidden_size, n_aux, dtype)
        before_send(
            ss,
            run_dir=rd,
            chunk=Path(hidden).stem,
            index=index,
            raw_bytes_per_token=bpt,
            pass_=pass_,
            ratio_known=exact,
        )
        # Bit-deterministic: the reference engine always, SGLang with batch-invariant ops.
        deterministic = cfg.engine == "reference" or bool(cfg.server.batch_invariant)
        out = cls(ss, rd, hidden, index, shapes, pass_, deterministic)
        # A failed chunk job exits through sys.exit: its reservation goes with it (one
        # SIGKILLed is found dead by the next gate, on this host).
        atexit.register(out.release)
        return out

    def announce(self, sidecar: dict[str, Any]) -> int:
        return after_chunk(
            self.ss,
            run_dir=self.run_dir,
            sidecar=sidecar,
            hidden=self.hidden,
            index=self.index,
            shapes=self.shapes,
            pass_=self.pass_,
            deterministic=self.deterministic,
        )

    def release(self) -> None:
        gate.release(self.run_dir, _key(Path(self.hidden).stem, self.pass_))
