"""The whole pipeline through real Snakemake on the embedded default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from fixtures_demo import (
    engine_processes,
    kill_processes_under,
    make_workdir,
    planned_jobs,
    run_dir_of,
    run_snakemake,
    snakemake_cmd,
    start_snakemake,
    stop_snakemake,
    wait_until_gone,
)

from hsextract.chunks import ChunkReader, check_chunk, sha256_file

pytestmark = pytest.mark.workflow

STAGES = {
    "demo_data", "demo_model", "merge_and_shuffle", "split_chunks", "delete_stale_states",
    "preflight_budget", "apply_patch", "gpu_gate", "launch_server", "manifest", "report_figures",
    "extract_all",
}  # fmt: skip


def test_dry_run_lists_every_stage_and_chunk_without_loading_a_model(tmp_path):
    workdir = make_workdir(tmp_path / "w", n_chunks=7)
    # A torch that cannot be imported: planning must not need it (nor any model).
    poison = tmp_path / "poison"
    (poison / "torch").mkdir(parents=True)
    (poison / "torch" / "__init__.py").write_text("raise ImportError('dry run imported torch')\n")
    env = {**os.environ, "PYTHONPATH": str(poison)}
    proc = subprocess.run(
        snakemake_cmd(workdir, "-n", "extract_all"), capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout)
    assert jobs.get("extract_chunk") == 7
    assert STAGES <= set(jobs), f"missing stages: {STAGES - set(jobs)}"
    assert not (workdir / "results").exists(), "a dry run must not write outputs"


def test_success_leaves_no_dump_dir_in_shm(demo_run, monkeypatch):
    from hsextract.config import dump_dir, load_config

    monkeypatch.chdir(demo_run["workdir"])
    ddir = dump_dir(load_config("config.yaml"))
    assert str(ddir).startswith("/dev/shm/hsextract-")
    assert not ddir.exists(), f"{ddir} left in /dev/shm (RAM) after a successful run"


def test_extract_all_writes_contract_chunks_and_manifest(demo_run):
    rd, manifest = demo_run["run_dir"], demo_run["manifest"]
    assert manifest["totals"]["chunks"] == 4
    stats = json.loads((rd / "merged" / "stats.json").read_text())
    n_records = sum(c["records"] for c in manifest["chunks"])
    assert n_records == manifest["totals"]["records"] > 0
    for entry in manifest["chunks"]:
        path = rd / entry["path"]
        assert sha256_file(path) == entry["sha256"]
        info = check_chunk(path, expect_records=entry["records"])
        r = ChunkReader(path)
        shapes = r.shapes()
        t, h, k = info["tokens"], info["hidden_size"], len(info["aux_layers"])
        assert shapes["input_ids"] == ([t], "I32")
        assert shapes["loss_mask"] == ([t], "U8")
        assert shapes["offsets"] == ([entry["records"] + 1], "I64")
        # The default codec (lossless): the rows as frames of a blob, decoded per record
        # to the captured dtype and the contract's shapes (tests/test_storage.py: bit-exact).
        assert r.codec == info["codec"] == "lossless"
        assert shapes["frame_start"] == ([entry["records"] + 1], "I64")
        assert shapes["blob"][1] == "U8" and 0 < info["stored_bytes"] < info["raw_bytes"]
        assert info["raw_bytes"] == t * h * (k + 1) * 4
        for j, (a, b) in enumerate(zip(r.offsets[:-1], r.offsets[1:], strict=True)):
            rec = r[j]
            assert rec["hidden_states"].shape == (b - a, h)
            assert rec["aux_hidden_states"].shape == (b - a, k * h)
            assert rec["hidden_states"].dtype == rec["aux_hidden_states"].dtype == torch.float32
        assert r.aux_layers == [2, 4, 5]  # SGLang's EAGLE-3 default for 8 layers
        for key in ("record_ids", "model", "fingerprint", "engine", "format_version"):
            assert key in r.metadata
        assert r.metadata["fingerprint"] == rd.name
    # The merge's own counts agree with what was extracted.
    assert stats["records_out"] == manifest["totals"]["records"] == 48
    assert stats["tokens_out"] == manifest["totals"]["tokens"]
    assert stats["truncated"] == 1  # the demo's one record of max_seq_len + 7
    assert not engine_processes(demo_run["workdir"]), "a server outlived the workflow"


def test_rerun_of_one_deleted_chunk_reruns_only_it(demo_copy):
    workdir, rd, manifest = demo_copy["workdir"], demo_copy["run_dir"], demo_copy["manifest"]
    before = {
        c["path"]: (sha256_file(rd / c["path"]), (rd / c["path"]).stat().st_mtime_ns)
        for c in manifest["chunks"]
    }
    victim = manifest["chunks"][2]["path"]
    (rd / victim).unlink()
    plan = planned_jobs(run_snakemake(workdir, "-n", "extract_all").stdout)
    want = {"extract_chunk": 1, "manifest": 1, "report_figures": 1, "extract_all": 1}
    assert plan == want, plan
    run_snakemake(workdir, "-j1", str((rd / victim).relative_to(workdir)))
    for path, (sha, mtime) in before.items():
        assert sha256_file(rd / path) == sha, f"{path} changed"
        if path != victim:
            assert (rd / path).stat().st_mtime_ns == mtime, f"{path} was rewritten"
    assert not wait_until_gone(workdir), "a server outlived the workflow"


def test_sigint_mid_chunk_leaves_nothing_and_rerun_matches(demo_run, tmp_path):
    """Ctrl-C in the terminal (SIGINT to the whole process group) mid-chunk.  The other
    ways a workflow dies (SIGKILL of Snakemake alone or of its group, SIGTERM) are in
    tests/faults/test_faults_resources.py."""
    workdir = make_workdir(tmp_path / "w")
    proc = start_snakemake(workdir, "-j1", "extract_all")
    try:
        rd = run_dir_of(workdir)
        deadline = time.monotonic() + 300
        # Wait until a chunk job is extracting (its temporary chunk file exists).
        while not (rd / "hidden").is_dir() or not any((rd / "hidden").glob(".chunk_*.tmp")):
            assert proc.poll() is None, "workflow finished before it could be interrupted"
            assert time.monotonic() < deadline, "no chunk job started extracting"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        proc.communicate(timeout=120)
        assert proc.returncode != 0
        left = wait_until_gone(workdir)  # the watchdog polls twice a second
        assert not left, f"left running after Ctrl-C: {left}"
    finally:
        stop_snakemake(proc)
        kill_processes_under(workdir)
    for f in (rd / "hidden").glob("chunk_*.safetensors"):
        sidecar = f.with_suffix(".json")
        assert sidecar.exists(), f"{f} looks finished but has no sidecar"
        assert json.loads(sidecar.read_text())["sha256"] == sha256_file(f)
    run_snakemake(workdir, "-j1", "extract_all")
    shas = {
        c["path"]: c["sha256"] for c in json.loads((rd / "manifest.json").read_text())["chunks"]
    }
    assert shas == {c["path"]: c["sha256"] for c in demo_run["manifest"]["chunks"]}
    assert not wait_until_gone(workdir)


def test_reader_dataset_over_manifest(demo_run):
    from hsextract.chunks import ManifestDataset

    ds = ManifestDataset(demo_run["run_dir"] / "manifest.json")
    assert len(ds) == demo_run["manifest"]["totals"]["records"]
    item = ds[len(ds) - 1]
    n = item["input_ids"].shape[0]
    assert item["hidden_states"].shape == (n, 64)
    assert item["aux_hidden_states"].shape == (n, 3 * 64)
    assert torch.isfinite(item["hidden_states"]).all()


def test_inspect_cli(demo_run):
    path = demo_run["run_dir"] / demo_run["manifest"]["chunks"][0]["path"]
    out = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "aux_hidden_states" in out and "fingerprint" in out and "records:" in out
    assert "codec: lossless" in out and "x smaller" in out


def test_verify_cli_catches_a_flipped_byte(demo_copy):
    rd = demo_copy["run_dir"]
    manifest = rd / "manifest.json"
    ok = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "verify", str(manifest)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stdout
    victim = rd / demo_copy["manifest"]["chunks"][1]["path"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "verify", str(manifest)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and str(victim.name) in bad.stdout
