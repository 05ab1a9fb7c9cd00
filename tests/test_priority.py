"""procs.lower_priority: client.nice reaches every thread of a chunk job, lowers only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

#: A child process: a thread started before the call, the call, a thread started after;
#: prints each thread's niceness (read back from the kernel, per thread) and the return.
CHILD = textwrap.dedent(
    """
    import json, os, sys, threading
    from hsextract.procs import lower_priority

    os.nice(int(sys.argv[2]))  # the niceness the job was started with (nice(1))
    go, seen = threading.Event(), {}
    reported = {"before": threading.Event(), "after": threading.Event()}

    def report(key):
        seen[key] = os.getpriority(os.PRIO_PROCESS, 0)
        reported[key].set()
        go.wait()

    before = threading.Thread(target=report, args=("before",))
    before.start()
    reported["before"].wait()
    got = lower_priority(int(sys.argv[1]))
    after = threading.Thread(target=report, args=("after",))
    after.start()
    reported["after"].wait()
    tasks = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
    go.set()
    before.join()
    after.join()
    print(json.dumps({"returned": got, "after_started": seen["after"],
                      "tasks": sorted(tasks.values())}))
    """
)


def _run(nice: int, started: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(nice), str(started)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_thread_is_lowered_those_running_and_those_started_after():
    got = _run(5, 0)
    assert got["returned"] == 5
    assert got["after_started"] == 5
    assert got["tasks"] == [5, 5, 5], got  # main, the one started before, the one after


def test_a_job_started_nicer_stays_as_nice_and_zero_changes_nothing():
    assert _run(3, 7)["tasks"] == [7, 7, 7]
    got = _run(0, 2)
    assert got["returned"] == 2 and got["tasks"] == [2, 2, 2], got
