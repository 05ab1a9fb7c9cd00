"""One exception base so the CLI and the rules can print a clean message, not a traceback,
and the one way a message names a list of files."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class HsextractError(Exception):
    """A failure the user can act on; the message says what and where."""


class ConfigError(HsextractError):
    """The config asks for something impossible or unsafe."""


def name_list(names: list[str], most: int = 5) -> str:
    """The first few names of a refused directory's contents, for its message."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


@contextmanager
def one_sentence(prefix: str = "hsextract: error: ") -> Iterator[None]:
    """An :class:`HsextractError` inside ends the process in its one sentence (exit 1).

    For the workflow's parse (rules/common.smk): Snakemake prints an exception raised
    there with 3-5 ``File ".../config.py"`` lines before the sentence, which the same
    error from ``hsextract`` is alone."""
    try:
        yield
    except HsextractError as exc:
        print(f"{prefix}{exc}", file=sys.stderr)
        raise SystemExit(1) from None
