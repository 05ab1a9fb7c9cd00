"""Stops a server when the workflow that owns it is gone.

Started detached next to every server.  Snakemake's ``onerror`` cannot run when the
workflow is SIGKILLed (an OOM killer, a scheduler preemption), and without this an
SGLang server would go on holding 8 GPUs.  Polls; no dependencies beyond the stdlib.
"""

from __future__ import annotations

import sys
import time

from hsextract.server import _group_alive, owner_alive, stop_process_group


def watch(owner: int, pgid: int, owner_start: str | None = None, interval_s: float = 0.5) -> int:
    """Until the server's group is gone: stop it once the owner is (its pid dead, or reused
    by another process: ``owner_start`` is the owner's start time when the server started)."""
    while True:
        if not _group_alive(pgid):
            return 0
        if not owner_alive(owner, owner_start):
            print(
                f"hsextract watchdog: owner {owner} gone, stopping server group {pgid}",
                file=sys.stderr,
                flush=True,
            )
            stop_process_group(pgid)
            return 0
        time.sleep(interval_s)


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4]))
