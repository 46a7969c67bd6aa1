"""Export fixtures: one full export of the trained tiny model, shared by every export test."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from capsnet.cli import main
from capsnet.training.data import Dataset, load_dataset


@dataclass
class TinyExport:
    checkpoint: Path
    out: Path  # the export directory
    repo: Path  # the Triton model repository
    sidecar: dict


@pytest.fixture(scope="session")
def embedded() -> Dataset:
    return load_dataset("embedded")


@pytest.fixture(scope="session")
def tiny_export(trained_tiny_checkpoint, tmp_path_factory) -> TinyExport:
    """`capsnet export` with every CPU option: reconstruction, INT8, FP16 and a Triton repository.

    The INT8 gate is opened wide: these tests check the artifacts, and how many points the tiny model's
    INT8 loses depends on the host's int8 kernels (test_export_int8 checks the gate itself).
    """
    root = tmp_path_factory.mktemp("export")
    out, repo = root / "model", root / "triton"
    code = main(["export", str(trained_tiny_checkpoint), "--out", str(out), "--reconstruction", "--int8", "--fp16",
                 "--max-accuracy-drop", "100", "--triton", str(repo)])
    assert code == 0
    return TinyExport(trained_tiny_checkpoint, out, repo, json.loads((out / "model.json").read_text()))
