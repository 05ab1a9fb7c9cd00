"""What both exports share (export/common.py): the directory they may write in; and the
helpers both exports' tests use to make a chunk stale.  (hsextract imports are in the
tests, so that the exports' tests also run on code without them: before/after checks.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fixtures_demo import run_snakemake


def copy_workdir(workdir: Path, run_dir: Path, dst: Path) -> tuple[Path, Path]:
    """A private copy of a finished workdir (a test that changes data must not disturb
    the others); Snakemake's metadata records the original's absolute paths, so it goes."""
    shutil.copytree(workdir, dst, symlinks=True)
    shutil.rmtree(dst / ".snakemake", ignore_errors=True)
    return dst, dst / run_dir.relative_to(workdir)


def make_one_chunk_stale(workdir: Path, run_dir: Path) -> str:
    """Change one token of one record (same length) and run only the split, so that the
    index assigns a chunk other records than its extracted file holds.  Returns the stale
    chunk's name."""
    index = run_dir / "chunks" / "index.json"
    before = {e["path"]: e["content_digest"] for e in json.loads(index.read_text())["chunks"]}
    shard = workdir / "results" / "demo" / "data" / "shard_00.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    rec = json.loads(lines[1])
    rec["input_ids"][-1] = (rec["input_ids"][-1] + 1) % 500
    lines[1] = json.dumps(rec, separators=(",", ":")) + "\n"
    shard.write_text("".join(lines))
    run_snakemake(workdir, "-j1", str(index.relative_to(workdir)))
    after = {e["path"]: e["content_digest"] for e in json.loads(index.read_text())["chunks"]}
    changed = [Path(p).stem for p in after if after[p] != before[p]]
    assert len(changed) == 1, changed
    return changed[0]


def put_other_records_in(run_dir: Path, chunk: str, other: str) -> None:
    """Copy chunk ``other`` (file and sidecar, freshly stamped) over ``chunk``: a chunk
    file holding other records than the index assigns it that the workflow takes for
    current (the plan and the index did not change; what a file restored from another
    copy of the run gives), so that only the exports' own check stands in its way."""
    for suffix in (".safetensors", ".json"):
        dst = run_dir / "hidden" / f"{chunk}{suffix}"
        shutil.copyfile(run_dir / "hidden" / f"{other}{suffix}", dst)
        os.utime(dst)


def test_claim_refuses_a_directory_that_is_not_ours_and_changes_nothing(tmp_path):
    from hsextract.export.common import ExportError, claim_dir

    theirs = tmp_path / "theirs"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "sub" / "notes.tmp").write_text("mine")
    with pytest.raises(ExportError, match=f"{theirs} is not empty and holds no hsextract"):
        claim_dir(theirs, "fmt", "fp1", tmp_path, "the trainer reads it")
    assert sorted(p.name for p in theirs.rglob("*")) == ["notes.tmp", "sub"]


def test_claim_takes_a_new_or_empty_directory_then_only_that_run_and_format(tmp_path):
    from hsextract.export.common import OWNER_FILE, ExportError, claim_dir

    out = tmp_path / "out"
    (out / "done").mkdir(parents=True)  # what Snakemake creates before a job runs
    claim_dir(out, "fmt", "fp1", tmp_path, "reads")
    owner = json.loads((out / OWNER_FILE).read_text())
    assert owner["format"] == "fmt" and owner["fingerprint"] == "fp1"
    (out / "done" / "x.json").write_text("{}")
    claim_dir(out, "fmt", "fp1", tmp_path, "reads")  # ours: taken again
    with pytest.raises(ExportError, match="holds the export of run 'fp1'"):
        claim_dir(out, "fmt", "fp2", tmp_path, "reads")
    with pytest.raises(ExportError, match="not the other export of fp1"):
        claim_dir(out, "other", "fp1", tmp_path, "reads")
