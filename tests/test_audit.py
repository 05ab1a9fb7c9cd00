"""The audit stage: a sample of every run's states against HF's forward of the model.

It passes on the demo (4 chunks: every chunk sampled) and on a streamed run whose payloads
were deleted after the trainer's ack (it reads the states set aside when each chunk was
written); it fails, naming the layer and the records, on runs whose capture was wrong at
capture time (faults.py's capture actions in the reference engine), and deletes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import yaml
from fixtures_demo import run_snakemake, snakemake_cmd
from safetensors.torch import load_file, save_file

from hsextract import audit
from hsextract.config import load_config, typed
from hsextract.status import collect, render
from hsextract.stream import journal


def test_the_sample_is_seeded_and_spread_over_the_chunks():
    chunks = [{"path": f"chunk_{i:05d}.jsonl", "records": n} for i, n in enumerate([9, 0, 30, 9])]
    a = audit.sample(chunks, 16, seed=0)
    assert a == audit.sample(chunks, 16, seed=0)
    assert a != audit.sample(chunks, 16, seed=1)
    assert sum(map(len, a.values())) == 16
    assert set(a) == {"chunk_00000", "chunk_00002", "chunk_00003"}  # the empty one has none
    assert len(a["chunk_00002"]) in (9, 10, 11)  # in proportion to its records (30 of 48)
    sizes = {f"chunk_{i:05d}": n for i, n in enumerate([9, 0, 30, 9])}
    assert all(0 <= j < sizes[c] for c, js in a.items() for j in js)
    assert all(len(set(js)) == len(js) for js in a.values())
    assert sum(map(len, audit.sample(chunks, 100, seed=0).values())) == 48  # at most all
    assert audit.sample(chunks, 0, seed=0) == {}


def test_the_verdict_follows_the_bound():
    assert audit.judge(0.0019, 1e-3) == "pass"
    assert audit.judge(0.003, 1e-3) == "warn"
    assert audit.judge(0.0051, 1e-3) == "fail"  # fp32: a 0.5 % error fails


def test_the_audit_passes_on_the_demo(demo_run):
    """Every captured tensor of 16 records spread over the demo's 4 chunks agrees with HF's
    forward (fp32: ~1e-7); the run page and `hsextract status` say so."""
    rd = demo_run["run_dir"]
    result = json.loads((rd / audit.AUDIT_FILE).read_text())
    assert result["verdict"] == "pass", result
    assert len(result["records"]) == 16
    chunks = {Path(c["path"]).stem for c in demo_run["manifest"]["chunks"]}
    assert {r["chunk"] for r in result["records"]} == chunks
    # Every aux layer of the demo (8 layers: [2, 4, 5]) and the final state.
    assert sorted(result["layers"]) == ["2", "4", "5", "final"]
    for e in result["layers"].values():
        assert e["rel_rms_worst_record"] < 1e-5 and e["cosine"] > 0.99999, e
    assert result["layers"]["final"]["top1_agreement"] == 1.0
    assert result["device"] == "cpu" and result["estimate_s"] is not None
    assert not (rd / audit.FAILED_FILE).exists()
    assert "Audit: stored states vs the model" in (rd / "report" / "run.html").read_text()
    cwd = os.getcwd()
    try:
        os.chdir(demo_run["workdir"])
        cfg = typed(load_config(demo_run["workdir"] / "config.yaml"))
        line = [x for x in render(collect(cfg)).splitlines() if x.startswith("audit")]
    finally:
        os.chdir(cwd)
    assert line and "passed: 16 records" in line[0], line
    assert "hsextract [audit]: auditing 16 records" in demo_run["stdout"]
    assert "about " in demo_run["stdout"]  # the CPU time estimated up front


def _audit_on(copy: dict) -> None:
    """demo_copy turns the audit off; these tests are about it."""
    path = copy["workdir"] / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["audit"]["records"] = 16
    path.write_text(yaml.safe_dump(cfg))


def _rerun_with_fault(copy: dict, chunks: list[str], capture: list[dict]):
    """Re-extract ``chunks`` of a finished demo copy with a capture fault armed in the
    engine (the chunk files removed first, as a chunk lost is redone: the fault acts at
    capture time, the files it writes carry their own sha256), then the audit."""
    wd, rd = copy["workdir"], copy["run_dir"]
    _audit_on(copy)
    for c in chunks:
        for suffix in (".safetensors", ".json"):
            (rd / "hidden" / f"{c}{suffix}").unlink()
    env = {**os.environ, "HSEXTRACT_FAULTS": json.dumps({"capture": capture})}
    proc = subprocess.run(
        snakemake_cmd(wd, "-j1", "extract_all"), capture_output=True, text=True, env=env,
        timeout=900,
    )  # fmt: skip
    return proc, proc.stdout + proc.stderr


def _assert_nothing_deleted(copy: dict) -> dict:
    rd = copy["run_dir"]
    manifest = json.loads((rd / "manifest.json").read_text())
    for c in manifest["chunks"]:
        assert (rd / c["path"]).exists() and (rd / c["path"]).with_suffix(".json").exists()
    assert not (rd / audit.AUDIT_FILE).exists()
    failed = json.loads((rd / audit.FAILED_FILE).read_text())
    assert failed["verdict"] == "fail"
    return failed


def _failure_line(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith("hsextract [audit]: audit failed")]
    assert len(lines) == 1, out[-4000:]
    return lines[0]


def test_a_layer_captured_off_by_one_fails_the_audit(demo_copy):
    """Aux layer 2 of chunk_00001's records stored from the stream entering layer 3."""
    proc, out = _rerun_with_fault(
        demo_copy, ["chunk_00001"], [{"rid": "chunk_00001-", "do": "layer_off_by_one"}]
    )
    assert proc.returncode != 0
    line = _failure_line(out)
    assert "the stored aux layer 2 differs" in line, line
    assert "it matches the stream entering layer 3 instead" in line, line
    failed = _assert_nothing_deleted(demo_copy)
    bad = failed["layers"]["2"]["records_over"]
    sampled = [f"{r['chunk']}/{r['id']}" for r in failed["records"] if r["chunk"] == "chunk_00001"]
    assert bad == sampled and bad, failed["layers"]["2"]
    assert [k for k, e in failed["layers"].items() if e["verdict"] == "fail"] == ["2"]
    cfg = typed(load_config(demo_copy["workdir"] / "config.yaml"))
    assert audit.status_line(cfg, demo_copy["run_dir"]).startswith("FAILED, the run is unaudited")


