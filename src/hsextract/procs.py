"""Whether a process named in a state file still runs, and which process it is.

Its own module because the server's lifecycle (hsextract.server), the stale deletion that
must spare a live server's files (hsextract.stale), the /dev/shm ledger and the merge's
worker files (hsextract.budget, hsextract.records) and the sweep of readers' abandoned
verdict dirs (hsextract.chunkfile) all ask, and all of them are below server."""

from __future__ import annotations

import os


def start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): tells a reused pid from the original."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int | str | None) -> bool:
    """Whether a process of this host's pid space runs (a zombie does not): the servers'
    and watchdogs' state files name a pid, and every owner check asks here."""
    try:
        pid = int(pid)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def owner_alive(pid: int | str, start: str | None = None) -> bool:
    """Whether the owner still runs: its pid alive, and the same process if ``start`` (its
    start time) was recorded."""
    return pid_alive(pid) and (start is None or start_time(int(pid)) == str(start))


def lower_priority(nice: int) -> int:
    """Run every thread of this process at niceness ``nice`` or nicer; return the calling
    thread's niceness after.

    Why every thread: on Linux niceness is a thread's (``setpriority(PRIO_PROCESS, 0)``
    sets the caller's alone); threads started later inherit their creator's, but those
    already running (torch's, a progress bar's) keep theirs.  A thread already nicer (a
    job started under ``nice(1)``) is left as it is: an unprivileged process may not make
    one less nice, and lowering is all that is asked."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no procfs: the calling thread's (the process's elsewhere)
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)
