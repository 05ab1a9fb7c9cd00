"""The chunk file contract: streaming writer, zero-copy reader, structural checks."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from hsextract.chunks import ChunkFileError, ChunkReader, ChunkWriter, check_chunk, sha256_file

META = {
    "record_ids": json.dumps(["a", "b", "c"]),
    "aux_layers": json.dumps([2, 4, 5]),
    "hidden_size": "8",
    "model": "m",
    "fingerprint": "fp",
    "engine": "reference",
    "format_version": "1",
}


def records(dtype, lengths=(5, 1, 9)):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        out.append(
            (
                torch.randint(0, 1000, (n,), generator=g),
                torch.randint(0, 2, (n,), generator=g),
                torch.randn(n, 8, generator=g).to(dtype),
                torch.randn(n, 24, generator=g).to(dtype),
            )
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_of_order_writes_equal_a_plain_safetensors_load(tmp_path, dtype):
    recs = records(dtype)
    path = tmp_path / "chunk_00000.safetensors"
    w = ChunkWriter(path, [5, 1, 9], hidden_size=8, n_aux=3, dtype=dtype, metadata=META)
    order = [2, 0, 1]
    random.Random(1).shuffle(order)
    for j in order:
        w.put(j, *recs[j])
    digest = w.finish()
    assert digest == sha256_file(path)
    flat = load_file(str(path))  # the reference safetensors loader accepts the file
    assert flat["offsets"].tolist() == [0, 5, 6, 15]
    assert flat["input_ids"].dtype == torch.int32 and flat["loss_mask"].dtype == torch.uint8
    assert torch.equal(flat["hidden_states"], torch.cat([r[2] for r in recs]))
    assert torch.equal(flat["aux_hidden_states"], torch.cat([r[3] for r in recs]))
    reader = ChunkReader(path)
    assert len(reader) == 3 and reader.record_ids == ["a", "b", "c"]
    for j, item in enumerate(reader):
        assert torch.equal(item["hidden_states"], recs[j][2])
        assert item["input_ids"].tolist() == recs[j][0].tolist()
    assert check_chunk(path, expect_records=3)["tokens"] == 15


def test_missing_record_never_yields_a_finished_file(tmp_path):
    path = tmp_path / "chunk.safetensors"
    w = ChunkWriter(path, [5, 1, 9], hidden_size=8, n_aux=3, dtype=torch.float32, metadata=META)
    recs = records(torch.float32)
    w.put(0, *recs[0])
    with pytest.raises(ChunkFileError, match=r"records \[1, 2\] never written"):
        w.finish()
    assert not path.exists() and not list(tmp_path.iterdir())


def test_wrong_shapes_and_dtype_refused(tmp_path):
    w = ChunkWriter(tmp_path / "c.safetensors", [5], hidden_size=8, n_aux=3,
                    dtype=torch.float32, metadata=META)  # fmt: skip
    ids, mask, hid, aux = records(torch.float32, (5,))[0]
    with pytest.raises(ChunkFileError, match="shapes"):
        w.put(0, ids, mask, hid[:4], aux)
    with pytest.raises(ChunkFileError, match="dtype"):
        w.put(0, ids, mask, hid.double(), aux)
    w.abort()
    assert not list(tmp_path.iterdir())


def test_empty_chunk_is_a_valid_file(tmp_path):
    path = tmp_path / "empty.safetensors"
    meta = dict(META, record_ids="[]")
    ChunkWriter(path, [], hidden_size=8, n_aux=3, dtype=torch.float32, metadata=meta).finish()
    assert check_chunk(path, expect_records=0)["tokens"] == 0
    assert len(ChunkReader(path)) == 0


def test_check_chunk_rejects_a_truncated_file(tmp_path):
    path = tmp_path / "c.safetensors"
    w = ChunkWriter(path, [5, 1, 9], hidden_size=8, n_aux=3, dtype=torch.float32, metadata=META)
    for j, r in enumerate(records(torch.float32)):
        w.put(j, *r)
    w.finish()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ChunkFileError):
        check_chunk(path)


@pytest.mark.parametrize("codec", ["none", "lossless", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_free_layout_reads_what_the_reader_reads(tmp_path, codec, dtype):
    """check_chunk reads the header and index tensors with numpy (chunkfile.ChunkLayout):
    its figures equal ChunkReader's for every codec and dtype."""
    from hsextract.chunkfile import ChunkLayout

    path = tmp_path / "c.safetensors"
    meta = dict(META, dtype=str(dtype).removeprefix("torch."))
    w = ChunkWriter(
        path, [5, 1, 9], hidden_size=8, n_aux=3, dtype=dtype, metadata=meta, codec=codec
    )
    for j, r in enumerate(records(dtype)):
        w.put(j, *r)
    w.finish()
    layout, reader = ChunkLayout(path), ChunkReader(path)
    assert layout.shapes() == reader.shapes()
    assert layout.offsets.tolist() == reader.offsets.tolist()
    assert (layout.raw_bytes(), layout.stored_bytes()) == (
        reader.raw_bytes(),
        reader.stored_bytes(),
    )
    assert layout.metadata == reader.metadata and layout.record_ids == reader.record_ids
    info = check_chunk(path, expect_records=3)
    assert info["tokens"] == 15 and info["codec"] == codec and info["aux_layers"] == [2, 4, 5]
    if codec == "lossless":
        assert (layout.frames == reader.frames).all()
        assert layout.blob_bytes == len(reader._blob)


def test_the_manifest_imports_no_torch():
    """The manifest job runs after the last chunk of every run, so its start is in the run's
    fixed tail; importing torch was most of it (~2.5 s here, the job took ~4 s on the H200)."""
    import subprocess
    import sys

    code = "import sys, hsextract.manifest, hsextract.steps; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
