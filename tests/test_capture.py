"""The capture writer (server side of the dump protocol), on CPU tensors.

The CUDA path differs only in how rows reach the staging buffer (device snapshot + D2H on
a side stream); the pool, the writer threads, the serialisation and the renames are the
same code, so they are tested here.  bench/capture_gpu.py checks the CUDA path's pieces.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsextract import capture
from hsextract.capture import (
    AUX_LAYERS_ENV,
    DUMP_DIR_ENV,
    CaptureWriteError,
    DumpWriter,
    get_writer,
    piece_name,
)

H = 16
LAYERS = [2, 4, 5]


def _batch(total: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (total,), generator=g)
    hidden = torch.randn(total, H, generator=g).to(dtype)
    aux = [torch.randn(total, H, generator=g).to(dtype) for _ in LAYERS]
    return ids, hidden, aux


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def _visible(dump: Path) -> list[Path]:
    return sorted(p for p in dump.rglob("*") if p.is_file())


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    d = tmp_path / "dump"
    d.mkdir(mode=0o700)
    return d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_of_several_requests_gives_one_piece_each(dump: Path, dtype: torch.dtype) -> None:
    rids, starts, lens = ["r0", "r1", "r2"], [0, 7, 0], [5, 3, 9]
    ids, hidden, aux = _batch(sum(lens), dtype)
    w = DumpWriter(dump, LAYERS, slots=2, threads=3)
    w.write_batch(rids, starts, lens, ids, hidden, aux)
    w.flush()
    aux_cat = torch.cat(aux, dim=1)
    row = 0
    for rid, start, n in zip(rids, starts, lens, strict=True):
        t, meta = _load(dump / rid / piece_name(start))
        assert t["input_ids"].dtype == torch.int64
        assert torch.equal(t["input_ids"], ids[row : row + n])
        assert t["hidden_states"].dtype == dtype
        assert torch.equal(t["hidden_states"], hidden[row : row + n])
        assert torch.equal(t["aux_hidden_states"], aux_cat[row : row + n])
        assert meta == {"rid": rid, "start": str(start), "n": str(n), "aux_layers": "[2, 4, 5]"}
        row += n
    assert [p.relative_to(dump).as_posix() for p in _visible(dump)] == [
        "r0/000000000.safetensors",
        "r1/000000007.safetensors",
        "r2/000000000.safetensors",
    ]
    # safetensors' own loader agrees with safe_open (header and offsets are well formed).
    assert set(load_file(str(dump / "r2" / piece_name(0)))) == {
        "input_ids",
        "hidden_states",
        "aux_hidden_states",
    }
    w.close()


def test_request_split_over_passes_covers_it_exactly_once(dump: Path) -> None:
    """Chunked prefill: one request in three passes, batched with others each time."""
    src = {"long": _batch(20, seed=1), "x": _batch(4, seed=2), "y": _batch(8, seed=3)}
    w = DumpWriter(dump, LAYERS, slots=1, threads=2)
    # (rids, starts, lens) per pass; "long" is split 0..8, 8..15, 15..20.
    passes = [
        (["long"], [0], [8]),
        (["x", "long"], [0, 8], [4, 7]),
        (["long", "y"], [15, 0], [5, 8]),
    ]
    for rids, starts, lens in passes:
        rows = [
            (src[r][0][s : s + n], src[r][1][s : s + n], [a[s : s + n] for a in src[r][2]])
            for r, s, n in zip(rids, starts, lens, strict=True)
        ]
        w.write_batch(
            rids,
            starts,
            lens,
            torch.cat([r[0] for r in rows]),
            torch.cat([r[1] for r in rows]),
            [torch.cat([r[2][k] for r in rows]) for k in range(len(LAYERS))],
        )
    w.flush()
    for rid, expect in [("long", [0, 8, 15]), ("x", [0]), ("y", [0])]:
        pieces = sorted((dump / rid).iterdir())
        assert [p.name for p in pieces] == [piece_name(s) for s in expect]
        loaded = [_load(p)[0] for p in pieces]
        ids, hidden, aux = src[rid]
        assert torch.equal(torch.cat([t["input_ids"] for t in loaded]), ids)
        assert torch.equal(torch.cat([t["hidden_states"] for t in loaded]), hidden)
        assert torch.equal(
            torch.cat([t["aux_hidden_states"] for t in loaded]), torch.cat(aux, dim=1)
        )
    w.close()


def test_caller_may_overwrite_its_tensors_right_after_write_batch(dump: Path) -> None:
    """SGLang reuses its buffers for the next pass: the writer must have copied already."""
    ids, hidden, aux = _batch(64)
    keep = (ids.clone(), hidden.clone(), [a.clone() for a in aux])
    gate = threading.Event()
    w = DumpWriter(dump, LAYERS, slots=2, threads=1)
    real = w._write_piece

    def held(*args, **kwargs):  # keep the piece unwritten until the inputs are trashed
        gate.wait(10)
        real(*args, **kwargs)

    w._write_piece = held  # type: ignore[method-assign]
    w.write_batch(["r"], [0], [64], ids, hidden, aux)
    ids.fill_(-1)
    hidden.fill_(float("nan"))
    for a in aux:
        a.zero_()
    gate.set()
    w.flush()
    t, _ = _load(dump / "r" / piece_name(0))
    assert torch.equal(t["input_ids"], keep[0])
    assert torch.equal(t["hidden_states"], keep[1])
    assert torch.equal(t["aux_hidden_states"], torch.cat(keep[2], dim=1))
    w.close()


def test_no_partial_piece_is_ever_visible_under_its_final_name(dump: Path) -> None:
    """A reader polling the dir sees either nothing or a complete, loadable piece."""
    stop = threading.Event()
    seen: dict[str, int] = {}
    problems: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for p in dump.rglob("*" + capture.PIECE_SUFFIX):
                if p.name.startswith("."):
                    problems.append(f"temporary name with final suffix: {p}")
                    continue
                try:
                    t, meta = _load(p)
                except FileNotFoundError:
                    continue
                except Exception as exc:  # a torn file would land here
                    problems.append(f"{p}: {exc!r}")
                    continue
                n = int(meta["n"])
                if t["hidden_states"].shape != (n, H) or t["aux_hidden_states"].shape != (
                    n,
                    H * len(LAYERS),
                ):
                    problems.append(f"{p}: wrong shapes")
                seen[str(p)] = n

    th = threading.Thread(target=reader)
    th.start()
    try:
        w = DumpWriter(dump, LAYERS, slots=2, threads=4)
        for i in range(40):
            ids, hidden, aux = _batch(3000, seed=i)
            w.write_batch([f"q{i}", f"p{i}"], [0, 0], [1000, 2000], ids, hidden, aux)
        w.flush()
    finally:
        stop.set()
        th.join()
    assert problems == []
    assert len(_visible(dump)) == 80
    assert not [p for p in dump.rglob(".*")], "temporary files left behind"
    w.close()


def test_writer_thread_failure_is_raised_on_next_call_and_by_flush(dump: Path) -> None:
    (dump / "blocked").write_text("a file where the request dir should be")
    w = DumpWriter(dump, LAYERS, slots=2, threads=2)
    ids, hidden, aux = _batch(8)
    w.write_batch(["ok", "blocked"], [0, 0], [4, 4], ids, hidden, aux)
    with pytest.raises(CaptureWriteError, match="blocked"):
        w.flush()
    # Sticky: the protocol is broken for that request, so every later call says so.
    with pytest.raises(CaptureWriteError):
        w.write_batch(["ok2"], [0], [8], ids, hidden, aux)
    with pytest.raises(CaptureWriteError):
        w.flush()
    with pytest.raises(CaptureWriteError):
        w.close()
    assert (dump / "ok" / piece_name(0)).is_file()
    assert not (dump / "ok2").exists()
    assert not [p for p in dump.rglob(".*")], "temporary file of the failed piece left behind"


def test_flush_waits_for_every_handed_over_piece(dump: Path) -> None:
    gate = threading.Event()
    w = DumpWriter(dump, LAYERS, slots=4, threads=2)
    real = w._write_piece

    def held(*args, **kwargs):
        gate.wait(10)
        real(*args, **kwargs)

    w._write_piece = held  # type: ignore[method-assign]
    for i in range(3):
        ids, hidden, aux = _batch(10, seed=i)
        w.write_batch([f"r{i}", f"s{i}"], [0, 0], [4, 6], ids, hidden, aux)
    done = threading.Event()
    flusher = threading.Thread(target=lambda: (w.flush(), done.set()))
    flusher.start()
    assert not done.wait(0.2), "flush returned while pieces were still held back"
    assert _visible(dump) == []
    gate.set()
    flusher.join(10)
    assert done.is_set()
    assert len(_visible(dump)) == 6  # every piece, the moment flush returns
    w.flush()  # nothing pending: returns at once
    w.close()


def test_pool_is_bounded_and_applies_backpressure(dump: Path) -> None:
    gate = threading.Event()
    w = DumpWriter(dump, LAYERS, slots=1, threads=1)
    real = w._write_piece

    def held(*args, **kwargs):
        gate.wait(10)
        real(*args, **kwargs)

    w._write_piece = held  # type: ignore[method-assign]
    ids, hidden, aux = _batch(32)
    w.write_batch(["a"], [0], [32], ids, hidden, aux)  # takes the only buffer
    second = threading.Event()

    def submit() -> None:
        w.write_batch(["b"], [0], [32], ids, hidden, aux)
        second.set()

    th = threading.Thread(target=submit)
    th.start()
    assert not second.wait(0.2), "second batch was accepted with no free buffer"
    gate.set()
    th.join(10)
    assert second.is_set()
    w.flush()
    assert len(_visible(dump)) == 2
    w.close()


def test_tiny_pool_completes_many_batches_with_one_buffer(dump: Path) -> None:
    w = DumpWriter(dump, LAYERS, slots=1, threads=1)
    for i in range(25):
        n = 5 + (i * 37) % 200  # varying sizes: the one buffer grows, never multiplies
        ids, hidden, aux = _batch(n, seed=i)
        w.write_batch([f"r{i}"], [0], [n], ids, hidden, aux)
    w.flush()
    assert len(_visible(dump)) == 25
    slot = w._free.get_nowait()
    assert w._free.empty(), "more than one staging buffer exists"
    assert slot.buf is not None and slot.buf.numel() < 4 * (1 << 20)
    w._free.put(slot)
    t, _ = _load(dump / "r24" / piece_name(0))
    assert torch.equal(t["hidden_states"], _batch(5 + (24 * 37) % 200, seed=24)[1])
    w.close()


def test_zero_length_requests_write_nothing(dump: Path) -> None:
    w = DumpWriter(dump, LAYERS, threads=1)
    ids, hidden, aux = _batch(4)
    w.write_batch(["a", "b"], [3, 0], [0, 4], ids, hidden, aux)
    w.flush()
    assert [p.relative_to(dump).as_posix() for p in _visible(dump)] == ["b/000000000.safetensors"]
    w.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lens": [4, 5]}, "sum\\(extend_lens\\)"),
        ({"rids": ["../x", "b"]}, "unsafe"),
        ({"rids": [".hidden", "b"]}, "unsafe"),
        ({"n_aux": 2}, "aux tensors"),
        ({"aux_dtype": torch.float32}, "aux\\[0\\]"),
    ],
)
def test_bad_batches_are_refused_by_the_caller_thread(dump: Path, kwargs, match) -> None:
    w = DumpWriter(dump, LAYERS, threads=1)
    ids, hidden, aux = _batch(8)
    aux = aux[: kwargs.get("n_aux", 3)]
    if "aux_dtype" in kwargs:
        aux = [a.to(kwargs["aux_dtype"]) for a in aux]
    with pytest.raises(ValueError, match=match):
        w.write_batch(
            kwargs.get("rids", ["a", "b"]), [0, 0], kwargs.get("lens", [4, 4]), ids, hidden, aux
        )
    w.close()
    assert _visible(dump) == []


def test_closed_writer_refuses_work(dump: Path) -> None:
    w = DumpWriter(dump, LAYERS, threads=2)
    ids, hidden, aux = _batch(4)
    w.write_batch(["a"], [0], [4], ids, hidden, aux)
    w.close()
    w.close()
    assert (dump / "a" / piece_name(0)).is_file()
    with pytest.raises(RuntimeError, match="closed"):
        w.write_batch(["b"], [0], [4], ids, hidden, aux)


def test_dump_dir_must_be_a_real_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(RuntimeError, match="not an existing real directory"):
        DumpWriter(link, LAYERS)
    with pytest.raises(RuntimeError, match="not an existing real directory"):
        DumpWriter(tmp_path / "missing", LAYERS)


def test_get_writer_follows_the_environment(dump: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    assert get_writer() is None
    monkeypatch.setenv(DUMP_DIR_ENV, str(dump))
    monkeypatch.setenv(AUX_LAYERS_ENV, json.dumps(LAYERS))
    monkeypatch.setenv(capture.SLOTS_ENV, "2")
    monkeypatch.setenv(capture.THREADS_ENV, "3")
    monkeypatch.setenv(capture.D2H_CHUNK_ENV, "0")
    w = get_writer()
    assert w is not None and w is get_writer()
    assert (w.aux_layers, w.slots, w.threads, w.d2h_chunk_bytes) == (LAYERS, 2, 3, 0)
    ids, hidden, aux = _batch(4)
    w.write_batch(["a"], [0], [4], ids, hidden, aux)
    w.flush()
    assert (dump / "a" / piece_name(0)).is_file()
    assert oct((dump / "a").stat().st_mode & 0o777) == oct(0o700 & ~_umask())
    w.close()
    monkeypatch.setattr(capture, "_WRITER", None)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_inference_mode_and_grad_callers_mix(dump: Path) -> None:
    """The reference engine and SGLang differ in grad mode; one writer serves both."""
    w = DumpWriter(dump, LAYERS, slots=1, threads=1)
    with torch.inference_mode():
        w.write_batch(["a"], [0], [4], *_batch(4, seed=1))
    w.write_batch(["b"], [0], [4], *_batch(4, seed=2))
    ids, hidden, aux = _batch(4, seed=3)
    leaf = hidden.float().requires_grad_()
    w.write_batch(["c"], [0], [4], ids, (leaf * 1).to(hidden.dtype), aux)
    w.flush()
    for rid, seed in [("a", 1), ("b", 2), ("c", 3)]:
        t, _ = _load(dump / rid / piece_name(0))
        assert torch.equal(t["hidden_states"], _batch(4, seed=seed)[1])
    w.close()


@pytest.mark.gpu  # run on a GPU machine: pytest -m gpu (deselected by default)
@pytest.mark.parametrize("chunk_mb, inflight", [(0, 0), (1, 0), (1, 1), (1, 3)])
def test_cuda_path_copies_before_the_forward_stream_reuses_its_memory(
    dump: Path, chunk_mb: int, inflight: int
) -> None:
    """On a non-default forward stream, the caller trashes and frees its tensors at once."""
    dev = torch.device("cuda")
    w = DumpWriter(dump, LAYERS, slots=2, threads=2, d2h_chunk_mb=chunk_mb, d2h_inflight=inflight)
    fwd = torch.cuda.Stream()
    want = []
    # SGLang runs its forward under inference mode (grad mode is per thread).
    infer = torch.inference_mode() if inflight else contextlib.nullcontext()
    with torch.cuda.stream(fwd), infer:
        for i in range(6):
            total = 4096
            ids = torch.randint(0, 50_000, (total,), device=dev)
            hidden = torch.randn(total, 1024, device=dev, dtype=torch.bfloat16)
            aux = [torch.randn_like(hidden) for _ in LAYERS]
            keep = [x.cpu() for x in (ids, hidden, torch.cat(aux, dim=1))]
            w.write_batch([f"a{i}", f"b{i}"], [0, 0], [1000, 3096], ids, hidden, aux)
            hidden.fill_(float("nan"))
            for a in aux:
                a.zero_()
            del ids, hidden, aux
            torch.full((4 * total, 1024), float("nan"), device=dev)  # reuses the memory
            want += [(f"a{i}", [x[:1000] for x in keep]), (f"b{i}", [x[1000:] for x in keep])]
    w.flush()
    for rid, (ids_c, hid_c, aux_c) in want:
        t, _ = _load(dump / rid / piece_name(0))
        assert torch.equal(t["input_ids"], ids_c)
        assert torch.equal(t["hidden_states"], hid_c)
        assert torch.equal(t["aux_hidden_states"], aux_c)
    w.close()
