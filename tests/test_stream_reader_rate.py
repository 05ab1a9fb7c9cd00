"""What a loader worker sends is what the reader reads in the process (issue 60, item 3):
the worker path decodes into shared memory of each record's own size, and must give the
same records, in the same order, byte for byte, for every codec, with the same errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hsextract.chunkfile import ChunkFileError
from hsextract.chunks import ChunkReader, ChunkWriter
from hsextract.stream import journal
from hsextract.stream.loader import StreamLoader
from hsextract.stream.reader import StreamDataset, shared_compact, worker_record

H, K = 64, 3


def write_chunk(run_dir: Path, i: int, lens: list[int], codec: str, prenorm: bool) -> dict:
    """A chunk of bf16 normals (what lossless really compresses), records of ``lens``."""
    path = run_dir / "hidden" / f"chunk_{i:05d}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    k = K + prenorm
    meta = {"record_ids": json.dumps([f"r{i}-{j}" for j in range(len(lens))]),
            "aux_layers": json.dumps([1, 2, 3, 4][:k]), "hidden_size": str(H),
            "num_layers": "4"}  # fmt: skip
    w = ChunkWriter(path, lens, hidden_size=H, n_aux=k, dtype=torch.bfloat16, metadata=meta,
                    codec=codec)  # fmt: skip
    gen = torch.Generator().manual_seed(i)
    for j, t in enumerate(lens):
        w.put(j, torch.arange(t, dtype=torch.int32) + 1000 * i, torch.ones(t, dtype=torch.uint8),
              torch.randn(t, H, generator=gen).to(torch.bfloat16),
              torch.randn(t, k * H, generator=gen).to(torch.bfloat16))  # fmt: skip
    return {"chunk": path.stem, "path": f"hidden/{path.name}", "sha256": w.finish(),
            "records": len(lens), "tokens": sum(lens), "content_digest": f"d{i}"}  # fmt: skip


def make_run(run_dir: Path, codec: str, prenorm: bool = False) -> None:
    sizes = [[5, 300, 1, 77, 40], [2, 9, 513], [33]]
    shapes = {"hidden": H, "aux": K * H, "prenorm": prenorm, "dtype": "bfloat16"}
    for i, lens in enumerate(sizes):
        side = write_chunk(run_dir, i, lens, codec, prenorm)
        journal.announce(run_dir, n_chunks=len(sizes), shapes=shapes, **side)


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, v in a.items():
        if isinstance(v, torch.Tensor):
            assert (v.dtype, v.shape, v.stride()) == (b[key].dtype, b[key].shape, b[key].stride())
            assert v.contiguous().view(torch.uint8).numpy().tobytes() == (
                b[key].contiguous().view(torch.uint8).numpy().tobytes()
            ), key
        else:
            assert v == b[key], key


@pytest.mark.parametrize("codec", ["lossless", "none", "fp8"])
@pytest.mark.parametrize("prenorm", [False, True])
def test_a_workers_record_is_the_readers_byte_for_byte_in_shared_memory_of_its_size(
    tmp_path, codec, prenorm
):
    make_run(tmp_path, codec, prenorm)
    for p in sorted((tmp_path / "hidden").glob("*.safetensors")):
        r = ChunkReader(p, verify=False)
        for j in range(len(r)):
            mine = worker_record(r, j)
            same(mine, r[j])
            t = len(mine["input_ids"])
            if codec == "lossless":  # decoded in shared memory: torch sends it, no copy
                assert mine["hidden_states"].is_shared()
                assert mine["aux_hidden_states"].is_shared()
            for v in mine.values():
                if isinstance(v, torch.Tensor) and v.numel():
                    # its own rows only (aux and prenorm: the record's stored layers),
                    # never its chunk's other records
                    own = (v.nbytes, t * (K + prenorm) * H * v.element_size())
                    assert v.untyped_storage().nbytes() in own


@pytest.mark.parametrize("codec", ["lossless", "none"])
def test_loader_workers_yield_what_the_reader_yields_in_the_process(tmp_path, codec):
    make_run(tmp_path, codec)
    alone = list(StreamDataset(tmp_path, seed=3))
    for workers in (1, 2):
        got = list(StreamLoader(StreamDataset(tmp_path, seed=3), batch_size=None,
                                num_workers=workers))  # fmt: skip
        assert len(got) == len(alone) == 9
        for a, b in zip(alone, got, strict=True):
            same(a, b)


def test_a_corrupt_frame_table_raises_the_readers_error_in_a_worker(tmp_path):
    make_run(tmp_path, "lossless")
    r = ChunkReader(tmp_path / "hidden" / "chunk_00000.safetensors", verify=False)
    r.frames = r.frames.copy()
    r.frames[r.frame_start[1], 0] = 0  # record 1's first frame claims record 0
    with pytest.raises(ChunkFileError, match="frame table entry .* is corrupt"):
        r[1]
    with pytest.raises(ChunkFileError, match="frame table entry .* is corrupt"):
        worker_record(r, 1)
    with pytest.raises(IndexError):
        worker_record(r, len(r))


def test_a_changed_chunk_is_still_nacked_not_trained_on_with_workers(tmp_path):
    make_run(tmp_path, "lossless")
    p = tmp_path / "hidden" / "chunk_00001.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    got = []
    ds = StreamDataset(tmp_path, timeout_s=60)
    with pytest.raises(journal.StreamError, match=r"chunk_00001 \(seq 1\)(.|\n)*nacked"):
        for s in StreamLoader(ds, batch_size=None, num_workers=1):
            got.append(s["seq"])
    assert set(got) == {0}
    assert list(journal.read_state(tmp_path / "stream").nacked) == [1]


def test_views_of_one_mapping_are_sent_apart_unless_they_overlap():
    """Slices of one file-wide storage copy their own bytes each, never what lies between;
    overlapping ones (aux and the pre-norm state of one block) share one copy."""
    whole = torch.arange(10_000, dtype=torch.int32)
    block = torch.arange(100, dtype=torch.int16)[20:60].view(4, 10)
    sample = {"a": whole[10:20], "b": whole[9000:9100], "c": block[:, :7], "d": block[:, 7:],
              "id": "x", "e": torch.ones(3)}  # fmt: skip
    out = shared_compact(sample)
    same(out, sample)
    assert out["a"].untyped_storage().nbytes() == 40
    assert out["b"].untyped_storage().nbytes() == 400
    assert out["c"].untyped_storage().data_ptr() == out["d"].untyped_storage().data_ptr()
    assert out["c"].untyped_storage().nbytes() == 40 * 2  # the block's rows, spanned
    assert all(out[k].is_shared() for k in "abcd")
    assert out["e"] is sample["e"]  # its own storage: torch's one copy, as before
