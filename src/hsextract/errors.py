"""One exception base so the CLI and the rules can print a clean message, not a traceback,
and the one way a message names a list of files."""


class HsextractError(Exception):
    """A failure the user can act on; the message says what and where."""


class ConfigError(HsextractError):
    """The config asks for something impossible or unsafe."""


def name_list(names: list[str], most: int = 5) -> str:
    """The first few names of a refused directory's contents, for its message."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more
