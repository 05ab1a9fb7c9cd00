"""CPU milliseconds per MB of hidden states on the client's piece path, step by step (issue
60, item 2), for one or more source trees alternated in the same run.

Why: the client's cost is per byte, not per request (bench/README "Client ceiling": ~3 ms
a MB of states on the 16-core device, ~1.3 of it the checks and rows written, ~1.1 the
sha256).  Rates on a shared machine move with its load; CPU per MB, measured in the same
run for the trees compared, is the figure to compare.

Pieces are written beforehand by the real ``hsextract.capture.DumpWriter`` (one piece a
request, bf16 random rows), then one thread runs what a chunk job runs once the server has
answered (``hsextract.client.extract_chunk``'s ``one``): ``read_pieces``, ``assemble``
(token parity, shapes, finiteness, statistics; with codec ``none`` the rows written into
the chunk file from the buffer they were checked in), the request dir removed,
``ChunkWriter.put_files`` (with a codec: the rows read, checked and encoded), the pieces
closed; then the chunk's sha256 (``chunkfile.sha256_file``, the digest ``finish`` takes).
Each step's thread CPU time is read around it; inside ``assemble`` / ``put_files`` the
module functions doing the per-byte work are wrapped by name where the tree has them
(``client._pread_full``, ``client._all_finite``, ``stats.LayerStats.add_rows``,
``chunks._pwrite_all``), so a step a tree lacks reads 0.  Then the per-byte steps alone,
on one request's rows in a reused buffer: the read, the finiteness check, the statistics,
a write into fresh file pages, ``os.copy_file_range`` into fresh pages (the kernel copy a
codec ``none`` path could use instead of the write), the finiteness check on a populated
mapping instead of a read (map, check, unmap), the sha256.  The write and the copy go to
a file where the chunk goes: beside the pieces (``--work-root``, /dev/shm as in
bench/client_ceiling.py) or ``--chunk-root`` (a disk's file system, as in production):
tmpfs pages cost ~2x ext4's to allocate.

Each tree runs in a subprocess of its own (``--src`` paths, alternated ``--rounds`` times;
medians).  Last line: ``<tree>/<first tree> checks+copy ms/MB: X.XXX vs Y.YYY, ratio Z.ZZ``
(everything but the digest; the first tree is the baseline).

    python bench/cpu_per_mb.py                                  # this tree alone
    git worktree add /tmp/cc-old HEAD~1                         # the tree before
    python bench/cpu_per_mb.py --src /tmp/cc-old/src,src --tokens 2048 --layers 6
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import hashlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux's value where Python lacks it

#: Steps of the request path, in order; ``total`` is their sum without the digest.
PATH_STEPS = ("read_pieces", "assemble", "remove_dir", "put_files", "close")
#: Per-byte work inside them, timed by wrapping these (module, name) where they exist.
WRAPPED = {
    "pread": ("client", "_pread_full"),
    "finite": ("client", "_all_finite"),
    "stats": ("stats", "LayerStats.add_rows"),
    "write": ("chunks", "_pwrite_all"),
}


def _wrap(mods: dict, spent: dict[str, float]) -> None:
    """Time the per-byte functions by name (thread CPU); a name a tree lacks is skipped."""
    for step, (mod, name) in WRAPPED.items():
        owner = mods[mod]
        *outer, attr = name.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue

        def timed(*args, _fn=fn, _step=step, **kwargs):
            t = time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_step] += time.thread_time() - t

        setattr(owner, attr, timed)


def worker(a: argparse.Namespace) -> dict[str, float]:
    """One tree's figures: ms per MB of states per step."""
    sys.path.insert(0, str(Path(a.worker).resolve()))
    import torch
    from piece_path import write_pieces  # bench/: this script's own directory

    from hsextract import chunks, client, stats
    from hsextract.chunkfile import sha256_file

    client.one_thread_per_op()  # as a chunk job does
    layers = list(range(2, 2 + a.layers))
    geo = client.Geometry(a.hidden, 2 + a.layers + 3, layers, torch.bfloat16)
    root = Path(a.work_root) / f"hsextract-cpu-per-mb-{os.getuid()}-{os.getpid()}"
    root.mkdir(mode=0o700)
    try:
        dump = root / "dump"
        dump.mkdir()
        ids = write_pieces(dump, layers, a.tokens, a.hidden, a.requests)
        chunk_dir = root
        if a.chunk_root:  # the chunk on another file system (a disk's, as in production)
            chunk_dir = Path(a.chunk_root) / root.name
            chunk_dir.mkdir(mode=0o700)
        chunk = chunks.ChunkWriter(
            chunk_dir / "chunk.safetensors",
            [a.tokens] * a.requests,
            hidden_size=a.hidden,
            n_aux=a.layers,
            dtype=torch.bfloat16,
            metadata={"bench": "cpu_per_mb"},
            codec=a.codec,
        )
        sent, mask = ids.tolist(), torch.ones(a.tokens, dtype=torch.uint8)
        spent = dict.fromkeys([*PATH_STEPS, *WRAPPED, "sha256"], 0.0)
        _wrap({"client": client, "stats": stats, "chunks": chunks}, spent)

        def step(name: str, t: float) -> float:
            now = time.thread_time()
            spent[name] += now - t
            return now

        for j in range(a.requests):
            rid_dir = dump / f"r{j}"
            sink = chunk.row_sink(j)
            t = time.thread_time()
            pieces = client.read_pieces(rid_dir, a.tokens, 10.0)
            t = step("read_pieces", t)
            d = client.assemble(pieces, sent, geo, f"r{j}", sink, check_values=sink is not None)
            t = step("assemble", t)
            client._remove_request_dir(rid_dir)  # noqa: SLF001 - what extract_dump runs
            t = step("remove_dir", t)
            chunk.put_files(j, d.ids, mask, d.hidden, d.aux, d.dtype, rows_sunk=sink is not None,
                            check=None if d.checked else d.check_rows)  # fmt: skip
            t = step("put_files", t)
            d.close()
            step("close", t)
        # The digest as finish takes it, on the finished file's bytes (finish itself also
        # fsyncs: a disk wait, not CPU of ours).
        digest = chunk.finish()
        t = time.thread_time()
        if sha256_file(chunk.path) != digest:
            raise SystemExit("sha256 of the finished chunk differs from finish()'s")
        spent["sha256"] = time.thread_time() - t
        mb = a.requests * a.tokens * a.hidden * 2 * (a.layers + 1) / 2**20
        out = {k: v / mb * 1e3 for k, v in spent.items()}
        out["total"] = sum(out[k] for k in PATH_STEPS)
        out["chunk_sha256"] = digest
        out.update(_alone(a, client, stats, root, chunk_dir))
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if a.chunk_root:
            shutil.rmtree(Path(a.chunk_root) / root.name, ignore_errors=True)


