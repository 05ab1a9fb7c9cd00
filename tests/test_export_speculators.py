"""The speculators export, read by vLLM speculators' own ``ArrowDataset`` (0.9.0)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fixtures_demo import make_workdir, planned_jobs, run_dir_of, run_snakemake
from test_export_common import copy_workdir, make_one_chunk_stale, put_other_records_in

from hsextract.chunks import ChunkReader
from hsextract.commands import snakemake_command
from hsextract.export.common import record_indices


@pytest.fixture(scope="module")
def prenorm_run(tmp_path_factory) -> dict:
    """The demo with prenorm_final on, extracted and exported for speculators."""
    wd = make_workdir(tmp_path_factory.mktemp("prenorm"), prenorm_final=True)
    run_snakemake(wd, "-j1", "export_speculators")
    rd = run_dir_of(wd)
    return {"workdir": wd, "run_dir": rd, "out": rd / "export" / "speculators"}


@pytest.fixture
def prenorm_copy(prenorm_run, tmp_path) -> dict:
    """A private copy of the exported prenorm run, for a test that changes it."""
    wd, rd = copy_workdir(prenorm_run["workdir"], prenorm_run["run_dir"], tmp_path / "copy")
    return {"workdir": wd, "run_dir": rd, "out": rd / "export" / "speculators"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "export", "speculators", *args],
        capture_output=True,
        text=True,
    )


def files_of(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _ours(rd) -> dict[int, dict]:
    """Every record of the run by its train.jsonl line, from our own chunk files."""
    out = {}
    for chunk in sorted((rd / "hidden").glob("chunk_*.safetensors")):
        reader = ChunkReader(chunk)
        for j, idx in enumerate(record_indices(rd, chunk.stem)):
            out[idx] = reader[j]
    return out


@pytest.mark.workflow
def test_speculators_arrow_dataset_reads_our_export(prenorm_run):
    from speculators.train.data import ArrowDataset

    rd, out = prenorm_run["run_dir"], prenorm_run["out"]
    ours = _ours(rd)
    lines = (rd / "merged" / "train.jsonl").read_text().splitlines()
    assert sorted(ours) == list(range(len(lines))) == list(range(48))
    # on_missing="raise": a missing hs file is an error, never a vLLM request.
    ds = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise",
                      hidden_states_dtype=torch.float32)  # fmt: skip
    assert len(ds) == len(lines)
    for i in range(len(ds)):
        got, want = ds[i], ours[i]
        assert not type(got).__name__ == "SampleUnavailable", (i, got)
        rec = json.loads(lines[i])
        assert got["input_ids"].tolist() == rec["input_ids"] == want["input_ids"].tolist()
        assert got["loss_mask"].tolist() == rec["loss_mask"]
        # speculators' hidden_states: the aux layers side by side; the verifier's last
        # hidden state: the stream before the final norm.  Bit for bit our chunk files.
        assert torch.equal(got["hidden_states"], want["aux_hidden_states"])
        assert torch.equal(got["verifier_last_hidden_states"], want["prenorm_hidden_states"])
        assert got["lengths"].tolist() == [len(rec["input_ids"])]


@pytest.mark.workflow
def test_speculators_export_refuses_a_run_without_the_prenorm_state(demo_run, tmp_path):
    from hsextract.export.speculators import ExportError, export_chunk

    chunk = next((demo_run["run_dir"] / "hidden").glob("chunk_*.safetensors"))
    with pytest.raises(ExportError, match="prenorm_final: true"):
        export_chunk(chunk, demo_run["run_dir"], tmp_path / "out", tmp_path / "done.json")
    assert not (tmp_path / "done.json").exists()


@pytest.mark.workflow
def test_speculators_export_reruns_only_a_changed_chunk(prenorm_run):
    wd, rd, out = prenorm_run["workdir"], prenorm_run["run_dir"], prenorm_run["out"]
    assert planned_jobs(run_snakemake(wd, "-n", "export_speculators").stdout) == {}
    victim = sorted((rd / "hidden").glob("chunk_*.safetensors"))[1]
    idx = record_indices(rd, victim.stem)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").iterdir()}
    victim.unlink()
    plan = planned_jobs(run_snakemake(wd, "-n", "export_speculators").stdout)
    assert plan.get("extract_chunk") == 1 and plan.get("export_speculators_chunk") == 1, plan
    assert "export_speculators_dataset" not in plan
    run_snakemake(wd, "-j1", "export_speculators")
    after = {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").iterdir()}
    assert set(after) == set(before)
    redone = {n for n in after if after[n] != before[n]}
    assert redone == {f"hs_{i}.safetensors" for i in idx}
    # And the CLI, for a finished run outside Snakemake: the same files.
    res = cli("--manifest", str(rd / "manifest.json"), "--out", str(rd / "export" / "again"))
    assert res.returncode == 0, res.stderr
    for name in after:
        a = (out / "hidden_states" / name).read_bytes()
        assert a == (rd / "export" / "again" / "hidden_states" / name).read_bytes()


@pytest.mark.workflow
def test_speculators_export_refuses_a_stale_chunk(prenorm_copy):
    """The Arrow rows come from train.jsonl, the states from the chunk: a chunk extracted
    from other records than the index assigns it would pair new tokens with old states."""
    from speculators.train.data import ArrowDataset

    wd, rd, out = prenorm_copy["workdir"], prenorm_copy["run_dir"], prenorm_copy["out"]
    stale = make_one_chunk_stale(wd, rd)
    hidden = rd / "hidden" / f"{stale}.safetensors"
    message = f"{stale}: {hidden} holds other records than chunks/index.json assigns it"
    before = files_of(out)
    res = cli("--manifest", str(rd / "manifest.json"))
    assert res.returncode == 1, res.stdout
    assert (
        message in res.stderr and f"rerun `{snakemake_command(hidden, run_dir=rd)}`" in res.stderr
    )
    assert files_of(out) == before  # every chunk is checked before anything is written

    # What the message says to do gives an export of the new tokens' states.
    hidden.unlink()
    run_snakemake(wd, "-j1", "export_speculators")
    ours = _ours(rd)
    ds = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise",
                      hidden_states_dtype=torch.float32)  # fmt: skip
    for i in range(len(ds)):  # the states are of the new tokens
        assert ds[i]["input_ids"].tolist() == ours[i]["input_ids"].tolist()
        assert torch.equal(ds[i]["verifier_last_hidden_states"], ours[i]["prenorm_hidden_states"])

    # The workflow's chunk job refuses such a chunk the same way when nothing upstream
    # sees it (-k: the manifest job refuses it too, and may run first).
    before = files_of(out)
    put_other_records_in(rd, "chunk_00001", "chunk_00002")
    proc = run_snakemake(wd, "-j1", "-k", "export_speculators", check=False)
    hidden = (rd / "hidden" / "chunk_00001.safetensors").relative_to(wd)
    message = f"chunk_00001: {hidden} holds other records than chunks/index.json assigns it"
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
    hs = {f"hidden_states/hs_{i}.safetensors" for i in record_indices(rd, "chunk_00001")}
    assert {n: files_of(out)[n] for n in hs} == {n: before[n] for n in hs}


@pytest.mark.workflow
def test_speculators_export_refuses_a_directory_it_does_not_own(prenorm_run, tmp_path):
    manifest = str(prenorm_run["run_dir"] / "manifest.json")
    theirs = tmp_path / "theirs"
    planted = {
        "data-00000-of-00001.arrow": b"their rows",
        "state.json": b'{"theirs": true}',
        "hidden_states/hs_999.safetensors": b"their states",
        "notes.tmp": b"their notes",
    }
    for name, data in planted.items():
        (theirs / name).parent.mkdir(parents=True, exist_ok=True)
        (theirs / name).write_bytes(data)
    res = cli("--manifest", manifest, "--out", str(theirs))
    assert res.returncode == 1, res.stdout
    assert f"{theirs} is not empty and holds no hsextract export" in res.stderr
    assert files_of(theirs) == planted
    # Another format's export directory (SpecForge's) is not taken either.
    other = tmp_path / "specforge"
    other.mkdir()
    owner = other / "hsextract_export.json"
    owner.write_text(json.dumps({"format": "specforge-offline-eagle3"}))
    res = cli("--manifest", manifest, "--out", str(other))
    assert res.returncode == 1 and f"{other} holds the export of run" in res.stderr
    assert list(other.iterdir()) == [owner]


@pytest.mark.workflow
def test_speculators_export_touches_only_its_own_files(prenorm_copy):
    wd, out = prenorm_copy["workdir"], prenorm_copy["out"]
    planted = {
        "notes.tmp": b"their notes",
        "data-mine.arrow": b"their rows",
        "done/notes.txt": b"their notes",
        "hidden_states/notes.tmp": b"their notes",
        "hidden_states/hs_3.safetensors.bak": b"their copy",
    }
    for name, data in planted.items():
        (out / name).write_bytes(data)
    killed = out / "hidden_states" / ".hs_3.safetensors.4242.tmp"  # a killed writer's
    killed.write_bytes(b"partial")
    res = cli("--manifest", str(prenorm_copy["run_dir"] / "manifest.json"))
    assert res.returncode == 0, res.stderr
    assert "48 records" in res.stdout and "1 stale removed" in res.stdout, res.stdout
    assert not killed.exists()
    assert {n: (out / n).read_bytes() for n in planted} == planted
    # The workflow's jobs too: the dataset and every chunk rewritten, the summary redone.
    (out / "done" / "dataset.json").unlink()
    (out / "done" / "chunk_00000.json").unlink()
    run_snakemake(wd, "-j1", "export_speculators")
    assert (out / "export.json").is_file()
    assert {n: (out / n).read_bytes() for n in planted} == planted
