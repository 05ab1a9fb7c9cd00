"""Which chunks need (re-)extraction: the workflow's one data-dependent decision.

A chunk file is current when its sidecar says it holds exactly the records that
``chunks/index.json`` now assigns to that chunk (same content digest, see
:func:`hsextract.records.record_digest`), for this run's fingerprint, and the file on disk
is the bytes the sidecar recorded: the same size, and -- when it is newer than its sidecar,
i.e. written to after its extraction -- the same sha256.  Everything else (missing,
records changed, another fingerprint, a file cut short or altered) is re-extracted;
nothing current is touched.  Only files whose size or mtime says they changed are hashed,
so planning 10k+ chunks stays a stat per file.

Snakemake decides what to run from file times, before the merge and split have run, so it
cannot know which chunks a data change touches.  ``plan_chunks`` is therefore a checkpoint:
after it has run, Snakemake re-evaluates the chunk jobs, and each gets this plan as an
input that is newer than its output (re-extract) or ``ancient`` (keep).  See
rules/extract.smk for why the checkpoint must come after every other stage a chunk job
depends on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsextract.chunkfile import sha256_file
from hsextract.commands import snakemake_command
from hsextract.config import Config
from hsextract.errors import HsextractError
from hsextract.records import input_changes, read_index, resolve_inputs
from hsextract.sizing import chunk_count


class PlanError(HsextractError):
    """The merged data or the split do not match the config (Snakemake could not tell)."""


def check_data_matches_config(cfg: Config, index_path: Path, stats_path: Path) -> None:
    """Refuse to plan from a merge or split made with other settings.

    The params rerun trigger reruns them when a setting changes, but it needs Snakemake's
    metadata (``.snakemake/``); a copied or restored run dir has none.  Planning from the
    old data would pass stale chunks as current, so say what differs and what to run.
    """
    stats = json.loads(Path(stats_path).read_text())
    index = read_index(index_path)
    made = stats.get("params", {})
    want = {
        "max_seq_len": cfg.max_seq_len,
        "overlength": cfg.merge.overlength,
        "seed": cfg.seed,
    }
    diff = [f"{k}: {made.get(k)!r} -> {v!r}" for k, v in want.items() if made.get(k) != v]
    if diff:
        raise PlanError(
            f"{stats_path} was merged with other settings ({'; '.join(diff)}); run "
            f"`{snakemake_command('extract_all', '--forcerun', 'merge_and_shuffle')}`"
        )
    changed = changed_inputs(cfg, stats)
    if changed:
        raise PlanError(
            f"the inputs changed since {stats_path} was merged ({'; '.join(changed)}); run "
            f"`{snakemake_command('extract_all', '--forcerun', 'merge_and_shuffle')}`"
        )
    want = chunk_count(cfg)
    if index.get("n_chunks") != want:
        shown = f"auto ({want})" if cfg.n_chunks == "auto" else str(want)
        raise PlanError(
            f"{index_path} splits into {index.get('n_chunks')} chunks, n_chunks is "
            f"{shown}; run `{snakemake_command('extract_all', '--forcerun', 'split_chunks')}`"
        )


def changed_inputs(
    cfg: Config, stats: dict[str, Any], *, base: Path | None = None, content: bool = False
) -> list[str]:
    """Each shard added, gone or changed since the merge that wrote ``stats``, named.

    Your shards are re-resolved from ``inputs`` (a new file a glob now matches counts);
    the demo's are the ones the merge read.  Relative paths are relative to ``base``
    (default: the working directory, the workflow's).  ``content``: see
    :func:`hsextract.records.input_changes`.
    """
    recorded = stats.get("inputs") or []
    current = None if cfg.demo.enabled else resolve_inputs(list(cfg.inputs or []), base)
    return input_changes(recorded, current, base=base, content=content)


#: Names of the files a chunk job writes under hidden/.
_CHUNK_RE = re.compile(r"chunk_(\d{5})\.(safetensors|json)")
#: A later pass's dir under hidden/ (stream.epochs_mode regenerate: rule extract_chunk_pass).
_PASS_RE = re.compile(r"pass([1-9]\d*)")


def pass_dir(run_dir: Path, pass_: int = 1) -> Path:
    """Where pass ``pass_``'s chunk files and receipts are: hidden/, or hidden/pass<p>/."""
    hidden = Path(run_dir) / "hidden"
    return hidden if pass_ == 1 else hidden / f"pass{pass_}"


def later_passes(run_dir: Path) -> list[int]:
    """The passes > 1 that have a dir under hidden/ (none offline or in one pass)."""
    try:
        with os.scandir(Path(run_dir) / "hidden") as entries:
            found = [_PASS_RE.fullmatch(e.name) for e in entries if e.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(p for p in (int(m.group(1)) for m in found if m) if p > 1)


def plan_key(chunk: str, pass_: int = 1) -> str:
    """A chunk's name in the plan: pass 1's bare (``chunk_00003``), a later pass's with its
    dir (``pass2/chunk_00003``), as its receipt is named under hidden/."""
    return chunk if pass_ == 1 else f"pass{pass_}/{chunk}"


@dataclass(frozen=True)
class ChunkState:
    chunk: str  # "chunk_00003"
    current: bool
    reason: str


def chunk_states(
    run_dir: Path,
    index_path: Path,
    fingerprint: str,
    *,
    rehash: bool = True,
    restamp: bool = False,
    pass_: int = 1,
) -> list[ChunkState]:
    """Each indexed chunk: is its hidden-state file current, and if not, why not.
    ``pass_``: of that pass's files (hidden/pass<p>/, stream.epochs_mode regenerate).

    A chunk file newer than its sidecar was written to after its extraction: with
    ``rehash`` it is hashed, and current only if its bytes are still the sidecar's sha256;
    without (``hsextract status``, the server's start, the space check: they must stay
    cheap) it counts as current, as before: plan_chunks decides, and a chunk job that then
    needs a server starts it (``ensure()``).  A restored run whose sidecars got new mtimes
    is not all redo in a status.  With ``restamp``
    (plan_chunks), one whose bytes are unchanged (touched, copied without its times) gets
    its sidecar's mtime, as a chunk job leaves it, so that no later plan hashes it again.
    """
    index = read_index(index_path)
    hidden = pass_dir(Path(run_dir), pass_)
    freed = _freed(Path(run_dir), pass_)
    out = []
    for entry in index["chunks"]:
        name = Path(entry["path"]).stem
        out.append(_state(hidden, name, entry, fingerprint, rehash, restamp, freed.get(name)))
    return out


def _freed(run_dir: Path, pass_: int = 1) -> dict[str, dict[str, Any]]:
    """Payloads of pass ``pass_`` the stream deleted after the trainer's ack
    (stream.receipts): done, not missing.  No stream dir (an offline run): none, and the
    stream is not imported."""
    if not (run_dir / "stream").is_dir():
        return {}
    from hsextract.stream.receipts import deleted_after_ack

    return deleted_after_ack(run_dir, pass_)


def later_pass_states(
    run_dir: Path, index_path: Path, fingerprint: str, *, rehash: bool = True,
    restamp: bool = False,
) -> list[ChunkState]:  # fmt: skip
    """Chunks of later passes (hidden/pass<p>/) whose receipt is there and whose chunk file
    is not current -- lost before its ack, above all -- named by :func:`plan_key`.  A pass-p
    chunk shares its pass-1 chunk's plan trigger (records changed redo every pass); these
    are its own: the plan lists them and extract_chunk_pass redoes them, as extract_chunk
    redoes pass 1's.  One without a receipt is a missing output: Snakemake runs it anyway."""
    out = []
    for p in later_passes(Path(run_dir)):
        where = pass_dir(Path(run_dir), p)
        for s in chunk_states(run_dir, index_path, fingerprint, rehash=rehash,
                              restamp=restamp, pass_=p):  # fmt: skip
            if s.current or not (where / f"{s.chunk}.json").exists():
                continue
            why = s.reason
            if not (where / f"{s.chunk}.safetensors").exists():
                why = "its chunk file is gone, its receipt is not (lost before the trainer's ack)"
            out.append(ChunkState(plan_key(s.chunk, p), False, f"pass {p}: {why}"))
    return out


def _state(
    hidden: Path,
    name: str,
    entry: dict[str, Any],
    fingerprint: str,
    rehash: bool = True,
    restamp: bool = False,
    freed: dict[str, Any] | None = None,
) -> ChunkState:
    data, sidecar = hidden / f"{name}.safetensors", hidden / f"{name}.json"
    try:
        meta = json.loads(sidecar.read_text())
        sidecar_mtime = sidecar.stat().st_mtime_ns
    except FileNotFoundError:
        return ChunkState(name, False, "not extracted yet")
    except (OSError, ValueError) as exc:
        return ChunkState(name, False, f"unreadable sidecar or chunk file ({exc})")
    try:
        if freed is None:
            st = data.stat()
    except FileNotFoundError:
        return ChunkState(name, False, "not extracted yet")
    except OSError as exc:
        return ChunkState(name, False, f"unreadable sidecar or chunk file ({exc})")
    if freed is not None:
        from hsextract.stream.receipts import receipt_matches

        if not receipt_matches(meta, freed):
            return ChunkState(
                name, False, "its payload was deleted after the trainer's ack, and its sidecar "
                "is of other bytes (redone since?)"
            )  # fmt: skip
    if meta.get("fingerprint") != fingerprint:
        return ChunkState(name, False, f"extracted for fingerprint {meta.get('fingerprint')}")
    if meta.get("content_digest") != entry["content_digest"]:
        got = meta.get("records")
        return ChunkState(
            name,
            False,
            f"records changed ({got} -> {entry['records']} records, content digest "
            f"{str(meta.get('content_digest'))[:12]} -> {entry['content_digest'][:12]})",
        )
    if freed is not None:
        return ChunkState(name, True, "current (acknowledged by the trainer, payload deleted)")
    size = st.st_size
    if size != meta.get("bytes"):
        return ChunkState(
            name, False, f"file is {size} bytes, its sidecar says {meta.get('bytes')}"
        )
    if st.st_mtime_ns > sidecar_mtime:
        return _rehashed(data, st, meta, sidecar_mtime, rehash, restamp)
    return ChunkState(name, True, "current")


def _rehashed(
    data: Path, st: os.stat_result, meta: dict, sidecar_mtime: int, rehash: bool, restamp: bool
) -> ChunkState:
    """A chunk file written to after its sidecar: current only if its bytes are the ones
    extracted (the sidecar's sha256)."""
    name = data.stem
    if not rehash:
        return ChunkState(name, True, "current unless its bytes changed (the plan re-hashes it)")
    try:
        actual = sha256_file(data)
    except OSError as exc:
        return ChunkState(name, False, f"unreadable chunk file ({exc})")
    recorded = str(meta.get("sha256"))
    if actual != recorded:
        return ChunkState(
            name,
            False,
            f"its bytes changed since extraction (sha256 {actual[:12]}..., its sidecar "
            f"says {recorded[:12]}...)",
        )
    if restamp and not data.is_symlink():
        # As the chunk job left it (Snakemake touches its outputs, the sidecar last): not
        # newer than its sidecar, so the scan for changed chunks passes it by.  A file we
        # may not stamp (another owner's copy) is only hashed again by the next plan.
        with contextlib.suppress(OSError):
            os.utime(data, ns=(st.st_atime_ns, sidecar_mtime))
    return ChunkState(name, True, "current (written to after its extraction, same bytes)")


def changed_chunks(run_dir: Path) -> list[tuple[str, int, int]]:
    """Chunk files newer than their sidecar (name, size, mtime_ns): a stat of each file of
    hidden/ and of every later pass's hidden/pass<p>/ (named ``pass<p>/chunk_...``), no
    sidecar read, since this runs while Snakemake plans (:func:`changed_note`).

    A chunk job writes its file, then its sidecar, and Snakemake touches both when the job
    ends, in the rule's order (the sidecar last); a chunk file newer than its sidecar was
    written to since (a byte flipped in place, a touch, a copy over it).
    """
    out = []
    for p in [1, *later_passes(Path(run_dir))]:
        try:
            with os.scandir(pass_dir(Path(run_dir), p)) as entries:
                found = {e.name: e for e in entries}
        except (FileNotFoundError, NotADirectoryError):
            continue
        for fname, e in found.items():
            m = _CHUNK_RE.fullmatch(fname)
            side = (found.get(f"chunk_{m.group(1)}.json")
                    if m and m.group(2) == "safetensors" else None)  # fmt: skip
            if side is None:
                continue  # no sidecar: the chunk job's output is missing, Snakemake redoes it
            try:
                st, side_st = e.stat(), side.stat()
            except FileNotFoundError:
                continue
            if st.st_mtime_ns > side_st.st_mtime_ns:
                out.append((plan_key(fname, p), st.st_size, st.st_mtime_ns))
    return sorted(out)


def changed_note(run_dir: Path) -> str:
    """The plan's trigger for chunk files changed since extraction:
    ``state/changed/<digest>.json``, named by :func:`changed_chunks`.

    Why a name: nothing Snakemake compares changes when a chunk's bytes do (the chunk job's
    inputs are ancient, its sidecar is untouched), so ``extract_all`` said "Nothing to be
    done".  A new set of changed files is a new name, a missing input of extract_all (the
    target: Snakemake makes only a target's missing inputs) and of plan_chunks; its rule
    (note_changed_chunks) writes it, the plan reruns, re-hashes those files and lists the
    ones whose bytes changed.  No changed file: the same name as every time before.  A note
    is a few bytes, one per such event; none is removed, so no old name comes back missing.
    """
    found: list[Any] = list(changed_chunks(Path(run_dir)))
    found += _lost(Path(run_dir)) + _nacked(Path(run_dir))
    digest = hashlib.sha256(json.dumps(found).encode()).hexdigest()[:16]
    return str(Path(run_dir) / "state" / "changed" / f"{digest}.json")


def _lost(run_dir: Path) -> list[list[Any]]:
    """Under a stream (stream.budget_gb), chunks whose sidecar -- the rule's output, the
    receipt -- is there and whose chunk file is not, though the stream did not free it
    after an ack: lost before its ack (or removed by hand).  Of every pass (hidden/ and
    hidden/pass<p>/, named by :func:`plan_key`).  In the changed note's name, so the next
    extract_all plans again and redoes them.  Offline: none (a missing chunk file is a
    missing output there)."""
    if not (run_dir / "stream").is_dir():
        return []
    out: list[list[Any]] = []
    for p in [1, *later_passes(run_dir)]:
        try:
            names = set(os.listdir(pass_dir(run_dir, p)))
        except (FileNotFoundError, NotADirectoryError):
            continue
        gone = sorted(
            n.removesuffix(".json")
            for n in names
            if _CHUNK_RE.fullmatch(n) and n.endswith(".json")
            and n.replace(".json", ".safetensors") not in names
        )  # fmt: skip
        if not gone:
            continue
        from hsextract.stream.receipts import deleted_after_ack

        freed = deleted_after_ack(run_dir, p)
        out += [["lost", plan_key(c, p)] for c in gone if c not in freed]
    return out


def _nacked(run_dir: Path) -> list[list[Any]]:
    """Chunks the trainer nacked and no redo answered yet (stream.receipts.open_nacks):
    in the changed note's name too, so the next extract_all plans again and redoes them.
    No ack file (an offline run, or no nack): a stat, nothing imported."""
    if not (run_dir / "stream" / "acks.jsonl").exists():
        return []
    from hsextract.stream.receipts import open_nacks

    return [["nack", p, n["seq"], n["rev"]] for p, n in sorted(open_nacks(run_dir).items())]


def note_changed(run_dir: Path, out: Path) -> list[tuple[str, int, int]]:
    """Write a changed-chunks note (:func:`changed_note`): what it found, for the curious."""
    from hsextract.server import write_json

    found = changed_chunks(Path(run_dir))
    write_json(Path(out), {"newer_than_their_sidecar": [list(f) for f in found]})
    return found


def remove_orphans(run_dir: Path, n_chunks: int) -> list[dict[str, Any]]:
    """Hidden-state files of chunk numbers a smaller n_chunks no longer has.

    A fresh run with this config has none, and they hold records of another chunking
    (the manifest would never list them), so they go; the report says what.
    """
    hidden = Path(run_dir) / "hidden"
    removed = []
    if not hidden.is_dir():
        return removed
    for f in sorted(hidden.iterdir()):
        m = _CHUNK_RE.fullmatch(f.name)
        if m and int(m.group(1)) >= n_chunks and not f.is_symlink() and f.is_file():
            removed.append({"path": f.name, "bytes": f.stat().st_size})
            f.unlink()
    return removed


def make_plan(run_dir: Path, index_path: Path, fingerprint: str, out: Path) -> dict[str, Any]:
    """Write ``state/plan.json``: the chunks to extract and why, the ones kept."""
    from hsextract.server import write_json

    nacked = _redo_nacked(Path(run_dir))
    states = chunk_states(run_dir, index_path, fingerprint, restamp=True)
    n = len(states)
    orphans = remove_orphans(run_dir, n)
    first = [s for s in states if not s.current]
    todo = first + later_pass_states(run_dir, index_path, fingerprint, restamp=True)
    plan = {
        # Unique per plan: Snakemake compares a small input's checksum with the one it
        # recorded for the job, and a re-extraction must never look like the last one.
        "planned_at_ns": time.time_ns(),
        "pid": os.getpid(),
        "fingerprint": fingerprint,
        "n_chunks": n,
        "extract": [s.chunk for s in todo],
        "reasons": {s.chunk: s.reason for s in todo},
        "current": n - len(first),
        "orphans_removed": orphans,
        "nacked_removed": nacked,
    }
    write_json(Path(out), plan)
    return plan


def _redo_nacked(run_dir: Path) -> list[str]:
    """Chunks the trainer nacked: their payload and sidecar deleted (only the journal's
    path in the run dir), so this plan lists them and their redo is a new revision."""
    if not (run_dir / "stream" / "acks.jsonl").exists():
        return []
    from hsextract.stream.receipts import redo_nacked

    return redo_nacked(run_dir)


def summary(plan: dict[str, Any]) -> str:
    todo = plan["extract"]
    n = plan["n_chunks"]
    head = f"{n - plan['current']} of {n} chunk(s) to extract, {plan['current']} current"
    if len(todo) > n - plan["current"]:
        head += f", and {len(todo) - (n - plan['current'])} of later passes"
    lines = [head] + [f"  {c}: {plan['reasons'][c]}" for c in todo[:20]]
    if len(todo) > 20:
        lines.append(f"  ... and {len(todo) - 20} more (state/plan.json)")
    for c in plan.get("nacked_removed", []):
        lines.append(f"  removed {c} and its sidecar: the trainer nacked it (sha256)")
    for o in plan["orphans_removed"]:
        lines.append(f"  removed {o['path']} ({o['bytes']} bytes): beyond n_chunks")
    return "\n".join(lines)


_CACHE: dict[str, tuple[int, frozenset[str]]] = {}


def to_extract(plan_path: str | os.PathLike[str]) -> frozenset[str]:
    """The chunk names a plan file lists, parsed once per file version (one call per job)."""
    key = str(plan_path)
    mtime = os.stat(key).st_mtime_ns
    hit = _CACHE.get(key)
    if hit is None or hit[0] != mtime:
        hit = (mtime, frozenset(json.loads(Path(key).read_text())["extract"]))
        _CACHE[key] = hit
    return hit[1]
