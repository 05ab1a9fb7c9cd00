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


def test_a_run_whose_chunk_files_were_deleted_after_the_ack_is_not_exported(tmp_path):
    """Streamed under a budget, two chunk files deleted after the trainer's ack (by the
    stream's own deletion): both exports refuse before writing anything, in one sentence
    naming the run, how many and what to do; one deleted and re-extracted since is none."""
    from hsextract.chunkfile import sha256_file
    from hsextract.export import specforge, speculators
    from hsextract.export.common import ExportError
    from hsextract.stream import gate, journal

    run = tmp_path / "run"
    (run / "hidden").mkdir(parents=True)
    for i in range(3):
        p = run / "hidden" / f"chunk_{i:05d}.safetensors"
        p.write_bytes(bytes([i]) * 64)
        journal.announce(run, chunk=p.stem, path=f"hidden/{p.name}", sha256=sha256_file(p),
                         records=1, tokens=1, content_digest=f"d{i}", n_chunks=3)  # fmt: skip
    journal.AckWriter(run).ack([0, 1, 2])
    st = journal.read_state(run / "stream")
    assert len(gate.delete_acked(run, st, 1)) == 3
    (run / "hidden" / "chunk_00002.safetensors").write_bytes(bytes([2]) * 64)  # re-extracted
    manifest = run / "manifest.json"
    manifest.write_text(json.dumps({"fingerprint": "fp", "totals": {"records": 3}, "chunks": [
        {"chunk": f"chunk_{i:05d}", "path": f"hidden/chunk_{i:05d}.safetensors",
         "sha256": "0" * 64} for i in range(3)]}))  # fmt: skip
    for fmt in (specforge, speculators):
        out = tmp_path / f"export_{fmt.FORMAT}"
        with pytest.raises(ExportError) as err:
            fmt.export_run(manifest, out)
        msg = str(err.value)
        assert msg.startswith(
            f"{run}: 2 chunk file(s) (chunk_00000, chunk_00001) were deleted after the "
            "trainer's ack"
        ), msg
        assert "stream.budget_gb: null" in msg and "extract_all" in msg and "\n" not in msg
        assert not out.exists()  # refused before anything was written


@pytest.mark.workflow
@pytest.mark.parametrize("target", ["export_specforge", "export_speculators"])
def test_an_export_under_a_budget_before_its_chunks_are_written_is_refused_in_one_sentence(
    tmp_path, target
):
    """Issue 58: under stream.budget_gb no rule writes a chunk file, so `snakemake -n
    export_specforge` on a run not yet extracted stopped in Snakemake's
    MissingInputException; the plan now ends with one sentence naming the chunks and the
    command, and writes nothing."""
    from fixtures_demo import make_workdir, run_dir_of, run_snakemake

    prenorm = target == "export_speculators"  # what that export needs first
    wd = make_workdir(tmp_path / "w", **{"stream.budget_gb": 1.0, "prenorm_final": prenorm})
    rd = run_dir_of(wd)
    proc = run_snakemake(wd, "-n", target, check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    assert "MissingInputException" not in said and "Traceback" not in said, said[-3000:]
    (line,) = [x for x in said.splitlines() if x.startswith("hsextract: error:")]
    assert f"{rd.relative_to(wd)}: 4 of 4 chunk file(s) (chunk_00000, chunk_00001, " in line
    assert "stream.budget_gb: null" in line and "snakemake -j1 extract_all" in line, line
    assert not (rd / "export").exists() and not (rd / "hidden").exists()
