"""The chunk file contract: streaming writer, zero-copy reader, structural checks."""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from hsextract import chunks
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


def records(dtype, lengths=(5, 1, 9), h=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        out.append(
            (
                torch.randint(0, 1000, (n,), generator=g),
                torch.randint(0, 2, (n,), generator=g),
                torch.randn(n, h, generator=g).to(dtype),
                torch.randn(n, 3 * h, generator=g).to(dtype),
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


BIG_H, BIG_LENGTHS = 256, [64] * 16  # 4 KiB of fp32 states a token: 4 MiB a chunk


SINK_SLICE = 3000  # bytes: slices that end mid-row and split records, as assemble's may


def write_big(path, codec="none", order=None, via="put"):
    """A chunk of a few MiB, records in ``order``.  The rows go in with ``put`` (tensors),
    or from a file as a dump's pieces hold them: ``via="row_sink"`` (uncompressed, what the
    client does) reads them a slice at a time, as ``assemble`` checks them, into
    ``row_sink(j)``, then ``put_files(..., rows_sunk=True)``; ``via="put_files"`` (a codec)
    hands ``put_files`` the byte ranges to read.  Returns the writer, its records written."""
    recs = records(torch.float32, BIG_LENGTHS, h=BIG_H)
    meta = dict(
        META,
        record_ids=json.dumps([str(j) for j in range(len(recs))]),
        hidden_size=str(BIG_H),
        dtype="float32",
    )
    w = ChunkWriter(path, BIG_LENGTHS, hidden_size=BIG_H, n_aux=3, dtype=torch.float32,
                    metadata=meta, codec=codec)  # fmt: skip
    src = path.with_name(path.name + ".rows")
    fd = os.open(src, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if via != "put" else -1
    try:
        for j in order or range(len(recs)):
            ids, mask, hid, aux = recs[j]
            if via == "put":
                w.put(j, ids, mask, hid, aux)
                continue
            ranges = []
            for t in (hid, aux):
                data = t.numpy().tobytes()
                at = os.fstat(fd).st_size
                os.pwrite(fd, data, at)
                ranges.append([(fd, at, len(data), str(src))])
            sink = w.row_sink(j) if via == "row_sink" else None
            if sink is not None:
                for tensor, [(_, at, nbytes, _)] in enumerate(ranges):
                    for pos in range(0, nbytes, SINK_SLICE):
                        sink(tensor, pos, os.pread(fd, min(SINK_SLICE, nbytes - pos), at + pos))
            w.put_files(j, ids, mask, *ranges, torch.float32, rows_sunk=sink is not None)
    except BaseException:
        w.abort()
        raise
    finally:
        if fd >= 0:
            os.close(fd)
            src.unlink()
    return w


def test_uncompressed_rows_come_only_through_the_row_sink(tmp_path):
    """Uncompressed, the rows have one way into a chunk file: ``row_sink``, as the client
    checks them (issue 40).  ``put_files`` handed only their byte ranges refuses in one
    sentence naming the record and the way; the record is not written, so the chunk cannot
    finish, and nothing is left behind."""
    ids, mask, hid, aux = records(torch.float32)[0]
    w = ChunkWriter(tmp_path / "c.safetensors", [5], hidden_size=8, n_aux=3,
                    dtype=torch.float32, metadata=META)  # fmt: skip
    src = tmp_path / "rows"
    src.write_bytes(hid.numpy().tobytes() + aux.numpy().tobytes())
    fd = os.open(src, os.O_RDONLY)
    try:
        hb = hid.numel() * 4
        with pytest.raises(ChunkFileError, match=r"record 0: .*row_sink\(0\).*rows_sunk=True"):
            w.put_files(0, ids, mask, [(fd, 0, hb, str(src))],
                        [(fd, hb, aux.numel() * 4, str(src))], torch.float32)  # fmt: skip
    finally:
        os.close(fd)
    with pytest.raises(ChunkFileError, match=r"records \[0\] never written"):
        w.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows"]


class CountingSync:
    """os.fdatasync, counting its calls: which fds, from which threads, how many at once."""

    def __init__(self):
        self.real, self.lock = os.fdatasync, threading.Lock()
        self.fds, self.threads, self.running, self.most = [], set(), 0, 0

    def __call__(self, fd):
        with self.lock:
            self.fds.append(fd)
            self.threads.add(threading.current_thread())
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            self.real(fd)
        finally:
            with self.lock:
                self.running -= 1


@pytest.mark.parametrize(
    "codec,via",
    [
        ("none", "put"),
        ("none", "row_sink"),
        ("lossless", "put"),
        ("lossless", "put_files"),
        ("fp8", "put"),
    ],
)
def test_background_syncs_while_streaming_leave_the_bytes_unchanged(
    tmp_path, monkeypatch, codec, via
):
    """Past SYNC_EVERY_BYTES the writer fdatasyncs in the background, one at a time, so the
    fsync at finish (the run's tail) has little left; the file is the same bytes as one
    written without, for every codec and write path, and no sync thread outlives it."""
    order = list(range(len(BIG_LENGTHS)))
    random.Random(2).shuffle(order)
    monkeypatch.setattr(chunks, "PENDING_BYTES", 0)  # lossless: out-of-order frames spill
    counting = CountingSync()
    monkeypatch.setattr(chunks.os, "fdatasync", counting)
    (tmp_path / "ref").mkdir()
    monkeypatch.setattr(chunks, "SYNC_EVERY_BYTES", 1 << 62)
    ref = write_big(tmp_path / "ref" / "c.safetensors", codec, order, via).finish()
    assert counting.fds == []

    threads = set(threading.enumerate())
    monkeypatch.setattr(chunks, "SYNC_EVERY_BYTES", 64 << 10)
    w = write_big(tmp_path / "c.safetensors", codec, order, via)
    fd = w.fd
    # Lossless: the blob's own thread writes (and so starts the syncs) while the puts
    # return; all of it is done by finish, whose fsync comes after.
    assert w.finish() == ref == sha256_file(tmp_path / "c.safetensors")
    assert len(counting.fds) >= 1 and set(counting.fds) == {fd}
    assert threading.main_thread() not in counting.threads  # in the background
    assert counting.most == 1
    assert not any(t.is_alive() for t in counting.threads)  # joined by finish
    assert set(threading.enumerate()) <= threads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "ref"]


def test_a_failed_background_sync_fails_the_chunk(tmp_path, monkeypatch):
    """Linux reports a writeback error once per open file: after a background fdatasync's
    EIO the final fsync may succeed, so finish raises the background error itself."""

    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(chunks, "SYNC_EVERY_BYTES", 64 << 10)
    monkeypatch.setattr(chunks.os, "fdatasync", eio)
    threads = set(threading.enumerate())
    w = write_big(tmp_path / "c.safetensors")
    with pytest.raises(OSError) as info:
        w.finish()
    assert info.value.errno == errno.EIO
    assert not list(tmp_path.iterdir())  # not renamed into place, no temp file left
    assert w.fd == -1 and set(threading.enumerate()) <= threads


def test_abort_waits_for_a_background_sync_before_closing_the_fd(tmp_path, monkeypatch):
    """Closed under a running sync, the fd's number could be reused by another open: the
    sync would flush the wrong file.  abort waits for it, then closes."""
    started, release, waiting, returned = (threading.Event() for _ in range(4))
    seen = []

    def blocked(fd):
        started.set()
        try:
            release.wait(30)
            try:
                seen.append(os.fstat(fd).st_ino)  # the chunk's file still, or not
            except OSError:
                seen.append(None)
        finally:
            returned.set()

    monkeypatch.setattr(chunks, "SYNC_EVERY_BYTES", 64 << 10)
    monkeypatch.setattr(chunks.os, "fdatasync", blocked)
    w = write_big(tmp_path / "c.safetensors")
    ino = os.fstat(w.fd).st_ino
    releaser = threading.Thread(target=lambda: waiting.wait(30) and release.set())
    try:
        assert started.wait(30)
        future = w._sync_future  # abort waits on it: say when it does
        wait_for_it = future.exception

        def signalled(timeout=None):
            waiting.set()
            return wait_for_it(timeout)

        future.exception = signalled
        releaser.start()
        w.abort()
        assert waiting.is_set()
    finally:
        waiting.set()
        release.set()
        if releaser.is_alive():
            releaser.join(30)
        if started.is_set():
            returned.wait(30)
        w.abort()
    assert seen == [ino]
    assert not list(tmp_path.iterdir())


def test_a_small_chunk_starts_no_sync_thread(tmp_path, monkeypatch):
    """The reference engine's CI writes thousands of tiny chunks: under SYNC_EVERY_BYTES
    the writer starts no thread and no background sync."""
    counting = CountingSync()
    monkeypatch.setattr(chunks.os, "fdatasync", counting)
    threads = set(threading.enumerate())
    path = tmp_path / "c.safetensors"
    w = ChunkWriter(path, [5, 1, 9], hidden_size=8, n_aux=3, dtype=torch.float32, metadata=META)
    for j, r in enumerate(records(torch.float32)):
        w.put(j, *r)
    assert set(threading.enumerate()) <= threads and w._sync_pool is None
    w.finish()
    assert counting.fds == [] and check_chunk(path, expect_records=3)["tokens"] == 15


def _flip_sites(path) -> dict[str, int]:
    """Byte positions of a written chunk, one per part of the file a reader trusts: the
    header's length, its metadata, its tensor table, and each stored tensor's bytes."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    head = data[: 8 + n]
    sites = {
        "header length": 0,
        "metadata (record_ids)": head.index(b'\\"a\\"') + 2,  # the id "a" -> "`"
        "metadata (hidden_size)": head.index(b'"hidden_size":"8"') + len('"hidden_size":"'),
        "tensor table (offsets)": head.index(b'"data_offsets":[') + len('"data_offsets":['),
        "last byte": len(data) - 1,
    }
    for name, t in header.items():
        a, b = t.get("data_offsets", (0, 0)) if name != "__metadata__" else (0, 0)
        if b > a:
            sites[f"tensor {name}"] = 8 + n + (a + b) // 2
    return sites


@pytest.mark.parametrize("codec", ["none", "lossless", "fp8"])
def test_reader_refuses_a_flipped_byte_anywhere(tmp_path, codec):
    """Issue 38 item 8: ChunkReader checks the sha256 its sidecar recorded (or the one it
    is given) when it opens, so no flipped byte -- header, frame table, states -- yields
    records; the error names the file and how to redo it, and the file is left alone."""
    from hsextract.chunkfile import ChunkDigestError

    path = tmp_path / "chunk_00000.safetensors"
    meta = dict(META, dtype="bfloat16")
    w = ChunkWriter(
        path, [5, 1, 9], hidden_size=8, n_aux=3, dtype=torch.bfloat16, metadata=meta, codec=codec
    )
    for j, r in enumerate(records(torch.bfloat16)):
        w.put(j, *r)
    digest = w.finish()
    path.with_suffix(".json").write_text(json.dumps({"path": path.name, "sha256": digest}))
    good = [r["hidden_states"] for r in ChunkReader(path)]  # intact: checked and read
    sites = _flip_sites(path)
    if codec == "lossless":
        assert "tensor frames" in sites and "tensor blob" in sites
    assert len(sites) >= 9, sites
    data = path.read_bytes()
    missed = {}
    for i, (where, at) in enumerate(sites.items()):
        # A file of its own per flip (the hash is cached per file while it is unchanged).
        bad = tmp_path / f"chunk_{i + 1:05d}.safetensors"
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        bad.write_bytes(bytes(flipped))
        bad.with_suffix(".json").write_text(json.dumps({"path": bad.name, "sha256": digest}))
        try:
            got = [r["hidden_states"] for r in ChunkReader(bad)]
            missed[where] = "read" if all(map(torch.equal, got, good)) else "altered tensors"
        except ChunkDigestError as exc:
            msg = str(exc)
            assert msg.startswith(f"{bad} has sha256 ") and f"not the {digest[:12]}" in msg
            assert f"rerun `snakemake -j1 {bad}`" in msg and "\n" not in msg
        except Exception as exc:  # noqa: BLE001 - any other error is a miss too
            missed[where] = f"{type(exc).__name__}: {exc}"
        assert bad.read_bytes() == bytes(flipped)  # never repaired or deleted
    assert not missed, missed
    assert ChunkReader(path).sha256 == digest

    # No sidecar: the digest given is checked; without either, nothing is (documented).
    bare = tmp_path / "copy.safetensors"
    flipped = bytearray(data)
    flipped[sites["tensor input_ids"]] ^= 0x01
    bare.write_bytes(bytes(flipped))
    with pytest.raises(ChunkDigestError, match="has sha256"):
        ChunkReader(bare, expected_sha256=digest)
    assert ChunkReader(bare).sha256 is None
    assert ChunkReader(bad, verify=False).sha256 is None  # the exports hash as they read


def test_a_stalled_blob_write_holds_no_other_records_put(tmp_path, monkeypatch):
    """Lossless: the blob is written in record order by a thread of the writer's own, so
    a write that stalls (writeback throttling, a spill copied back) holds up no other
    record's put -- each request keeps its place in the server's window only until its
    frames are handed over (issue 40).  The file is the same bytes as one never stalled."""
    lengths, recs = [5, 1, 9, 3], records(torch.bfloat16, lengths=(5, 1, 9, 3))
    meta = dict(META, record_ids=json.dumps(["a", "b", "c", "d"]))

    def writer(path):
        return ChunkWriter(path, lengths, hidden_size=8, n_aux=3, dtype=torch.bfloat16,
                           metadata=meta, codec="lossless")  # fmt: skip

    ref = writer(tmp_path / "ref.safetensors")
    for j in range(len(lengths)):
        ref.put(j, *recs[j])
    ref_sha = ref.finish()

    gate, stalled = threading.Event(), threading.Event()
    real = chunks._OrderedBlob._write

    def stalling(self, *args):
        stalled.set()
        assert gate.wait(60), "the test never opened the gate"
        real(self, *args)

    monkeypatch.setattr(chunks._OrderedBlob, "_write", stalling)
    w = writer(tmp_path / "c.safetensors")
    putting_done = threading.Event()

    def put_all():
        for j in range(len(lengths)):
            w.put(j, *recs[j])
        putting_done.set()

    t = threading.Thread(target=put_all, daemon=True)
    try:
        t.start()
        assert stalled.wait(60), "the blob was never written"
        # Record 0's write is stalled; every put, record 0's own included, returns.
        assert putting_done.wait(60), "a put waited for the blob's stalled write"
    finally:
        gate.set()
        t.join(60)
    assert w.finish() == ref_sha == sha256_file(tmp_path / "c.safetensors")


def test_a_failed_blob_write_fails_the_chunk_and_leaves_nothing(tmp_path, monkeypatch):
    """The blob's writer fails (a full disk) after the puts returned: finish raises the
    disk's error; a put after the failure raises it at once (the chunk job stops sending);
    nothing is left behind, no thread outlives the writer."""
    lengths, recs = [5, 1, 9, 3], records(torch.float32, lengths=(5, 1, 9, 3))
    meta = dict(META, record_ids=json.dumps(["a", "b", "c", "d"]))
    gate = threading.Event()

    def full(self, *args):
        assert gate.wait(60), "the test never opened the gate"
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(chunks._OrderedBlob, "_write", full)
    threads = set(threading.enumerate())
    for n_put in (4, 3):
        d = tmp_path / f"put{n_put}"
        w = ChunkWriter(d / "c.safetensors", lengths, hidden_size=8, n_aux=3,
                        dtype=torch.float32, metadata=meta, codec="lossless")  # fmt: skip
        gate.clear()
        try:
            for j in range(n_put):
                w.put(j, *recs[j])  # each returns: the write of record 0 waits at the gate
        finally:
            gate.set()
        if n_put == 3:
            deadline = time.monotonic() + 60
            while w.blob.error is None:  # the event: the writer thread has failed
                assert time.monotonic() < deadline, "the blob's writer never failed"
                time.sleep(0.01)
            with pytest.raises(OSError) as early:
                w.put(3, *recs[3])
            assert early.value.errno == errno.ENOSPC
            w.abort()  # what the client does once a record fails
        else:
            with pytest.raises(OSError) as got:
                w.finish()
            assert got.value.errno == errno.ENOSPC
        assert not list(d.iterdir())  # the temporary (and any spill) file removed
    assert set(threading.enumerate()) <= threads  # the blob's threads ended
