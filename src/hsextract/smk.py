"""Glue for Snakemake ``script:`` jobs: log to the rule's log, fail with a clean message."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from hsextract.errors import HsextractError
from hsextract.interrupt import INTERRUPTED_EXIT, interrupted_message

#: A job's last log line once its step returned: whatever error it logged before (one it
#: recovered from, a traceback a library printed) is history, not the run's state
#: (``hsextract status`` reads no error above it).
JOB_DONE = "hsextract: job done"


def run_step(snakemake: Any, step: Callable[[Any], None]) -> None:
    """Run one stage with stdout/stderr going to the rule's log file.

    An :class:`HsextractError` ends the job with its message (the user's next action), any
    other exception with a traceback; each lands in the log and once on the terminal (the
    profile has no ``show-failed-logs``: it printed the log, so every error twice).  A
    Ctrl-C (Snakemake's whole process group gets it) ends the job with one line naming
    what it left unfinished, exit status 130: a traceback through whatever the step was
    waiting on says nothing the user can act on.
    """
    log_path = snakemake.log[0] if snakemake.log else None
    stream = open(log_path, "a", buffering=1) if log_path else sys.stderr  # noqa: SIM115
    sys.stdout = sys.stderr = stream
    logging.basicConfig(
        level=logging.INFO,
        stream=stream,
        format="%(asctime)s %(levelname)s %(message)s",
        force=True,
    )
    try:
        step(snakemake)
        print(f"{JOB_DONE} [{snakemake.rule}]", flush=True)
    except HsextractError as exc:
        print(f"ERROR [{snakemake.rule}]: {exc}", flush=True)
        sys.__stderr__.write(f"hsextract [{snakemake.rule}]: {exc}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        if _outputs_written(snakemake):
            # The Ctrl-C landed as the job ended: every output is in place (each is
            # written under a temporary name and renamed), so the job is done.  Failing
            # it now made Snakemake delete a finished chunk, and the next run redo it.
            print(f"{JOB_DONE} [{snakemake.rule}] (Ctrl-C after its outputs were written)")
            return
        name = _job_name(snakemake)
        msg = interrupted_message(name, starts_over=name.startswith("chunk "))
        print(msg, flush=True)
        sys.__stderr__.write(f"hsextract [{snakemake.rule}]: {msg}\n")
        sys.exit(INTERRUPTED_EXIT)
    except Exception:
        traceback.print_exc()
        sys.__stderr__.write(f"hsextract [{snakemake.rule}]: failed (log: {log_path}):\n")
        traceback.print_exc(file=sys.__stderr__)
        raise
    finally:
        stream.flush()


def _outputs_written(snakemake: Any) -> bool:
    """Whether every output of the job exists (a job with none never counts as done)."""
    import os

    outputs = [str(o) for o in (getattr(snakemake, "output", None) or [])]
    return bool(outputs) and all(os.path.exists(o) for o in outputs)


def _job_name(snakemake: Any) -> str:
    """The job as the user knows it: ``chunk 00002`` for a chunk job, else the rule and
    its wildcards (``extract_chunk`` has the one wildcard ``chunk``)."""
    wc = getattr(snakemake, "wildcards", None)
    wildcards = dict(wc.items()) if hasattr(wc, "items") else {}  # a Namedlist, or a dict
    if set(wildcards) == {"chunk"}:
        return f"chunk {wildcards['chunk']}"
    named = ", ".join(f"{k}={v}" for k, v in wildcards.items())
    return f"{snakemake.rule} ({named})" if named else str(snakemake.rule)


#: Snakemake options under which it runs no job and deletes nothing: it plans, prints or
#: checks (``--unlock`` only clears Snakemake's own lock in its working directory).
_READ_ONLY_OPTIONS = (
    "dryrun", "lint", "list_target_rules", "list_rules", "print_compilation", "summary",
    "detailed_summary", "dag", "rulegraph", "filegraph", "d3dag", "list_changes",
    "list_input_changes", "list_params_changes", "list_untracked", "list_conda_envs",
    "unlock", "containerize", "generate_unit_tests", "archive",
)  # fmt: skip


def runs_jobs(argv: Sequence[str] | None = None) -> bool:
    """Whether this Snakemake command line (default: this process's) may run jobs.

    Asked when the Snakefile is parsed, where Snakemake has not yet said (its executor,
    ``-n`` among them, is set after the parse): the command line is read with Snakemake's
    own parser.  A dry run plans and touches nothing, so it need not hold the run dir
    (``stale.claim_run``) and may watch a running workflow's plan.  A command line this
    parser does not take (Snakemake driven through its Python API) counts as one that
    runs jobs: holding the run dir is the safe side.
    """
    from snakemake.cli import parse_args

    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            _, args = parse_args(args_in)  # prints which profile it reads: not twice
    except (SystemExit, Exception):  # noqa: BLE001 - any failure: hold the run dir
        return True
    if any(getattr(args, name, None) for name in _READ_ONLY_OPTIONS):
        return False
    report = getattr(args, "report", None) or getattr(args, "reporter", None)
    return not (report and not getattr(args, "report_after_run", False))
