"""One chunk job's per-request piece path, no HTTP (issue 40): requests/s and CPU ms a
request, rows written as they are checked vs checked and then copied again.

Pieces are written beforehand by the real ``hsextract.capture.DumpWriter`` (one piece a
request, bf16), then a thread pool of ``--threads`` (a chunk job's sender threads) runs,
per request, what ``hsextract.client.extract_chunk`` runs once the server has answered:
``read_pieces`` -> ``assemble`` -> the request dir removed -> ``ChunkWriter.put_files`` ->
the pieces closed; ``finish`` is not timed (its sha256 is per chunk, not per request).

* ``sunk`` (what the client does): ``assemble(rows_to=ChunkWriter.row_sink(j))`` writes each
  slice of rows into the chunk file from the buffer it was checked in (one read of the rows);
* ``spliced`` (a baseline, the client before ``row_sink``): ``assemble`` checks, then
  :func:`splice_rows` reads the rows again to ``splice`` them into the chunk file (what
  ``put_files`` did for codec none before ``row_sink``; it lives only here now, so the
  ratio keeps a baseline measured in the same run);
* ``unlocked`` (a baseline, the client before its chunk file's write lock): as ``sunk``,
  with ``ChunkWriter``'s write lock taken out, so sender threads write into the one file
  at once and wait for its inode lock in the kernel, spinning (``ChunkWriter._pwrite_at``).

The modes alternate, ``--rounds`` times each, on fresh pieces and a fresh chunk file under
a dir of its own in ``--work-root`` (default /dev/shm), removed at the end.  Last lines,
one per baseline: ``sunk/<baseline> requests/s ratio: X.XX, CPU a request Y.YY`` (medians
over the thread counts).

    python bench/piece_path.py                       # 128-token records, 3 aux layers
    python bench/piece_path.py --layers 6 --threads 1,16 --baselines unlocked
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _splice(src: int, at: int, nbytes: int, dst: int, pos: int, pipe: tuple[int, int, int]) -> None:
    """Copy ``nbytes`` of ``src`` at ``at`` to ``dst`` at ``pos`` through ``pipe`` (r, w,
    step); a source that cannot splice is copied with pread/pwrite."""
    from hsextract import chunks

    r, w, step = pipe
    end = at + nbytes
    while at < end:
        try:
            n = os.splice(src, w, min(step, end - at), offset_src=at)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            return chunks._copy(src, at, end - at, dst, pos, str(src))  # noqa: SLF001
        if n <= 0:
            raise OSError(f"fd {src} ends at byte {at}, expected {end}")
        at += n
        while n:
            m = os.splice(r, dst, n, offset_dst=pos)
            n, pos = n - m, pos + m


def splice_rows(chunk, j: int, hidden: list, aux: list) -> None:
    """The baseline: record ``j``'s rows, ``(fd, offset, nbytes, name)`` ranges of the
    pieces, copied into ``chunk`` at their offsets in the kernel (``splice`` through a
    1 MiB pipe, as ``ChunkWriter.put_files`` did for codec none before ``row_sink``).  The
    bytes are counted as the writer counts its own (its background fdatasyncs) and as the
    record's sunk rows, so ``put_files(..., rows_sunk=True)`` then writes the ids and mask
    as in the ``sunk`` mode: the two modes differ only in how the rows get there."""
    r, w = os.pipe()
    try:
        step = 1 << 16  # a pipe's default capacity
        try:
            fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
            step = 1 << 20
        except OSError:  # pipe-max-size below 1 MiB, or the user's pipe quota is full
            pass
        start, got = int(chunk.offsets[j]), []
        for name, rb, ranges in zip(
            ("hidden_states", "aux_hidden_states"), chunk.row_bytes, (hidden, aux), strict=True
        ):
            pos = chunk.data_start + chunk.base[name] + rb * start
            for fd, offset, nbytes, _ in ranges:
                _splice(fd, offset, nbytes, chunk.fd, pos, (r, w, step))
                chunk._wrote(nbytes)  # noqa: SLF001 - not a pwrite of the writer's: counted
                pos += nbytes
            got.append(sum(n for _, _, n, _ in ranges))
        chunk._sunk[j] = got  # noqa: SLF001 - as row_sink(j) counts what it took
    finally:
        os.close(r)
        os.close(w)


def write_pieces(dump: Path, layers: list[int], tokens: int, hidden: int, requests: int) -> Any:
    """``requests`` requests of ``tokens`` random bf16 rows each, as the server's own
    DumpWriter writes their pieces into ``dump`` (bench/cpu_per_mb.py reads them too); the
    token ids every request was sent."""
    import torch

    from hsextract.capture import DumpWriter

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30000, (tokens,), generator=g)
    states = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    aux = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in layers]
    writer = DumpWriter(dump, layers, threads=2)
    for j in range(requests):
        writer.write_batch([f"r{j}"], [0], [tokens], ids, states, aux)
    writer.flush()
    writer.close()
    return ids


def one_round(root: Path, a: argparse.Namespace, mode: str, threads: int) -> tuple[float, float]:
    """(requests/s, process CPU ms a request) of ``a.requests`` requests."""
    import torch

    from hsextract import client
    from hsextract.chunks import ChunkWriter

    layers = list(range(2, 2 + a.layers))
    geo = client.Geometry(a.hidden, 2 + a.layers + 3, layers, torch.bfloat16)
    dump = root / "dump"
    dump.mkdir(mode=0o700)
    ids = write_pieces(dump, layers, a.tokens, a.hidden, a.requests)
    chunk = ChunkWriter(
        root / "chunk.safetensors",
        [a.tokens] * a.requests,
        hidden_size=a.hidden,
        n_aux=a.layers,
        dtype=torch.bfloat16,
        metadata={"bench": "piece_path"},
    )
    sent, mask = ids.tolist(), torch.ones(a.tokens, dtype=torch.uint8)

    if mode == "unlocked":
        chunk._write_lock = contextlib.nullcontext()  # noqa: SLF001 - the baseline
    spliced = mode == "spliced"

    def request(j: int) -> None:
        rid_dir = dump / f"r{j}"
        sink = None if spliced else chunk.row_sink(j)
        try:
            pieces = client.read_pieces(rid_dir, a.tokens, 10.0)
            dump_ = client.assemble(pieces, sent, geo, f"r{j}", rows_to=sink)
        finally:
            client._remove_request_dir(rid_dir)  # noqa: SLF001 - what extract_dump runs
        with dump_:
            if sink is None:
                splice_rows(chunk, j, dump_.hidden, dump_.aux)
            chunk.put_files(j, dump_.ids, mask, dump_.hidden, dump_.aux, dump_.dtype,
                            rows_sunk=True)  # fmt: skip

    cpu, t = time.process_time(), time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(request, range(a.requests)))
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    finally:
        chunk.abort()
        shutil.rmtree(dump, ignore_errors=True)
    return a.requests / wall, cpu / a.requests * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens a request")
    ap.add_argument("--layers", type=int, default=3, help="captured aux layers (+ the final)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=400, help="a round")
    ap.add_argument("--threads", default="1,8", help="sender threads, one setting per line")
    ap.add_argument("--rounds", type=int, default=3, help="per mode and thread count")
    ap.add_argument("--work-root", default="/dev/shm")
    ap.add_argument(
        "--baselines",
        default="spliced,unlocked",
        help="modes compared with sunk (the client): spliced, unlocked, or both",
    )
    a = ap.parse_args()
    import torch

    from hsextract.client import one_thread_per_op

    one_thread_per_op()  # as a chunk job does
    mb = 2 * a.hidden * (a.layers + 1) * a.tokens / 2**20
    print(f"piece path: {a.tokens}-token requests, {a.layers} aux layers + final, hidden "
          f"{a.hidden}, bf16 ({mb:.1f} MiB a request), {a.requests} requests a round, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs")  # fmt: skip
    # Ours alone: a fresh dir, removed at the end; nothing else under --work-root is touched.
    work = Path(a.work_root) / f"hsextract-piece-path-{os.getuid()}-{os.getpid()}"
    work.mkdir(mode=0o700)
    baselines = [b for b in a.baselines.split(",") if b]
    if not baselines or set(baselines) - {"spliced", "unlocked"}:
        ap.error(f"--baselines {a.baselines!r}: one or both of spliced, unlocked")
    modes = ["sunk", *baselines]
    ratios: dict[str, list[tuple[float, float]]] = {b: [] for b in baselines}
    try:
        for threads in [int(x) for x in a.threads.split(",")]:
            got: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
            for i in range(a.rounds):
                for mode in modes if i % 2 == 0 else modes[::-1]:
                    root = work / f"{mode}-{threads}-{i}"
                    root.mkdir()
                    got[mode].append(one_round(root, a, mode, threads))
                    shutil.rmtree(root)
            med = {m: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v))
                   for m, v in got.items()}  # fmt: skip
            for mode, (rate, cpu) in med.items():
                runs = ", ".join(f"{r:.0f}" for r, _ in got[mode])
                print(f"  {threads:>2} threads, {mode:>8}: {rate:8.1f} requests/s (median of "
                      f"{runs}), {cpu:.3f} ms CPU a request")  # fmt: skip
            for b in baselines:
                ratios[b].append((med["sunk"][0] / med[b][0], med["sunk"][1] / med[b][1]))
                print(f"  {threads:>2} threads: sunk/{b} requests/s {ratios[b][-1][0]:.2f}, "
                      f"CPU a request {ratios[b][-1][1]:.2f}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for b, v in ratios.items():
        print(
            f"sunk/{b} requests/s ratio: {statistics.median(r for r, _ in v):.2f}, CPU a "
            f"request {statistics.median(c for _, c in v):.2f}"
        )


if __name__ == "__main__":
    main()