def test_a_record_at_shifted_positions_fails_the_audit(demo_copy):
    """One sampled record of chunk_00002 stored one position late (row t holds token
    t-1's states): the audit names it, and only it, in every layer."""
    rd = demo_copy["run_dir"]
    _audit_on(demo_copy)
    cfg = typed(load_config(demo_copy["workdir"] / "config.yaml"))
    picks = audit.sample(demo_copy["manifest"]["chunks"], cfg.audit.records, cfg.seed)
    j = picks["chunk_00002"][0]
    rid = f"chunk_00002-{j:06d}"
    proc, out = _rerun_with_fault(
        demo_copy, ["chunk_00002"], [{"rid": rid, "do": "shift_positions"}]
    )
    assert proc.returncode != 0
    line = _failure_line(out)
    failed = _assert_nothing_deleted(demo_copy)
    rec = next(r for r in failed["records"] if r["chunk"] == "chunk_00002" and r["position"] == j)
    name = f"chunk_00002/{rec['id']}"
    assert name in line, line
    for key in ("2", "4", "5", "final"):  # the record's every tensor, no other record
        assert failed["layers"][key]["records_over"] == [name], (key, failed["layers"][key])
    assert rd.joinpath("manifest.json").exists()


def test_the_final_state_before_the_norm_fails_the_audit(demo_copy):
    """A model whose final norm weight is not uniform (so the pre-norm state is not the
    post-norm one rescaled), every chunk extracted with the final state taken before it."""
    wd = demo_copy["workdir"]
    weights = wd / "results" / "demo" / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    g = torch.Generator().manual_seed(3)
    norm = tensors["model.norm.weight"]
    tensors["model.norm.weight"] = 0.5 + torch.rand(norm.shape, generator=g, dtype=norm.dtype)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    chunks = [Path(c["path"]).stem for c in demo_copy["manifest"]["chunks"]]
    proc, out = _rerun_with_fault(demo_copy, chunks, [{"rid": "chunk_", "do": "final_prenorm"}])
    assert proc.returncode != 0
    line = _failure_line(out)
    assert "the stored final state (after the norm) differs" in line, line
    assert "it matches the state before the final norm instead" in line, line
    failed = _assert_nothing_deleted(demo_copy)
    assert [k for k, e in failed["layers"].items() if e["verdict"] == "fail"] == ["final"]
    assert failed["layers"]["final"]["cosine"] < 0.999  # not a mere rescaling
    assert failed["layers"]["final"]["top1_agreement"] < 1.0


@pytest.mark.workflow
def test_the_audit_reads_the_set_aside_states_of_a_streamed_run(demo_copy):
    """Under a disk budget, with a trainer acking every chunk as it is announced, the
    stream deletes the payloads; the audit passes on the states the chunk jobs set aside.
    (The finished demo's chunks removed and extracted again under the budget: the stages
    before them are the demo's, already run.)"""
    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    cfg["audit"]["records"] = 16
    cfg["stream"] = {"budget_gb": 1.0, "poll_s": 0.2}
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
    names = [Path(c["path"]).stem for c in demo_copy["manifest"]["chunks"]]
    for c in names:
        for suffix in (".safetensors", ".json"):
            (rd / "hidden" / f"{c}{suffix}").unlink()
    (rd / audit.AUDIT_FILE).unlink()
    stop = threading.Event()

    def trainer() -> None:  # acks whatever is announced, as a trainer's checkpoints would
        sdir = journal.stream_dir(rd)
        while not stop.is_set():
            if (sdir / journal.JOURNAL).exists():
                st = journal.read_state(sdir)
                todo = [s for s in st.chunks if not st.is_acked(s)]
                journal.AckWriter(rd).ack(todo)
            stop.wait(0.1)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    try:
        out = run_snakemake(wd, "-j1", "extract_all")
    finally:
        stop.set()
        t.join()
    result = json.loads((rd / audit.AUDIT_FILE).read_text())
    assert result["verdict"] == "pass" and result["streamed"], result
    gone = [c for c in names if not (rd / "hidden" / f"{c}.safetensors").exists()]
    sampled = {r["chunk"] for r in result["records"]}
    assert set(gone) & sampled, (gone, sampled)  # audited from what was set aside
    assert sampled == set(names), sampled  # spread: 16 records over 4 chunks
    for c in sampled:
        assert audit.sample_file(rd, c).exists()
    assert "hsextract [audit]: passed" in out.stdout + out.stderr


