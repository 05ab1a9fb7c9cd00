"""One exception base so the CLI and the rules can print a clean message, not a traceback."""


class HsextractError(Exception):
    """A failure the user can act on; the message says what and where."""


class ConfigError(HsextractError):
    """The config asks for something impossible or unsafe."""
