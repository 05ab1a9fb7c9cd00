"""Benchmark packing: dump pieces in /dev/shm -> one chunk file on disk, vs ``cp`` of the pieces.

Writes realistic dump pieces with ``hsextract.capture.DumpWriter`` (H=7168, 3 aux layers +
final, bf16; records of 1,500-5,000 tokens scheduled SGLang-style into 1,024-token extend
passes, so each record arrives as several pieces; ~2.2 GB in all), then times, per trial:

* ``pack``: exactly what ``hsextract.client.extract_chunk`` runs for a chunk, minus HTTP --
  a thread pool (``client.requests_in_flight`` = 8 workers) doing ``read_pieces`` (opens
  the pieces, reads the ids) -> ``assemble`` (parity, shapes, dtype, aux layers,
  finiteness, a slice at a time; uncompressed, each checked slice written into the chunk
  file from that buffer: ``ChunkWriter.row_sink``) -> piece unlinking ->
  ``ChunkWriter.put_files`` (the ids and mask) -> closing them, per record, then
  ``ChunkWriter.finish`` (fsync, sha256, rename) and ``check_chunk``;
  With ``--codec lossless`` (or ``fp8``) ``put_files`` reads and encodes the rows;
* ``cp``: ``cp -r`` of the same piece files to the same disk, then ``sync -f`` so the bytes
  are as durable as the chunk file's (its ``finish`` fsyncs).  ``cp`` alone (page cache
  only) is printed too.

Fairness: before each timed side the pieces are freshly written to /dev/shm, the previous
side's output is deleted, then ``sync`` and ``echo 1 > /proc/sys/vm/drop_caches`` (when
allowed; the output says whether it was), so both start with a clean page cache for the
disk and no dirty pages.  The order of the two sides alternates between trials.

Usage: .venv/bin/python bench/pack.py [--gb 2.2] [--trials 3] [--disk-dir /tmp] [--profile]
       [--codec none|lossless|fp8]
Last line: ``pack/cp throughput ratio: X.XX`` (medians; ``cp`` includes its sync).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hsextract.capture import DumpWriter
from hsextract.chunks import ChunkReader, ChunkWriter, check_chunk
from hsextract.client import Geometry, assemble, read_pieces

H = 7168
AUX = [2, 30, 58]  # SGLang's EAGLE-3 default for 61 layers
DTYPE = torch.bfloat16
BYTES_PER_TOKEN = 2 * H * (len(AUX) + 1) + 8  # + int64 id


def make_records(target_bytes: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out: list[list[int]] = []
    total = 0
    while total * BYTES_PER_TOKEN < target_bytes:
        n = rng.randint(1500, 5000)
        out.append([rng.randrange(129_280) for _ in range(n)])
        total += n
    return out


def write_pieces(dump_dir: Path, records: list[list[int]], rids: list[str], prefill: int) -> int:
    """SGLang-like continuous batching + chunked prefill into ``dump_dir``; returns bytes."""
    g = torch.Generator().manual_seed(1)
    pool = [torch.randn(prefill, H, generator=g).to(DTYPE) for _ in range(len(AUX) + 1)]
    writer = DumpWriter(dump_dir, AUX, threads=2)
    done = [0] * len(records)
    j_next, running, n_pass = 0, [], 0
    try:
        while j_next < len(records) or running:
            while len(running) < 8 and j_next < len(records):
                running.append(j_next)
                j_next += 1
            batch, starts, lens, left = [], [], [], prefill
            for j in running:
                if left == 0:
                    break
                n = min(len(records[j]) - done[j], left)
                batch.append(j)
                starts.append(done[j])
                lens.append(n)
                left -= n
            total = sum(lens)
            ids = torch.cat(
                [
                    torch.tensor(records[j][s : s + n])
                    for j, s, n in zip(batch, starts, lens, strict=True)
                ]
            )
            # Values differ by pass offset, so records are not all alike.
            rot, n_pass = (n_pass * 97) % prefill, n_pass + 1
            hidden, *aux = (torch.roll(p, rot, 0)[:total] for p in pool)
            writer.write_batch([rids[j] for j in batch], starts, lens, ids, hidden, aux, AUX)
            for j, n in zip(batch, lens, strict=True):
                done[j] += n
            running = [j for j in running if done[j] < len(records[j])]
    finally:
        writer.close()
    return sum(p.stat().st_size for p in dump_dir.rglob("*") if p.is_file())


def settle() -> bool:
    """sync, then drop the page cache if we may; True if dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def pack(
    dump_dir: Path,
    out: Path,
    records: list[list[int]],
    rids: list[str],
    threads: int,
    codec: str = "none",
) -> str:
    """The client's packing path for one chunk (extract_chunk minus HTTP)."""
    geo = Geometry(hidden_size=H, num_layers=61, aux_layers=AUX, dtype=DTYPE)
    meta = {
        "record_ids": json.dumps([f"rec-{j}" for j in range(len(records))]),
        "aux_layers": json.dumps(AUX),
        "hidden_size": str(H),
        "model": "bench",
        "fingerprint": "bench",
        "engine": "reference",
        "dtype": "bfloat16",
        "chunk": out.stem,
    }
    writer = ChunkWriter(
        out,
        [len(r) for r in records],
        hidden_size=H,
        n_aux=len(AUX),
        dtype=DTYPE,
        metadata=meta,
        codec=codec,
    )

    def one(j: int) -> None:
        rid_dir = dump_dir / rids[j]
        sink = writer.row_sink(j)  # uncompressed: rows written as they are checked
        try:  # Client.extract_dump
            pieces = read_pieces(rid_dir, len(records[j]), 60.0)
            dump = assemble(pieces, records[j], geo, f"record {j}", rows_to=sink)
        finally:
            shutil.rmtree(rid_dir, ignore_errors=True)
        with dump:  # extract_chunk: the rest of the record, then free the pieces
            mask = torch.ones(len(records[j]), dtype=torch.uint8)
            writer.put_files(
                j, dump.ids, mask, dump.hidden, dump.aux, dump.dtype, rows_sunk=sink is not None
            )

    try:
        if threads <= 1:  # inline: what --profile uses, so cProfile sees the work
            for j in range(len(records)):
                one(j)
        else:
            with ThreadPoolExecutor(max_workers=threads) as ex:
                for f in [ex.submit(one, j) for j in range(len(records))]:
                    f.result()
        sha = writer.finish()
    except BaseException:
        writer.abort()
        raise
    check_chunk(out, expect_records=len(records))
    return sha