def _alone(a: argparse.Namespace, client, stats, root: Path, chunk_dir: Path) -> dict[str, float]:
    """The per-byte steps alone on one request's aux rows (``alone:`` keys), ms per MB."""
    import torch

    n, cols = a.tokens, a.layers * a.hidden
    src = root / "rows"
    rows = torch.randn(n, cols).to(torch.bfloat16)
    src.write_bytes(rows.view(torch.int16).numpy().tobytes())
    nbytes = rows.numel() * 2
    reps = max(3, min(1000, (200 << 20) // nbytes))  # ~200 MB, or 1,000 calls of tiny rows
    mb = nbytes * reps / 2**20
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view, t = memoryview(buf.numpy()), buf.view(torch.bfloat16).view(n, cols)
    fd = os.open(src, os.O_RDONLY)
    dst = os.open(chunk_dir / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    pos = [0]

    def write() -> None:
        v = view
        while len(v):
            m = os.pwrite(dst, v[: 1 << 20], pos[0])
            v, pos[0] = v[m:], pos[0] + m

    def copy_range() -> None:
        at = 0
        while at < nbytes:
            m = os.copy_file_range(fd, dst, nbytes - at, at, pos[0])
            at, pos[0] = at + m, pos[0] + m

    def mapped() -> None:
        # The read a mapping would save: map (populated), check in place, unmap.  Through
        # ctypes, as CPython's mmap.close unmaps with the GIL held (bench/README).
        at = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED | MAP_POPULATE, fd, 0)
        if at in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            client._all_finite(torch.frombuffer((ctypes.c_char * nbytes).from_address(at),  # noqa: SLF001
                                                dtype=torch.bfloat16))  # fmt: skip
        finally:
            libc.munmap(ctypes.c_void_p(at), ctypes.c_size_t(nbytes))

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    names = ["n"] * (a.layers + 1)
    steps = {
        "read": lambda: client._pread_full(fd, view, 0),  # noqa: SLF001
        "finite": lambda: client._all_finite(t),  # noqa: SLF001
        "map + finite + unmap (no read)": mapped,
        "stats": lambda: stats.LayerStats(names).add_rows(0, t, a.layers),
        "write (fresh pages)": write,
        "copy_file_range (fresh pages)": copy_range,
        "sha256": lambda: hashlib.sha256(view).digest(),
    }
    out = {}
    try:
        for name, fn in steps.items():
            try:
                fn()
            except OSError as exc:  # copy_file_range across file systems: EXDEV
                if exc.errno != errno.EXDEV:
                    raise
                out[f"alone: {name}"] = float("nan")
                continue
            os.ftruncate(dst, 0)
            pos[0] = 0
            c = time.thread_time()
            for _ in range(reps):
                fn()
            out[f"alone: {name}"] = (time.thread_time() - c) / mb * 1e3
            os.ftruncate(dst, 0)
    finally:
        os.close(fd)
        os.close(dst)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="src", help="trees' src dirs, comma-separated; first: base")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a request")
    ap.add_argument("--layers", type=int, default=3, help="captured aux layers (+ the final)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--codec", default="none", choices=("none", "lossless", "fp8"))
    ap.add_argument("--requests", type=int, default=0, help="a round (0: ~400 MB of states)")
    ap.add_argument("--rounds", type=int, default=3, help="per tree, alternated")
    ap.add_argument("--work-root", default="/dev/shm", help="pieces (and the chunk)")
    ap.add_argument("--chunk-root", default="", help="the chunk file here instead (a disk)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    mb_req = 2 * a.hidden * (a.layers + 1) * a.tokens / 2**20
    a.requests = a.requests or max(4, int(400 / mb_req))
    if a.worker:
        print(json.dumps(worker(a)))
        return
    srcs = [s for s in a.src.split(",") if s]
    print(f"cpu per MB: {a.tokens}-token requests, {a.layers} aux layers + final, hidden "
          f"{a.hidden}, bf16, codec {a.codec} ({mb_req:.1f} MiB a request, {a.requests} a "
          f"round), {a.rounds} rounds a tree, alternated; {os.cpu_count()} CPUs; load "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    got: dict[str, list[dict]] = {s: [] for s in srcs}
    keep = ("tokens", "layers", "hidden", "codec", "work_root", "chunk_root")
    argv = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keep]
    for i in range(a.rounds):
        for s in srcs if i % 2 == 0 else srcs[::-1]:
            cmd = [sys.executable, __file__, *argv, "--requests", str(a.requests), "--worker", s]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode:
                raise SystemExit(f"{s}: {res.stderr[-2000:]}")
            got[s].append(json.loads(res.stdout.strip().splitlines()[-1]))
    shas = {s: {r.pop("chunk_sha256") for r in v} for s, v in got.items()}
    keys = list(got[srcs[0]][0])
    med = {
        s: {k: statistics.median(r.get(k, 0.0) for r in v) for k in keys} for s, v in got.items()
    }
    print(f"{'ms per MB of states (median)':42}" + "".join(f"{s[-24:]:>26}" for s in srcs))
    for k in keys:
        print(f"  {k:40}" + "".join(f"{med[s][k]:26.3f}" for s in srcs))
    same = len({frozenset(v) for v in shas.values()}) == 1 and all(
        len(v) == 1 for v in shas.values()
    )
    print(f"chunk sha256 {'identical in every run and tree' if same else 'DIFFERS'}: "
          f"{sorted(set().union(*shas.values()))[0][:16]}...")  # fmt: skip
    base = srcs[0]
    for s in srcs[1:]:
        print(f"{s}/{base} checks+copy ms/MB: {med[s]['total']:.3f} vs {med[base]['total']:.3f}, "
              f"ratio {med[s]['total'] / med[base]['total']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
