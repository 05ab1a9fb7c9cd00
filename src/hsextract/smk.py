"""Glue for Snakemake ``script:`` jobs: log to the rule's log, fail with a clean message."""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hsextract.errors import HsextractError


def run_step(snakemake: Any, step: Callable[[Any], None]) -> None:
    """Run one stage with stdout/stderr going to the rule's log file.

    An :class:`HsextractError` ends the job with its message (the user's next action), any
    other exception with a traceback; both land in the log, which the profile's
    ``show-failed-logs`` prints on failure.
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
    except HsextractError as exc:
        print(f"ERROR [{snakemake.rule}]: {exc}", flush=True)
        sys.__stderr__.write(f"hsextract [{snakemake.rule}]: {exc}\n")
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        stream.flush()