def timed_cp(src: Path, dst: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    t1 = time.perf_counter()
    subprocess.run(["sync", "-f", str(dst)], check=True)
    return t1 - t0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.2, help="piece bytes per chunk (GB)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=1024, help="tokens per extend pass")
    ap.add_argument("--threads", type=int, default=8, help="client.requests_in_flight")
    ap.add_argument("--disk-dir", default="/tmp", help="where the chunk file and cp go")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument(
        "--codec",
        default="none",
        choices=["none", "lossless", "fp8"],
        help="storage.codec of the chunk file (cp always copies the uncompressed pieces)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the first pack trial (run inline, one thread)",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    records = make_records(int(args.gb * 1e9), seed=0)
    tokens = sum(len(r) for r in records)
    shm = Path(tempfile.mkdtemp(prefix="hsextract-bench-pack-", dir=args.shm_dir))
    disk = Path(tempfile.mkdtemp(prefix="hsextract-bench-pack-", dir=args.disk_dir))
    os.chmod(shm, 0o700)
    dump = shm / "dump"
    res: dict[str, list[float]] = {"pack": [], "cp": [], "cp_nosync": []}
    shas = set()
    dropped = True
    try:

        def fresh_pieces() -> tuple[list[str], int]:
            shutil.rmtree(dump, ignore_errors=True)
            dump.mkdir(mode=0o700)
            rids = [f"chunk_00000-{j:06d}-{uuid.uuid4().hex[:8]}" for j in range(len(records))]
            return rids, write_pieces(dump, records, rids, args.prefill)

        for trial in range(args.trials):
            for side in ("cp", "pack") if trial % 2 == 0 else ("pack", "cp"):
                rids, nbytes = fresh_pieces()
                n_pieces = sum(1 for _ in dump.rglob("*.safetensors"))
                for p in disk.iterdir():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                dropped &= settle()
                if side == "cp":
                    t_cp, t = timed_cp(dump, disk / "cp")
                    res["cp_nosync"].append(t_cp)
                    res["cp"].append(t)
                else:
                    out = disk / "chunk_00000.safetensors"
                    prof = cProfile.Profile() if args.profile and not res["pack"] else None
                    t0 = time.perf_counter()
                    if prof:
                        prof.enable()
                    threads = 1 if prof else args.threads
                    shas.add(pack(dump, out, records, rids, threads, args.codec))
                    if prof:
                        prof.disable()
                    t = time.perf_counter() - t0
                    res["pack"].append(t)
                    if prof:
                        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)
                    # Spot check: a record's bytes came through unchanged.
                    r = ChunkReader(out)[len(records) // 2]
                    assert r["input_ids"].tolist() == records[len(records) // 2]
                    assert r["hidden_states"].shape == (len(records[len(records) // 2]), H)
                rate = nbytes / t / 1e9
                print(f"trial {trial} {side:>4}: {t:6.2f} s  {rate:5.2f} GB/s", flush=True)
        med = {k: statistics.median(v) for k, v in res.items()}
        size = (disk / "chunk_00000.safetensors").stat().st_size
        print(
            f"pieces: {len(records)} records, {tokens} tokens, {n_pieces} pieces, "
            f"{nbytes / 1e9:.3f} GB in {args.shm_dir}; chunk file {size / 1e9:.3f} GB on "
            f"{args.disk_dir}; H={H}, k={len(AUX)}, bf16, prefill {args.prefill}, "
            f"{args.threads} client threads, codec {args.codec} "
            f"(pieces/chunk bytes {nbytes / size:.3f})"
        )
        print(f"page cache dropped before each side: {'yes' if dropped else 'NO (not allowed)'}")
        print(f"chunk sha256: {sorted(shas)}")
        for key, what in (
            ("pack", "pack (read+assemble+put+finish)"),
            ("cp", "cp -r + sync -f"),
            ("cp_nosync", "cp -r alone (page cache)"),
        ):
            runs = ", ".join(f"{t:.2f}" for t in res[key])
            print(
                f"{what:<32} median {med[key]:.2f} s, {nbytes / med[key] / 1e9:.2f} GB/s ({runs})"
            )
        print(f"pack/cp throughput ratio: {med['cp'] / med['pack']:.2f}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
