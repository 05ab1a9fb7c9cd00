"""The whole pipeline through real Snakemake on the embedded default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures_demo import (
    default_sigint,
    engine_processes,
    kill_processes_under,
    make_workdir,
    planned_jobs,
    poll,
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
    "demo_data", "demo_model", "merge_and_shuffle", "publish_merge", "split_chunks",
    "delete_stale_states", "preflight_budget", "apply_patch", "gpu_gate", "launch_server",
    "manifest", "audit", "report_figures", "extract_all",
}  # fmt: skip


def test_dry_run_lists_every_stage_and_chunk_without_loading_a_model(tmp_path):
    # As shipped (the audit on), the demo's model not built: a dry run loads no model.
    workdir = make_workdir(tmp_path / "w", built_model=False, n_chunks=7, **{"audit.records": 16})
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
    from hsextract.config import dump_dir, read_config

    monkeypatch.chdir(demo_run["workdir"])
    ddir = dump_dir(read_config("config.yaml"))
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
    tests/faults/test_faults_resources.py.

    The chunk is held mid-request (fault injection: the engine waits on a gate file), so
    the run cannot finish before the signal lands: a demo chunk takes under a second, and
    a signal sent "once a temporary file exists" raced the chunk's end and the next job's
    start, where Snakemake 9 used to drop it (test_ctrl_c_while_snakemake_prints...)."""
    workdir = make_workdir(tmp_path / "w")
    gate, fault_log = tmp_path / "gate", tmp_path / "faults.jsonl"
    hold = {
        "log": str(fault_log),
        "extend": [{"rid": "chunk_", "nth": [1], "do": "wait", "gate": str(gate)}],
    }

    def held() -> list[dict]:
        lines = fault_log.read_text().splitlines() if fault_log.exists() else []
        return [json.loads(x) for x in lines]

    proc = start_snakemake(workdir, "-j1", "extract_all", faults=hold)
    try:
        rd = run_dir_of(workdir)
        poll(lambda: held() or proc.poll() is not None, "a chunk's request held mid-chunk")
        assert proc.poll() is None, f"workflow ended before a chunk was held:\n{proc.stdout.read()}"
        chunk = held()[0]["rid"].split("-")[0]  # rid: <chunk>-<record>
        assert list((rd / "hidden").glob(f".{chunk}.safetensors.*.tmp")), "not mid-chunk"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        # The signal is pending in every process of the group now; the held request may
        # end (the chunk job waits for its requests in flight before it stops), and the
        # job stops at its next step: its chunk cannot be finished any more.
        gate.touch()
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0, out[-4000:]
        left = wait_until_gone(workdir)  # the watchdog polls twice a second
        assert not left, f"left running after Ctrl-C: {left}"
    finally:
        gate.touch()
        stop_snakemake(proc)
        kill_processes_under(workdir)
    # One sentence from the interrupted job, no traceback (neither its own nor Snakemake's).
    n = chunk.removeprefix("chunk_")
    want = (
        f"interrupted: chunk {n} not finished; it is extracted whole, so rerunning the same "
        "command starts it over (finished chunks are kept)"
    )
    assert f"hsextract [extract_chunk]: {want}" in out, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-6000:]
    assert not (rd / "hidden" / f"{chunk}.safetensors").exists(), "a half chunk was kept"
    assert not list((rd / "hidden").glob(".*.tmp")), "temporary files left"
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


_PRESS_CTRL_C_MID_WRITE = """
import io, logging, os, signal, sys

from snakemake.logging import ColorizingTextHandler

if sys.argv[1] == "kept":
    from hsextract.interrupt import keep_ctrl_c

    keep_ctrl_c()


class Terminal(io.StringIO):
    def write(self, s):
        os.kill(os.getpid(), signal.SIGINT)  # the key, pressed while Snakemake prints
        return super().write(s)


log = logging.getLogger("snakemake-like")
log.addHandler(ColorizingTextHandler(stream=Terminal()))
try:
    log.warning("localrule extract_chunk:")
except KeyboardInterrupt:
    print("interrupted")
else:
    print("dropped")
"""


@pytest.mark.parametrize("mode", ["as-shipped", "kept"])
def test_ctrl_c_while_snakemake_prints_is_not_dropped(mode):
    """Snakemake 9's terminal log handler catches KeyboardInterrupt and drops it, so a
    Ctrl-C that landed while the scheduler printed a job (between any two jobs) was lost:
    the run went on and exited 0.  The workflow installs hsextract.interrupt.keep_ctrl_c
    (Snakefile), which raises it again once the write returns.  "as-shipped" pins the
    Snakemake behaviour the workaround exists for: when it fails, Snakemake has stopped
    dropping the interrupt and keep_ctrl_c can go."""
    proc = subprocess.run(
        [sys.executable, "-c", _PRESS_CTRL_C_MID_WRITE, mode],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=default_sigint,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("interrupted" if mode == "kept" else "dropped")


def test_the_workflow_keeps_ctrl_c():
    """keep_ctrl_c is installed where Snakemake parses the workflow (its main process)."""
    from hsextract.interrupt import keep_ctrl_c

    text = (Path(__file__).resolve().parents[1] / "Snakefile").read_text()
    assert "keep_ctrl_c()" in text and keep_ctrl_c.__module__ == "hsextract.interrupt"


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
