"""`export_specforge` / `hsextract export specforge`, read back by SpecForge 0.2.0's own code.

SpecForge is installed without its dependencies (README's test command: they pin another
torch and SGLang); its readers need only torch, transformers, pydantic and datasets.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from fixtures_demo import planned_jobs, run_snakemake
from specforge.algorithms.eagle3.data import normalize_offline_sample
from specforge.data.preprocessing import build_offline_eagle3_dataset
from specforge.runtime.data_plane.feature_store import LocalFeatureStore, load_feature_file
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
from test_export_common import copy_workdir, make_one_chunk_stale, put_other_records_in

from hsextract.chunks import ChunkReader, ChunkWriter
from hsextract.commands import snakemake_command
from hsextract.export.common import record_indices
from hsextract.export.specforge import export_chunk

pytestmark = pytest.mark.workflow
KEYS = {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}


def out_of(rd: Path) -> Path:
    return rd / "export" / "specforge"


def chunk_records(rd: Path) -> dict[int, dict]:
    """Every record of the run by its train.jsonl line, as our ChunkReader reads it."""
    manifest = json.loads((rd / "manifest.json").read_text())
    out = {}
    for c in manifest["chunks"]:
        reader = ChunkReader(rd / c["path"])
        for j, idx in enumerate(record_indices(rd, c["chunk"])):
            out[idx] = {**reader[j], "dtype": reader.dtype, "chunk": c["chunk"]}
    return out


def check_export(rd: Path, out: Path, *, suffix: str = ".ckpt") -> list:
    """SpecForge's four readers on the export, against our chunk files: every record,
    every key, dtypes and shapes; idx = the record's train.jsonl line.  Returns the refs."""
    manifest = json.loads((rd / "manifest.json").read_text())
    n = manifest["totals"]["records"]
    want = chunk_records(rd)
    assert sorted(want) == list(range(n))
    lines = (rd / "merged" / "train.jsonl").read_bytes().splitlines()
    assert len(lines) == n

    refs = OfflineManifestReader(str(out), validate_files=True).read()
    assert len(refs) == n
    store = LocalFeatureStore()
    seen = []
    for ref in refs:
        path = ref.feature_store_uri.removeprefix("file://")
        m = re.fullmatch(r".*/rows_(\d+)-(\d+)/data_(\d+)" + re.escape(suffix), path)
        assert m, path
        g, g_end, idx = (int(x) for x in m.groups())
        assert g == idx // 2000 * 2000 and g_end == g + 2000
        seen.append(idx)
        rec = want[idx]
        t, h = len(rec["input_ids"]), rec["hidden_states"].shape[1]
        k_h = rec["aux_hidden_states"].shape[1]
        specs = {name: (s.dtype, s.shape) for name, s in ref.feature_specs.items()}
        dt = str(rec["dtype"]).removeprefix("torch.")
        assert specs == {
            "input_ids": ("int64", (t,)),
            "loss_mask": ("int64", (t,)),
            "hidden_state": (dt, (1, t, h)),
            "aux_hidden_state": (dt, (1, t, k_h)),
        }
        assert ref.num_tokens == t
        raw = load_feature_file(path)
        assert set(raw) == KEYS
        expect = {
            "input_ids": rec["input_ids"].to(torch.int64),
            "loss_mask": rec["loss_mask"].to(torch.int64),
            "hidden_state": rec["hidden_states"].unsqueeze(0),
            "aux_hidden_state": rec["aux_hidden_states"].unsqueeze(0),
        }
        for key, value in expect.items():
            assert raw[key].dtype == value.dtype and torch.equal(raw[key], value), (idx, key)
        got, handle = store.get(ref)
        store.release(handle)
        assert all(torch.equal(got[key], expect[key]) for key in KEYS)
        norm = normalize_offline_sample(raw, max_len=manifest["max_seq_len"])
        assert torch.equal(norm["target"], expect["hidden_state"])
        assert torch.equal(norm["hidden_state"], expect["aux_hidden_state"])
        assert torch.equal(norm["input_ids"][0], expect["input_ids"])
        assert torch.equal(norm["loss_mask"][0, :-1], expect["loss_mask"][:-1])
        # idx is the line of merged/train.jsonl this record came from.
        line = json.loads(lines[idx])
        assert line["id"] == rec["id"] and line["input_ids"] == rec["input_ids"].tolist()
    assert sorted(seen) == list(range(n))

    ds = build_offline_eagle3_dataset(str(out), max_len=manifest["max_seq_len"])
    assert len(ds) == n
    assert ds.datapaths == [r.feature_store_uri.removeprefix("file://") for r in refs]
    for i in range(n):
        item = ds[i]
        ref_norm = normalize_offline_sample(
            load_feature_file(ds.datapaths[i]), max_len=manifest["max_seq_len"]
        )
        assert item.keys() == ref_norm.keys()
        assert all(torch.equal(item[key], ref_norm[key]) for key in item)
    summary = json.loads((out / "export.json").read_text())
    assert summary["records"] == n and summary["fingerprint"] == manifest["fingerprint"]
    return refs


