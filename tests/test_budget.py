"""Budget preflight: both budgets fail early with the numbers and the key to change."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from hsextract import budget
from hsextract.budget import BudgetError, bytes_per_token, max_in_flight, preflight

GB = 10**9


def test_bytes_per_token_matches_the_seed_scale() -> None:
    # DeepSeek-V3: H=7168, 3 aux + final, bf16: ~57 KB/token -> ~5 TB for 87.8 M tokens.
    assert bytes_per_token(7168, 3, "bfloat16") == 2 * 7168 * 4 + 4 + 1 == 57349
    assert bytes_per_token(64, 3, "torch.float32") == 4 * 64 * 4 + 5
    assert 5.0e12 < 87_800_000 * bytes_per_token(7168, 3, "bf16") < 5.1e12
    with pytest.raises(BudgetError, match="model.dtype"):
        bytes_per_token(64, 3, "int4")


def _args(tmp_path: Path, **kw) -> dict:
    args = dict(
        total_tokens=87_800_000, max_len=8192, hidden_size=7168, n_aux=3, dtype="bfloat16",
        output_root=tmp_path / "results", dump_dir=tmp_path / "shm" / "dump",
        requests_in_flight=8, shm_budget_bytes=64 * GB,
    )  # fmt: skip
    args.update(kw)
    return args


def _patch_free(monkeypatch, free: dict[str, int]) -> list[Path]:
    """Patch the module-level probe; free space is looked up by the path's last part."""
    seen: list[Path] = []

    def fake(path: Path) -> int:
        seen.append(Path(path))
        return free[Path(path).name]

    monkeypatch.setattr(budget, "probe_free_bytes", fake)
    return seen


def test_preflight_passes_and_reports(tmp_path: Path, monkeypatch) -> None:
    seen = _patch_free(monkeypatch, {"results": 6_000 * GB, "dump": 100 * GB})
    r = preflight(**_args(tmp_path))
    assert {p.name for p in seen} == {"results", "dump"}  # the probe really was used
    assert r["bytes_per_token"] == 57349
    # tensors (int64 ids) plus a header allowance per piece: one pass, so up to 4 pieces
    assert r["dump_bytes_per_request"] == 8192 * (2 * 7168 * 4 + 8) + 4 * budget.PIECE_OVERHEAD
    assert r["requests_that_fit_budget"] == 64 * GB // r["dump_bytes_per_request"]


def test_output_budget_fails_with_numbers_and_key(tmp_path: Path, monkeypatch) -> None:
    _patch_free(monkeypatch, {"results": 4_000 * GB, "dump": 100 * GB})
    with pytest.raises(BudgetError) as e:
        preflight(**_args(tmp_path))
    msg = str(e.value)
    assert "output_root" in msg and "87,800,000 tokens" in msg and "4.0 TB" in msg
    assert "dump" not in msg.split("output:")[0]


def test_shm_budget_fails_with_numbers_and_key(tmp_path: Path, monkeypatch) -> None:
    _patch_free(monkeypatch, {"results": 6_000 * GB, "dump": 100 * GB})
    with pytest.raises(BudgetError) as e:
        preflight(**_args(tmp_path, shm_budget_bytes=2 * GB))  # one request is ~0.47 GB
    msg = str(e.value)
    assert "client.requests_in_flight to 4" in msg and "dump.shm_budget_gb" in msg
    assert "output:" not in msg


def test_dump_free_space_fails_even_within_budget(tmp_path: Path, monkeypatch) -> None:
    _patch_free(monkeypatch, {"results": 6_000 * GB, "dump": 1 * GB})
    with pytest.raises(BudgetError, match=r"has 1.0 GB free.*dump.dir"):
        preflight(**_args(tmp_path))


def test_explicit_probe_argument_wins(tmp_path: Path) -> None:
    with pytest.raises(BudgetError, match="output_root"):
        preflight(**_args(tmp_path), free_bytes=lambda p: 1)


def test_real_probe_finds_an_existing_ancestor(tmp_path: Path) -> None:
    assert budget.probe_free_bytes(tmp_path / "not" / "yet" / "there") > 0


