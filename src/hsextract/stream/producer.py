"""The chunk job's side of the stream: the gate before it sends, the announcement after.

Called from :func:`hsextract.steps.extract_chunk` only when ``stream.budget_gb`` is set;
an offline run never imports this package.
"""

from __future__ import annotations

import atexit
import logging
import sys
from pathlib import Path
from typing import Any

from hsextract.stream import gate, journal

log = logging.getLogger("hsextract")


def _chunk_entries(index: Path) -> list[dict[str, Any]]:
    from hsextract.records import read_index

    return list(read_index(index)["chunks"])


def before_send(
    ss: gate.StreamSettings, *, run_dir: Path, chunk: str, index: Path, raw_bytes_per_token: int
) -> dict[str, Any]:
    """Wait for room in the budget (logging why), then hold this chunk's reservation."""
    entries = _chunk_entries(index)
    tokens = {Path(e["path"]).stem: int(e["tokens"]) for e in entries}
    if chunk not in tokens:
        raise journal.StreamError(f"{chunk} is not a chunk of {index}; rerun split_chunks")

    def tell(info: dict[str, Any]) -> None:
        sys.__stderr__.write(f"hsextract [{chunk}]: {gate.waiting_text(info)}\n")

    figures = gate.wait_for_room(
        run_dir,
        ss,
        chunk=chunk,
        tokens=tokens[chunk],
        raw_bytes_per_token=raw_bytes_per_token,
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
) -> int:
    """Announce the verified, renamed chunk (once), drop the reservation; its seq."""
    chunk = sidecar["chunk"]
    try:
        seq, new = journal.announce(
            run_dir,
            chunk=chunk,
            path=str(Path(hidden).resolve().relative_to(Path(run_dir).resolve())),
            sha256=sidecar["sha256"],
            records=int(sidecar["records"]),
            tokens=int(sidecar["tokens"]),
            content_digest=str(sidecar.get("content_digest", "")),
            n_chunks=len(_chunk_entries(index)),
            shapes=shapes,
            final_pass=ss.final_pass,
        )
    finally:
        gate.release(run_dir, chunk)
    with journal.locked(journal.stream_dir(run_dir)):
        # Acked while this chunk was made: freed now, not at the next chunk's gate, which
        # the last chunks never reach.  This one itself (redone after its ack) is left to
        # the next gate: Snakemake checks its outputs when the job ends.
        st = journal.read_state(journal.stream_dir(run_dir))
        gate.delete_acked(run_dir, st, ss.final_pass, keep=chunk)
    if new:
        log.info("%s: announced to the trainer as seq %d", chunk, seq)
    else:
        log.info("%s: already announced as seq %d (a rerun): not announced again", chunk, seq)
    return seq


class ChunkStream:
    """One chunk job's stream: opened past the gate, announces once, releases always."""

    def __init__(self, ss: gate.StreamSettings, run_dir: Path, hidden: Path, index: Path,
                 shapes: dict[str, Any]) -> None:  # fmt: skip
        self.ss, self.run_dir, self.hidden, self.index, self.shapes = (
            ss, run_dir, hidden, index, shapes
        )  # fmt: skip

    @classmethod
    def open(cls, cfg: Any, *, hidden: Path, index: Path) -> ChunkStream:
        from hsextract.budget import bytes_per_token
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
        before_send(
            ss,
            run_dir=rd,
            chunk=Path(hidden).stem,
            index=index,
            raw_bytes_per_token=bytes_per_token(geo.hidden_size, n_aux, dtype),
        )
        out = cls(ss, rd, hidden, index, shapes)
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
        )

    def release(self) -> None:
        gate.release(self.run_dir, Path(self.hidden).stem)
