"""split_chunks and load_chunk: exact partition, balance, and refusal of changed chunks."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from hsextract.records import (
    ChunkInputError,
    id_hash,
    load_chunk,
    merge_and_shuffle,
    records_digest,
    split_chunks,
)


def _merged(tmp: Path, lengths: list[int]) -> Path:
    src = tmp / "in.jsonl"
    src.write_bytes(
        b"".join(
            orjson.dumps({"id": f"r{k}", "input_ids": [k % 50] * n, "loss_mask": [1] * n,
                          "extra": {"k": k}}) + b"\n"
            for k, n in enumerate(lengths)
        )
    )  # fmt: skip
    merge_and_shuffle([src], tmp / "merged", max_seq_len=4096, overlength="truncate", seed=3,
                      vocab_size=100, max_reject_fraction=0.0)  # fmt: skip
    return tmp / "merged" / "train.jsonl"


def _outs(tmp: Path, n: int) -> list[Path]:
    return [tmp / "chunks" / f"chunk_{i:05d}.jsonl" for i in range(n)]


def test_partition_is_exact_stable_and_deterministic(tmp_path: Path) -> None:
    lengths = [(k * 7919) % 1000 + 1 for k in range(200)]
    merged = _merged(tmp_path, lengths)
    outs = _outs(tmp_path, 6)
    index = tmp_path / "chunks" / "index.json"
    chunks = split_chunks(merged, outs, index)
    first = [p.read_bytes() for p in outs]

    merged_lines = merged.read_bytes().splitlines(keepends=True)
    chunk_lines = [ln for p in outs for ln in p.read_bytes().splitlines(keepends=True)]
    assert sorted(chunk_lines) == sorted(merged_lines)  # every record once, bytes unchanged
    for i, p in enumerate(outs):  # record -> chunk by its id's hash; within, by (hash, id)
        ids = [orjson.loads(ln)["id"] for ln in p.read_bytes().splitlines()]
        assert all(id_hash(r) % 6 == i for r in ids)
        assert ids == sorted(ids, key=lambda r: (id_hash(r), r))
    tokens = [c["tokens"] for c in chunks]
    assert sum(tokens) == sum(lengths)
    assert min(c["records"] for c in chunks) > 0
    data = json.loads(index.read_text())
    assert data["chunks"] == chunks and data["n_chunks"] == 6 and data["format"] == 2
    assert [c["path"] for c in chunks] == [p.name for p in outs]
    for c, p in zip(chunks, outs, strict=True):  # the digest is of the records' values
        recs = load_chunk(p, index)
        assert c["content_digest"] == records_digest(recs)

    split_chunks(merged, outs, index)
    assert [p.read_bytes() for p in outs] == first


def test_removing_a_record_changes_only_its_chunk(tmp_path: Path) -> None:
    """What hash assignment buys: a data change re-extracts the chunks it touches."""
    lengths = [(k * 37) % 90 + 1 for k in range(120)]
    merged = _merged(tmp_path, lengths)
    index = tmp_path / "chunks" / "index.json"
    before = split_chunks(merged, _outs(tmp_path, 8), index)
    lines = merged.read_bytes().splitlines(keepends=True)
    victim = orjson.loads(lines[17])["id"]
    merged.write_bytes(b"".join(ln for k, ln in enumerate(lines) if k != 17))
    after = split_chunks(merged, _outs(tmp_path, 8), index)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True))
               if a["content_digest"] != b["content_digest"]]  # fmt: skip
    assert changed == [id_hash(victim) % 8]

    # A new merge seed reorders train.jsonl but changes no chunk at all.
    def split_with_seed(seed: int, where: str) -> tuple[bytes, list[str]]:
        merge_and_shuffle([tmp_path / "in.jsonl"], tmp_path / where, max_seq_len=4096,
                          overlength="truncate", seed=seed, vocab_size=100,
                          max_reject_fraction=0.0)  # fmt: skip
        train = tmp_path / where / "train.jsonl"
        got = split_chunks(train, _outs(tmp_path / where, 8), tmp_path / where / "index.json")
        return train.read_bytes(), [c["content_digest"] for c in got]

    train3, digests3 = split_with_seed(3, "s3")
    train99, digests99 = split_with_seed(99, "s99")
    assert train3 != train99 and digests3 == digests99


def test_fewer_records_than_chunks_gives_valid_empty_chunks(tmp_path: Path) -> None:
    merged = _merged(tmp_path, [5, 3])
    outs = _outs(tmp_path, 4)
    index = tmp_path / "chunks" / "index.json"
    chunks = split_chunks(merged, outs, index)
    assert all(p.exists() for p in outs)
    assert sorted(c["records"] for c in chunks) == [0, 0, 1, 1]
    empty = next(p for p, c in zip(outs, chunks, strict=True) if c["records"] == 0)
    assert load_chunk(empty, index) == []


def test_load_chunk_round_trip(tmp_path: Path) -> None:
    merged = _merged(tmp_path, [4, 9, 2, 7])
    outs = _outs(tmp_path, 2)
    index = tmp_path / "chunks" / "index.json"
    split_chunks(merged, outs, index)
    got = {r.id: r for p in outs for r in load_chunk(p, index, max_seq_len=9, vocab_size=100)}
    want = {o["id"]: o for o in map(orjson.loads, merged.read_bytes().splitlines())}
    assert set(got) == set(want)
    for rid, r in got.items():
        assert (r.input_ids, r.loss_mask) == (want[rid]["input_ids"], want[rid]["loss_mask"])
    assert sorted(r.line for r in load_chunk(outs[0], index)) == list(
        range(1, len(load_chunk(outs[0], index)) + 1)
    )
    with pytest.raises(ChunkInputError, match="max_seq_len 8"):
        load_chunk(outs[0] if any(len(r.input_ids) == 9 for r in load_chunk(outs[0], index))
                   else outs[1], index, max_seq_len=8)  # fmt: skip


@pytest.mark.parametrize("change", ["truncate", "edit", "append"])
def test_changed_chunk_is_refused_naming_the_file(tmp_path: Path, change: str) -> None:
    merged = _merged(tmp_path, [30, 40, 50])
    outs = _outs(tmp_path, 1)
    index = tmp_path / "chunks" / "index.json"
    split_chunks(merged, outs, index)
    data = outs[0].read_bytes()
    if change == "truncate":
        outs[0].write_bytes(data[: len(data) // 2])
    elif change == "edit":  # same length, still valid JSON: only the hash can tell
        i = data.index(b'"input_ids":[') + len(b'"input_ids":[')
        outs[0].write_bytes(data[:i] + (b"1" if data[i : i + 1] != b"1" else b"2") + data[i + 1 :])
    else:
        outs[0].write_bytes(data + data.splitlines(keepends=True)[0])
    with pytest.raises(ChunkInputError) as e:
        load_chunk(outs[0], index)
    assert str(outs[0]) in str(e.value) and "split_chunks" in str(e.value)


def test_chunk_without_index_is_still_validated(tmp_path: Path) -> None:
    p = tmp_path / "chunk_00000.jsonl"
    p.write_bytes(b'{"id": "a", "input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(ChunkInputError, match=r"chunk_00000.jsonl:1: length_mismatch"):
        load_chunk(p, None)
    p.write_bytes(b'{"input_ids": [1, 2], "loss_mask": [1, 0]}\n')
    with pytest.raises(ChunkInputError, match="missing_id"):
        load_chunk(p, None)


def test_split_refuses_an_edited_merged_file(tmp_path: Path) -> None:
    merged = _merged(tmp_path, [3, 4])
    merged.write_bytes(merged.read_bytes() + b'{"id": "z", "input_ids": [-1], "loss_mask": [0]}\n')
    with pytest.raises(ChunkInputError, match="line 3"):
        split_chunks(merged, _outs(tmp_path, 2), tmp_path / "chunks" / "index.json")


def test_missing_chunk_is_rebuilt_from_train_jsonl_byte_for_byte(tmp_path):
    from hsextract.records import load_chunk, merge_and_shuffle, split_chunks

    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            f'{{"id": "r{i}", "input_ids": {list(range(i + 1))}, "loss_mask": {[1] * (i + 1)}}}\n'
            for i in range(20)
        )
    )
    merge_and_shuffle([src], tmp_path / "m", max_seq_len=64, overlength="drop", seed=3,
                      vocab_size=None, max_reject_fraction=0.0)  # fmt: skip
    outs = [tmp_path / "c" / f"chunk_{i:05d}.jsonl" for i in range(3)]
    split_chunks(tmp_path / "m" / "train.jsonl", outs, tmp_path / "c" / "index.json")
    original = outs[1].read_bytes()
    outs[1].unlink()
    recs = load_chunk(outs[1], tmp_path / "c" / "index.json", merged=tmp_path / "m" / "train.jsonl")
    assert outs[1].read_bytes() == original and len(recs) == original.count(b"\n")
    # train.jsonl edited after the split: the rebuild refuses rather than invent a chunk.
    train = tmp_path / "m" / "train.jsonl"
    train.write_bytes(train.read_bytes().replace(b'"r', b'"x'))  # every line's id
    outs[2].unlink()
    with pytest.raises(ChunkInputError, match="changed after split_chunks"):
        load_chunk(outs[2], tmp_path / "c" / "index.json", merged=train)
