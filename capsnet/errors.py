"""Errors caused by the user (bad input, missing files): the CLI prints them on one line."""


class CapsNetError(Exception):
    """A user-facing error: `capsnet` prints its message on one line and exits non-zero."""