def test_max_in_flight() -> None:
    per = 8192 * (2 * 7168 * 4 + 8)
    assert max_in_flight(16 * GB, per) == 16 * GB // per == 34
    assert max_in_flight(per - 1, per) == 1  # never 0: the preflight refuses that case
    with pytest.raises(ValueError):
        max_in_flight(GB, 0)


def test_two_budgets_of_one_process_share_the_ledger_without_clashing(tmp_path: Path) -> None:
    """Two chunks extracted at once in one process (the live throughput bench, a library
    user): two budgets on one dump dir.  Their reservations must be distinct and both
    count (found on the H200: the second got the first's name and failed)."""
    from concurrent.futures import ThreadPoolExecutor

    from hsextract.budget import SharedByteBudget

    a, b = SharedByteBudget(tmp_path, 10_000), SharedByteBudget(tmp_path, 10_000)
    with ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(lambda i: (a if i % 2 else b).acquire(100), range(40)))
    assert len(set(tokens)) == 40
    assert a.reserved() == b.reserved() == 4_000
    for t in tokens:
        a.release(t)
    assert b.reserved() == 0


def test_sending_turns_are_shared_and_handed_over(tmp_path: Path) -> None:
    """Two turns, three jobs: the third waits until one gives its turn back, then takes it."""
    import threading

    from hsextract.budget import SendingTurn

    a, b, c = (SendingTurn(tmp_path, 2, poll_s=0.005) for _ in range(3))
    a.acquire()
    b.acquire()
    assert {a.index, b.index} == {0, 1}
    assert SendingTurn.held(tmp_path)
    got = threading.Event()
    t = threading.Thread(target=lambda: (c.acquire(), got.set()))
    t.start()
    assert not got.wait(0.3)  # both turns taken: the third job waits
    freed = a.index
    a.release()
    assert got.wait(10)
    t.join()
    assert c.index == freed
    b.release()
    c.release()
    c.release()  # idempotent
    assert not SendingTurn.held(tmp_path)


