"""Chunk bytes and manifest fields are checked by everything that reads them (issue 34).

The exports and the dataset reader hash each chunk file against its sidecar's sha256 as
they read it, and ``hsextract verify`` compares every field of the manifest with the
chunk files, sidecars, index and config it was made from.  (hsextract imports are in the
tests, so that this file also runs on code without these checks: before/after checks.)
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hsextract.commands import snakemake_command

pytestmark = pytest.mark.workflow


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_a_state_byte(path: Path) -> None:
    """Flip one byte of a stored state so that the chunk still decodes (other numbers, no
    error): in a lossless chunk, inside a plane stored raw (a compressed one would fail
    its zstd checksum); in an uncompressed one, in the middle of ``hidden_states``."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    at = None
    if "blob" in header:
        ncol = 5  # record, tensor, row0, nrows, offset; then one length per byte plane
        a, b = header["frames"]["data_offsets"]
        width = header["frames"]["shape"][1]
        frames = np.frombuffer(bytes(data[base + a : base + b]), dtype=np.int64)
        blob = base + header["blob"]["data_offsets"][0]
        for row in frames.reshape(-1, width).tolist():
            pos = blob + row[ncol - 1]
            for length in row[ncol:]:
                if length < 0:  # stored raw
                    at = pos + (-length) // 2
                    break
                pos += length
            if at is not None:
                break
    else:
        a, b = header["hidden_states"]["data_offsets"]
        at = base + (a + b) // 2
    assert at is not None, f"{path}: no raw plane to flip a byte in"
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def chunk_files(rd: Path, chunk: str, suffix: str = ".ckpt") -> list[Path]:
    """The SpecForge files of a chunk's records."""
    from hsextract.export.common import record_indices
    from hsextract.export.specforge import relpath

    out = rd / "export" / "specforge"
    return [out / relpath(i, suffix.endswith(".gz")) for i in record_indices(rd, chunk)]


def hsextract(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args], capture_output=True, text=True
    )


