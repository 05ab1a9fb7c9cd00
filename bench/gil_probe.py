"""How much the capture's writer threads slow the server's Python (issue 40, server side).

Inside SGLang the dump writer (``hsextract.capture.DumpWriter``: a D2H copier thread and
``HSEXTRACT_CAPTURE_THREADS`` writer threads) shares one process, and so one GIL, with the
scheduler's main thread, whose Python launches every forward.  A slower launch is GPU idle
wherever the forward waits on the device mid-launch.  This bench tells the GIL's share of
that apart from the rest of the host: a main thread runs a fixed piece of pure Python
(dict updates, as the scheduler's bookkeeping) once alone, then once per pass right after
handing a pass to a ``DumpWriter`` (``write_batch``, the real one), while
``capture_gpu.Consumer`` deletes the pieces as a client would (and checks their tiling).
On CUDA the pass comes from the GPU through the real D2H path; without, the CPU path.

The baseline is the same loop alone, in the same run.  One line per (pieces a pass, writer
threads): ``busy X ms alone, Y ms beside the writer (R.RRx)``, medians.  Output goes to a
dir of its own under ``--dump-root`` (default /dev/shm), removed at the end.

    python3 bench/gil_probe.py                        # 7B shape: hidden 3584, 5 aux layers
    python3 bench/gil_probe.py --pieces 8,62 --threads 1,2,4 --passes 20
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# bench/capture_gpu.py puts the repo's src/ on sys.path; its Consumer plays the client.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from capture_gpu import Consumer  # noqa: E402

from hsextract import capture  # noqa: E402


def busy(n: int) -> float:
    """Seconds for ``n`` dict updates: Python that holds the GIL throughout."""
    t0 = time.perf_counter()
    d: dict[int, int] = {}
    for i in range(n):
        d[i & 1023] = d.get(i & 1023, 0) + i
    return time.perf_counter() - t0


def probe(args: argparse.Namespace, pieces: int, threads: int) -> tuple[float, float]:
    """Median busy-loop seconds alone and right after each pass's hand-over."""
    dump = Path(tempfile.mkdtemp(dir=args.dump_root, prefix="hsextract-gil-probe-"))
    writer = capture.DumpWriter(dump, list(range(args.aux)), threads=threads)
    consumer = Consumer(dump, {})
    try:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hidden = torch.randn(args.tokens, args.hidden, device=dev).to(torch.bfloat16)
        aux = [hidden] * args.aux
        ids = torch.arange(args.tokens, device=dev)
        lens = [args.tokens // pieces] * pieces
        lens[-1] += args.tokens - sum(lens)
        alone = [busy(args.loop) for _ in range(args.passes)]
        consumer.start()
        beside = []
        for p in range(args.passes):
            rids = [f"p{p}r{j}" for j in range(pieces)]
            writer.write_batch(rids, [0] * pieces, lens, ids, hidden, aux)
            beside.append(busy(args.loop))
        writer.flush()
        if consumer.errors:
            raise RuntimeError(f"the pieces did not tile their requests: {consumer.errors[:3]}")
        return statistics.median(alone), statistics.median(beside)
    finally:
        consumer.stop.set()
        if consumer.is_alive():
            consumer.join()
        writer.close()
        shutil.rmtree(dump, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", default="62,256", help="pieces (requests) a pass")
    ap.add_argument("--threads", default="1,4", help="writer threads a DumpWriter")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a pass")
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--aux", type=int, default=5, help="aux layers")
    ap.add_argument("--loop", type=int, default=200_000, help="dict updates a busy loop")
    ap.add_argument("--dump-root", default="/dev/shm")
    args = ap.parse_args()
    ratios = []
    for pieces in (int(x) for x in args.pieces.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            alone, beside = probe(args, pieces, threads)
            ratios.append(beside / alone)
            print(
                f"pieces/pass {pieces:4d} threads {threads}: busy {alone * 1e3:.1f} ms alone, "
                f"{beside * 1e3:.1f} ms beside the writer ({beside / alone:.2f}x)",
                flush=True,
            )
    print(f"gil probe: worst beside/alone ratio {max(ratios):.2f}")


if __name__ == "__main__":
    main()