def _demo_records(demo_run, n: int = 3, tokens: int = 48) -> list[audit.Stored]:
    """The first ``tokens`` of ``n`` demo records (a prefix's states are the record's: the
    model is causal), for in-process forwards that stay short on a CPU."""
    from hsextract.chunks import ChunkReader

    c = demo_run["manifest"]["chunks"][0]
    reader = ChunkReader(demo_run["run_dir"] / c["path"])
    return [
        audit.Stored(
            "chunk_00000", j, str(reader[j]["id"]), reader[j]["input_ids"][:tokens].tolist()
        )
        for j in range(n)
    ]


def test_a_bf16_run_is_judged_against_bf16s_own_noise(demo_run):
    """States as a bf16 forward gives them pass, with the bf16-vs-fp32 noise measured per
    layer as the bound's basis; the same states with layer 2 taken one layer late fail."""
    from transformers import AutoModelForCausalLM

    path = demo_run["workdir"] / "results" / "demo" / "model"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    records = _demo_records(demo_run)
    for r in records:
        got = audit.forward_states(model, r.input_ids, {2, 3, 4, 5}, 8)
        r.states = {k: got[k].to(torch.bfloat16) for k in (2, 4, 5, "final")}
    cpu = audit.Placement("cpu", None, None, "")
    layers = audit.measure(path, records, 8, "bfloat16", "lossless", cpu)
    for e in layers.values():
        assert e["verdict"] == "pass", e
        assert e["dtype_noise"] > 0 and e["noise"] >= e["dtype_noise"], e
    assert layers["final"]["top1_agreement"] > 0.9, layers["final"]
    for r in records:  # the capture of layer 2 off by one
        r.states[2] = audit.forward_states(model, r.input_ids, {3}, 8)[3].to(torch.bfloat16)
    layers = audit.measure(path, records, 8, "bfloat16", "lossless", cpu)
    assert [k for k, e in layers.items() if e["verdict"] == "fail"] == ["2"], layers
    assert layers["2"]["rel_rms_worst_record"] > audit.FAIL_X * layers["2"]["noise"]


def test_the_fp8_codec_error_is_measured_into_the_bound(demo_run):
    """An fp32 run stored with storage.codec fp8: its states are the forward's through the
    codec; they pass only because the codec's own error, measured on the same tensors, is
    part of the bound (the fp32 bound alone fails them)."""
    from transformers import AutoModelForCausalLM

    from hsextract.storage import fp8_dequantize, fp8_quantize

    path = demo_run["workdir"] / "results" / "demo" / "model"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records = _demo_records(demo_run)
    for r in records:
        got = audit.forward_states(model, r.input_ids, {2, 4, 5}, 8)
        r.states = {
            k: fp8_dequantize(*fp8_quantize(got[k].float().unsqueeze(1)), torch.float32)[:, 0]
            for k in (2, 4, 5, "final")
        }
    cpu = audit.Placement("cpu", None, None, "")
    layers = audit.measure(path, records, 8, "float32", "fp8", cpu)
    assert all(e["verdict"] == "pass" and e["codec_noise"] > 0 for e in layers.values()), layers
    layers = audit.measure(path, records, 8, "float32", "lossless", cpu)
    assert all(e["verdict"] == "fail" for e in layers.values()), layers


def test_the_prenorm_state_is_audited_where_captured(demo_run):
    """With prenorm_final the stream before the final norm (aux index L) is one more
    audited tensor; stored as the normed state instead, it fails under its own name."""
    from transformers import AutoModelForCausalLM

    path = demo_run["workdir"] / "results" / "demo" / "model"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records = _demo_records(demo_run)
    for r in records:
        got = audit.forward_states(model, r.input_ids, {2, 4, 5, 8}, 8)
        r.states = {k: got[k].float() for k in (2, 4, 5, 8, "final")}
    cpu = audit.Placement("cpu", None, None, "")
    layers = audit.measure(path, records, 8, "float32", "lossless", cpu)
    assert layers["8"]["name"] == "pre-norm final state (aux 8)"
    assert all(e["verdict"] == "pass" for e in layers.values()), layers
    for r in records:
        r.states[8] = r.states["final"]
    layers = audit.measure(path, records, 8, "float32", "lossless", cpu)
    assert [k for k, e in layers.items() if e["verdict"] == "fail"] == ["8"], layers
    assert layers["8"]["diagnosis"] == "it matches the final state after the norm instead"
