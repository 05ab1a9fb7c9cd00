"""The chunk job's per-request path (issue 40): the HTTP POST, the piece checks, the
request dir's removal.  Each keeps a guarantee of the slower path it replaced."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hsextract import client
from hsextract.capture import DumpWriter
from hsextract.client import ExtractionError, Geometry, TransientError
from hsextract.stats import SAMPLE_EVERY

H, LAYERS = 16, [2, 4, 5]
GEO = Geometry(hidden_size=H, num_layers=8, aux_layers=LAYERS, dtype=torch.bfloat16)


def _piece(dump: Path, rid: str, n: int, bad_row: int | None = None) -> list[int]:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 50_000, (n,), generator=g)
    hidden = torch.randn(n, H, generator=g).to(torch.bfloat16)
    aux = [torch.randn(n, H, generator=g).to(torch.bfloat16) for _ in LAYERS]
    if bad_row is not None:
        aux[1][bad_row, 3] = float("nan")
    writer = DumpWriter(dump, LAYERS, threads=1)
    writer.write_batch([rid], [0], [n], ids, hidden, aux)
    writer.flush()
    writer.close()
    return ids.tolist()


def test_a_non_finite_value_in_any_slice_of_a_piece_fails_it(tmp_path, monkeypatch):
    """The checks read a piece a slice of rows at a time: a NaN in the last slice of the
    aux rows is found as surely as in the first."""
    # Eight rows a slice (the statistics' sampling step): a 50-row piece is 7 slices.
    monkeypatch.setattr(client, "CHECK_SLICE_BYTES", SAMPLE_EVERY * 2 * H * len(LAYERS))
    ids = _piece(tmp_path, "r-bad", 50, bad_row=49)
    pieces = client.read_pieces(tmp_path / "r-bad", 50, 10)
    with pytest.raises(ExtractionError, match="non-finite values"):
        client.assemble(pieces, ids, GEO, "record 'x'")


def test_sliced_checks_take_the_statistics_of_the_same_rows(tmp_path, monkeypatch):
    ids = _piece(tmp_path, "r-ok", 50)
    with client.assemble(client.read_pieces(tmp_path / "r-ok", 50, 10), ids, GEO, "w") as d:
        whole = d.stats.report()
        _, hidden, aux = d.tensors()
    monkeypatch.setattr(client, "CHECK_SLICE_BYTES", SAMPLE_EVERY * 2 * H * len(LAYERS))
    with client.assemble(client.read_pieces(tmp_path / "r-ok", 50, 10), ids, GEO, "w") as d:
        sliced = d.stats.report()
    for name, layer in whole["layers"].items():  # the same rows, summed in another order
        assert sliced["layers"][name]["rms"] == pytest.approx(layer["rms"], rel=1e-5)
        assert sliced["layers"][name]["max_abs"] == layer["max_abs"]
    sample = torch.cat([aux, hidden], 1)[::SAMPLE_EVERY].view(-1, len(LAYERS) + 1, H).float()
    for i, name in enumerate([f"aux_{x}" for x in LAYERS] + ["final"]):
        assert sliced["layers"][name]["max_abs"] == float(sample[:, i].abs().max())
        assert sliced["layers"][name]["values"] == sample.shape[0] * H


def test_rows_go_to_the_chunk_file_as_they_are_checked_and_a_bad_one_never_counts(
    tmp_path, monkeypatch
):
    """Uncompressed, the checked slices are written from the check's buffer (one read of
    the rows, issue 40): the file is the one the rows' values give, whatever the slicing;
    a record with a NaN in its last slice is refused and never counted as written (the
    chunk cannot finish), and a record whose rows the sink did not all take is refused."""
    from hsextract.chunks import ChunkFileError, ChunkWriter

    monkeypatch.setattr(client, "CHECK_SLICE_BYTES", SAMPLE_EVERY * 2 * H * len(LAYERS))
    dumps = tmp_path / "dump"
    dumps.mkdir(mode=0o700)
    good = {n: _piece(dumps, f"r{n}", n) for n in (50, 21)}
    bad = _piece(dumps, "r-bad", 50, bad_row=49)

    def writer(name: str, lengths: list[int]) -> ChunkWriter:
        kw = {"hidden_size": H, "n_aux": len(LAYERS), "dtype": torch.bfloat16}
        return ChunkWriter(tmp_path / name, lengths, metadata={"m": "x"}, **kw)

    sunk, ref = writer("sunk.safetensors", [21, 50]), writer("ref.safetensors", [21, 50])
    for j, n in ((1, 50), (0, 21)):
        pieces = client.read_pieces(dumps / f"r{n}", n, 10)
        with client.assemble(pieces, good[n], GEO, "w", rows_to=sunk.row_sink(j)) as d:
            ids, hidden, aux = d.tensors()
            mask = torch.ones(n, dtype=torch.uint8)
            sunk.put_files(j, d.ids, mask, d.hidden, d.aux, d.dtype, rows_sunk=True)
            ref.put(j, ids, mask, hidden, aux)
    assert sunk.finish() == ref.finish()

    w = writer("bad.safetensors", [50, 21])
    with pytest.raises(ExtractionError, match="non-finite values"):
        client.assemble(
            client.read_pieces(dumps / "r-bad", 50, 10), bad, GEO, "w", rows_to=w.row_sink(0)
        )
    with client.assemble(client.read_pieces(dumps / "r21", 21, 10), good[21], GEO, "w") as d:
        w.row_sink(1)  # handed out, never fed: the rows did not go through it
        with pytest.raises(ChunkFileError, match="row sink took"):
            w.put_files(1, d.ids, torch.ones(21), d.hidden, d.aux, d.dtype, rows_sunk=True)
    with pytest.raises(ChunkFileError, match=r"records \[0, 1\] never written"):
        w.finish()
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_with_a_codec_the_encoder_checks_the_rows_it_reads(tmp_path, monkeypatch, codec):
    """With a codec the values are checked on the encoder's read (issue 40: one read of
    the rows, not two): the file and the statistics are those of the check in
    ``assemble``, whatever the framing (the record's every SAMPLE_EVERY-th row); a NaN in
    the last frame of the aux rows refuses the record, which is never counted as written."""
    from hsextract import storage
    from hsextract.chunks import ChunkFileError, ChunkWriter

    dumps = tmp_path / "dump"
    dumps.mkdir(mode=0o700)
    good = {n: _piece(dumps, f"r{n}", n) for n in (50, 21)}
    bad = _piece(dumps, "r-bad", 50, bad_row=49)

    def writer(name: str, lengths: list[int]) -> ChunkWriter:
        kw = {"hidden_size": H, "n_aux": len(LAYERS), "dtype": torch.bfloat16, "codec": codec}
        return ChunkWriter(tmp_path / name, lengths, metadata={"m": "x"}, **kw)

    def stats(d: client.Dump) -> dict:
        return d.stats.report()["layers"]

    # Frames of 3 aux rows (7 of hidden): rows 8, 16, ... fall inside frames, not at r0.
    monkeypatch.setattr(storage, "FRAME_BYTES", 3 * 2 * H * len(LAYERS))
    late, ref = writer("late.safetensors", [21, 50]), writer("ref.safetensors", [21, 50])
    for j, n in ((1, 50), (0, 21)):
        with client.assemble(client.read_pieces(dumps / f"r{n}", n, 10), good[n], GEO, "w") as d:
            ids, hidden, aux = d.tensors()
            want = stats(d)
        pieces = client.read_pieces(dumps / f"r{n}", n, 10)
        with client.assemble(pieces, good[n], GEO, "w", check_values=False) as d:
            assert not d.checked and all(v["values"] == 0 for v in stats(d).values())
            mask = torch.ones(n, dtype=torch.uint8)
            late.put_files(j, d.ids, mask, d.hidden, d.aux, d.dtype, check=d.check_rows)
            got = stats(d)
        ref.put(j, ids, mask, hidden, aux)
        for name, layer in want.items():  # the same rows, summed in another order
            assert got[name]["values"] == layer["values"] > 0
            assert got[name]["max_abs"] == layer["max_abs"]
            assert got[name]["rms"] == pytest.approx(layer["rms"], rel=1e-5)
    assert late.finish() == ref.finish()

    w = writer("bad.safetensors", [50, 21])
    with client.assemble(
        client.read_pieces(dumps / "r-bad", 50, 10), bad, GEO, "record 'b'", check_values=False
    ) as d:
        with pytest.raises(ExtractionError, match=r"record 'b': non-finite .*aux rows 48-49"):
            w.put_files(0, d.ids, torch.ones(50), d.hidden, d.aux, d.dtype, check=d.check_rows)
    with pytest.raises(ChunkFileError, match=r"records \[0, 1\] never written"):
        w.finish()
    assert not list(tmp_path.glob("*bad.safetensors*"))


def test_a_request_dir_is_removed_whatever_it_holds(tmp_path):
    plain, odd = tmp_path / "a-00000000", tmp_path / "b-00000000"
    _piece(tmp_path, plain.name, 4)
    _piece(tmp_path, odd.name, 4)
    (odd / "sub").mkdir()  # not what a server writes: rmtree's way
    (odd / "sub" / "x").write_text("x")
    for d in (plain, odd, tmp_path / "never-made"):
        client._remove_request_dir(d)
        assert not d.exists()


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _serve(closes: bool):
    """A loopback server answering POSTs with JSON; with ``closes`` it closes each
    connection after its answer without saying so (as a server's idle timeout does)."""
    seen: list[tuple[str, bytes, int]] = []  # path, body, the client's port

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, body, self.client_address[1]))
            out = b'{"meta_info": {"finish_reason": {"type": "length"}}}'
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(out)}\r\n\r\n".encode()
                + out
            )
            self.close_connection = closes

    srv = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