def stamps(d: Path) -> dict[str, int]:
    return {
        str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()
    }


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "export", "specforge", *args],
        capture_output=True,
        text=True,
    )


def job_lines(proc: subprocess.CompletedProcess, rule: str) -> int:
    return (proc.stdout + proc.stderr).count(f"rule {rule}:")


@pytest.fixture(scope="module")
def exported(demo_run, tmp_path_factory) -> dict:
    """The finished demo, copied, with `snakemake -j1 export_specforge` run once."""
    workdir = tmp_path_factory.mktemp("specforge") / "w"
    shutil.copytree(demo_run["workdir"], workdir, symlinks=True)
    shutil.rmtree(workdir / ".snakemake", ignore_errors=True)
    rd = workdir / demo_run["run_dir"].relative_to(demo_run["workdir"])
    proc = run_snakemake(workdir, "-j1", "export_specforge")
    return {"workdir": workdir, "run_dir": rd, "out": out_of(rd), "proc": proc}


@pytest.fixture
def exported_copy(exported, tmp_path) -> dict:
    """A private copy of the exported demo, for a test that changes it (each such test
    used to copy the demo and run the same first export itself)."""
    wd, rd = copy_workdir(exported["workdir"], exported["run_dir"], tmp_path / "copy")
    return {"workdir": wd, "run_dir": rd}


def test_specforge_is_installed_without_its_heavy_dependencies():
    assert version("specforge") == "0.2.0"
    assert torch.__version__.startswith("2.13.0")  # not SpecForge's pin (2.11.0)


def test_specforge_reads_every_record_exactly(exported):
    rd, out = exported["run_dir"], exported["out"]
    refs = check_export(rd, out)
    assert json.loads((rd / "manifest.json").read_text())["totals"]["records"] == len(refs) == 48
    assert job_lines(exported["proc"], "export_specforge_chunk") == 4
    done = json.loads((out / "done" / "chunk_00000.json").read_text())
    assert {f["path"] for f in done["files"]} <= {
        str(p.relative_to(out)) for p in out.glob("rows_*/data_*.ckpt")
    }
    assert done["dtype"] == "float32" and done["aux_layers"] == [2, 4, 5]


def test_a_rerun_does_nothing(exported):
    workdir, out = exported["workdir"], exported["out"]
    before = stamps(out)
    assert "Nothing to be done" in run_snakemake(workdir, "-n", "export_specforge").stdout
    # The CLI on a finished export checks every file and rewrites none.
    res = cli("--manifest", str(exported["run_dir"] / "manifest.json"))
    assert res.returncode == 0, res.stderr
    assert "48 records" in res.stdout and "0 written, 48 kept" in res.stdout, res.stdout
    assert stamps(out) == before


def test_reextracting_one_chunk_reexports_only_that_chunk(exported_copy):
    workdir, rd = exported_copy["workdir"], exported_copy["run_dir"]
    out = out_of(rd)
    before = stamps(out)
    (rd / "hidden" / "chunk_00001.safetensors").unlink()
    plan = planned_jobs(run_snakemake(workdir, "-n", "export_specforge").stdout)
    assert plan.get("extract_chunk") == plan.get("export_specforge_chunk") == 1, plan
    proc = run_snakemake(workdir, "-j1", "export_specforge")
    assert proc.returncode == 0, proc.stderr
    assert job_lines(proc, "extract_chunk") == job_lines(proc, "export_specforge_chunk") == 1
    # A rerun gives the chunk's bytes again, so its files are verified and kept.
    assert "hsextract [export chunk_00001]: 8 records, 0 written, 8 kept" in proc.stderr
    after = stamps(out)
    changed = {p for p in after if after[p] != before.get(p)}
    assert changed == {"done/chunk_00001.json", "export.json"}, changed
    check_export(rd, out)


