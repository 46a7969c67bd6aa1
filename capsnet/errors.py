"""Errors caused by the user (bad input, missing files): the CLI prints them on one line."""


class CapsNetError(Exception):
    """A user-facing error: `capsnet` prints its message on one line and exits non-zero."""


def first_line(err: BaseException) -> str:
    """A library exception's message cut to fit a CapsNetError's one line: onnxruntime's and numpy's run to several."""
    return (str(err).strip().splitlines() or [""])[0][:300]
