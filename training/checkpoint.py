"""Writing checkpoints: one self-describing file (capsnet.models.checkpoint reads it back), written atomically.

A save writes the whole payload to a hidden temporary file beside the target, then renames it over the target, so
a reader (export, serving, `--resume`) sees the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from pathlib import Path

import torch

from capsnet import __version__
from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import FORMAT_NAME, FORMAT_VERSION, Checkpoint

# A save writes .NAME.XXXXXXXX.tmp beside NAME (hidden, random), then renames it over NAME.
TEMPORARY_SUFFIX = ".tmp"


def save_checkpoint(checkpoint: Checkpoint, path: str | os.PathLike) -> None:
    """Write atomically: a temp file in the same directory, then rename over the target."""
    path = Path(path)
    payload = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "capsnet_version": __version__,
        "config": checkpoint.config.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in checkpoint.state_dict.items()},
        "class_names": list(checkpoint.class_names),
        "metrics": checkpoint.metrics,
        "epoch": checkpoint.epoch,
        "optimizer_state": checkpoint.optimizer_state,
        "scheduler_state": checkpoint.scheduler_state,
        "history": checkpoint.history,
        "dataset": checkpoint.dataset,
        "scaler_state": checkpoint.scaler_state,
        "epoch_progress": checkpoint.epoch_progress,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=TEMPORARY_SUFFIX, dir=path.parent)
    except OSError as err:
        raise CapsNetError(f"cannot write checkpoint {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_leftover_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that saves of `path` killed midway (SIGKILL, out of memory) left behind; only
    for a caller that owns `path`, since another process's save in progress looks the same."""
    path = Path(path)
    removed = []
    for leftover in path.parent.glob(f"{glob.escape(_temporary_prefix(path))}*{TEMPORARY_SUFFIX}"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove: nothing worse than before
            leftover.unlink()
            removed.append(leftover)
    return removed


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