def test_a_killed_export_is_repaired_on_rerun(exported_copy):
    workdir, rd = exported_copy["workdir"], exported_copy["run_dir"]
    out = out_of(rd)
    victim = json.loads((out / "done" / "chunk_00002.json").read_text())["files"]
    # What a SIGKILL mid-chunk leaves: no marker (Snakemake removes an incomplete job's
    # output), a journal whose last line is torn, a partial file under its temporary
    # name; and, beyond what our writer can leave, a truncated and a missing file.
    (out / "done" / "chunk_00002.json").unlink()
    with open(out / "journal" / "chunk_00002.jsonl", "a") as f:
        f.write('{"idx": 3, "key": "tor')
    folder = out / Path(victim[0]["path"]).parent
    temp = folder / f".data_{victim[0]['idx']}.ckpt.4242.tmp"
    temp.write_bytes(b"PK\x03\x04 partial")
    truncated = out / victim[1]["path"]
    truncated.write_bytes(truncated.read_bytes()[: victim[1]["bytes"] // 2])
    (out / victim[2]["path"]).unlink()
    proc = run_snakemake(workdir, "-j1", "export_specforge")
    assert job_lines(proc, "export_specforge_chunk") == 1
    assert "hsextract [export chunk_00002]: 14 records, 2 written, 12 kept" in proc.stderr
    assert not temp.exists()
    assert not list(out.rglob(".*.tmp"))
    check_export(rd, out)

    # A file damaged under a finished chunk: Snakemake's mtimes cannot see it, the CLI
    # checks every file (size, then mtime or sha256) and rewrites only it.
    other = json.loads((out / "done" / "chunk_00000.json").read_text())["files"][0]
    (out / other["path"]).write_bytes(b"")
    res = cli("--manifest", str(rd / "manifest.json"))
    assert res.returncode == 0, res.stderr
    assert "48 records" in res.stdout and "1 written, 47 kept" in res.stdout, res.stdout
    check_export(rd, out)
    # Snakemake then re-checks the summary (its benchmark file predates the repaired
    # marker) but re-exports no chunk: the CLI's repair stands.
    dry = run_snakemake(workdir, "-n", "export_specforge")
    assert job_lines(dry, "export_specforge_chunk") == 0, dry.stdout
    assert job_lines(dry, "export_specforge_summary") == 1, dry.stdout


def test_a_data_change_reexports_and_removes_what_no_record_holds(exported_copy):
    workdir, rd = exported_copy["workdir"], exported_copy["run_dir"]
    out = out_of(rd)
    shard = workdir / "results" / "demo" / "data" / "shard_00.jsonl"
    lines = shard.read_bytes().splitlines(keepends=True)
    shard.write_bytes(b"".join(lines[1:]))
    proc = run_snakemake(workdir, "-j1", "export_specforge")
    # train.jsonl changed, so every record's line may have: every chunk is re-exported.
    assert job_lines(proc, "extract_chunk") == 1
    assert job_lines(proc, "export_specforge_chunk") == 4
    assert "47 records in" in proc.stderr and "1 stale file(s) removed" in proc.stderr
    assert not (out / "rows_0-2000" / "data_47.ckpt").exists()
    assert len(check_export(rd, out)) == 47


def test_cli_gzip_then_plain_into_its_own_directory(exported, tmp_path):
    rd = exported["run_dir"]
    manifest = str(rd / "manifest.json")
    out = tmp_path / "sf"
    res = cli("--manifest", manifest, "--out", str(out), "--gzip")
    assert res.returncode == 0, res.stderr
    assert "48 records" in res.stdout and "48 written" in res.stdout
    assert f"data.hidden_states_path={out}" in res.stdout
    assert len(list(out.glob("rows_*/data_*.ckpt.gz"))) == 48
    assert not list(out.glob("rows_*/data_*.ckpt"))
    check_export(rd, out, suffix=".ckpt.gz")
    # Same records, gzip-only header bytes: a rerun reproduces every file byte for byte.
    before = {p: p.read_bytes() for p in out.glob("rows_*/*")}
    shutil.rmtree(out / "journal")
    shutil.rmtree(out / "done")
    res = cli("--manifest", manifest, "--out", str(out), "--gzip")
    assert res.returncode == 0 and "48 written" in res.stdout, res.stdout + res.stderr
    assert {p: p.read_bytes() for p in out.glob("rows_*/*")} == before

    # Back to plain .ckpt: no .ckpt.gz twin is left for SpecForge to read twice; a
    # record file no chunk lists goes too.
    orphan = out / "rows_0-2000" / "data_1999.ckpt"
    orphan.write_bytes(b"stale")
    res = cli("--manifest", manifest, "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert not list(out.rglob("*.ckpt.gz")) and not orphan.exists()
    assert len(check_export(rd, out)) == 48

    # A .ckpt that is someone else's is refused, never deleted.
    foreign = out / "mine.ckpt"
    foreign.write_bytes(b"x")
    res = cli("--manifest", manifest, "--out", str(out))
    assert res.returncode == 1 and "mine.ckpt is not part of this export" in res.stderr
    assert foreign.exists()


def test_cli_refuses_a_directory_it_does_not_own(exported, tmp_path):
    manifest = str(exported["run_dir"] / "manifest.json")
    theirs = tmp_path / "theirs"
    (theirs / "rows_0-2000").mkdir(parents=True)
    (theirs / "rows_0-2000" / "data_0.ckpt").write_bytes(b"their record")
    res = cli("--manifest", manifest, "--out", str(theirs))
    assert res.returncode == 1
    assert f"{theirs} is not empty and holds no hsextract export" in res.stderr
    assert (theirs / "rows_0-2000" / "data_0.ckpt").read_bytes() == b"their record"
    # Another run's export directory: mixing two runs' states is refused.
    other = tmp_path / "other"
    other.mkdir()
    (other / "hsextract_export.json").write_text(
        json.dumps({"format": "specforge-offline-eagle3", "fingerprint": "0123456789ab"})
    )
    res = cli("--manifest", manifest, "--out", str(other))
    assert res.returncode == 1 and "holds the export of run '0123456789ab'" in res.stderr


def test_bf16_states_keep_their_dtype_and_prenorm_aux_is_left_out(exported, tmp_path):
    """A bf16 chunk (codec none) whose aux also holds the prenorm_final slot (layer L):
    SpecForge gets bf16 and the EAGLE-3 layers only."""
    src = exported["run_dir"]
    rd = tmp_path / "run"
    for part in ("chunks/index.json", "merged/train.jsonl", "hidden/chunk_00000.json"):
        (rd / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / part, rd / part)
    reader = ChunkReader(src / "hidden" / "chunk_00000.safetensors")
    h, n_layers = reader.hidden_size, int(reader.metadata["num_layers"])
    meta = {
        k: v
        for k, v in reader.metadata.items()
        if k not in ("codec", "codec_params", "format_version")
    }
    meta.update(aux_layers=json.dumps([*reader.aux_layers, n_layers]), dtype="bfloat16")
    recs = list(reader)
    prenorm = [torch.randn(len(r["input_ids"]), h).to(torch.bfloat16) for r in recs]

    def write(metadata: dict) -> None:
        """The chunk file, and its sidecar's sha256 and size, as an extraction leaves them."""
        writer = ChunkWriter(
            rd / "hidden" / "chunk_00000.safetensors",
            [len(r["input_ids"]) for r in recs],
            hidden_size=h,
            n_aux=len(reader.aux_layers) + 1,
            dtype=torch.bfloat16,
            metadata=metadata,
            codec="none",
        )
        for j, (r, p) in enumerate(zip(recs, prenorm, strict=True)):
            aux = torch.cat([r["aux_hidden_states"].to(torch.bfloat16), p], dim=1)
            hid = r["hidden_states"].to(torch.bfloat16)
            writer.put(j, r["input_ids"], r["loss_mask"], hid, aux)
        sha = writer.finish()
        side = json.loads((rd / "hidden" / "chunk_00000.json").read_text())
        side.update(sha256=sha, bytes=os.path.getsize(rd / "hidden" / "chunk_00000.safetensors"))
        (rd / "hidden" / "chunk_00000.json").write_text(json.dumps(side))

    write(meta)

    out = tmp_path / "sf"
    marker = export_chunk(rd, "chunk_00000", out)
    assert marker["dtype"] == "bfloat16" and marker["prenorm_left_out"] is True
    assert marker["aux_layers"] == reader.aux_layers and marker["written"] == len(recs)
    refs = OfflineManifestReader(str(out), validate_files=True).read()
    assert len(refs) == len(recs)
    by_idx = dict(zip(record_indices(rd, "chunk_00000"), recs, strict=True))
    k = len(reader.aux_layers)
    for ref in refs:
        assert ref.feature_specs["hidden_state"].dtype == "bfloat16"
        path = ref.feature_store_uri.removeprefix("file://")
        raw = load_feature_file(path)
        r = by_idx[int(re.search(r"data_(\d+)\.ckpt$", path).group(1))]
        assert raw["aux_hidden_state"].shape == (1, len(r["input_ids"]), k * h)
        assert torch.equal(raw["aux_hidden_state"][0], r["aux_hidden_states"].to(torch.bfloat16))
        assert torch.equal(raw["hidden_state"][0], r["hidden_states"].to(torch.bfloat16))
        # torch.save writes a tensor's whole storage: none drags the dropped slot along.
        assert raw["aux_hidden_state"].untyped_storage().nbytes() == k * h * 2 * len(r["input_ids"])

    # Re-extracted into other bytes (same records): every file of the chunk is rewritten.
    write({**meta, "note": "extracted again"})
    assert export_chunk(rd, "chunk_00000", out)["written"] == len(recs)
    assert export_chunk(rd, "chunk_00000", out)["kept"] == len(recs)


def test_a_stale_chunk_is_refused(exported_copy):
    workdir, rd = exported_copy["workdir"], exported_copy["run_dir"]
    out = out_of(rd)
    stale = make_one_chunk_stale(workdir, rd)
    hidden = rd / "hidden" / f"{stale}.safetensors"
    before = stamps(out)
    res = cli("--manifest", str(rd / "manifest.json"))
    assert res.returncode == 1, res.stdout
    assert f"{stale}: {hidden} holds other records than chunks/index.json assigns it" in (
        res.stderr
    )
    assert f"rerun `{snakemake_command(hidden, run_dir=rd)}`" in res.stderr
    assert stamps(out) == before  # every chunk is checked before anything is written
    # The workflow's chunk job refuses such a chunk when nothing upstream sees it (-k:
    # the manifest job may refuse first).
    hidden.unlink()
    run_snakemake(workdir, "-j1", "export_specforge")  # what the message says to do
    check_export(rd, out)
    put_other_records_in(rd, "chunk_00001", "chunk_00002")
    proc = run_snakemake(workdir, "-j1", "-k", "export_specforge", check=False)
    rel = (rd / "hidden" / "chunk_00001.safetensors").relative_to(workdir)
    assert proc.returncode != 0
    assert f"chunk_00001: {rel} holds other records than chunks/index.json" in proc.stderr


def test_files_it_did_not_write_survive_in_its_own_directory(exported, tmp_path):
    manifest = str(exported["run_dir"] / "manifest.json")
    out = tmp_path / "sf"
    assert cli("--manifest", manifest, "--out", str(out)).returncode == 0
    planted = {
        "notes.tmp": b"their notes",
        "settings-mine.json": b"{}",
        "done/notes.txt": b"their notes",
        "journal/notes.jsonl": b"their notes",
        "rows_0-2000/notes.tmp": b"their notes",
        "rows_0-2000/.data_3.ckpt.tmp": b"their temp",
    }
    for name, data in planted.items():
        (out / name).write_bytes(data)
    killed = out / "rows_0-2000" / ".data_3.ckpt.4242.tmp"  # a killed writer's
    killed.write_bytes(b"partial")
    # --gzip: another settings file, every record rewritten, every .ckpt removed.
    res = cli("--manifest", manifest, "--out", str(out), "--gzip")
    assert res.returncode == 0, res.stderr
    assert "48 written" in res.stdout and not killed.exists()
    assert {n: (out / n).read_bytes() for n in planted} == planted
    check_export(exported["run_dir"], out, suffix=".ckpt.gz")