@pytest.mark.parametrize("closes", [False, True])
def test_the_direct_path_keeps_one_connection_and_reopens_a_closed_one(closes):
    """A sender thread's connection is kept alive between its requests; one the server
    closed while idle is noticed and reopened, not reported as a failed request (which
    would cost a retry with backoff)."""
    srv, url, seen = _serve(closes)
    http = client._DirectHttp({"Authorization": "Bearer k"})
    try:
        for i in range(5):
            status, data = http.post(url, "/generate", b'{"rid": "r%d"}' % i, 10.0)
            assert status == 200 and b"meta_info" in data
        assert [s[:2] for s in seen] == [("/generate", b'{"rid": "r%d"}' % i) for i in range(5)]
        assert len({port for _, _, port in seen}) == (5 if closes else 1)  # connections
    finally:
        http.close()
        srv.shutdown()
        srv.server_close()


def test_a_refused_connection_is_transient():
    srv, url, _ = _serve(False)
    srv.shutdown()
    srv.server_close()  # nobody listens on that port now
    http = client._DirectHttp({})
    with pytest.raises(TransientError, match="connection failed: ConnectionRefusedError"):
        http.post(url, "/generate", b"{}", 5.0)


def test_requests_still_carries_what_the_environment_says(monkeypatch):
    """Loopback never needs a proxy (trust_env off: direct); for another host a proxy or
    .netrc credentials from the environment keep the request on requests, as before."""
    for var in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")
    assert client._direct_ok("http://127.0.0.1:30000", trust_env=False)
    assert client._direct_ok("http://10.1.2.3:30000", trust_env=True)
    assert not client._direct_ok("https://10.1.2.3:30000", trust_env=True)
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert not client._direct_ok("http://10.1.2.3:30000", trust_env=True)
    monkeypatch.setenv("no_proxy", "10.1.2.3")
    assert client._direct_ok("http://10.1.2.3:30000", trust_env=True)
