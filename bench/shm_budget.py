"""The /dev/shm budget under load (issue 40): grants a second and waits of
``hsextract.budget.SharedByteBudget`` when the budget binds, against a byte semaphore in
memory (no ledger, no lease: the most any budget could give) in the same run.

Two scenarios, each ``--seconds`` long after a 2 s warm-up, every budget on one ledger in a
dir of its own under ``--work-root`` (removed at the end):

* ``binding``: ``--jobs`` budgets (chunk jobs), each with ``--threads`` sender threads that
  take ``--request-mb`` and hold it for a random 0.4-1.6 x ``--hold-s`` (a request's life:
  the server's queue and pass, the pieces read), then ask again; the demand is above
  ``--capacity-mb``, so the budget binds evenly across jobs.  The baseline runs the same
  threads on one ``threading.Condition``-guarded counter of the same capacity (it lets a
  releasing thread take its bytes straight back: fast, and unfair).
* ``starve``: 4 budgets of 12 threads taking 100 bytes for 2 ms in a loop and one thread
  of a 5th taking 600, on 1,000 bytes: the demand never fits, and the large request
  waits for room that small ones keep taking.  Figures: its grants and longest wait.

The jobs are threads of this process, each with its own budget (its own lease, ``flock``
and watcher), not processes: the ledger's protocol is the same, the GIL is shared.  Last
line: ``budget/in-memory grants a second: X.XX``.

    python bench/shm_budget.py
    python bench/shm_budget.py --threads 160 --hold-s 0.05 --seconds 8
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

MB = 1 << 20


class MemorySemaphore:
    """The baseline: a byte semaphore in memory, waiters woken as bytes come back."""

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self.cv = threading.Condition()

    def acquire(self, nbytes: int) -> int:
        with self.cv:
            self.cv.wait_for(lambda: self.free >= nbytes)
            self.free -= nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        with self.cv:
            self.free += nbytes
            self.cv.notify_all()


def run(
    budgets: list, plan: list[tuple[int, int, float]], warm_s: float, seconds: float
) -> dict[int, tuple[int, float]]:
    """Threads ``(budget index, bytes, hold s)`` acquire, hold and release in a loop;
    per budget index, (grants, longest wait s) over ``seconds`` after ``warm_s`` (a wait
    still under way at the end included)."""
    stop, counting = threading.Event(), threading.Event()
    got: dict[int, list] = {i: [0, 0.0] for i, _, _ in plan}
    lock = threading.Lock()
    asking: dict[int, float] = {}  # per thread: when its acquire under way began

    def loop(i: int, nbytes: int, hold: float, seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            asking[seed] = time.perf_counter()
            token = budgets[i].acquire(nbytes)
            waited = time.perf_counter() - asking.pop(seed)
            time.sleep(hold * r.uniform(0.4, 1.6))
            budgets[i].release(token)
            if counting.is_set():
                with lock:
                    got[i][0] += 1
                    got[i][1] = max(got[i][1], waited)

    threads = [threading.Thread(target=loop, args=(*p, k), daemon=True) for k, p in enumerate(plan)]
    for t in threads:
        t.start()
    time.sleep(warm_s)
    counting.set()
    time.sleep(seconds)
    counting.clear()
    # A thread that never got through waited too: the longest wait counts it.
    now = time.perf_counter()
    for k, since in list(asking.items()):
        i = plan[k][0]
        got[i][1] = max(got[i][1], now - since)
    stop.set()
    for t in threads:
        t.join()
    return {i: (n, w) for i, (n, w) in got.items()}


def scenario(
    make: Callable[[int], list], plan: list[tuple[int, int, float]], a
) -> dict[int, tuple[int, float]]:
    budgets = make(max(i for i, _, _ in plan) + 1)
    try:
        return run(budgets, plan, 2.0, a.seconds)
    finally:
        for b in budgets:
            if hasattr(b, "close"):
                b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=160, help="sender threads a job")
    ap.add_argument("--request-mb", type=float, default=5.5, help="a request's pieces")
    ap.add_argument("--capacity-mb", type=float, default=2000)
    ap.add_argument("--hold-s", type=float, default=0.5, help="a request's mean hold")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--work-root", default="/dev/shm")
    a = ap.parse_args()
    from hsextract.budget import PATIENCE_S, SharedByteBudget

    work = Path(a.work_root) / f"hsextract-shm-budget-{os.getuid()}-{os.getpid()}"
    work.mkdir(mode=0o700)
    req, cap = int(a.request_mb * MB), int(a.capacity_mb * MB)
    print(f"shm budget: {a.jobs} jobs x {a.threads} threads, {a.request_mb} MB a request "
          f"held ~{a.hold_s} s, {a.capacity_mb:.0f} MB (demand "
          f"{a.jobs * a.threads * a.request_mb:.0f} MB), patience {PATIENCE_S} s, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    try:
        plan = [(j, req, a.hold_s) for j in range(a.jobs) for _ in range(a.threads)]
        rates = {}
        for name, make in (
            ("in-memory", lambda n: [MemorySemaphore(cap)] * n),
            ("budget", lambda n: [SharedByteBudget(work / "binding", cap) for _ in range(n)]),
        ):
            (work / "binding").mkdir(exist_ok=True)
            got = scenario(make, plan, a)
            rates[name] = sum(n for n, _ in got.values()) / a.seconds
            print(f"  binding, {name:>9}: {rates[name]:8.1f} grants/s (ideal "
                  f"{cap / req / a.hold_s:.0f}), longest wait "
                  f"{max(w for _, w in got.values()):.2f} s")  # fmt: skip
        (work / "starve").mkdir()
        plan = [(i % 4, 100, 0.002) for i in range(12)] + [(4, 600, 0.002)]
        got = scenario(
            lambda n: [SharedByteBudget(work / "starve", 1000) for _ in range(n)],
            plan, a,
        )  # fmt: skip
        small = [got[i] for i in range(4)]
        print(f"  starve: the 600-byte request {got[4][0]} grants, longest wait "
              f"{got[4][1]:.2f} s; the 100-byte ones {sum(n for n, _ in small)} grants, "
              f"longest wait {max(w for _, w in small):.2f} s")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"budget/in-memory grants a second: {rates['budget'] / rates['in-memory']:.2f}")


if __name__ == "__main__":
    main()
