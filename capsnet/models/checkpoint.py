"""Checkpoints: one self-describing file with a format version, read back into a model of its architecture.

A checkpoint holds everything export and serving need (config, weights, class names, input
normalisation via the config, routing settings, metrics) plus the optimiser state for `--resume`;
one written mid-epoch (`--checkpoint-every`) also records how far into the next epoch it got.
It loads with `torch.load(weights_only=True)`: plain containers and tensors only, no pickled code, so no
class's module path is stored and a checkpoint outlives moves of the code. Training writes it
(capsnet.training.checkpoint).
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from capsnet.errors import CapsNetError
from capsnet.models.any_size import GapCnn, SharedCapsNet
from capsnet.models.capsnet import CapsNet
from capsnet.models.cnn_baseline import CnnBaseline
from capsnet.models.config import CapsNetConfig
from capsnet.models.em import EMCapsNet

FORMAT_NAME = "capsnet-checkpoint"
FORMAT_VERSION = 1


# A model of any architecture: each keeps its CapsNetConfig as `config` and answers with a CapsNetOutput.
Model = CapsNet | EMCapsNet | CnnBaseline | SharedCapsNet | GapCnn


def create_model(config: CapsNetConfig) -> Model:
    """A freshly initialised model of the config's architecture."""
    architectures: dict[str, Callable[[CapsNetConfig], Model]] = {
        "capsnet": CapsNet, "em": EMCapsNet, "cnn-baseline": CnnBaseline, "shared-capsnet": SharedCapsNet,
        "gap-cnn": GapCnn}
    return architectures[config.arch](config)


@dataclass
class Checkpoint:
    config: CapsNetConfig
    state_dict: dict[str, torch.Tensor]
    class_names: list[str]
    metrics: dict[str, Any] = field(default_factory=dict)
    # training state, for --resume
    epoch: int = 0
    optimizer_state: dict | None = None
    scheduler_state: dict | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    dataset: str = ""
    scaler_state: dict | None = None  # CUDA mixed precision's loss scale
    # None at an epoch's end; mid-epoch, the steps taken into epoch `epoch + 1` and their running totals
    epoch_progress: dict[str, Any] | None = None

    def build_model(self) -> Model:
        """The model of `config.arch` (CapsNet, EMCapsNet, CnnBaseline, SharedCapsNet or GapCnn) in eval mode on the
        CPU with these weights."""
        model = create_model(self.config)
        model.load_state_dict(self.state_dict)
        return model.eval()


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise CapsNetError(f"checkpoint {path} does not exist" if not path.exists()
                           else f"checkpoint {path} is not a file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for truncated/garbage files
        raise CapsNetError(f"checkpoint {path} is damaged or not a capsnet checkpoint ({type(err).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
        raise CapsNetError(f"{path} is not a capsnet checkpoint")
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise CapsNetError(
            f"checkpoint {path} has format version {version}; this capsnet-serve reads version {FORMAT_VERSION}"
        )
    _check_fields(payload, path)
    try:
        config = CapsNetConfig.from_dict(payload["config"])
        checkpoint = Checkpoint(
            config=config,
            state_dict=payload["state_dict"],
            class_names=list(payload["class_names"]),
            metrics=payload.get("metrics") or {},
            epoch=payload.get("epoch") or 0,
            optimizer_state=payload.get("optimizer_state"),
            scheduler_state=payload.get("scheduler_state"),
            history=payload.get("history") or [],
            dataset=payload.get("dataset") or "",
            scaler_state=payload.get("scaler_state"),
            epoch_progress=payload.get("epoch_progress"),
        )
        create_model(config).load_state_dict(checkpoint.state_dict)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CapsNetError(f"checkpoint {path} is damaged: {str(err).splitlines()[0]}") from None
    if len(checkpoint.class_names) != config.num_classes:
        raise CapsNetError(f"checkpoint {path} is damaged: {len(checkpoint.class_names)} class names for "
                           f"{config.num_classes} classes")
    return checkpoint


def _is_list_of(kind: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(isinstance(item, kind) for item in value)


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


# What each payload field must hold. Fields other than _REQUIRED_FIELDS may be absent or None (their default).
_FIELD_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "config": ("a dict", _is_dict),
    "state_dict": ("a dict", _is_dict),
    "class_names": ("a list of names", _is_list_of(str)),
    "epoch": ("a count of epochs", lambda value: type(value) is int and value >= 0),  # not a bool either
    "history": ("a list of per-epoch records", _is_list_of(dict)),
    "dataset": ("a name", lambda value: isinstance(value, str)),
    **dict.fromkeys(("metrics", "optimizer_state", "scheduler_state", "scaler_state", "epoch_progress"),
                    ("a dict", _is_dict)),
}
_REQUIRED_FIELDS = ("config", "state_dict", "class_names")


def _check_fields(payload: dict, path: Path) -> None:
    """A file that loads may still hold a field of the wrong kind (edited by hand, written by other code), which
    would fail later with a traceback, or not fail at all (a string of class names); name the first one."""
    for name, (meaning, ok) in _FIELD_CHECKS.items():
        value = payload.get(name)
        if (value is not None or name in _REQUIRED_FIELDS) and not ok(value):
            raise CapsNetError(f"checkpoint {path} is damaged: its {name} is not {meaning}: {reprlib.repr(value)}")
