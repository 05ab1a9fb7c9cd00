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


def _key(chunk: str, pass_: int) -> str:
    """A chunk job's name in the gate (its reservation): a later pass's is its own."""
    return chunk if pass_ == 1 else f"{chunk}.pass{pass_}"


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
