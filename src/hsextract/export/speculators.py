"""vLLM speculators' offline format, as its ``ArrowDataset`` (``speculators.train.data``)
reads it (speculators 0.9.0; ``hs_connectors.FileTransfer`` loads the files)::

    <out>/                              the trainer's data path
      data-*.arrow, dataset_info.json,  ``datasets.save_to_disk``: one row per line of
      state.json                        merged/train.jsonl, in order: ``input_ids``,
                                        ``loss_mask`` (int64 lists), ``seq_len``; torch format
      hidden_states/hs_{idx}.safetensors
                                        ``token_ids`` [T] int64, ``hidden_states``
                                        [T, k+1, H]: the k aux layers in order, then the
                                        last layer's output *before* the final norm
      done/chunk_<i>.json               ours: which files a chunk's export wrote (sha256)
      done/dataset.json                 ours: the dataset's rows and train.jsonl's sha256
      export.json                       ours, last: the export checked against the manifest
      hsextract_export.json             ours, first: which run owns the directory

The directory must be new, empty or already this run's export (:func:`claim_dir`), and
only files named as the export names them are ever replaced or removed there: a file of
any other name (someone's notes) is left alone.

``idx`` is the dataset row, which speculators maps to ``hs_{idx}``; rows are the lines of
train.jsonl, so ``idx`` is the record's line number (:func:`record_indices`), the same
index the SpecForge export uses.  The last slot needs ``prenorm_final: true``: speculators
feeds it to the verifier's own final norm and LM head.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from hsextract.chunks import ChunkReader
from hsextract.commands import hsextract_command
from hsextract.export.common import (
    CheckedChunk,
    ExportError,
    check_chunks,
    claim_dir,
    extract_all,
    open_chunk,
    read_json,
    read_record,
    refuse_deleted_after_ack,
    start_hash,
    verify_source,
)

DATASET_FILES = ("dataset_info.json", "state.json")
FORMAT = "speculators-offline"
SUMMARY_FILE = "export.json"
#: Why a directory holding anything else is refused (:func:`claim_dir`).
READS = (
    "speculators reads the Arrow dataset and hidden_states/ of the directory it is given, "
    "and the export replaces them"
)
_HS_RE = re.compile(r"^hs_(\d+)\.safetensors$")
_HS_TEMP_RE = re.compile(r"^\.hs_\d+\.safetensors\.\d+\.tmp$")
_ARROW_RE = re.compile(r"^data-\d{5}-of-\d{5}\.arrow$")
_DATASET_TEMP_RE = re.compile(r"^\.dataset\.\d+\.tmp$")


def hs_path(out: Path, idx: int) -> Path:
    return Path(out) / "hidden_states" / f"hs_{idx}.safetensors"


def write_dataset(train: Path, out: Path) -> int:
    """The Arrow dataset of every line of ``train`` (train.jsonl), in order; returns rows.

    Built in a temporary directory beside ``out`` and moved in with ``state.json`` last,
    so a killed export leaves no dataset ``load_from_disk`` would take as complete.  The
    caller has claimed ``out``: the files replaced are only those ``save_to_disk`` names.
    """
    import datasets
    import orjson

    out = Path(out)
    # One dataset job per export directory: another's temporary directory is a killed one's.
    for old in out.iterdir():
        if _DATASET_TEMP_RE.match(old.name) and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)

    def rows():
        with open(train, "rb") as f:
            for line in f:
                rec = orjson.loads(line)
                yield {
                    "input_ids": rec["input_ids"],
                    "loss_mask": rec["loss_mask"],
                    "seq_len": len(rec["input_ids"]),
                }

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    tmp = out / f".dataset.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        ds = datasets.Dataset.from_generator(
            rows, features=features, cache_dir=str(tmp / "cache"), keep_in_memory=False
        )
        ds.set_format(type="torch")  # speculators compares torch tensors row by row
        ds.save_to_disk(str(tmp / "ds"))
        for old in [*out.glob("data-*.arrow"), *(out / n for n in DATASET_FILES)]:
            if _ARROW_RE.match(old.name) or old.name in DATASET_FILES:
                old.unlink(missing_ok=True)
        new = sorted((tmp / "ds").iterdir(), key=lambda p: p.name == "state.json")
        for f in new:
            os.replace(f, out / f.name)
        return len(ds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_chunk(
    chunk: Path, run_dir: Path, out: Path, marker: Path, expect_sha256: str | None = None
) -> dict:
    """Write ``hs_{idx}.safetensors`` for every record of one chunk file, then ``marker``.

    The chunk is checked first (:func:`open_chunk`: its records are the ones the index
    assigns it, ``expect_sha256`` the manifest's), so no file pairs new tokens with states
    of old ones."""
    src = open_chunk(Path(run_dir), Path(chunk).stem, expect_sha256)
    _require_prenorm(src)
    return _write_chunk(src, Path(run_dir), Path(out), Path(marker))


def _require_prenorm(src: CheckedChunk) -> None:
    if not src.reader.prenorm:
        raise ExportError(
            f"chunk {src.name} ({src.path}) has no pre-norm final state: speculators' "
            "hidden_states end with the last layer's output before the final norm. Set "
            "prenorm_final: true and run extract_all (a new run dir), then export that run"
        )


def _write_chunk(src: CheckedChunk, run_dir: Path, out: Path, marker: Path) -> dict:
    from hsextract.server import write_json

    claim_dir(out, FORMAT, str(src.sidecar.get("fingerprint")), run_dir, READS)
    # The export no longer matches what export.json says it checked.
    (out / SUMMARY_FILE).unlink(missing_ok=True)
    reader, name = src.reader, src.name
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    h, k = reader.hidden_size, len(reader.aux_layers)
    files: list[dict] = []
    # The files are rewritten: the old marker no longer describes them.  The new one is
    # written only once the chunk's bytes, hashed as they were read, are its sidecar's.
    marker.unlink(missing_ok=True)
    with start_hash(src) as hasher:
        for j, idx in enumerate(src.indices):
            rec = read_record(src, hasher, j, lambda: [hs_path(out, f["idx"]) for f in files])
            files.append(_write_record(rec, src.name, idx, out, h, k))
        verify_source(src, hasher, [hs_path(out, f["idx"]) for f in files])
    done = {
        "chunk": name,
        "source_sha256": src.sha256,
        "content_digest": src.content_digest,
        "files": files,
    }
    write_json(marker, done)
    return done


def _write_record(rec: dict, chunk: str, idx: int, out: Path, h: int, k: int) -> dict:
    """``hs_{idx}.safetensors`` of a record (temp name, then rename); its marker entry."""
    from safetensors.torch import save_file

    from hsextract.chunks import sha256_file

    t = rec["input_ids"].shape[0]
    layers = rec["aux_hidden_states"].reshape(t, k, h)
    states = torch.cat([layers, rec["prenorm_hidden_states"].reshape(t, 1, h)], dim=1)
    path = hs_path(out, idx)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {"token_ids": rec["input_ids"].to(torch.int64), "hidden_states": states}
    try:
        save_file(
            {key: v.contiguous() for key, v in tensors.items()},
            str(tmp),
            # One key: safetensors writes a metadata map in hash order, which differs
            # per process, and a rerun must give the same bytes.
            metadata={"hsextract": json.dumps({"record_id": str(rec["id"]), "chunk": chunk})},
        )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"idx": idx, "id": rec["id"], "sha256": sha256_file(path)}


def default_out(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "export" / "speculators"


def export_dataset(train: Path, out: Path, marker: Path, fingerprint: str) -> dict:
    """:func:`write_dataset` into ``out`` (claimed for the run ``train`` belongs to), then
    ``marker`` (rows, train.jsonl's sha256)."""
    from hsextract.chunks import sha256_file
    from hsextract.server import write_json

    claim_dir(out, FORMAT, fingerprint, Path(train).parent.parent, READS)
    (out / SUMMARY_FILE).unlink(missing_ok=True)
    done = {"rows": write_dataset(train, out), "train_sha256": sha256_file(train)}
    write_json(Path(marker), done)
    return done


def finish_export(manifest: Path, out: Path) -> dict:
    """Check every chunk's marker against the manifest and the dataset against
    train.jsonl, remove ``hs_*`` files no chunk wrote (a shorter train.jsonl) and killed
    writers' temporary files, and write ``export.json``.  A stale or missing piece fails
    naming it, never passes as done; no file of another name is touched."""
    from hsextract.chunks import sha256_file
    from hsextract.server import write_json

    manifest, out = Path(manifest), Path(out)
    man = read_json(manifest, "export", f"run `{extract_all(manifest)}` first")
    run_dir = manifest.parent
    again = ("export", "speculators", "--manifest", manifest, "--out", out)
    redo = f"rerun `{hsextract_command(*again, with_config=False)}`"
    claim_dir(out, FORMAT, str(man.get("fingerprint")), run_dir, READS)
    listed: set[str] = set()
    for c in man["chunks"]:
        m = read_json(out / "done" / f"{c['chunk']}.json", c["chunk"], redo)
        if m["source_sha256"] != c["sha256"]:
            raise ExportError(
                f"{c['chunk']}: exported from other bytes than the manifest lists; {redo}"
            )
        for f in m["files"]:
            if not hs_path(out, f["idx"]).is_file():
                raise ExportError(f"{c['chunk']}: {hs_path(out, f['idx'])} is missing; {redo}")
            listed.add(f"hs_{f['idx']}.safetensors")
    rows = int(man["totals"]["records"])
    if listed != {f"hs_{i}.safetensors" for i in range(rows)}:
        raise ExportError(
            f"{out}: the chunks hold {len(listed)} records, not lines 0..{rows - 1}; {redo}"
        )
    ds = read_json(out / "done" / "dataset.json", "export", redo)
    train = run_dir / "merged" / "train.jsonl"
    if ds["rows"] != rows or ds["train_sha256"] != sha256_file(train):
        raise ExportError(f"{out}: the dataset was written from another train.jsonl; {redo}")
    removed = []
    for p in (out / "hidden_states").iterdir():
        if (_HS_RE.match(p.name) and p.name not in listed) or _HS_TEMP_RE.match(p.name):
            p.unlink()
            removed.append(p.name)
    # Its metadata only; every chunk's bytes were checked as they were exported.
    first = ChunkReader(run_dir / man["chunks"][0]["path"], verify=False) if man["chunks"] else None
    summary = {
        "format": FORMAT,
        "fingerprint": man.get("fingerprint"),
        "records": rows,
        "tokens": int(man["totals"]["tokens"]),
        "aux_layers": first.aux_layers if first else None,
        "hidden_states": "[T, k+1, H]: the aux layers in order, then the pre-norm final state",
        "idx": "the record's 0-based line in merged/train.jsonl (the dataset row)",
        "dtype": str(first.dtype).removeprefix("torch.") if first else None,
        "train": (
            "speculators train --verifier-name-or-path <model> --data-path "
            f"{shlex.quote(str(out.resolve()))} --speculator-type eagle3"
        ),
    }
    write_json(out / SUMMARY_FILE, summary)
    summary["removed"] = removed
    return summary


def export_run(manifest: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> dict:
    """Every chunk of a manifest, the dataset, then :func:`finish_export` (the CLI)."""
    from tqdm import tqdm

    manifest = Path(manifest)
    man = read_json(manifest, "export", f"run `{extract_all(manifest)}` first")
    run_dir = manifest.parent
    refuse_deleted_after_ack(run_dir)
    out = Path(out) if out is not None else default_out(run_dir)
    fp = str(man.get("fingerprint"))
    claim_dir(out, FORMAT, fp, run_dir, READS)
    check_chunks(run_dir, man, _require_prenorm)
    export_dataset(run_dir / "merged" / "train.jsonl", out, out / "done" / "dataset.json", fp)
    for c in tqdm(
        man["chunks"], unit="chunk", desc="export speculators", disable=not sys.stderr.isatty()
    ):
        export_chunk(
            run_dir / c["path"], run_dir, out, out / "done" / f"{c['chunk']}.json", c["sha256"]
        )
    return {**finish_export(manifest, out), "out": str(out)}


def register_cli(sub: Any) -> None:
    """``hsextract export speculators --manifest M [--out DIR]``."""
    p = sub.add_parser(
        "speculators",
        help="vLLM speculators' offline format (hs_{idx}.safetensors + Arrow dataset)",
        description="Write a finished run (prenorm_final: true) for speculators' ArrowDataset.",
    )
    p.add_argument("--manifest", required=True, help="the run's manifest.json")
    p.add_argument("--out", help="export directory (default: <run dir>/export/speculators)")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    s = export_run(args.manifest, args.out)
    print(
        f"{s['records']} records ({s['tokens']} tokens) in {s['out']}, "
        f"{len(s['removed'])} stale removed"
    )
    print(f"train: {s['train']}")
    return 0


# Snakemake jobs (rules/export.smk): scripts/export_speculators_*.py hand them `snakemake`.


def step_dataset(sm: Any) -> None:
    from hsextract.config import fingerprint, typed

    out = Path(sm.output.done).parent.parent
    export_dataset(Path(sm.input.train), out, Path(sm.output.done), fingerprint(typed(sm.config)))


def step_chunk(sm: Any) -> None:
    hidden = Path(sm.input.hidden)
    out = Path(sm.output.done).parent.parent
    m = export_chunk(hidden, hidden.parent.parent, out, Path(sm.output.done))
    sys.__stderr__.write(
        f"hsextract [export speculators {hidden.stem}]: {len(m['files'])} records\n"
    )


def step_summary(sm: Any) -> None:
    s = finish_export(Path(sm.input.manifest), Path(sm.output.summary).parent)
    sys.__stderr__.write(
        f"hsextract [export speculators]: {s['records']} records in "
        f"{Path(sm.output.summary).parent}, {len(s['removed'])} stale removed\n"
    )
