"""The one results schema every benchmark writes, and paths written so that a result reads the same on any machine.

A run is {"command", "machine", "measurements": [...], ...its own parts}; each measurement is one engine at one batch
size timed one way:

    {"engine": "onnxruntime:int8", "batch": 32, "io": "numpy", "figures": {"p50_ms": ..., "images_per_s": ...}}

`engine` is the backend registry's "<kind>:<precision>" (or a reference's name: REFERENCES), `io` whether the images
came in and went out as numpy arrays (what a server pays) or stayed on the device, and `figures` the timing summary
(capsnet.bench.timing.summarize) with whatever else the run measured of that cell. The Markdown reports are written
from these rows (capsnet.bench.report_files, scripts/gpu_check_report.py).

A command or path in a result names no machine: paths under the repository root (or the folder a command ran in) are
written relative to it, the temporary folder as $TMPDIR and the home folder as ~.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Iterable
from pathlib import Path

NUMPY, ON_DEVICE = "numpy", "device_resident"
# the references timed beside the served engines: the public formulation (capsnet/bench/analysis/public_reference.py),
# and on a GPU the model eager and under torch.compile at torch's own defaults
PUBLIC, EAGER, COMPILE = "public", "eager", "compile"
REFERENCES = (PUBLIC, EAGER, COMPILE)


def measurement(engine: str, batch: int, figures: dict, io: str = NUMPY) -> dict:
    return {"engine": engine, "batch": batch, "io": io, "figures": figures}


def cells(measurements: Iterable[dict], io: str = NUMPY) -> dict[tuple[str, int], dict]:
    """(engine, batch) -> figures, of the measurements timed `io`."""
    return {(row["engine"], row["batch"]): row["figures"] for row in measurements if row["io"] == io}


# An absolute path inside a command or a value: a "/" that starts a word (not the "//" of a URL, not a ratio "1/2")
_ABSOLUTE = re.compile(r"(?<![\w:/.~$-])/[^\s\"'=,;|)]+")


def portable(value: str, root: Path) -> str:
    """`value` (a path, or a command line with paths in it) with every absolute path written portably: under `root`,
    relative to it ("." for `root` itself); under the temporary folder, as $TMPDIR/...; under the home folder, as
    ~/...; beside `root` (under the same top folder), relative to `root` with "..". System paths (/usr, /opt) stay."""
    root = Path(os.path.abspath(root))
    temporary, home = Path(tempfile.gettempdir()), Path.home()

    def rewrite(match: re.Match) -> str:
        path = Path(os.path.normpath(match.group()))
        for base, written in ((root, None), (temporary, "$TMPDIR"), (home, "~")):
            if path == base or base in path.parents:
                relative = path.relative_to(base)
                if written is None:
                    return str(relative)
                return written if relative == Path() else f"{written}/{relative}"
        if len(Path(os.path.commonpath([path, root])).parts) > 1:
            return os.path.relpath(path, root)
        return str(path)

    return _ABSOLUTE.sub(rewrite, value)


def portable_command(argv: Iterable[str], root: Path) -> str:
    """A command line, shell-quoted, with every path in it portable (the Python that ran it as `python`)."""
    words = [str(word) for word in argv]
    if words and Path(words[0]).name.startswith("python"):
        words[0] = "python"
    return " ".join(_quote(portable(word, root)) for word in words)


def _quote(word: str) -> str:
    """shlex.quote, leaving $TMPDIR and ~ for the shell to expand."""
    for prefix in ("$TMPDIR/", "~/"):
        if word.startswith(prefix):
            return prefix + shlex.quote(word[len(prefix):])
    return shlex.quote(word)