def test_specforge_export_refuses_a_chunk_whose_bytes_changed(demo_copy):
    """One flipped byte that still decodes: refused naming the file, both digests and the
    fix, no traceback, the chunk file left alone and none of its records' files kept."""
    from hsextract.chunkfile import ChunkDigestError
    from hsextract.chunks import ChunkReader

    rd = demo_copy["run_dir"]
    victim = rd / "hidden" / "chunk_00001.safetensors"
    expected = demo_copy["manifest"]["chunks"][1]["sha256"]
    flip_a_state_byte(victim)
    actual = sha(victim)
    reader = ChunkReader(victim, verify=False)
    assert len([reader[j] for j in range(len(reader))]) == len(reader)  # silent to decoding
    with pytest.raises(ChunkDigestError, match=re.escape(f"{victim} has sha256 {actual[:12]}")):
        ChunkReader(victim)  # its sidecar's sha256, checked at open

    res = hsextract("export", "specforge", "--manifest", str(rd / "manifest.json"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"hsextract: error: chunk_00001: {victim} has sha256 {actual[:12]}")
    assert f"not the {expected[:12]}" in lines[0]
    assert f"delete {victim} and rerun `{snakemake_command(victim, run_dir=rd)}`" in lines[0]
    assert sha(victim) == actual  # never deleted or repaired for the user
    assert not (rd / "export" / "specforge" / "done" / "chunk_00001.json").exists()
    assert not any(p.exists() for p in chunk_files(rd, "chunk_00001"))
    assert all(p.exists() for p in chunk_files(rd, "chunk_00000"))  # checked, kept

    flip_a_state_byte(victim)  # the same byte back: the bytes extracted
    assert sha(victim) == expected
    res = hsextract("export", "specforge", "--manifest", str(rd / "manifest.json"))
    assert res.returncode == 0, res.stderr
    assert all(p.exists() for c in ("chunk_00001", "chunk_00002") for p in chunk_files(rd, c))


def test_a_frame_that_does_not_decode_is_blamed_on_the_changed_bytes(demo_copy):
    """A flipped byte in a compressed frame fails zstd's checksum mid-export: the error
    says the file's bytes changed (and the fix), not only that a record does not decode."""
    rd = demo_copy["run_dir"]
    victim = rd / "hidden" / "chunk_00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = hsextract("export", "specforge", "--manifest", str(rd / "manifest.json"))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"{victim} has sha256 {sha(victim)[:12]}" in res.stderr
    assert f"rerun `{snakemake_command(victim, run_dir=rd)}`" in res.stderr
    assert victim.exists()


def _prenorm_chunk(rd: Path) -> None:
    """chunk_00000 rewritten uncompressed with a prenorm_final slot (what speculators
    needs), its sidecar updated as an extraction leaves it."""
    from hsextract.chunks import ChunkReader, ChunkWriter

    path = rd / "hidden" / "chunk_00000.safetensors"
    reader = ChunkReader(path)
    recs = list(reader)
    h, n_layers = reader.hidden_size, int(reader.metadata["num_layers"])
    meta = {
        k: v
        for k, v in reader.metadata.items()
        if k not in ("codec", "codec_params", "format_version")
    }
    meta["aux_layers"] = json.dumps([*reader.aux_layers, n_layers])
    writer = ChunkWriter(
        path.with_name("new.safetensors"),
        [len(r["input_ids"]) for r in recs],
        hidden_size=h,
        n_aux=len(reader.aux_layers) + 1,
        dtype=reader.dtype,
        metadata=meta,
        codec="none",
    )
    for j, r in enumerate(recs):
        aux = torch.cat([r["aux_hidden_states"], r["hidden_states"]], dim=1)
        writer.put(j, r["input_ids"], r["loss_mask"], r["hidden_states"], aux)
    digest = writer.finish()
    os.replace(path.with_name("new.safetensors"), path)
    side = json.loads(path.with_suffix(".json").read_text())
    side.update(sha256=digest, bytes=path.stat().st_size)
    path.with_suffix(".json").write_text(json.dumps(side))


def test_speculators_export_refuses_a_chunk_whose_bytes_changed(demo_copy, tmp_path):
    from hsextract.export.common import ExportError, record_indices
    from hsextract.export.speculators import export_chunk, hs_path

    rd, out = demo_copy["run_dir"], tmp_path / "spec"
    _prenorm_chunk(rd)
    hidden = rd / "hidden" / "chunk_00000.safetensors"
    marker = out / "done" / "chunk_00000.json"
    done = export_chunk(hidden, rd, out, marker)
    paths = [hs_path(out, i) for i in record_indices(rd, "chunk_00000")]
    assert len(done["files"]) == len(paths) and all(p.exists() for p in paths)

    expected = sha(hidden)
    flip_a_state_byte(hidden)
    with pytest.raises(ExportError) as err:
        export_chunk(hidden, rd, out, marker)
    msg = str(err.value)
    assert msg.startswith(f"chunk_00000: {hidden} has sha256 {sha(hidden)[:12]}"), msg
    assert (
        f"not the {expected[:12]}" in msg
        and f"rerun `{snakemake_command(hidden, run_dir=rd)}`" in msg
    )
    assert "\n" not in msg
    assert not marker.exists() and not any(p.exists() for p in paths)
    assert hidden.exists()


def test_dataset_checks_each_chunk_once_and_refuses_changed_bytes(demo_copy, monkeypatch):
    import hsextract.chunkfile as chunkfile
    from hsextract.chunkfile import ChunkFileError
    from hsextract.chunks import ManifestDataset

    rd = demo_copy["run_dir"]
    calls: list[str] = []
    real = chunkfile.sha256_file

    def counted(path, *args, **kwargs):
        calls.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(chunkfile, "sha256_file", counted)
    victim = rd / "hidden" / "chunk_00001.safetensors"
    flip_a_state_byte(victim)
    ds = ManifestDataset(rd / "manifest.json")
    n0 = demo_copy["manifest"]["chunks"][0]["records"]
    assert [ds[i]["id"] for i in range(n0)]  # chunk_00000: intact
    assert calls == ["chunk_00000.safetensors"]  # hashed once, on its first record
    with pytest.raises(ChunkFileError) as err:
        ds[n0]  # chunk_00001's first record
    expected = demo_copy["manifest"]["chunks"][1]["sha256"]
    assert str(err.value) == (
        f"{victim} has sha256 {sha(victim)[:12]}..., not the {expected[:12]}... recorded "
        f"when it was extracted (its bytes changed on disk since): delete {victim} and "
        f"rerun `{snakemake_command(victim, run_dir=rd)}`"
    )
    # The advice redoes the copy's chunk (from its directory, with the project's
    # Snakefile), not the original run's whose workflow recorded the config.
    assert f"`cd {demo_copy['workdir']} && snakemake -j1 results/" in str(err.value)
    with pytest.raises(ChunkFileError):
        ds[n0 + 1]  # a failed check is not cached as passed
    ManifestDataset(rd / "manifest.json")[0]  # another dataset, same process: no rehash
    assert calls.count("chunk_00000.safetensors") == 1


def test_dataset_blames_a_stale_manifest_not_a_good_chunk(demo_copy):
    """Issue 38 item 7: a chunk re-extracted after the manifest was written (its sidecar's
    sha256 is its bytes', the manifest's is older) is not called damaged: the advice is
    the command that rebuilds the manifest, not a redo that reproduces the state."""
    from hsextract.chunkfile import ChunkDigestError
    from hsextract.chunks import ManifestDataset

    rd = demo_copy["run_dir"]
    path = rd / "manifest.json"
    data = json.loads(path.read_text())
    data["chunks"][1]["sha256"] = "0" * 64  # what the manifest said before the redo
    path.write_text(json.dumps(data))
    ds = ManifestDataset(path)
    n0 = data["chunks"][0]["records"]
    with pytest.raises(ChunkDigestError) as err:
        ds[n0]
    msg = str(err.value)
    assert "the manifest is stale, not the chunk" in msg and "\n" not in msg
    assert msg.endswith(f"rebuild it with `{snakemake_command('extract_all', run_dir=rd)}`"), msg
    assert str(rd / "hidden" / "chunk_00001.safetensors") in msg


def _set(data: dict, key: str, fn) -> None:
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[parts[-1]] = fn(node[parts[-1]])


# (manifest key, edit, what a problem line must name)
EDITS = [
    ("chunks.1.records", lambda v: v + 1, ("chunk chunk_00001", "records")),
    ("chunks.1.tokens", lambda v: v - 1, ("chunk chunk_00001", "tokens")),
    ("chunks.2.bytes", lambda v: v + 8, ("chunk chunk_00002", "bytes")),
    ("chunks.0.states_raw_bytes", lambda v: v * 2, ("chunk chunk_00000", "states_raw_bytes")),
    ("chunks.3.content_digest", lambda v: "0" * 64, ("chunk chunk_00003", "content_digest")),
    ("chunks.3.codec", lambda v: "none", ("chunk chunk_00003", "codec")),
    (
        "chunks.2.path",
        lambda v: "hidden/../hidden/chunk_00002.safetensors",
        ("chunk_00002", "path"),
    ),
    ("max_seq_len", lambda v: v * 2, ("max_seq_len",)),
    ("max_seq_len", lambda v: 100, ("chunk chunk_00000", "max_seq_len")),
    ("aux_layers", lambda v: v[:-1], ("chunk chunk_00000", "aux_layers")),
    ("fingerprint", lambda v: "0123456789ab", ("fingerprint",)),
    ("codec", lambda v: "fp8", ("codec",)),
    ("engine", lambda v: "sglang", ("engine",)),
    ("model", lambda v: "some/other/model", ("model",)),
    ("format_version", lambda v: "2", ("format_version",)),
    ("totals.tokens", lambda v: v + 1, ("totals.tokens",)),
    ("totals.records", lambda v: v - 1, ("totals.records",)),
    ("totals.chunks", lambda v: v + 1, ("totals.chunks",)),
    ("totals.bytes", lambda v: v + 1, ("totals.bytes",)),
    ("data.records", lambda v: v + 1, ("data.records",)),
    ("data.train_sha256", lambda v: "f" * 64, ("data.train_sha256",)),
]


def test_verify_reports_every_edited_manifest_field(demo_copy):
    """Each edit of a manifest field gives a one-line problem naming the field (and its
    chunk); the untouched manifest is ok."""
    from hsextract.manifest import verify_manifest

    path = demo_copy["run_dir"] / "manifest.json"
    original = json.loads(path.read_text())
    assert verify_manifest(path) == []
    missed = {}
    for key, edit, names in EDITS:
        data = copy.deepcopy(original)
        _set(data, key, edit)
        path.write_text(json.dumps(data))
        problems = verify_manifest(path)
        assert all("\n" not in p for p in problems), problems
        if not any(all(n in p for n in names) for p in problems):
            missed[key] = problems
    path.write_text(json.dumps(original))
    assert not missed, missed


def test_verify_cli_names_the_chunk_and_field_of_an_edit(demo_copy):
    rd = demo_copy["run_dir"]
    path = rd / "manifest.json"
    data = json.loads(path.read_text())
    data["chunks"][1]["records"] += 1
    data["max_seq_len"] = 4096
    path.write_text(json.dumps(data))
    res = hsextract("verify", str(path))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    lines = res.stdout.splitlines()
    records = [line for line in lines if line.startswith("chunk chunk_00001: records is 9 ")]
    # Against the file's own header, and against the index that assigned its records.
    assert [line.split(" but ")[1].split(";")[0] for line in records] == [
        f"8 in {rd / 'hidden' / 'chunk_00001.safetensors'}",
        f"8 in {rd / 'chunks' / 'index.json'}",
    ], res.stdout
    assert any(line.startswith("max_seq_len is 4096 in the manifest") for line in lines)
