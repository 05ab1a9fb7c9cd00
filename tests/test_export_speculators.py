"""The speculators export, read by vLLM speculators' own ``ArrowDataset`` (0.9.0)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fixtures_demo import make_workdir, planned_jobs, run_dir_of, run_snakemake

from hsextract.chunks import ChunkReader
from hsextract.export.common import record_indices


@pytest.fixture(scope="module")
def prenorm_run(tmp_path_factory) -> dict:
    """The demo with prenorm_final on, extracted and exported for speculators."""
    wd = make_workdir(tmp_path_factory.mktemp("prenorm"), prenorm_final=True)
    run_snakemake(wd, "-j1", "export_speculators")
    rd = run_dir_of(wd)
    return {"workdir": wd, "run_dir": rd, "out": rd / "export" / "speculators"}


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
    cli = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "export", "speculators",
         "--manifest", str(rd / "manifest.json"), "--out", str(rd / "export" / "again")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    for name in after:
        a = (out / "hidden_states" / name).read_bytes()
        assert a == (rd / "export" / "again" / "hidden_states" / name).read_bytes()
