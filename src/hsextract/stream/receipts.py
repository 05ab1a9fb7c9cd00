"""Receipts and redos: how Snakemake, the plan and the manifest see the stream's deletions.

Under ``stream.budget_gb`` the producer deletes a chunk's payload once the trainer acked it
(:func:`hsextract.stream.gate.delete_acked`, logged in ``deleted.jsonl``); its sidecar
stays and is the chunk's *receipt*.  So under a budget extract_chunk's output is the
sidecar alone (the payload a param) and ``extract_all`` asks for receipts: a deleted,
acknowledged chunk is done, not missing; the plan counts it current, the manifest lists it
from the receipt, ``verify`` checks it against the receipt and the deletion's record.  A
payload gone *without* such a line (lost before its ack, or removed by hand) is named in
the plan's trigger (plan.changed_note), so the next ``extract_all`` redoes it; the journal
recognises the redo (same chunk, same sha256 with a bit-deterministic engine) and
announces nothing twice.

A chunk the trainer *nacked* (its bytes were not the announced sha256) is in that trigger
too; the plan deletes its payload and sidecar -- only at the path the journal names inside
the run dir -- and redoes it; its announcement is a new revision of the same seq, which
readers open.

Stdlib only: the plan and ``hsextract status`` call this.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from hsextract.chunkfile import sha256_file
from hsextract.stream.gate import DELETED
from hsextract.stream.journal import (
    ACKS,
    StreamState,
    append_line,
    file_identity,
    locked,
    read_lines,
    read_state,
    stream_dir,
)

log = logging.getLogger("hsextract")


def deleted_after_ack(run_dir: str | Path, pass_: int = 1) -> dict[str, dict[str, Any]]:
    """Chunk name -> its ``deleted.jsonl`` line (with the payload's sha256), for every
    payload of pass ``pass_`` (hidden/, or hidden/pass<p>/ under epochs_mode regenerate)
    the producer freed after the trainer's ack that is still gone.

    The last line for a path decides: a payload re-extracted since (it exists again) or
    deleted for a nack is no receipt.  ``{}`` without a stream (an offline run).
    """
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    lines = read_lines(sdir / DELETED)
    if not lines:
        return {}
    where = Path("hidden") if pass_ == 1 else Path("hidden", f"pass{pass_}")
    last: dict[str, dict[str, Any]] = {}
    for d in lines:
        if Path(d["path"]).parent == where:  # this pass's (the names repeat across passes)
            last[str(d["path"])] = d
    st: StreamState | None = None
    out: dict[str, dict[str, Any]] = {}
    for path, d in last.items():
        if d.get("why", "ack") != "ack" or (run_dir / path).exists():
            continue
        if "sha256" not in d:  # written before deleted lines carried it: the journal's
            st = st or read_state(sdir)
            line = st.chunks.get(int(d["seq"]))
            if line is None or line["path"] != path:
                continue
            d = {**d, "sha256": line["sha256"], "chunk": line["chunk"]}
        out[str(d.get("chunk") or Path(path).stem)] = d
    return out


def receipt_matches(sidecar: dict[str, Any], deleted: dict[str, Any]) -> bool:
    """Whether a sidecar describes the very payload that was deleted (not a later redo's)."""
    return sidecar.get("sha256") == deleted.get("sha256") and sidecar.get("bytes") == deleted.get(
        "bytes"
    )


def open_nacks(run_dir: str | Path, st: StreamState | None = None) -> dict[str, dict[str, Any]]:
    """Payload path (the journal's; one per chunk and pass) -> ``{chunk, seq, rev,
    sha256_expected, sha256_seen}`` for each nack the journal has not answered yet.
    ``{}`` when the trainer never nacked (one stat)."""
    sdir = stream_dir(run_dir)
    if st is None:
        if not (sdir / ACKS).exists():
            return {}
        st = read_state(sdir)
    out = {}
    for seq, n in st.nacked.items():
        if st.nack_open(seq):
            line = st.chunks[seq]
            out[line["path"]] = {
                "chunk": line["chunk"],
                "seq": seq,
                "rev": int(line.get("rev", 0)),
                "sha256_expected": n.get("sha256_expected"),
                "sha256_seen": n.get("sha256_seen"),
            }
    return out


def _ours(run_dir: Path, rel: str) -> Path | None:
    """The file the journal names, if it is a plain file inside the run dir (else not ours)."""
    p = run_dir / rel
    if p.is_symlink() or run_dir.resolve() not in p.resolve().parents:
        return None
    return p


def _taken_up(st: StreamState, nack: dict[str, Any]) -> bool:
    """A plan already deleted this revision for its redo (logged last, after both unlinks,
    so a plan killed between them does it again)."""
    d = st.deleted.get(nack["seq"]) or {}
    return d.get("why") == "nack" and int(d.get("rev", -1)) == nack["rev"]


def redo_nacked(run_dir: str | Path) -> list[str]:
    """Delete the payload and sidecar of each chunk the trainer nacked, so the plan redoes it.

    Only the path the journal names, inside the run dir, not a symlink, and only while its
    bytes still differ from the announced sha256 (a payload restored since is the one the
    trainer wants: its next read accepts it).  Logged in ``deleted.jsonl`` (``why: nack``).
    Returns the payload paths deleted.  The line carries the revision nacked: a
    waiting reader takes it as the redo under way (stream.reader.open_checked).
    """
    run_dir = Path(run_dir)
    sdir = stream_dir(run_dir)
    if not (sdir / ACKS).exists():
        return []
    # Hashed outside the stream's lock (acks and every gate take it; a payload is GBs), as
    # ``hsextract stream gc`` does: picked under it, then deleted under it again only if
    # the nack is still open and the file unchanged since it was hashed.
    with locked(sdir):
        st = read_state(sdir)
        picked = []
        for path, n in sorted(open_nacks(run_dir, st).items()):
            if _taken_up(st, n):
                continue
            p = _ours(run_dir, path)
            if p is None:
                log.warning("%s: nacked, but %s is not our file: left alone", n["chunk"], path)
                continue
            picked.append((path, n, p, file_identity(p)))
    seen: dict[str, str | None] = {}
    for path, _, p, ident in picked:
        try:
            seen[path] = None if ident is None else sha256_file(p)
        except FileNotFoundError:
            seen[path] = None
    done = []
    with locked(sdir):
        st = read_state(sdir)
        still = open_nacks(run_dir, st)
        for path, n, p, ident in picked:
            if still.get(path) != n or _taken_up(st, n) or file_identity(p) != ident:
                continue  # answered, or written to while hashed: the next plan looks again
            if seen[path] == n["sha256_expected"]:
                continue  # restored since: the trainer's next read accepts it
            side = p.with_suffix(".json")
            size = ident[1] if ident is not None else 0
            p.unlink(missing_ok=True)
            if not side.is_symlink():
                side.unlink(missing_ok=True)
            append_line(
                sdir / DELETED,
                {"seq": n["seq"], "rev": n["rev"], "chunk": n["chunk"], "path": path,
                 "why": "nack", "bytes": size, "sha256": n["sha256_expected"],
                 "at": round(time.time(), 3)},
            )  # fmt: skip
            done.append(path)
    return done


def regenerated(run_dir: str | Path) -> dict[str, Any]:
    """epochs_mode regenerate: per later pass, its chunks re-extracted and how many have
    pass 1's sha256 (all of them with a bit-deterministic engine); for the report."""
    st = read_state(stream_dir(run_dir))
    first = {c["chunk"]: c["sha256"] for c in st.chunks.values() if c["pass"] == 1}
    out: dict[str, Any] = {}
    for c in sorted(st.chunks.values(), key=lambda c: (c["pass"], c["chunk"])):
        if c["pass"] == 1:
            continue
        p = out.setdefault(str(c["pass"]), {"chunks": 0, "matched": 0, "differ": []})
        p["chunks"] += 1
        if first.get(c["chunk"]) == c["sha256"]:
            p["matched"] += 1
        else:
            p["differ"].append(c["chunk"])
    return out


def forced_by_user(dag_settings: Any, receipt: str, rule: str) -> bool:
    """Whether the command line forces this receipt's job (``-f <receipt>``, ``-F``,
    ``--forcerun <rule or receipt>``): a redo the user asked for, extracted again though
    the chunk is announced (stream.producer.restore).  Snakemake's incomplete-job rerun
    forces the job too, but is not in the command line's settings (``dag_settings``,
    read where the DAG is built): there the announced chunk's receipt is restored."""
    if getattr(dag_settings, "forceall", False):
        return True
    want = os.path.abspath(receipt)

    def names(items: Any) -> bool:
        return any(str(t) == rule or os.path.abspath(str(t)) == want for t in items or ())

    if names(getattr(dag_settings, "forcerun", ())):
        return True
    return bool(getattr(dag_settings, "forcetargets", False)) and names(
        getattr(dag_settings, "targets", ())
    )
