"""The chunk codecs: lossless is bit-exact for any bytes, fp8 within e4m3's error, both
read back by the same reader through the same client path as uncompressed chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_demo import (
    make_workdir,
    run_dir_of,
    run_snakemake,
    start_snakemake,
    stop_snakemake,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsextract import chunks, storage
from hsextract.chunks import ChunkFileError, ChunkReader, ChunkWriter, check_chunk, sha256_file
from hsextract.config import fingerprint, load_config, typed

META = {
    "aux_layers": "[1, 2]",
    "model": "m",
    "fingerprint": "f",
    "engine": "reference",
}
TORCH_OF = {2: torch.bfloat16, 4: torch.float32}


def special_bits(esize: int) -> list[int]:
    """-0.0, +-inf, NaNs with payloads and both signs, smallest/largest subnormals."""
    bits = 8 * esize
    exp = {2: 8, 4: 8, 8: 11}[esize]  # bf16 has float32's exponent
    man = bits - 1 - exp
    sign = 1 << (bits - 1)
    inf = ((1 << exp) - 1) << man
    return [
        sign,  # -0.0
        inf,
        inf | sign,
        inf | 1,  # NaN, smallest payload
        inf | (1 << (man - 1)) | 5,  # quiet NaN with payload
        inf | sign | ((1 << man) - 1),
        1,  # smallest subnormal
        (1 << man) - 1,  # largest subnormal
        sign | 1,
    ]


@st.composite
def planes_input(draw):
    esize = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 600))
    kind = draw(st.sampled_from(["bits", "floats", "specials", "constant"]))
    udt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[esize]
    if kind == "bits":
        arr = draw(hnp.arrays(udt, n))
    elif kind == "floats" and esize in (2, 4, 8):
        fdt = {2: np.float16, 4: np.float32, 8: np.float64}[esize]
        floats = st.floats(
            allow_nan=True, allow_infinity=True, allow_subnormal=True, width=8 * esize
        )
        arr = draw(hnp.arrays(fdt, n, elements=floats)).view(udt)
    elif kind == "specials":
        pool = special_bits(esize) if esize > 1 else [0, 255, 128]
        arr = np.array(draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)), dtype=udt)
    else:
        arr = np.full(n, draw(st.integers(0, 255)), dtype=udt)
    return esize, arr


@settings(max_examples=300, deadline=None)
@given(planes_input())
def test_frame_round_trip_is_bit_exact(case):
    esize, arr = case
    raw = arr.tobytes()
    parts, lengths = storage.compress_frame(memoryview(raw), esize)
    assert len(lengths) == esize
    blob = b"junk" + b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert len(blob) - 4 == sum(abs(x) for x in lengths)
    out = np.empty(len(raw), dtype=np.uint8)
    storage.decompress_frame(memoryview(blob), 4, lengths, len(raw), out)
    assert out.tobytes() == raw


def _round_trip(raw: bytes, esize: int) -> tuple[bytes, list[int]]:
    parts, lengths = storage.compress_frame(memoryview(raw), esize)
    blob = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    out = np.empty(len(raw), dtype=np.uint8)
    storage.decompress_frame(memoryview(blob), 0, lengths, len(raw), out)
    return out.tobytes(), lengths


@settings(max_examples=60, deadline=None)
@given(esize=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_planes_split_by_shifts_are_the_transposed_bytes(esize, data):
    """The planes a frame is split into (by shifts of whole elements, issue 40) are byte
    ``p`` of every element in memory order, as the transposed copy they replace made:
    so files written before and after are the same bytes.  They never share the input's
    memory: a plane stored raw waits with its record's frames while the thread reads the
    next frame into the same buffer (``chunks._Rows.read``)."""
    n = data.draw(st.integers(0, 300))
    raw = data.draw(st.binary(min_size=n * esize, max_size=n * esize))
    u = np.frombuffer(raw, dtype=np.uint8)
    got = storage.split_planes(u, esize)
    assert got.shape == (esize, n) and got.dtype == np.uint8
    assert np.array_equal(got, u.reshape(-1, esize).T)
    assert not np.shares_memory(got, u)


def test_noise_plane_is_stored_and_exponent_plane_compressed():
    """bf16 of normal data: the low byte (mantissa) is stored raw, the high byte packed."""
    x = torch.randn(4096, 256).to(torch.bfloat16)  # planes of 1 MiB: the probe decides
    raw = x.view(torch.int16).numpy().tobytes()
    back, lengths = _round_trip(raw, 2)
    assert back == raw
    assert lengths[0] == -x.numel(), "the mantissa plane should be stored, zstd cannot shrink noise"
    assert 0 < lengths[1] < 0.6 * x.numel(), lengths


def test_a_plane_misjudged_by_the_probe_is_still_exact():
    """Noise in the first 64 KiB, zeros after: stored raw (size lost, bytes kept); a plane
    that is compressible from its start is compressed."""
    n = 4 * storage.PROBE_BYTES
    rng = np.random.default_rng(0)
    lo = np.zeros(n, dtype=np.uint8)
    lo[: storage.PROBE_BYTES] = rng.integers(0, 256, storage.PROBE_BYTES)
    hi = np.full(n, 0x3F, dtype=np.uint8)
    raw = np.stack([lo, hi], axis=1).tobytes()
    back, lengths = _round_trip(raw, 2)
    assert back == raw
    assert lengths[0] == -n and 0 < lengths[1] < n // 100


def write_chunk(path, lengths, h, k, dtype, codec, seed=0, via_files=False, tmp=None, order=None):
    """Random records (from ``seed``) written in a scrambled order (or ``order``)."""
    g = torch.Generator().manual_seed(seed)
    recs = {}
    meta = dict(META, record_ids=json.dumps([f"r{j}" for j in range(len(lengths))]))
    meta.update(aux_layers=json.dumps(list(range(1, k + 1))), hidden_size=str(h))
    meta["dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    w = ChunkWriter(path, lengths, hidden_size=h, n_aux=k, dtype=dtype, metadata=meta, codec=codec)
    scrambled = torch.randperm(len(lengths), generator=g).tolist()
    order = scrambled if order is None else order
    data = {}
    for j in range(len(lengths)):  # drawn in record order: the same records in any order
        n = lengths[j]
        data[j] = (
            torch.randint(0, 1000, (n,), generator=g),
            torch.randint(0, 2, (n,), generator=g).to(torch.uint8),
            (torch.randn(n, h, generator=g) * 4).to(dtype),
            (torch.randn(n, k * h, generator=g) * 40).to(dtype),
        )
    fds = []
    try:
        for j in order:
            n = lengths[j]
            ids, mask, hid, aux = recs[j] = data[j]
            if not via_files:
                w.put(j, ids, mask, hid, aux)
                continue
            ranges = {}
            for name, t in (("h", hid), ("a", aux)):
                # Rows split over several "pieces" at uneven boundaries, as dumps are.
                raw = t.contiguous().view(torch.uint8).numpy().tobytes()
                rb = len(raw) // n
                cuts = sorted({0, n, *torch.randint(0, n + 1, (3,), generator=g).tolist()})
                ranges[name] = []
                for a, b in zip(cuts, cuts[1:], strict=False):
                    if a == b:
                        continue
                    f = tmp / f"piece-{j}-{name}-{a}"
                    f.write_bytes(b"HDR!" + raw[a * rb : b * rb])
                    fd = os.open(f, os.O_RDONLY)
                    fds.append(fd)
                    ranges[name].append((fd, 4, (b - a) * rb, str(f)))
            w.put_files(j, ids, mask, ranges["h"], ranges["a"], dtype)
        sha = w.finish()
    finally:
        for fd in fds:
            os.close(fd)
    return recs, sha


@st.composite
def chunk_case(draw):
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    h = draw(st.sampled_from([1, 3, 8, 64]))
    k = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    frame = draw(st.sampled_from([1, 100, 4 << 20]))  # bytes: one row per frame .. whole
    return lengths, h, k, dtype, frame, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chunk_case())
def test_lossless_chunk_round_trip_any_order_any_framing(tmp_path, monkeypatch, case):
    lengths, h, k, dtype, frame, via_files, seed = case
    monkeypatch.setattr(storage, "FRAME_BYTES", frame)
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    path = d / "chunk.safetensors"
    recs, sha = write_chunk(path, lengths, h, k, dtype, "lossless", seed, via_files, d)
    assert sha == sha256_file(path)
    info = check_chunk(path, expect_records=len(lengths))
    assert info["codec"] == "lossless" and info["tokens"] == sum(lengths)
    r = ChunkReader(path)
    assert r.metadata["format_version"] == "2"
    # The same records in record order, every frame off the head spilled to disk: the
    # same bytes (a rerun reproduces a chunk's sha256 however its requests were scheduled).
    monkeypatch.setattr(chunks, "PENDING_BYTES", 1)
    again = d / "again.safetensors"
    _, sha2 = write_chunk(again, lengths, h, k, dtype, "lossless", seed, via_files, d,
                          order=list(range(len(lengths)))[::-1])  # fmt: skip
    assert sha2 == sha
    assert not list(d.glob(".*.tmp")), "a temporary or spill file was left"
    for j, (ids, mask, hid, aux) in recs.items():
        got = r[j]
        assert torch.equal(got["input_ids"], ids.to(torch.int32))
        assert torch.equal(got["loss_mask"], mask)
        assert got["hidden_states"].dtype == dtype and got["hidden_states"].shape == hid.shape
        assert got["aux_hidden_states"].shape == aux.shape
        assert torch.equal(got["hidden_states"].view(torch.uint8), hid.view(torch.uint8))
        assert torch.equal(got["aux_hidden_states"].view(torch.uint8), aux.view(torch.uint8))


def test_lossless_keeps_special_values_bit_exact(tmp_path):
    bits = special_bits(2)
    hid = torch.tensor(bits * 8, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    n = hid.numel() // 8
    hid, aux = hid.view(n, 8), hid.repeat(2).view(n, 16)
    meta = dict(META, record_ids='["x"]', hidden_size="8", dtype="bfloat16")
    path = tmp_path / "s.safetensors"
    w = ChunkWriter(path, [n], hidden_size=8, n_aux=2, dtype=torch.bfloat16, metadata=meta,
                    codec="lossless")  # fmt: skip
    w.put(0, torch.arange(n), torch.ones(n, dtype=torch.uint8), hid, aux)
    w.finish()
    got = ChunkReader(path)[0]
    assert torch.equal(got["hidden_states"].view(torch.int16), hid.view(torch.int16))
    assert torch.equal(got["aux_hidden_states"].view(torch.int16), aux.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_error_bounded_and_reported(tmp_path, dtype):
    lengths, h, k = [7, 130, 1], 64, 2
    path = tmp_path / "f.safetensors"
    recs, _ = write_chunk(path, lengths, h, k, dtype, "fp8", via_files=True, tmp=tmp_path)
    info = check_chunk(path, expect_records=3)
    # 1 byte per element + one float32 scale per token per layer.
    assert info["stored_bytes"] == sum(lengths) * (k + 1) * (h + 4)
    r = ChunkReader(path)
    report = json.loads(r.metadata["fp8_error"])
    assert list(report) == ["aux_1", "aux_2", "final"]
    sq_err = np.zeros(k + 1)
    sq_ref = np.zeros(k + 1)
    max_abs = np.zeros(k + 1)
    for j, (_, _, hid, aux) in recs.items():
        got = r[j]
        assert got["hidden_states"].dtype == dtype
        for slot, (ref, out) in enumerate(
            [(aux[:, i * h : (i + 1) * h], got["aux_hidden_states"][:, i * h : (i + 1) * h])
             for i in range(k)] + [(hid, got["hidden_states"])]
        ):  # fmt: skip
            ref, out = ref.float(), out.float()
            amax = ref.abs().amax(dim=1, keepdim=True)
            # e4m3: 3 mantissa bits (half an ulp = 1/16 relative), subnormals below 2^-6.
            bound = ref.abs() / 16 + amax / 448 * 2.0**-9 + ref.abs() / 128
            assert ((out - ref).abs() <= bound).all(), slot
            # the row's largest element maps to 448 exactly
            assert torch.allclose(out.abs().amax(dim=1), amax.squeeze(1), rtol=1e-2)
            sq_err[slot] += float((out - ref).double().square().sum())
            sq_ref[slot] += float(ref.double().square().sum())
            max_abs[slot] = max(max_abs[slot], float((out - ref).abs().max()))
    for slot, name in enumerate(report):
        rel = np.sqrt(sq_err[slot] / sq_ref[slot])
        # measured by the writer against the captured values, recomputed here from the file
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-6  # bf16 readback rounds once more
        assert report[name]["rel_rms"] == pytest.approx(rel, rel=tol, abs=1e-4)
        assert 0.005 < report[name]["rel_rms"] < 0.05
        assert report[name]["max_abs"] == pytest.approx(max_abs[slot], rel=0.1)


def test_corrupt_frame_table_and_truncated_blob_are_named(tmp_path):
    path = tmp_path / "c.safetensors"
    write_chunk(path, [50, 60], 16, 2, torch.bfloat16, "lossless")
    reader = ChunkReader(path)
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:header_end])
    a, _ = header["frames"]["data_offsets"]
    data = bytearray(path.read_bytes())
    # Frame 0's row0 -> 5: the frame table no longer tiles record 0's rows.
    data[header_end + a + 16 : header_end + a + 24] = (5).to_bytes(8, "little")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(ChunkFileError, match="record 0"):
        check_chunk(bad)
    # A flipped byte inside a compressed plane: zstd's frame checksum refuses it.
    b0, _ = header["blob"]["data_offsets"]
    row = reader.frames[0]
    ncol = len(storage.FRAME_COLUMNS)
    at = int(row[4]) + sum(abs(int(x)) for x in row[ncol : ncol + 1]) + 20  # inside plane 1
    assert int(row[ncol + 1]) > 0, "plane 1 (exponents) is compressed"
    data = bytearray(path.read_bytes())
    data[header_end + b0 + at] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ChunkFileError, match="record 0 does not decode"):
        ChunkReader(bad)[0]


def test_codec_is_in_the_fingerprint_and_none_keeps_old_run_dirs(tmp_path):
    cfg = load_config(Path(__file__).parents[1] / "config.yaml")
    fps = {}
    for codec in ("none", "lossless", "fp8"):
        cfg["storage"] = {"codec": codec}
        fps[codec] = fingerprint(typed(cfg))
    assert len(set(fps.values())) == 3
    del cfg["storage"]  # a config from before codecs existed: the v1 run dir
    assert fingerprint(typed(cfg)) == fps["none"]


def test_unknown_codec_in_a_file_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    meta = dict(META, record_ids='["a"]', hidden_size="4")
    w = ChunkWriter(path, [2], hidden_size=4, n_aux=2, dtype=torch.float32, metadata=meta)
    w.put(0, torch.arange(2), torch.ones(2), torch.zeros(2, 4), torch.zeros(2, 8))
    w.finish()
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    save_file(tensors, path, metadata=dict(ChunkReader(path).metadata, codec="zfp"))
    with pytest.raises(ChunkFileError, match="codec 'zfp'.*upgrade hsextract"):
        ChunkReader(path)


@pytest.mark.workflow
def test_demo_chunks_every_codec_through_the_workflow(demo_run, tmp_path):
    """The demo extracted with codec none and fp8 beside the default: every record of every
    chunk, decoded, equals the uncompressed run bit for bit (lossless) or within fp8's
    bound; verify and inspect read them all."""
    default = load_config(demo_run["workdir"] / "config.yaml")
    assert default["storage"]["codec"] == "lossless"
    runs = {"lossless": demo_run["run_dir"]}
    # The two runs at once (each -j1 workflow leaves a core mostly idle; CI has two): each
    # its own workdir, output root and dump dir.
    wds = {codec: make_workdir(tmp_path / codec, **{"storage.codec": codec})
           for codec in ("none", "fp8")}  # fmt: skip
    proc = start_snakemake(wds["fp8"], "-j1", "extract_all")
    try:
        run_snakemake(wds["none"], "-j1", "extract_all")
        out, _ = proc.communicate(timeout=900)
    finally:
        stop_snakemake(proc)
    assert proc.returncode == 0, f"the fp8 run failed:\n{out[-8000:]}"
    for codec, wd in wds.items():
        runs[codec] = run_dir_of(wd)
        assert runs[codec].name != demo_run["run_dir"].name
    compared = 0
    for chunk in sorted((runs["none"] / "hidden").glob("chunk_*.safetensors")):
        ref = ChunkReader(chunk)
        assert ref.codec == "none"
        lossless = ChunkReader(runs["lossless"] / "hidden" / chunk.name)
        fp8 = ChunkReader(runs["fp8"] / "hidden" / chunk.name)
        assert lossless.codec == "lossless" and fp8.codec == "fp8"
        assert lossless.record_ids == ref.record_ids == fp8.record_ids
        for j in range(len(ref)):
            a, b, c = ref[j], lossless[j], fp8[j]
            for name in ("hidden_states", "aux_hidden_states"):
                assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
                err = (c[name].float() - a[name].float()).abs()
                assert (err <= a[name].float().abs() / 16 + 1e-3).all()
            compared += 1
    assert compared == 48
    for codec, rd in runs.items():
        m = json.loads((rd / "manifest.json").read_text())
        assert m["codec"] == codec and all(c["codec"] == codec for c in m["chunks"])
        out = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "verify", str(rd / "manifest.json")],
            capture_output=True, text=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
    text = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "inspect",
         str(next((runs["fp8"] / "hidden").glob("chunk_*.safetensors")))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "fp8 error against the captured torch.float32 states, per layer" in text
    for layer in ("aux_2", "aux_4", "aux_5", "final"):
        assert layer in text
