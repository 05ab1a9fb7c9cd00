"""Lines that are not JSON text are rejected saying what they are and what to do.

Before, a line of NUL bytes came back as ``invalid_json: 'utf-16-be' codec can't decode
byte ...``: stdlib json, given bytes, guesses UTF-16/32 from the NULs.  Each case here is
a file a user really has: a binary file matched by a glob, a UTF-16 export with a BOM, a
Latin-1 file, a raw control character inside a string, a gzip shard.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest
from fixtures_demo import make_workdir, run_dir_of, run_snakemake

from hsextract.records import FAILED_REJECTS, RejectFractionError, merge_and_shuffle

GOOD = b'{"id": "g%d", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}'


def _merge(paths: list[Path], out: Path, **kw) -> dict:
    args = dict(max_seq_len=64, overlength="truncate", seed=0, vocab_size=512,
                max_reject_fraction=1.0)  # fmt: skip
    args.update(kw)
    return merge_and_shuffle(paths, out, **args)


def _rejects(out: Path) -> list[dict]:
    return [orjson.loads(x) for x in (out / "rejects.jsonl").read_bytes().splitlines()]


# (a nasty line, the reason, words its detail must hold)
CASES = [
    (b"\x00\x00\x00\x00", "control_byte",
     ["control byte 0x00 (NUL) at column 1", "is this a binary file?"]),
    (GOOD % 1 + b"\x00", "control_byte", ["control byte 0x00 (NUL) at column 61"]),
    (b'{"id": "a\x01b", "input_ids": [1], "loss_mask": [1]}', "control_byte",
     ["raw control byte 0x01 at column 10 inside a JSON string", "escape it as \\u0001"]),
    (b'{"id": "a\tb", "input_ids": [1], "loss_mask": [1]}', "control_byte",
     ["raw control byte 0x09 (tab) at column 10 inside a JSON string", "(as \\t)"]),
    (b'{"id": "caf\xe9", "input_ids": [1], "loss_mask": [1]}', "invalid_utf8",
     ["not UTF-8 text at column 12 (byte e9)", "Latin-1", "iconv"]),
    (b"\xef\xbb\xbf" + GOOD % 2, "utf8_bom", ["UTF-8 byte-order mark"]),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\xa0\x10", "binary_data",
     ["binary data, not UTF-8 text", "column 13", "is this a binary file?"]),
]  # fmt: skip


@pytest.mark.parametrize(("line", "reason", "words"), CASES)
def test_a_nasty_line_is_named_plainly(tmp_path, line, reason, words):
    shard = tmp_path / "shard.jsonl"
    shard.write_bytes(GOOD % 0 + b"\n" + line + b"\n" + GOOD % 9 + b"\n")
    stats = _merge([shard], tmp_path / "o")
    (rej,) = _rejects(tmp_path / "o")
    assert (rej["file"], rej["line"], rej["reason"]) == (str(shard), 2, reason), rej
    for w in words:
        assert w in rej["detail"], (w, rej["detail"])
    assert "codec can't decode" not in rej["detail"]
    assert stats["records_out"] == 2


def test_a_utf16_file_with_a_bom_is_named_on_every_line(tmp_path):
    shard = tmp_path / "export.jsonl"
    text = "".join(json.dumps({"id": f"u{i}", "input_ids": [1], "loss_mask": [1]}) + "\n"
                   for i in range(3))  # fmt: skip
    shard.write_bytes(text.encode("utf-16"))  # BOM, little-endian
    with pytest.raises(RejectFractionError) as exc:
        _merge([shard], tmp_path / "o", max_reject_fraction=0.5)
    rejects = _rejects(tmp_path / "o")
    first = rejects[0]
    assert (
        first["line"] == 1
        and "UTF-16LE text (byte-order mark ff fe at column 1)" in (first["detail"])
    )
    # The later lines start with the newline's NUL byte: still recognised as UTF-16.
    assert all("UTF-16" in r["detail"] for r in rejects[1:3]), rejects
    msg = str(exc.value)
    assert f"first: {shard}:1: invalid_utf8: not UTF-8: UTF-16LE text" in msg
    assert "iconv -f UTF-16 -t UTF-8" in msg and FAILED_REJECTS in msg


def test_a_gzip_shard_is_named(tmp_path):
    shard = tmp_path / "shard.jsonl"  # gzipped, under a plain name
    shard.write_bytes(gzip.compress(b"".join(GOOD % i + b"\n" for i in range(50))))
    with pytest.raises(RejectFractionError) as exc:
        _merge([shard], tmp_path / "o", max_reject_fraction=0.0)
    assert "gzip-compressed data, not JSON text" in str(exc.value)
    assert "decompress the file first (gunzip)" in str(exc.value)


def test_the_user_sees_file_line_and_cause_through_the_workflow(tmp_path):
    """Through snakemake: rejects within the bound reach the terminal; above it, the
    failure names the first bad line."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    shard = tmp_path / "data" / "shard.jsonl"
    shard.parent.mkdir()
    lines = [GOOD % i for i in range(30)]
    lines[4] = b"\x00" * 16
    shard.write_bytes(b"\n".join(lines) + b"\n")
    conf = {"demo.enabled": False, "inputs": [str(shard)], "model.path": str(model)}
    wd = make_workdir(tmp_path / "w", **conf, **{"merge.max_reject_fraction": 0.05})
    target = str((run_dir_of(wd) / "merged" / "stats.json").relative_to(wd))
    proc = run_snakemake(wd, "-j1", target)
    want = f"{shard}:5: control_byte: control byte 0x00 (NUL) at column 1"
    assert "1 of 30 records rejected, within merge.max_reject_fraction" in proc.stderr
    assert want in proc.stderr and "is this a binary file?" in proc.stderr

    wd = make_workdir(tmp_path / "w0", **conf, **{"merge.max_reject_fraction": 0.0})
    target = str((run_dir_of(wd) / "merged" / "stats.json").relative_to(wd))
    proc = run_snakemake(wd, "-j1", target, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "1 of 30 records rejected (3.33%) > merge.max_reject_fraction=0.0" in out
    assert f"first: {want}" in out
