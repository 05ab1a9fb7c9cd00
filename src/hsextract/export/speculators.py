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
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from hsextract.chunks import ChunkReader
from hsextract.export.common import ExportError, read_json, record_indices

DATASET_FILES = ("dataset_info.json", "state.json")
FORMAT = "speculators-offline"
_HS_RE = re.compile(r"^hs_(\d+)\.safetensors$")


def hs_path(out: Path, idx: int) -> Path:
    return Path(out) / "hidden_states" / f"hs_{idx}.safetensors"


def write_dataset(train: Path, out: Path) -> int:
    """The Arrow dataset of every line of ``train`` (train.jsonl), in order; returns rows.

    Built in a temporary directory beside ``out`` and moved in with ``state.json`` last,
    so a killed export leaves no dataset ``load_from_disk`` would take as complete.
    """
    import datasets
    import orjson

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

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
    tmp = Path(tempfile.mkdtemp(prefix=".dataset-", dir=out))
    try:
        ds = datasets.Dataset.from_generator(
            rows, features=features, cache_dir=str(tmp / "cache"), keep_in_memory=False
        )
        ds.set_format(type="torch")  # speculators compares torch tensors row by row
        ds.save_to_disk(str(tmp / "ds"))
        for old in [*out.glob("data-*.arrow"), *(out / n for n in DATASET_FILES)]:
            old.unlink(missing_ok=True)
        new = sorted((tmp / "ds").iterdir(), key=lambda p: p.name == "state.json")
        for f in new:
            os.replace(f, out / f.name)
        return len(ds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_chunk(chunk: Path, run_dir: Path, out: Path, marker: Path) -> dict:
    """Write ``hs_{idx}.safetensors`` for every record of one chunk file, then ``marker``."""
    from safetensors.torch import save_file

    from hsextract.chunks import sha256_file
    from hsextract.server import write_json

    reader = ChunkReader(chunk)
    name = Path(chunk).stem
    if not reader.prenorm:
        raise ExportError(
            f"chunk {name} ({chunk}) has no pre-norm final state: speculators' hidden_states "
            "end with the last layer's output before the final norm. Set prenorm_final: true "
            "and run extract_all (a new run dir), then export that run"
        )
    indices = record_indices(run_dir, name)
    if len(indices) != len(reader):
        raise ExportError(
            f"chunk {name}: {len(reader)} records in {chunk}, {len(indices)} in the index; "
            "rerun extract_all"
        )
    hs_dir = Path(out) / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    h, k = reader.hidden_size, len(reader.aux_layers)
    files = []
    for j, idx in enumerate(indices):
        rec = reader[j]
        t = rec["input_ids"].shape[0]
        layers = rec["aux_hidden_states"].reshape(t, k, h)
        states = torch.cat([layers, rec["prenorm_hidden_states"].reshape(t, 1, h)], dim=1)
        path = hs_path(out, idx)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(
            {"token_ids": rec["input_ids"].to(torch.int64), "hidden_states": states.contiguous()},
            str(tmp),
            # One key: safetensors writes a metadata map in hash order, which differs per
            # process, and a rerun must give the same bytes.
            metadata={"hsextract": json.dumps({"record_id": str(rec["id"]), "chunk": name})},
        )
        os.replace(tmp, path)
        files.append({"idx": idx, "id": rec["id"], "sha256": sha256_file(path)})
    done = {"chunk": name, "source_sha256": sha256_file(chunk), "files": files}
    write_json(Path(marker), done)
    return done


def default_out(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "export" / "speculators"


def export_dataset(train: Path, out: Path, marker: Path) -> dict:
    """:func:`write_dataset`, then ``marker`` (rows, train.jsonl's sha256)."""
    from hsextract.chunks import sha256_file
    from hsextract.server import write_json

    done = {"rows": write_dataset(train, out), "train_sha256": sha256_file(train)}
    write_json(Path(marker), done)
    return done


def finish_export(manifest: Path, out: Path) -> dict:
    """Check every chunk's marker against the manifest and the dataset against
    train.jsonl, remove ``hs_*`` files no chunk wrote (a shorter train.jsonl), and write
    ``export.json``.  A stale or missing piece fails naming it, never passes as done."""
    from hsextract.chunks import sha256_file
    from hsextract.server import write_json

    manifest, out = Path(manifest), Path(out)
    man = read_json(manifest, "export", "run `snakemake -j1 extract_all` first")
    run_dir = manifest.parent
    redo = f"rerun `hsextract export speculators --manifest {manifest} --out {out}`"
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
        if (_HS_RE.match(p.name) and p.name not in listed) or p.name.endswith(".tmp"):
            p.unlink()
            removed.append(p.name)
    first = ChunkReader(run_dir / man["chunks"][0]["path"]) if man["chunks"] else None
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
            f"speculators train --verifier-name-or-path <model> --data-path {out.resolve()} "
            "--speculator-type eagle3"
        ),
    }
    write_json(out / "export.json", summary)
    summary["removed"] = removed
    return summary


def export_run(manifest: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> dict:
    """Every chunk of a manifest, the dataset, then :func:`finish_export` (the CLI)."""
    from tqdm import tqdm

    manifest = Path(manifest)
    man = read_json(manifest, "export", "run `snakemake -j1 extract_all` first")
    run_dir = manifest.parent
    out = Path(out) if out is not None else default_out(run_dir)
    export_dataset(run_dir / "merged" / "train.jsonl", out, out / "done" / "dataset.json")
    for c in tqdm(
        man["chunks"], unit="chunk", desc="export speculators", disable=not sys.stderr.isatty()
    ):
        export_chunk(run_dir / c["path"], run_dir, out, out / "done" / f"{c['chunk']}.json")
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
    export_dataset(Path(sm.input.train), Path(sm.output.done).parent.parent, Path(sm.output.done))


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
