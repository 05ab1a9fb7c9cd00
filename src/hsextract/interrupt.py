"""Ctrl-C: a sentence and exit status 130, never a traceback, and never dropped.

Two places need this.  A stage (a Snakemake ``script:`` job) and the ``hsextract`` CLI
end on a Ctrl-C with one line saying what was left unfinished and how to go on
(:func:`interrupted_message`), exit status :data:`INTERRUPTED_EXIT` as a shell reports
a command ended by SIGINT.  And Snakemake's own process must not lose the Ctrl-C
(:func:`keep_ctrl_c`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

INTERRUPTED_EXIT = 130  # 128 + SIGINT: what a shell reports for a command Ctrl-C ended

_installed = False
_interrupts = 0  # SIGINTs seen by keep_ctrl_c's handler; read by the guarded emit


def interrupted_message(what: str, *, starts_over: bool = False) -> str:
    """The one line an interrupted step prints: what is left unfinished and what to do.

    Every output is written under a temporary name and renamed when complete, so an
    interrupted step leaves nothing half-written and the same command picks up there.
    ``starts_over``: the step keeps no partial work (a chunk is extracted whole), so the
    rerun does it from its start; "continue" alone read as a resume within it.
    """
    if starts_over:
        return (
            f"interrupted: {what} not finished; it is extracted whole, so rerunning the "
            "same command starts it over (finished chunks are kept)"
        )
    return f"interrupted: {what} not finished; rerun the same command to continue"


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupts
    _interrupts += 1
    raise KeyboardInterrupt


def keep_ctrl_c() -> None:
    """In Snakemake's own process: a Ctrl-C that lands while it writes a log line is not lost.

    Snakemake 9's terminal log handler (``snakemake.logging.ColorizingTextHandler.emit``)
    catches ``KeyboardInterrupt`` and drops it ("all errors have been handled before").
    A Ctrl-C that arrives while the scheduler prints a job (it does between every two
    jobs) is then gone: the workflow runs on to the end and exits 0, as if the key was
    never pressed (tests/test_workflow.py shows the dropped one).  So SIGINT is counted
    by our handler, and a log write during which one arrived and was swallowed raises it
    again once the write returns, in the main thread, where the scheduler handles it as
    usual ("Terminating processes on user request") and the run ends non-zero.

    Only the main thread re-raises: a signal handler runs there, so the count can change
    during another thread's write without that thread having been interrupted.  Idempotent;
    a no-op outside the main thread (``signal.signal`` refuses there) or where SIGINT is
    ignored (a background job of a non-interactive shell: no Ctrl-C can reach it).
    """
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    try:
        from snakemake.logging import ColorizingTextHandler
    except ImportError:  # not under Snakemake: nothing drops a Ctrl-C
        return
    signal.signal(signal.SIGINT, _on_sigint)
    ColorizingTextHandler.emit = _guarded(ColorizingTextHandler.emit)
    _installed = True


def _guarded(
    emit: Callable[[logging.Handler, logging.LogRecord], None],
) -> Callable[[logging.Handler, logging.LogRecord], None]:
    def guarded_emit(self: logging.Handler, record: logging.LogRecord) -> None:
        before = _interrupts
        emit(self, record)  # an interrupt it lets through propagates as it is
        if _interrupts != before and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt  # it arrived during the write and was swallowed there

    guarded_emit.__wrapped__ = emit  # type: ignore[attr-defined]
    return guarded_emit
