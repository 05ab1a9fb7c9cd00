"""The stream reader alone, per loader worker (issue 60, item 3): GB/s of raw states one
worker reads from a finished run, end to end and step by step, against the floor any
reader pays (the files' bytes read and hashed, nothing else), in one invocation:

    python bench/stream_reader.py --work /tmp/sr-bench [--old /tmp/sr-old/src]

The run: ``--chunks`` chunk files a codec (``lossless`` and ``none``) of ``--chunk-mb`` MB
of raw states each, written by the project's own ``ChunkWriter`` (bf16, hidden 4096, 3 aux
layers: an 8B EAGLE-3 shape; records of 128-1024 tokens), announced in a stream journal
whose pass has ended -- what a trainer reads once the workflow is done.  The states are
seeded normals (bf16's exponent plane compresses as a real run's does, within a few %).

Each figure is taken in a fresh process (no hash cache, no verdict from an earlier round)
from warm page cache (the files were just written or read: a trainer reading a chunk
the workflow just wrote finds it there too), ``--rounds`` times, the tree alternated
when ``--old`` is given (that tree's ``src`` first on ``PYTHONPATH``: before/after in one
run, same files, same load).  Figures, each GB/s of raw states (what the trainer gets,
whatever the codec stored) and the time of each step over all the records:

* ``floor``: every file's bytes read 1 MiB at a time and hashed (``sha256_file``);
* ``read`` / ``sha256``: the read alone (into one buffer), the hash alone (of bytes in
  memory);
* ``decode``: every record through ``ChunkReader`` (no hash), tensors as the reader gets
  them;
* ``sample``: the records made samples (``StreamDataset._sample``, layout raw);
* ``send``: every record as a loader worker makes it and pickles it for the trainer
  (torch's ``ForkingPickler``, which moves storages to shared memory), no hash: the
  worker's own CPU a record, without the trainer process competing for the cores;
* ``dataset``: ``StreamDataset`` iterated in the process (hash, decode, samples);
* ``spawn``: a ``StreamLoader`` with one worker over one empty sample: the worker's
  start and stop, which ``loader1`` pays once a pass (a trainer once an epoch);
* ``loader1``: ``StreamLoader`` with one worker (``batch_size=None``, as
  bench/stream_budget.py's consumer): the dataset plus moving each sample to the trainer
  process (the tensors go through shared memory).

The ratio printed is each figure over the floor of the same round.  Last line per codec:
``stream reader <codec>: loader1 X GB/s/worker, floor Y GB/s, ratio Z`` (loader1's steady
rate: the spawn left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9
HIDDEN, N_AUX = 4096, 3
STATES = ("hidden_states", "aux_hidden_states", "prenorm_hidden_states")
STEPS = ("floor", "read", "sha256", "decode", "sample", "send", "dataset", "spawn", "loader1")


def build(run_dir: Path, codec: str, chunks: int, chunk_mb: int, seed: int) -> dict:
    """The finished run: chunk files, sidecar-free, announced; the pass ended."""
    import random

    import torch

    from hsextract.chunks import ChunkWriter
    from hsextract.stream import journal

    per_token = (HIDDEN + N_AUX * HIDDEN) * 2
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = {"hidden": HIDDEN, "aux": N_AUX * HIDDEN, "prenorm": False, "dtype": "bfloat16"}
    raw = 0
    for i in range(chunks):
        lens: list[int] = []
        while sum(lens) * per_token < chunk_mb * 1e6:
            lens.append(rng.randint(128, 1024))
        path = run_dir / "hidden" / f"chunk_{i:05d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = [f"r{i}-{j}" for j in range(len(lens))]
        meta = {"record_ids": json.dumps(ids), "aux_layers": json.dumps([2, 18, 33]),
                "hidden_size": str(HIDDEN), "num_layers": "36"}  # fmt: skip
        w = ChunkWriter(path, lens, hidden_size=HIDDEN, n_aux=N_AUX, dtype=torch.bfloat16,
                        metadata=meta, codec=codec)  # fmt: skip
        for j, t in enumerate(lens):
            hid = (torch.randn(t, HIDDEN, generator=gen) * 0.7).to(torch.bfloat16)
            aux = (torch.randn(t, N_AUX * HIDDEN, generator=gen) * 0.3).to(torch.bfloat16)
            w.put(j, torch.arange(t, dtype=torch.int32), torch.ones(t, dtype=torch.uint8),
                  hid, aux)  # fmt: skip
        sha = w.finish()
        raw += sum(lens) * per_token
        journal.announce(run_dir, chunk=path.stem, path=f"hidden/{path.name}", sha256=sha,
                         records=len(lens), tokens=sum(lens), content_digest=f"d{i}",
                         n_chunks=chunks, shapes=shapes)  # fmt: skip
    return {"raw_bytes": raw}


def files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "hidden").glob("chunk_*.safetensors"))


def sample_bytes(sample: dict) -> int:
    """The raw states a sample hands out (ids and masks are not states)."""
    return sum(v.numel() * v.element_size() for k, v in sample.items() if k in STATES)


def child(step: str, run_dir: Path) -> dict:
    """One figure, in this (fresh) process: seconds and raw bytes handed out."""
    from hsextract.chunkfile import sha256_file
    from hsextract.chunks import ChunkReader
    from hsextract.stream.journal import read_state, stream_dir
    from hsextract.stream.reader import StreamDataset

    paths = files(run_dir)
    lines = sorted(read_state(stream_dir(run_dir)).chunks.values(), key=lambda c: c["seq"])
    raw = 0
    t0 = time.perf_counter()
    if step == "floor":
        for p, c in zip(paths, lines, strict=True):
            assert sha256_file(p) == c["sha256"]
    elif step == "read":
        buf = memoryview(bytearray(1 << 20))
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            pos = 0
            while n := os.preadv(fd, [buf], pos):
                pos += n
            os.close(fd)
    elif step in ("decode", "sample"):
        ds = StreamDataset(run_dir, layout="raw")
        for p, c in zip(paths, lines, strict=True):
            r = ChunkReader(p, verify=False)
            for j in range(len(r)):
                s = r[j] if step == "decode" else ds._sample(r[j], c)
                raw += sample_bytes(s)
    elif step == "send":
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory pickling

        try:
            from hsextract.stream.reader import worker_record
        except ImportError:  # a tree before it: what its worker did

            def worker_record(r: ChunkReader, j: int) -> dict:
                return r[j]

        for p in paths:
            r = ChunkReader(p, verify=False)
            for j in range(len(r)):
                s = worker_record(r, j)
                ForkingPickler.dumps(s)  # what the worker's queue does: into shared memory
                raw += sample_bytes(s)
    elif step == "dataset":
        for s in StreamDataset(run_dir, layout="raw"):
            raw += sample_bytes(s)
    elif step == "loader1":
        from hsextract.stream.loader import StreamLoader

        for s in StreamLoader(StreamDataset(run_dir, layout="raw"), batch_size=None,
                              num_workers=1):  # fmt: skip
            raw += sample_bytes(s)
    elif step == "spawn":
        from torch.utils.data import IterableDataset

        from hsextract.stream.loader import StreamLoader

        class One(IterableDataset):
            def __iter__(self):  # type: ignore[override]
                yield {"x": 0}

        for _ in StreamLoader(One(), batch_size=None, num_workers=1):
            pass
    else:
        raise SystemExit(f"unknown step {step}")
    return {"s": time.perf_counter() - t0, "raw": raw}


def hash_alone(run_dir: Path) -> dict:
    """The hash of bytes already in memory (the file read before the clock starts)."""
    import hashlib

    total = 0.0
    for p in files(run_dir):
        data = p.read_bytes()
        t = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        total += time.perf_counter() - t
    return {"s": total, "raw": 0}


def run_child(step: str, run_dir: Path, src: str | None) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, __file__, "--child", step, "--work", str(run_dir)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/hsextract-stream-reader")
    ap.add_argument("--codecs", default="lossless,none")
    ap.add_argument("--chunks", type=int, default=2, help="chunk files a codec")
    ap.add_argument("--chunk-mb", type=int, default=128, help="raw states a chunk (MB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--old", default=None, help="another tree's src: before/after alternated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = hash_alone(Path(args.work)) if args.child == "sha256" else None
        print(json.dumps(res or child(args.child, Path(args.work))))
        return
    work = Path(args.work)
    trees = {"new": None, **({"old": args.old} if args.old else {})}
    steps = args.steps.split(",")
    report: dict = {"load": os.getloadavg(), "cpus": os.cpu_count()}
    for codec in args.codecs.split(","):
        run_dir = work / codec
        stamp = run_dir / "built.json"
        want = {"chunks": args.chunks, "chunk_mb": args.chunk_mb, "seed": args.seed}
        if not stamp.exists() or json.loads(stamp.read_text()).get("want") != want:
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            info = build(run_dir, codec, args.chunks, args.chunk_mb, args.seed)
            stamp.write_text(json.dumps({"want": want, **info}))
        raw = json.loads(stamp.read_text())["raw_bytes"]
        disk = sum(p.stat().st_size for p in files(run_dir))
        times: dict = {t: {s: [] for s in steps} for t in trees}
        for _ in range(args.rounds):
            for tree, src in trees.items():
                for s in steps:
                    if tree == "old" and s in ("floor", "read", "sha256"):
                        continue  # the same code in both trees
                    r = run_child(s, run_dir, src)
                    if r["raw"] and r["raw"] != raw:
                        raise SystemExit(f"{codec} {s} ({tree}): {r['raw']} bytes, not {raw}")
                    times[tree][s].append(r["s"])
        load = os.getloadavg()[0]
        print(f"{codec}: {raw / GB:.3f} GB raw in {disk / GB:.3f} GB of files; load {load:.2f} "
              f"on {os.cpu_count()} cpus; median of {args.rounds}")  # fmt: skip
        floor = statistics.median(times["new"]["floor"]) if "floor" in steps else None
        res: dict = {"raw_bytes": raw, "file_bytes": disk}
        for tree in trees:
            for s in steps:
                if not times[tree][s]:
                    continue
                med = statistics.median(times[tree][s])
                ratio = f"  x{floor / med:.2f} of floor" if floor else ""
                print(f"  {tree:3s} {s:8s} {med:7.3f} s  {raw / med / GB:6.2f} GB/s{ratio}")
                res[f"{tree}.{s}"] = {"s": times[tree][s], "gb_per_s": raw / med / GB}
            if times[tree].get("spawn") and times[tree].get("loader1"):
                # The worker's start and stop are once a pass: its steady rate without them.
                med = statistics.median(times[tree]["loader1"]) - statistics.median(
                    times[tree]["spawn"]
                )
                ratio = f"  x{floor / med:.2f} of floor" if floor else ""
                print(f"  {tree:3s} {'loader1-spawn':8s} {med:7.3f} s  {raw / med / GB:6.2f} GB/s"
                      f"{ratio}")  # fmt: skip
                res[f"{tree}.steady"] = {"gb_per_s": raw / med / GB}
        report[codec] = res
        if "loader1" in steps and floor:
            lo = res.get("new.steady", res["new.loader1"])["gb_per_s"]
            print(f"stream reader {codec}: loader1 {lo:.2f} GB/s/worker, floor "
                  f"{raw / floor / GB:.2f} GB/s, ratio {lo / (raw / floor / GB):.2f}")  # fmt: skip
    (work / "stream_reader.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
