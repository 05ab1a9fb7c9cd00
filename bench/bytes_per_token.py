"""Benchmark bytes on disk per token of a chunk file vs the ideal 2*H*(k+1) for bf16.

Writes a real chunk file with ``hsextract.chunks.ChunkWriter`` (what ``extract_chunk``
uses) at DeepSeek-V3's shape: H=7168, k=3 aux layers + final, bf16, records with the seed's
length distribution (lognormal around ~2,350 tokens, capped at 8,192), record ids like the
pipeline's, the full contract metadata.  Bytes on disk are the allocated blocks after
``finish`` (fsync), ``st_blocks * 512``; the file size is printed too.  The demo's H=64 is
measured the same way for scale (there the 5 bytes/token of ids + loss mask are ~1%).

Usage: .venv/bin/python bench/bytes_per_token.py [--records 12] [--dir /tmp]
Last line: ``disk/ideal bytes_per_token ratio: X.XXX`` (H=7168).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from hsextract.chunks import ChunkWriter, check_chunk

K = 3


def write_chunk(path: Path, h: int, lengths: list[int]) -> tuple[int, int, int]:
    meta = {
        "record_ids": json.dumps([f"shard_03.jsonl:{1000 + j}" for j in range(len(lengths))]),
        "aux_layers": json.dumps([2, 30, 58]),
        "hidden_size": str(h),
        "model": "/models/deepseek-ai/DeepSeek-V3",
        "fingerprint": "3f9c2a71d0b4",
        "engine": "sglang",
        "format_version": "1",
        "dtype": "bfloat16",
        "chunk": path.stem,
    }
    w = ChunkWriter(path, lengths, hidden_size=h, n_aux=K, dtype=torch.bfloat16, metadata=meta)
    g = torch.Generator().manual_seed(0)
    try:
        for j, n in enumerate(lengths):
            ids = torch.randint(0, 129_280, (n,), generator=g)
            mask = torch.ones(n, dtype=torch.uint8)
            hid = torch.randn(n, h, generator=g).to(torch.bfloat16)
            aux = torch.randn(n, K * h, generator=g).to(torch.bfloat16)
            w.put(j, ids, mask, hid, aux)
        w.finish()
    except BaseException:
        w.abort()
        raise
    tokens = check_chunk(path, expect_records=len(lengths))["tokens"]
    st = os.stat(path)
    return tokens, st.st_blocks * 512, st.st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=12)
    ap.add_argument("--dir", default="/tmp", help="a directory on the disk to measure")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1900), 0.65, args.records), 16, 8192)
    lengths = [int(n) for n in lengths]
    tmp = Path(tempfile.mkdtemp(prefix="hsextract-bench-bpt-", dir=args.dir))
    try:
        ratio = 0.0
        for h in (64, 7168):
            tokens, disk, size = write_chunk(tmp / f"chunk_{h:05d}.safetensors", h, lengths)
            ideal = 2 * h * (K + 1)
            ratio = disk / tokens / ideal
            print(
                f"H={h:>5} k={K} bf16: {len(lengths)} records, {tokens} tokens; file "
                f"{size} B ({size / tokens:.2f} B/token), on disk {disk} B "
                f"({disk / tokens:.2f} B/token); ideal 2*H*(k+1) = {ideal} B/token; "
                f"disk/ideal {ratio:.4f}, size/ideal {size / tokens / ideal:.4f}"
            )
        print(f"disk/ideal bytes_per_token ratio: {ratio:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
