"""Where an export is written: a staging folder beside each target, renamed into place once complete, so a failed
or interrupted export never leaves half an artifact set and a previous export is only replaced by a complete one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from capsnet.errors import CapsNetError
from capsnet.model_description.files import CHECKPOINT_NAME
from capsnet.models.checkpoint import Checkpoint, load_checkpoint


def check_target(target: Path, marker: str) -> None:
    """`target` may be new, empty, or a previous export (holding `marker`), which is replaced."""
    if target.exists() and not target.is_dir():
        raise CapsNetError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not (target / marker).is_file():
        raise CapsNetError(f"{target} is not empty and holds no previous export ({marker}); refusing to replace it")


def check_apart(out_dir: Path, triton_repo: Path) -> None:
    """--out and the Triton repository must not hold one another: publishing one replaced the other, or the
    staging directory beside it, and the export failed after destroying the previous one. --out anywhere in the
    repository is refused too, as Triton would take it for a model."""
    out, repo = out_dir.resolve(), triton_repo.resolve()  # through symlinks and "..", as the renames will go
    if out == repo or out.is_relative_to(repo) or repo.is_relative_to(out):
        raise CapsNetError(f"--out {out_dir} and --triton {triton_repo} overlap; give them separate directories")


def staging_dir(target: Path, beside: Path | None = None) -> Path:
    """An empty directory in `beside` (default: `target`'s folder), on `target`'s filesystem so that the final
    rename is atomic."""
    folder = beside or target.parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=folder))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the export from a server running as another user
    except OSError as err:
        raise CapsNetError(f"cannot write to {folder}: {err.strerror or err}") from None
    return staging


def outside_repository(repo: Path) -> Path | None:
    """The folder holding the Triton repository `repo`, if the model can be staged there: Triton takes every directory
    in its repository for a model, a staging one too (an export killed midway left one, which Triton cannot load:
    its config.pbtxt names another model). None when `repo` is a mount point or its folder takes no files: the
    staging goes into `repo` then."""
    try:
        repo.mkdir(parents=True, exist_ok=True)
        repo = repo.resolve()
        outside = repo.parent
        if outside != repo and os.access(outside, os.W_OK | os.X_OK) and outside.stat().st_dev == repo.stat().st_dev:
            return outside
    except OSError as err:
        raise CapsNetError(f"cannot write to {repo}: {err.strerror or err}") from None
    return None


def publish(staging: Path, target: Path) -> None:
    """Rename the finished `staging` to `target`, replacing a previous export only now."""
    previous = staging.with_suffix(".previous")
    try:
        if target.exists():
            os.rename(target, previous)
        os.rename(staging, target)
    except OSError as err:
        if previous.exists() and not target.exists():
            os.rename(previous, target)  # put the previous export back
        raise CapsNetError(f"cannot move the export into {target}: {err.strerror or err}") from None
    if previous.is_symlink():  # `target` was a link to an export: the link is replaced, what it points to kept
        previous.unlink()
    else:
        shutil.rmtree(previous, ignore_errors=True)


def staged_checkpoint(checkpoint_path: Path, checkpoint: Checkpoint, staging: Path) -> Checkpoint:
    """Copy the checkpoint into `staging` and export the copy: training may replace `checkpoint_path` meanwhile,
    and model.ckpt then held another model than model.onnx. A copy of another configuration is refused, as the
    data was chosen and checked for the checkpoint loaded first."""
    copy = staging / CHECKPOINT_NAME
    shutil.copyfile(checkpoint_path, copy)
    try:
        staged = load_checkpoint(copy)
    except CapsNetError:  # replaced by something that is no checkpoint
        staged = None
    if staged is None or (staged.config, staged.class_names, staged.dataset) != (
            checkpoint.config, checkpoint.class_names, checkpoint.dataset):
        raise CapsNetError(f"{checkpoint_path} changed while it was being exported; export it again")
    return staged