def test_a_killed_jobs_turn_is_free_at_once(tmp_path: Path) -> None:
    """A turn is an flock: a SIGKILLed job cannot leave it taken."""
    import signal
    import subprocess
    import sys

    from hsextract.budget import SendingTurn
    from hsextract.server import remove_dump_dir_if_empty

    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    code = (
        "import sys, time; from pathlib import Path; from hsextract.budget import SendingTurn; "
        f"SendingTurn(Path({str(dump)!r}), 1).acquire(); print('held', flush=True); "
        "time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert SendingTurn.held(dump)
        assert not remove_dump_dir_if_empty(dump)  # a live job's turn: the dir stays
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert not SendingTurn.held(dump)
    mine = SendingTurn(dump, 1)
    assert mine.acquire() < 1
    mine.release()
    assert remove_dump_dir_if_empty(dump)
    assert not dump.exists()


def test_a_steady_window_takes_the_ledger_lock_only_to_grow(tmp_path: Path, monkeypatch) -> None:
    """Issue 40: a job whose requests' bytes are freed and taken again (its window full)
    serves them from its lease in memory: the ledger's lock (an flock, then a scan of the
    ledger) is taken to grow the lease to the window, not once per request (~260 ms a
    request at a simulated dp 8 when every request took it)."""
    from hsextract.budget import SharedByteBudget

    locks = []
    real = budget.fcntl.flock

    def counting(fd: int, op: int) -> None:
        if op & budget.fcntl.LOCK_EX:
            locks.append(op)
        real(fd, op)

    monkeypatch.setattr(budget.fcntl, "flock", counting)
    b = SharedByteBudget(tmp_path, 10_000)
    try:
        window = [b.acquire(100) for _ in range(8)]
        warm = 0
        for i in range(400):  # a request answered, the next one sent
            b.release(window.pop(0))
            window.append(b.acquire(100 + i % 3))
            if i == 99:
                warm = len(locks)  # the lease at the window's high-water mark
        steady = len(locks) - warm
        assert b.reserved() <= 10_000
        for t in window:
            b.release(t)
    finally:
        b.close()
    assert warm <= 8 * 3, f"{warm} ledger locks for the first 108 requests"
    assert steady == 0, f"{steady} ledger locks for 300 requests of a steady window"
    assert not [p for p in (tmp_path / budget.LEDGER_DIR).iterdir() if p.name != "lock"]


def _lease_holder(dump: Path, code: str):
    import subprocess
    import sys

    head = "import time; from pathlib import Path; from hsextract.budget import SharedByteBudget\n"
    return subprocess.Popen(
        [sys.executable, "-c", head + f"b = SharedByteBudget(Path({str(dump)!r}), 400)\n" + code],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_an_idle_lease_goes_to_a_waiting_job(tmp_path: Path) -> None:
    """Job A's lease stays at the most it had in use (300 of 400) while only 100 are in use
    and every one of its threads waits on the server; job B needs 300: A gives back what it
    does not use, without acquiring or releasing anything (no deadlock)."""
    import threading

    from hsextract.budget import SharedByteBudget

    holder = _lease_holder(
        tmp_path,
        "ts = [b.acquire(100) for _ in range(3)]; b.release(ts[0]); b.release(ts[1])\n"
        "print('held', flush=True); time.sleep(600)",
    )
    mine = SharedByteBudget(tmp_path, 400)
    try:
        assert holder.stdout.readline().strip() == "held"
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(mine.acquire(300)), daemon=True)
        t.start()
        t.join(60)
        assert got, "a job waited for bytes another job's idle lease held"
        assert mine.reserved() == 400  # A's 100 in use and B's 300: the bound holds
        mine.release(got[0])
    finally:
        holder.kill()
        holder.wait()
        mine.close()


def test_a_killed_jobs_lease_is_reclaimed(tmp_path: Path) -> None:
    import signal

    from hsextract.budget import SharedByteBudget

    holder = _lease_holder(tmp_path, "b.acquire(300); print('held', flush=True); time.sleep(600)")
    mine = SharedByteBudget(tmp_path, 400)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert mine.reserved() == 300
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert mine.reserved() == 0  # a dead process's lease no longer counts
        mine.release(mine.acquire(400))
    finally:
        holder.kill()
        holder.wait()
        mine.close()


def _hammer(dump: str, usage: str, seed: int) -> int:
    """One job: 4 threads taking random reservations; the bytes in use across every job
    are counted in ``usage`` (under its own lock) between grant and release."""
    import fcntl
    import os
    import random
    import threading

    from hsextract.budget import SharedByteBudget

    b = SharedByteBudget(Path(dump), 1000, poll_s=0.001)
    over = []

    def count(delta: int) -> None:
        fd = os.open(usage, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            now = int(os.pread(fd, 32, 0) or b"0") + delta
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(now).encode(), 0)
            if now > 1000:
                over.append(now)
        finally:
            os.close(fd)

    def worker(k: int) -> None:
        rng = random.Random(seed * 10 + k)
        for _ in range(60):
            n = rng.randint(1, 250)
            t = b.acquire(n)
            count(n)
            if rng.random() < 0.3:
                threading.Event().wait(rng.random() / 500)  # a request in flight
            count(-n)
            b.release(t)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b.close()
    return len(over)


def test_the_bound_holds_across_many_jobs(tmp_path: Path) -> None:
    """Six jobs of four threads on one budget of 1,000 bytes, reservations of up to 250:
    the bytes in use across all of them never pass it, and every job finishes (leases
    given back to the waiting ones)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    usage = tmp_path / "usage"
    usage.write_text("0")
    dump = tmp_path / "dump"
    dump.mkdir()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(6, mp_context=ctx) as pool:
        futures = [pool.submit(_hammer, str(dump), str(usage), s) for s in range(6)]
        overs = [f.result(timeout=300) for f in futures]
    assert overs == [0] * 6
    assert usage.read_text() == "0"
    assert not [p for p in (dump / budget.LEDGER_DIR).iterdir() if p.name != "lock"]


def test_under_a_stream_budget_the_output_disk_needs_the_budget_not_the_run(
    tmp_path: Path, monkeypatch
) -> None:
    """Issue 39: the stream deletes what the trainer acked, so a disk that holds
    stream.budget_gb + the largest chunk, not the run's 5 TB, is enough; without a budget
    it is not.  On e4eb6ed the preflight asked for the whole run under a budget too."""
    _patch_free(monkeypatch, {"results": 200 * GB, "dump": 100 * GB})
    largest = 1_000_000  # tokens: ~57 GB at 57,349 B/token
    with pytest.raises(BudgetError, match=r"87,800,000 tokens"):
        preflight(**_args(tmp_path))  # offline: the run's ~5 TB
    r = preflight(**_args(tmp_path), stream_budget_bytes=100 * GB, largest_chunk_tokens=largest)
    assert r["output_bytes_needed"] == int((100 * GB + largest * 57349) * 1.02)
    # The budget and one chunk must still fit: a smaller disk is refused naming both.
    _patch_free(monkeypatch, {"results": 120 * GB, "dump": 100 * GB})
    with pytest.raises(BudgetError) as e:
        preflight(**_args(tmp_path), stream_budget_bytes=100 * GB, largest_chunk_tokens=largest)
    msg = str(e.value)
    assert "stream.budget_gb (100.0 GB) + the largest chunk (1,000,000 tokens" in msg
    assert "has 120.0 GB free" in msg
    # A run smaller than its budget needs its own bytes only.
    small = preflight(**_args(tmp_path, total_tokens=10), stream_budget_bytes=100 * GB,
                      largest_chunk_tokens=10)  # fmt: skip
    assert small["output_bytes_needed"] == int(10 * 57349 * 1.02)


def test_a_release_never_waits_for_the_ledger(tmp_path: Path, monkeypatch) -> None:
    """Issue 40: another job's ledger visit holds the lock, and one of this job's threads
    waits for it to acquire bytes; a thread releasing bytes meanwhile returns at once
    (before, it waited behind the acquiring thread: at -j16 its window slot sat idle
    there).  The bytes go back to the waiting job all the same, by the watcher."""
    import fcntl
    import os
    import threading
    import time

    from hsextract.budget import SharedByteBudget
    from hsextract.procs import start_time

    flocking = threading.Event()
    real = budget.fcntl.flock

    def noting(fd: int, op: int) -> None:
        if op & fcntl.LOCK_EX and threading.current_thread().name == "acquirer":
            flocking.set()
        real(fd, op)

    monkeypatch.setattr(budget.fcntl, "flock", noting)
    b = SharedByteBudget(tmp_path, 1000)
    other = None
    try:
        t1, t2 = b.acquire(100), b.acquire(100)
        # Another live job waits (a lease of 0 bytes: the parent of this test's process),
        # having come after this one's requests (its ticket is later than theirs).
        ppid = os.getppid()
        mark = tmp_path / budget.LEDGER_DIR / f"{ppid}-{start_time(ppid)}-{LATER}-0"
        mark.touch()
        t3 = b.acquire(100)  # a visit: it sees the waiting job, serves from the lease no more
        other = os.open(tmp_path / budget.LEDGER_DIR / "lock", os.O_RDWR)
        real(other, fcntl.LOCK_EX)  # the other job's visit under way
        got: list[str] = []
        acq = threading.Thread(target=lambda: got.append(b.acquire(100)), name="acquirer")
        acq.start()
        assert flocking.wait(60), "the acquire never went to the ledger"
        released = threading.Event()
        rel = threading.Thread(target=lambda: (b.release(t1), released.set()), daemon=True)
        rel.start()
        assert released.wait(30), "a release waited for another job's ledger visit"
        real(other, fcntl.LOCK_UN)
        acq.join(60)
        assert got and not acq.is_alive()
        deadline = time.monotonic() + 60
        while b.reserved() != 300 and time.monotonic() < deadline:  # the watcher's give-back
            time.sleep(0.01)
        assert b.reserved() == 300, "the released bytes were not given back to the waiting job"
        for t in (t2, t3, got[0]):
            b.release(t)
    finally:
        if other is not None:
            os.close(other)
        b.close()


def test_a_visit_reads_proc_for_a_live_lease_at_most_once_a_second(tmp_path, monkeypatch):
    """Issue 40: each ledger visit of a contended budget checked every other lease's owner
    in /proc, under the lock all jobs take (16 owners at -j16).  An owner seen alive is
    trusted for ``ALIVE_TTL_S``; a count of who holds what (``reserved``) still reads it."""
    import os

    from hsextract.budget import SharedByteBudget
    from hsextract.procs import start_time

    reads: list[int] = []

    def counting(pid: int) -> str | None:
        reads.append(pid)
        return start_time(pid)

    monkeypatch.setattr(budget, "start_time", counting)
    monkeypatch.setattr(budget, "ALIVE_TTL_S", 3600.0)  # no expiry within the test
    ppid = os.getppid()
    lease = tmp_path / budget.LEDGER_DIR / f"{ppid}-{start_time(ppid)}-1-300"
    b = SharedByteBudget(tmp_path, 1000)
    try:
        lease.touch()  # another live job's lease: 300 of the 1,000
        held = [b.acquire(100 + i) for i in range(6)]  # each one grows the lease: a visit
        assert b.ledger_visits >= 6
        assert reads.count(ppid) == 1, reads
        assert b.reserved() == 300 + sum(100 + i for i in range(6))
        assert reads.count(ppid) == 2, reads  # reserved() reads it again
        for t in held:
            b.release(t)
    finally:
        b.close()


#: A waiting mark's ticket later than any request of the test's (the host's monotonic
#: clock in ns): another job that came to the ledger after them, so they go first.
LATER = 9 * 10**18


def _another_job_waits(tmp_path: Path) -> Path:
    """A waiting mark (a lease of 0 bytes) of another live process, this test's parent,
    that came after every request of the test."""
    import os

    from hsextract.procs import start_time

    ppid = os.getppid()
    mark = tmp_path / budget.LEDGER_DIR / f"{ppid}-{start_time(ppid)}-{LATER}-0"
    mark.touch()
    return mark


def _held_elsewhere(tmp_path: Path, nbytes: int) -> Path:
    """A lease of ``nbytes`` in ``tmp_path``'s ledger held by another live process (the
    test's parent): the test unlinks it to let the bytes go."""
    import os

    from hsextract.procs import start_time

    ppid = os.getppid()
    ledger = tmp_path / budget.LEDGER_DIR
    ledger.mkdir(exist_ok=True)
    lease = ledger / f"{ppid}-{start_time(ppid)}-1-{nbytes}"
    lease.touch()
    return lease


def _until(cond, seconds: float = 60.0) -> bool:
    """Wait for ``cond()`` (a state another thread reaches), with a generous deadline."""
    import time

    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_release_that_leaves_the_job_idle_never_waits_for_the_ledger(tmp_path: Path) -> None:
    """The job's last bytes are released while another job's visit holds the ledger: the
    release returns at once, and the lease goes back once the ledger is free."""
    import fcntl
    import os
    import threading

    from hsextract.budget import SharedByteBudget

    b = SharedByteBudget(tmp_path, 1000)
    other = os.open(tmp_path / budget.LEDGER_DIR / "lock", os.O_RDWR)
    try:
        t = b.acquire(100)
        fcntl.flock(other, fcntl.LOCK_EX)
        released = threading.Event()
        threading.Thread(target=lambda: (b.release(t), released.set()), daemon=True).start()
        assert released.wait(30), "the release waited for another job's ledger visit"
        fcntl.flock(other, fcntl.LOCK_UN)
        assert _until(lambda: b.reserved() == 0), "the idle lease was never given back"
    finally:
        os.close(other)
        b.close()


def test_a_failed_give_back_is_retried_not_stranded(tmp_path: Path, monkeypatch) -> None:
    """Under contention the watcher gives released bytes back; one give-back that fails
    (an OSError renaming the lease) is retried, never the watcher's silent end (which left
    the bytes stranded until the job closed)."""
    import threading

    from hsextract.budget import SharedByteBudget

    b = SharedByteBudget(tmp_path, 1000)
    failed = threading.Event()
    try:
        t1, t2 = b.acquire(300), b.acquire(300)
        _another_job_waits(tmp_path)
        t3 = b.acquire(100)  # a visit: contended from now on
        real = b._set_lease

        def once(nbytes: int) -> None:
            if threading.current_thread() is b._watcher and not failed.is_set():
                failed.set()
                raise OSError("injected: rename failed")
            real(nbytes)

        monkeypatch.setattr(b, "_set_lease", once)
        b.release(t1)
        assert failed.wait(60), "the watcher never tried to give the bytes back"
        assert _until(lambda: b.reserved() == 400), "the released bytes stayed stranded"
        b.release(t2)
        b.release(t3)
        assert _until(lambda: b.reserved() == 0)
    finally:
        b.close()


def test_close_takes_a_waiting_threads_mark_with_it(tmp_path: Path) -> None:
    """A thread waits for bytes (another live job holds them all) when the budget closes:
    its waiting mark goes too (other jobs' watchers would see a waiter forever), and the
    thread's acquire ends with an error instead of waiting on."""
    import os
    import threading

    from hsextract.budget import SharedByteBudget

    ledger = tmp_path / budget.LEDGER_DIR
    _held_elsewhere(tmp_path, 1000)  # the whole budget
    b = SharedByteBudget(tmp_path, 1000)
    ended: list[BaseException] = []

    def wait_for_bytes() -> None:
        try:
            b.acquire(100)
        except BaseException as exc:  # noqa: BLE001 - what the waiting thread saw
            ended.append(exc)

    th = threading.Thread(target=wait_for_bytes, daemon=True)
    mine = f"{os.getpid()}-"
    try:
        th.start()
        assert _until(lambda: any(p.name.startswith(mine) for p in ledger.iterdir()))
        b.close()
        th.join(60)
        assert not th.is_alive() and ended, "the waiting acquire did not end at close"
        assert not [p.name for p in ledger.iterdir() if p.name.startswith(mine)]
    finally:
        b.close()
        th.join(60)


def test_a_waiting_request_is_not_overtaken_by_smaller_ones_that_came_later(tmp_path: Path):
    """In order, once a waiter's patience is out (0 here): job Y waits for 500 bytes while
    job X holds 900 of 1,000; job Z then asks for 100, which would fit at once, and waits
    instead, as it would take bytes Y waits for (before, small requests took every byte
    freed while a long record's waited, for as long as they kept coming).  Once X lets
    go, both fit and both are served."""
    import threading

    from hsextract.budget import SharedByteBudget

    ledger = tmp_path / budget.LEDGER_DIR
    bx, by, bz = (SharedByteBudget(tmp_path, 1000, patience_s=0) for _ in range(3))
    order: list[str] = []
    tokens: dict[str, str] = {}
    lock = threading.Lock()

    def ask(name: str, b: SharedByteBudget, n: int) -> None:
        token = b.acquire(n)
        with lock:
            order.append(name)
            tokens[name] = token

    def waiting() -> int:
        return sum(1 for p in ledger.iterdir() if p.name.endswith("-0"))

    threads = []
    tx = bx.acquire(900)
    try:
        threads.append(threading.Thread(target=ask, args=("Y", by, 500), daemon=True))
        threads[-1].start()
        assert _until(lambda: waiting() == 1), "Y never waited"
        threads.append(threading.Thread(target=ask, args=("Z", bz, 100), daemon=True))
        threads[-1].start()
        assert _until(lambda: waiting() == 2 or bool(order)), "Z neither waited nor got bytes"
        assert order == [], f"{order[0]} got bytes past a request that waited before it"
        bx.release(tx)
        for t in threads:
            t.join(60)
        assert sorted(order) == ["Y", "Z"]
        assert waiting() == 0
    finally:
        bx.release(tx)  # a second release of a token is a no-op
        for t in threads:
            t.join(60)
        by.release(tokens.get("Y", ""))
        bz.release(tokens.get("Z", ""))
        for b in (bx, by, bz):
            b.close()


def test_a_job_using_its_whole_lease_still_lets_a_waiter_go_first(tmp_path: Path):
    """Job X's lease is all in use (3 x 100 of 400) and its threads take bytes back from
    it as soon as they release them; job Y waits for 200 (its patience out at once).
    X's watcher sees Y (before, it looked only while the lease held more than was in use,
    so Y was never seen), and the 100 bytes X releases go to Y's turn, not back to X."""
    import threading

    from hsextract.budget import SharedByteBudget

    bx, by = (SharedByteBudget(tmp_path, 400, patience_s=0) for _ in range(2))
    order: list[str] = []
    tokens: dict[str, str] = {}

    def ask(name: str, b: SharedByteBudget, n: int) -> None:
        tokens[name] = b.acquire(n)
        order.append(name)

    held = [bx.acquire(100) for _ in range(3)]
    threads = [threading.Thread(target=ask, args=("Y", by, 200), daemon=True)]
    try:
        threads[0].start()
        # The watcher's view (what its scan found), read as the event to wait for.
        assert _until(lambda: bx._contended), "a job with its whole lease in use never saw Y"
        bx.release(held.pop(0))
        threads.append(threading.Thread(target=ask, args=("X", bx, 100), daemon=True))
        threads[1].start()
        assert _until(lambda: bool(order)), "nobody got the released bytes"
        assert order[0] == "Y", "the job took its released bytes back past a waiter"
        by.release(tokens["Y"])
        threads[1].join(60)
        assert order == ["Y", "X"]
    finally:
        for t in held:
            bx.release(t)
        for name, b in (("Y", by), ("X", bx)):
            if name in tokens:
                b.release(tokens[name])
        for t in threads:
            t.join(60)
        bx.close()
        by.close()


def test_before_its_patience_is_out_a_waiter_leaves_room_to_younger_requests(tmp_path: Path):
    """Job Y waits for 500 bytes while job X holds 900 of 1,000; job Z's 100 fit, and
    Y has waited less than its patience: Z is served at once.  Why (issue 40): a strict
    turn passed bytes from job to job at the ledger's polling pace, and with every job
    waiting on a budget that binds, the chunk jobs of a live run got a fraction of the
    requests through (bench in the README's shm budget section)."""
    import threading

    from hsextract.budget import SharedByteBudget

    ledger = tmp_path / budget.LEDGER_DIR
    bx, by, bz = (SharedByteBudget(tmp_path, 1000, patience_s=3600) for _ in range(3))
    got: list[str] = []
    tx = bx.acquire(900)
    waiter = threading.Thread(target=lambda: got.append(by.acquire(500)), daemon=True)
    try:
        waiter.start()
        assert _until(lambda: any(p.name.endswith("-0") for p in ledger.iterdir())), (
            "Y never waited"
        )
        tz = bz.acquire(100)  # returns: it fits, and Y's claim is not due
        assert not got, "Y got bytes that X holds"
        bz.release(tz)
        bx.release(tx)
        waiter.join(60)
        assert got, "Y never got its bytes once X let go"
    finally:
        bx.release(tx)
        waiter.join(60)
        for t in got:
            by.release(t)
        for b in (bx, by, bz):
            b.close()


def test_a_job_s_queued_requests_are_granted_at_one_ledger_visit(tmp_path: Path):
    """Eight sender threads of one job queue while the budget is held elsewhere; once it
    is free, the head's visit grows the lease by every queued request and grants them all,
    not one visit each a thread wake-up apart (with a budget that never binds, a job's
    requests waited ~45 ms each in the ceiling bench, the server's queue run dry)."""
    import threading

    from hsextract.budget import SharedByteBudget

    other = _held_elsewhere(tmp_path, 1000)
    b = SharedByteBudget(tmp_path, 2000)
    tokens: list[str] = []
    threads = [
        threading.Thread(target=lambda: tokens.append(b.acquire(100)), daemon=True)
        for _ in range(8)
    ]
    try:
        b.acquire(1000)  # stays held: every later request needs the lease to grow
        for t in threads:
            t.start()
        assert _until(lambda: len(b._queue) == 8), "the requests never queued"
        before = b.ledger_visits
        other.unlink()  # room for all eight
        for t in threads:
            t.join(60)
        assert len(tokens) == 8
        # One visit grants them; a second where one had looked just before the room came.
        assert b.ledger_visits - before <= 2, b.ledger_visits - before
        assert b._lease == 1800
    finally:
        with contextlib.suppress(FileNotFoundError):
            other.unlink()
        for t in threads:
            t.join(60)
        b.close()


def test_waiting_threads_of_one_job_leave_one_mark_in_the_ledger(tmp_path: Path):
    """Eight sender threads of one job wait for bytes another live job holds: they queue
    in memory behind one mark, not a mark each (with hundreds of sender threads, a mark
    and a ledger visit per waiting thread took the grants of a binding budget from
    ~700 to ~3 a second: every visit scanned every mark under the lock all jobs take).
    In the job they are granted in the order they came (a reservation's sequence number
    says when it was granted; the threads may run in any order after), once the bytes are
    free."""
    import os
    import threading

    from hsextract.budget import SharedByteBudget

    other = _held_elsewhere(tmp_path, 1000)
    ledger = other.parent
    b = SharedByteBudget(tmp_path, 1000)
    granted: dict[int, int] = {}  # thread -> its reservation's sequence number
    tokens: list[str] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        token = b.acquire(100)
        with lock:
            granted[i] = int(token.split("-")[2])
            tokens.append(token)

    threads = []
    mine = f"{os.getpid()}-"  # this process's entries
    try:
        for i in range(8):  # one at a time: their order in the queue is known
            threads.append(threading.Thread(target=ask, args=(i,), daemon=True))
            threads[-1].start()
            assert _until(lambda n=i + 1: len(b._queue) == n), f"thread {i} never waited"
        marks = [p.name for p in ledger.iterdir() if p.name.startswith(mine)]
        assert len(marks) == 1 and marks[0].endswith("-0"), marks
        other.unlink()  # the other job lets go
        for t in threads:
            t.join(60)
        assert sorted(granted, key=granted.__getitem__) == list(range(8)), granted
        assert not [p.name for p in ledger.iterdir() if p.name.endswith("-0")]
    finally:
        with contextlib.suppress(FileNotFoundError):
            other.unlink()
        for t in threads:
            t.join(60)
        for t in tokens:
            b.release(t)
        b.close()


def test_a_lone_request_past_the_capacity_lends_no_room_to_the_next(tmp_path: Path):
    """A request larger than the whole budget is granted when nothing else is held, its
    lease past the capacity; once it is released, the request waiting behind it (900 of
    1,000) is served, and a third one (500) waits: the old lease's 1,500 bytes are no
    room to serve it from (before, both went: 1,400 bytes held on a budget of 1,000)."""
    import threading

    from hsextract.budget import SharedByteBudget

    b = SharedByteBudget(tmp_path, 1000)
    tokens: list[str] = []
    threads = []
    try:
        big = b.acquire(1500)
        threads.append(threading.Thread(target=lambda: tokens.append(b.acquire(900))))
        threads[-1].start()
        assert _until(lambda: len(b._queue) == 1), "the 900 never waited behind the 1,500"
        b.release(big)
        threads[-1].join(60)
        assert len(tokens) == 1, "the 900 was not served once the 1,500 went"
        threads.append(threading.Thread(target=lambda: tokens.append(b.acquire(500))))
        threads[-1].start()
        assert _until(lambda: len(b._queue) == 1 or len(tokens) == 2)
        assert len(tokens) == 1, "500 more bytes granted past the capacity"
        b.release(tokens[0])
        threads[-1].join(60)
        assert len(tokens) == 2
        assert _until(lambda: b.reserved() <= 1000), "the lease stayed past the budget"
    finally:
        for t in tokens:
            b.release(t)
        for t in threads:
            t.join(60)
        b.close()


def test_a_job_waiting_for_a_lease_keeps_the_dump_dir_in_use(tmp_path: Path) -> None:
    """``unused`` (what a cleanup of the dump dir asks first) is no while another live
    job waits for bytes, a mark in the ledger and no lease yet: it is about to send."""
    from hsextract.budget import SharedByteBudget

    b = SharedByteBudget(tmp_path, 1000)
    try:
        with b.unused() as free:
            assert free
        mark = _another_job_waits(tmp_path)
        with b.unused() as free:
            assert not free, "a waiting job's dump dir counted as unused"
        mark.unlink()
        with b.unused() as free:
            assert free
    finally:
        b.close()
